/* safetensors files: round trips, the exact bytes on disk, strict reading,
** atomic writes, XXH64 checksums */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include "check.h"
#include "io/ckpt.h"
#include "core/core.h"
#include "core/alloc.h"
#include "core/cuda.h"

static char dir[64];

static const char *at(const char *name) {
  static char buf[8][256];
  static int k;
  char *p = buf[k++ % 8];
  snprintf(p, 256, "%s/%s", dir, name);
  return p;
}

static bool exists(const char *path) { struct stat sb; return stat(path, &sb) == 0; }

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  fwrite(data, 1, n, f);
  fclose(f);
}

static unsigned char *read_bytes(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *p = malloc(*n + 1);
  *n = fread(p, 1, *n, f);
  fclose(f);
  return p;
}

/* a file as a foreign writer might make it: length, header text as given, data */
static void craft(const char *path, const char *header, const void *data, size_t ndata) {
  uint64_t n = strlen(header);
  unsigned char *buf = malloc(8 + n + ndata);
  memcpy(buf, &n, 8);
  memcpy(buf + 8, header, n);
  if (ndata) memcpy(buf + 8 + n, data, ndata);
  write_bytes(path, buf, 8 + n + ndata);
  free(buf);
}

static uint64_t lcg = 12345;
static unsigned char rand_byte(void) { lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL; return (unsigned char)(lcg >> 56); }

static void fill_random(dm_tensor *t) {
  unsigned char *p = dm_data(t);
  for (size_t i = 0; i < (size_t)dm_numel(t) * dm_dtype_size(t->dtype); i++) p[i] = rand_byte();
}

/* ---- XXH64 ------------------------------------------------------------------------------ */

static void xxh64_matches_reference(void) {
  CHECK(dm_xxh64("", 0, 0) == 0xEF46DB3751D8E999ULL);
  CHECK(dm_xxh64("a", 1, 0) == 0xD24EC4F1A98C6E5BULL);
  CHECK(dm_xxh64("abc", 3, 0) == 0x44BC2CF5AD770999ULL);
  /* An independent oracle: a zstd frame with a content checksum ends with the
  ** low 32 bits of XXH64(content, seed 0), little-endian (RFC 8878). Every
  ** length up to 100 walks each tail path of the algorithm. */
  unsigned char src[5000], dst[6000];
  for (size_t i = 0; i < sizeof src; i++) src[i] = rand_byte();
  size_t lens[] = {101, 255, 256, 1000, 4096, 4999};
  int bad = 0;
  ZSTD_CCtx *cc = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 1);
  for (size_t k = 0; k < 100 + sizeof lens / sizeof lens[0]; k++) {
    size_t n = k < 100 ? k : lens[k - 100];
    size_t z = ZSTD_compress2(cc, dst, sizeof dst, src, n);
    uint32_t want;
    memcpy(&want, dst + z - 4, 4);
    if (ZSTD_isError(z) || (uint32_t)dm_xxh64(src, n, 0) != want) bad++;
  }
  ZSTD_freeCCtx(cc);
  CHECK(bad == 0);
  CHECK(dm_xxh64("abc", 3, 1) != dm_xxh64("abc", 3, 0));   /* the seed is used */
}

static void file_checksum_covers_the_file(void) {
  unsigned char data[777];
  for (size_t i = 0; i < sizeof data; i++) data[i] = rand_byte();
  write_bytes(at("sum.bin"), data, sizeof data);
  int64_t size = -1;
  CHECK(dm_file_checksum(at("sum.bin"), &size) == dm_xxh64(data, sizeof data, 0));
  CHECK(size == 777);
  write_bytes(at("empty.bin"), data, 0);
  CHECK(dm_file_checksum(at("empty.bin"), &size) == 0xEF46DB3751D8E999ULL && size == 0);
  EXPECT_ERROR(dm_file_checksum(at("missing.bin"), &size), "missing.bin: cannot open");
}

/* ---- round trips ----------------------------------------------------------------------- */

/* element i of a strided view, gathered by hand into out */
static void gather(const dm_tensor *v, unsigned char *out) {
  size_t es = dm_dtype_size(v->dtype);
  const unsigned char *base = (const unsigned char *)v->storage->data;
  int64_t idx[DM_MAXDIM] = {0}, n = dm_numel(v);
  for (int64_t i = 0; i < n; i++) {
    int64_t off = v->offset;
    for (int d = 0; d < v->ndim; d++) off += idx[d] * v->strides[d];
    memcpy(out + (size_t)i * es, base + (size_t)off * es, es);
    for (int d = v->ndim - 1; d >= 0 && ++idx[d] == v->shape[d]; d--) idx[d] = 0;
  }
}

static bool same_tensor(const dm_tensor *want, const dm_tensor *got) {
  if (!got || got->dtype != want->dtype || !dm_same_shape(want, got) || !dm_is_contiguous(got)) return false;
  size_t nb = (size_t)dm_numel(want) * dm_dtype_size(want->dtype);
  unsigned char *exp = malloc(nb + 1);
  gather(want, exp);
  bool ok = nb == 0 || memcmp(exp, dm_data(got), nb) == 0;
  free(exp);
  return ok;
}

static dm_tensor *find(const dm_safetensors *st, const char *name) {
  for (int i = 0; i < st->n; i++) if (!strcmp(st->names[i], name)) return st->tensors[i];
  return NULL;
}

static void round_trip_every_dtype(void) {
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  enum { PER = 5 };
  const char *names[DM_NDTYPE * PER];
  char namebuf[DM_NDTYPE * PER][32];
  dm_tensor *ts[DM_NDTYPE * PER];
  int n = 0;
  for (int dt = 0; dt < DM_NDTYPE; dt++) {
    dm_tensor *plain = dm_empty(DM_CPU, dt, 2, (int64_t[]){3, 5});
    fill_random(plain);
    dm_tensor *base = dm_empty(DM_CPU, dt, 1, (int64_t[]){40});
    fill_random(base);
    /* shape [3, 4], strides [8, 2], offset 3: neither contiguous nor at the start */
    dm_tensor *strided = dm_tensor_view(base, 2, (int64_t[]){3, 4}, (int64_t[]){8, 2}, 3);
    dm_release(base);
    dm_tensor *scalar = dm_empty(DM_CPU, dt, 0, (int64_t[]){1});
    fill_random(scalar);
    dm_tensor *empty = dm_empty(DM_CPU, dt, 2, (int64_t[]){0, 4});
    dm_tensor *transposed = dm_transpose(plain, 0, 1);
    dm_tensor *made[PER] = {plain, strided, scalar, empty, transposed};
    const char *kind[PER] = {"plain", "strided", "scalar", "empty", "transposed"};
    for (int k = 0; k < PER; k++) {
      snprintf(namebuf[n], sizeof namebuf[n], "%s.%s", dm_dtype_name(dt), kind[k]);
      names[n] = namebuf[n];
      ts[n++] = made[k];
    }
  }
  CHECK(!dm_is_contiguous(ts[1]) && !dm_is_contiguous(ts[4]));
  const char *keys[] = {"quote\"back\\slash", "lines", "unicode"};
  const char *values[] = {"a \"b\" \\c", "one\ntwo\tthree\x01", "caf\xc3\xa9 \xf0\x9f\x90\xad"};
  dm_safetensors_write(at("all.safetensors"), n, names, ts, 3, keys, values);
  CHECK(!exists(at("all.safetensors.tmp")));

  dm_safetensors *st = dm_safetensors_read(at("all.safetensors"));
  CHECK(st->n == n);
  bool sorted = true, same = true;
  for (int i = 1; i < st->n; i++) sorted = sorted && strcmp(st->names[i - 1], st->names[i]) < 0;
  for (int i = 0; i < n; i++) {
    bool ok = same_tensor(ts[i], find(st, names[i]));
    if (!ok) fprintf(stderr, "  round trip differs: %s\n", names[i]);
    same = same && ok;
  }
  CHECK(sorted);
  CHECK(same);
  CHECK(st->nmeta == 3);
  CHECK(!strcmp(st->meta_keys[0], "lines") && !strcmp(st->meta_values[0], values[1]));
  CHECK(!strcmp(st->meta_keys[1], "quote\"back\\slash") && !strcmp(st->meta_values[1], values[0]));
  CHECK(!strcmp(st->meta_keys[2], "unicode") && !strcmp(st->meta_values[2], values[2]));
  CHECK(find(st, "f32.scalar")->ndim == 0 && find(st, "u8.empty")->shape[0] == 0);
  dm_safetensors_free(st);
  for (int i = 0; i < n; i++) dm_release(ts[i]);
  CHECK(dm_memory_stats(DM_CPU).count == before.count);
}

/* CUDA tensors, contiguous and strided, are copied to the host to be written */
static void cuda_tensors_round_trip(void) {
  if (!dm_cuda_available()) {
    printf("SKIP: no CUDA device (%s): writing CUDA tensors is untested here\n", dm_cuda_unavailable_reason());
    return;
  }
  dm_tensor *h = dm_empty(DM_CPU, DM_BF16, 2, (int64_t[]){3, 5});
  fill_random(h);
  dm_tensor *d = dm_to_device(h, DM_CUDA);
  dm_tensor *dt = dm_transpose(d, 0, 1);
  dm_tensor *ht = dm_transpose(h, 0, 1);
  dm_safetensors_write(at("cuda.safetensors"), 2, (const char *[]){"d", "dt"}, (dm_tensor *[]){d, dt}, 0, NULL, NULL);
  dm_safetensors *st = dm_safetensors_read(at("cuda.safetensors"));
  CHECK(same_tensor(h, find(st, "d")));
  CHECK(same_tensor(ht, find(st, "dt")));
  dm_safetensors_free(st);
  dm_release(h); dm_release(d); dm_release(dt); dm_release(ht);
}

/* ---- the bytes on disk, checked by hand (numpy is not installed here) --------------- */

static void header_is_standard_and_padded(void) {
  dm_tensor *a = dm_tensor_new(DM_CPU, DM_F32, 1, (int64_t[]){2});
  ((float *)dm_data(a))[0] = 1.5f;
  ((float *)dm_data(a))[1] = -2.0f;
  dm_tensor *b = dm_full(DM_CPU, DM_I64, 0, (int64_t[]){1}, 7);
  const char *names[] = {"b", "a"};
  dm_tensor *ts[] = {b, a};
  const char *k[] = {"k"}, *v[] = {"v"};
  dm_safetensors_write(at("known.safetensors"), 2, names, ts, 1, k, v);
  size_t n;
  unsigned char *p = read_bytes(at("known.safetensors"), &n);
  const char *want = "{\"__metadata__\":{\"k\":\"v\"},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                     "\"b\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]}}";
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | p[i];        /* little-endian, byte by byte */
  CHECK(hlen % 8 == 0 && hlen >= strlen(want) && hlen < strlen(want) + 8);
  CHECK(n == 8 + hlen + 16);
  CHECK(memcmp(p + 8, want, strlen(want)) == 0);
  bool spaces = true;
  for (size_t i = 8 + strlen(want); i < 8 + hlen; i++) spaces = spaces && p[i] == ' ';
  CHECK(spaces);
  const unsigned char data[16] = {0, 0, 0xc0, 0x3f, 0, 0, 0, 0xc0, 7, 0, 0, 0, 0, 0, 0, 0};
  CHECK(n >= 8 + hlen + 16 && memcmp(p + 8 + hlen, data, 16) == 0);
  free(p);

  /* no tensors, no metadata: "{}" padded to 8 */
  dm_safetensors_write(at("none.safetensors"), 0, NULL, NULL, 0, NULL, NULL);
  p = read_bytes(at("none.safetensors"), &n);
  CHECK(n == 16 && p[0] == 8 && memcmp(p + 8, "{}      ", 8) == 0);
  free(p);
  dm_safetensors *st = dm_safetensors_read(at("none.safetensors"));
  CHECK(st->n == 0 && st->nmeta == 0);
  dm_safetensors_free(st);
  dm_release(a);
  dm_release(b);
}

/* u8 codes written as F8_E4M3 (the low-bit banks) read back as their bytes; nothing else goes so */
static void e4m3_codes_as_f8(void) {
  dm_tensor *c = dm_tensor_new(DM_CPU, DM_U8, 1, (int64_t[]){3});
  uint8_t *cp = dm_data(c);
  cp[0] = 0x38; cp[1] = 0xB8; cp[2] = 0x7E;                    /* 1.0, -1.0, 448 */
  const char *names[] = {"c"}, *as[] = {"F8_E4M3"};
  dm_safetensors_write_as(at("f8.safetensors"), 1, names, &c, as, 0, NULL, NULL);
  size_t n;
  unsigned char *p = read_bytes(at("f8.safetensors"), &n);
  const char *want = "{\"c\":{\"dtype\":\"F8_E4M3\",\"shape\":[3],\"data_offsets\":[0,3]}}";
  CHECK(n > 8 + strlen(want) && memcmp(p + 8, want, strlen(want)) == 0);
  free(p);
  dm_safetensors *st = dm_safetensors_read(at("f8.safetensors"));
  dm_tensor *back = find(st, "c");
  CHECK(back && back->dtype == DM_U8 && memcmp(dm_data(back), cp, 3) == 0);
  dm_safetensors_free(st);
  dm_tensor *f = dm_tensor_new(DM_CPU, DM_F32, 1, (int64_t[]){1});
  ((float *)dm_data(f))[0] = 1;
  EXPECT_ERROR(dm_safetensors_write_as(at("f8bad.safetensors"), 1, names, &f, as, 0, NULL, NULL),
               "only u8 codes go as F8_E4M3");
  dm_release(f);
  dm_release(c);
}

/* what another writer might produce: other key order, whitespace, escapes, no padding */
static void reads_foreign_layouts(void) {
  const char *header =
    "{ \"w\\u00e9\\\"x\" : {\"data_offsets\": [0, 4], \"shape\": [2],\n\t\"dtype\": \"BF16\"},\r\n"
    "  \"emoji\\ud83d\\udc2d\": {\"shape\": [0, 3], \"dtype\": \"F64\", \"data_offsets\": [4, 4]},"
    "  \"__metadata__\": {\"format\": \"pt\", \"slash\": \"a\\/b\"} }";
  const unsigned char data[4] = {0x80, 0x3f, 0x00, 0xc0};   /* bf16 1.0, -2.0 */
  craft(at("foreign.safetensors"), header, data, 4);
  dm_safetensors *st = dm_safetensors_read(at("foreign.safetensors"));
  dm_tensor *w = find(st, "w\xc3\xa9\"x");
  CHECK(st->n == 2 && w && w->dtype == DM_BF16);
  CHECK(w && dm_bf16_to_f32(((uint16_t *)dm_data(w))[0]) == 1.0f && dm_bf16_to_f32(((uint16_t *)dm_data(w))[1]) == -2.0f);
  dm_tensor *e = find(st, "emoji\xf0\x9f\x90\xad");
  CHECK(e && e->dtype == DM_F64 && e->ndim == 2 && e->shape[1] == 3);
  CHECK(st->nmeta == 2 && !strcmp(st->meta_keys[0], "format") && !strcmp(st->meta_values[1], "a/b"));
  dm_safetensors_free(st);
}

/* ---- strict reading ---------------------------------------------------------------------- */

#define EXPECT_READ_ERROR(path, part) do {                                  \
    EXPECT_ERROR(dm_safetensors_read(path), part);                          \
    CHECK(strstr(check_msg, path) != NULL);                                 \
  } while (0)

static void bad_header(const char *header, size_t ndata, const char *part) {
  unsigned char data[64] = {0};
  craft(at("bad.safetensors"), header, data, ndata);
  EXPECT_READ_ERROR(at("bad.safetensors"), part);
}

static void refuses_bad_files(void) {
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  const char *f32x2 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  unsigned char zeros[8] = {0};
  craft(at("good.safetensors"), f32x2, zeros, 8);           /* the baseline the cases below break */
  dm_safetensors_free(dm_safetensors_read(at("good.safetensors")));

  /* truncation, at every level */
  write_bytes(at("short.safetensors"), "\x10\0\0", 3);
  EXPECT_READ_ERROR(at("short.safetensors"), "truncated: 3 bytes");
  bad_header(f32x2, 3, "truncated: header says 8 bytes of data (tensor 'a' ends there), file has 3");
  {
    unsigned char big[16] = {0, 0x10, 0, 0, 0, 0, 0, 0, '{', '}'};
    write_bytes(at("big.safetensors"), big, 10);
    EXPECT_READ_ERROR(at("big.safetensors"), "truncated: header says 4096 bytes of header, file has 2");
    big[5] = 1;                            /* 2^40 + 4096 */
    write_bytes(at("big.safetensors"), big, 10);
    EXPECT_READ_ERROR(at("big.safetensors"), "not sane");
  }
  EXPECT_READ_ERROR(at("nothere.safetensors"), "cannot open");

  /* corrupted JSON */
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, 
             "bad JSON at header byte 53: expected '}' or ',' in an object, found the end of the header");
  bad_header("{\"a\" {}}", 0, "expected ':' after a key");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8.0]}}", 8, "only integers");
  bad_header("{\"a\":true}", 0, "unexpected 't'");
  bad_header("{\"a\\q\":{}}", 0, "unknown escape '\\q'");
  bad_header("{\"a\\ud800\":{}}", 0, "without its pair");
  bad_header("{\"a", 0, "unterminated string");
  bad_header("{\"a\nb\":{}}", 0, "control character 0x0a");
  bad_header("{\"\xff\":{}}", 0, "invalid UTF-8");
  bad_header("{}  x", 0, "unexpected 'x' after the header object");
  write_bytes(at("nul.safetensors"), "\x04\0\0\0\0\0\0\0{}\0\0", 12);   /* padded with NULs, not spaces */
  EXPECT_READ_ERROR(at("nul.safetensors"), "unexpected byte 0x00 after the header object");
  bad_header("[1, 2]", 0, "does not start with '{'");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}", 4, "leading zeros");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", 4, "integer too large");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],}}", 8, "expected a key string");
  char deep[200] = "{\"a\":";
  for (int d = 0; d < 70; d++) strcat(deep, "[");
  for (int d = 0; d < 70; d++) strcat(deep, "]");
  bad_header(strcat(deep, "}"), 0, "nested more than 64 deep");

  /* the entries */
  bad_header("{\"a\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "tensor 'a': unknown dtype 'f32'");
  bad_header("{\"a\":{\"dtype\":\"F8_E5M2\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, "unknown dtype 'F8_E5M2'");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 12,
             "tensor 'a': data_offsets [0, 12] hold 12 bytes, but shape [2] of F32 needs 8");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "data_offsets [8, 0] hold -8 bytes");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1000,1008]}}", 8,
             "truncated: header says 1008 bytes of data (tensor 'a' ends there), file has 8");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16,
             "gap in the data: tensor 'a' starts at byte 8, but the data before it ends at 0");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
             "tensor 'b' at bytes [4, 12] overlaps tensor 'a' (ends at 8)");
  bad_header(f32x2, 12, "4 bytes of unexpected data after the last tensor");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape must hold non-negative integers");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 0, "tensor 'a': missing field 'data_offsets'");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, "unknown field 'x'");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "field 'dtype' appears twice");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 0, "data_offsets must be [begin, end]");
  bad_header("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, "9 dims");
  bad_header("{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,1]}}", 1, "shape is too large");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, "tensor 'a' appears twice");
  bad_header("{\"a\":3}", 0, "tensor 'a': its entry must be an object");
  bad_header("{\"a\\u0000b\":{}}", 0, "contains a NUL byte");
  bad_header("{\"__metadata__\":{\"k\":1}}", 0, "__metadata__ value of 'k' must be a string");
  bad_header("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "__metadata__ key 'k' appears twice");
  bad_header("{\"__metadata__\":[]}", 0, "__metadata__ must be an object");
  bad_header("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "__metadata__ appears twice");
  bad_header("{\"\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, "a tensor has an empty name");
  bad_header("{\"a\":{\"dtype\":8,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "tensor 'a': dtype must be a string");
  bad_header("{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8, "tensor 'a': shape must be an array");
  bad_header("{\"a\\udc00\":{}}", 0, "lone low surrogate \\udc00");
  bad_header("{\"a\\ud800\\u0041\":{}}", 0, "high surrogate \\ud800 followed by \\u0041");
  bad_header("{\"a\\u12\":{}}", 0, "\\u must be followed by 4 hex digits");
  bad_header("{\"a\":-x}", 0, "expected a digit");
  write_bytes(at("tiny.safetensors"), "\x01\0\0\0\0\0\0\0{", 9);
  EXPECT_READ_ERROR(at("tiny.safetensors"), "1 bytes cannot hold a JSON object");

  /* a good file, cut short */
  dm_tensor *t = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){1024});
  const char *name = "w";
  dm_safetensors_write(at("cut.safetensors"), 1, &name, &t, 0, NULL, NULL);
  size_t n;
  unsigned char *p = read_bytes(at("cut.safetensors"), &n);
  uint64_t hlen;
  memcpy(&hlen, p, 8);
  free(p);
  CHECK(n == 8 + hlen + 4096);
  CHECK(truncate(at("cut.safetensors"), (off_t)(8 + hlen + 1000)) == 0);
  EXPECT_READ_ERROR(at("cut.safetensors"), "truncated: header says 4096 bytes of data (tensor 'w' ends there), file has 1000");
  dm_release(t);
  CHECK(dm_memory_stats(DM_CPU).count == before.count);   /* errors leave no tensor behind */
}

/* ---- writing: arguments, atomicity ---------------------------------------------------- */

static void write_errors_leave_nothing(void) {
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  dm_tensor *a = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){4});
  dm_tensor *m = dm_zeros(DM_META, DM_F32, 1, (int64_t[]){4});
  dm_tensor *gone = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){4});
  dm_tensor_free(gone);
  const char *path = at("w.safetensors"), *tmp = at("w.safetensors.tmp");
  EXPECT_ERROR(dm_safetensors_write(path, 2, (const char *[]){"x", "x"}, (dm_tensor *[]){a, a}, 0, NULL, NULL),
               "w.safetensors: tensor name 'x' appears twice");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"m"}, &m, 0, NULL, NULL), "tensor 'm' is on the meta device");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"g"}, &gone, 0, NULL, NULL), "tensor 'g' was freed");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"__metadata__"}, &a, 0, NULL, NULL), "cannot name a tensor");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){""}, &a, 0, NULL, NULL), "tensor name is empty");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"\xc3("}, &a, 0, NULL, NULL), "not valid UTF-8");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"a"}, &a, 2, (const char *[]){"k", "k"},
                                    (const char *[]){"1", "2"}), "metadata key 'k' appears twice");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){NULL}, &a, 0, NULL, NULL), "a tensor name is missing");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"n"}, (dm_tensor *[]){NULL}, 0, NULL, NULL), "tensor 'n' is missing");
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"a"}, &a, 1, (const char *[]){"k"}, (const char *[]){"\xff"}),
               "metadata value of 'k' is missing or not valid UTF-8");
  char *huge = malloc(100000001);                          /* a header past the 100 MB readers accept */
  memset(huge, 'a', 100000000);
  huge[100000000] = 0;
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"a"}, &a, 1, (const char *[]){"k"}, (const char *[]){huge}),
               "more than the 100 MB readers accept");
  free(huge);
  EXPECT_ERROR(dm_safetensors_write(at("no/such/dir/x.safetensors"), 1, (const char *[]){"a"}, &a, 0, NULL, NULL),
               "cannot create");
  CHECK(!exists(path) && !exists(tmp));

  /* a write that fails half-way (the file-size limit stands in for a full disk) */
  dm_tensor *big = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){1 << 16});
  struct rlimit old, small = {4096, 0};
  getrlimit(RLIMIT_FSIZE, &old);
  small.rlim_max = old.rlim_max;
  signal(SIGXFSZ, SIG_IGN);
  setrlimit(RLIMIT_FSIZE, &small);
  EXPECT_ERROR(dm_safetensors_write(path, 1, (const char *[]){"big"}, &big, 0, NULL, NULL), "w.safetensors: write failed");
  setrlimit(RLIMIT_FSIZE, &old);
  CHECK(!exists(path) && !exists(tmp));

  /* replacing a file: the new one is complete, the temporary gone */
  dm_safetensors_write(path, 1, (const char *[]){"a"}, &a, 0, NULL, NULL);
  dm_safetensors_write(path, 1, (const char *[]){"big"}, &big, 0, NULL, NULL);
  CHECK(!exists(tmp));
  dm_safetensors *st = dm_safetensors_read(path);
  CHECK(st->n == 1 && !strcmp(st->names[0], "big") && dm_numel(st->tensors[0]) == 1 << 16);
  dm_safetensors_free(st);
  dm_release(a); dm_release(m); dm_release(gone); dm_release(big);
  CHECK(dm_memory_stats(DM_CPU).count == before.count);
}

static void files_and_directories(void) {
  dm_mkdirs(at("x/y/z"));
  CHECK(exists(at("x/y/z")));
  dm_mkdirs(at("x/y/z"));                                  /* again: fine */
  dm_write_file_atomic(at("x/y/z/meta.lua"), "return {}\n", 10);
  size_t n;
  unsigned char *p = read_bytes(at("x/y/z/meta.lua"), &n);
  CHECK(n == 10 && memcmp(p, "return {}\n", 10) == 0);
  free(p);
  CHECK(!exists(at("x/y/z/meta.lua.tmp")));
  EXPECT_ERROR(dm_mkdirs(at("x/y/z/meta.lua")), "not a directory");
  EXPECT_ERROR(dm_mkdirs(at("x/y/z/meta.lua/sub")), "cannot create directory");
  EXPECT_ERROR(dm_fsync_dir(at("nope")), "cannot open directory");
  EXPECT_ERROR(dm_mkdirs(""), "empty path");
  char longpath[5000];
  memset(longpath, 'x', sizeof longpath - 1);
  longpath[sizeof longpath - 1] = 0;
  EXPECT_ERROR(dm_mkdirs(longpath), "path too long");
  dm_fsync_dir(dir);
}

int main(void) {
  check_begin();
  snprintf(dir, sizeof dir, "/tmp/dm_ckpt_XXXXXX");
  if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
  xxh64_matches_reference();
  file_checksum_covers_the_file();
  round_trip_every_dtype();
  cuda_tensors_round_trip();
  header_is_standard_and_padded();
  e4m3_codes_as_f8();
  reads_foreign_layouts();
  refuses_bad_files();
  write_errors_leave_nothing();
  files_and_directories();
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  return check_end();
}
