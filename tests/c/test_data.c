/* byte corpora: files, directories, zstd, splits, batches, the loader thread, held-out windows */
#define _GNU_SOURCE            /* nftw (scratch.h) */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include "check.h"
#include "scratch.h"
#include "data/data.h"
#include "core/alloc.h"
#include "core/tensor.h"

static dm_corpus *open1(const char *path, int64_t eval_bytes) {
  return dm_corpus_open(1, (const char *const[]){path}, eval_bytes);
}

static bool corpus_equals(const dm_corpus *c, const uint8_t *want, int64_t n) {
  if (dm_corpus_size(c) != n) return false;
  uint8_t *got = malloc((size_t)n);
  dm_corpus_read(c, 0, n, got);
  bool same = memcmp(got, want, (size_t)n) == 0;
  free(got);
  return same;
}

static int64_t at64(const dm_tensor *t, int64_t i) { return (int64_t)dm_load(t->dtype, (char *)dm_data(t) + i * (int64_t)dm_dtype_size(t->dtype)); }

static dm_batch_spec spec(int64_t b, int64_t t, int64_t ctx, uint64_t seed) {
  return (dm_batch_spec){.batch = b, .seq = t, .ctx = ctx, .seed = seed, .dtype = DM_U8, .device = DM_CPU};
}

/* ---- splits and reading ------------------------------------------------------------------- */

static void splits(void) {
  uint8_t *b = make_bytes(1000, 1);
  write_file(tmp("a.txt"), b, 1000);
  dm_corpus *c = open1(tmp("a.txt"), 100);
  CHECK(dm_corpus_size(c) == 1000 && dm_corpus_train_size(c) == 900 && dm_corpus_eval_size(c) == 100);
  CHECK(corpus_equals(c, b, 1000));
  CHECK(dm_corpus_nfiles(c) == 1 && strcmp(dm_corpus_file(c, 0), tmp("a.txt")) == 0);
  uint8_t got[8];
  dm_corpus_read(c, -3, 8, got);                   /* before the start: pad bytes 0 */
  CHECK(got[0] == 0 && got[2] == 0 && memcmp(got + 3, b, 5) == 0);
  EXPECT_ERROR(dm_corpus_read(c, 995, 8, got), "cannot read 8 bytes at offset 995 of 1000");
  dm_corpus_release(c);
  EXPECT_ERROR(open1(tmp("a.txt"), 1000), "eval_bytes (1000) must be smaller than the corpus size (1000 bytes)");
  EXPECT_ERROR(open1(tmp("a.txt"), 5000), "a.txt");
  EXPECT_ERROR(open1(tmp("a.txt"), -1), "eval_bytes must be >= 0");
  c = open1(tmp("a.txt"), 0);
  CHECK(dm_corpus_train_size(c) == 1000);
  dm_corpus_release(c);
  free(b);
}

static void missing_empty_and_odd_paths(void) {
  EXPECT_ERROR(open1(tmp("nope.txt"), 0), "cannot open");
  EXPECT_ERROR(open1(tmp("nope.txt"), 0), "nope.txt': No such file or directory");
  write_file(tmp("empty.txt"), "", 0);
  EXPECT_ERROR(open1(tmp("empty.txt"), 0), "corpus is empty");
  EXPECT_ERROR(open1(tmp("empty.txt"), 0), "empty.txt");
  EXPECT_ERROR(open1("/dev/null", 0), "'/dev/null' is neither a regular file nor a directory");
  EXPECT_ERROR(dm_corpus_open(0, NULL, 0), "no path given");
  EXPECT_ERROR(dm_corpus_open(1, (const char *const[]){""}, 0), "path 1 is empty");
  if (geteuid() != 0) {
    write_file(tmp("secret.txt"), "x", 1);
    chmod(tmp("secret.txt"), 0);
    EXPECT_ERROR(open1(tmp("secret.txt"), 0), "secret.txt': Permission denied");
  } else {
    printf("skipping the unreadable-file check: running as root, which reads anything\n");
  }
  /* an empty file inside a list adds nothing */
  write_file(tmp("x.txt"), "xyz", 3);
  dm_corpus *c = dm_corpus_open(3, (const char *const[]){tmp("empty.txt"), tmp("x.txt"), tmp("empty.txt")}, 0);
  CHECK(dm_corpus_size(c) == 3 && dm_corpus_nfiles(c) == 1);
  dm_corpus_release(c);
}

static void directories(void) {
  mkdir(tmp("d"), 0755);
  mkdir(tmp("d/sub"), 0755);
  mkdir(tmp("d/.git"), 0755);
  write_file(tmp("d/b.txt"), "BB", 2);
  write_file(tmp("d/a.txt"), "A", 1);
  write_file(tmp("d/sub/c.txt"), "CCC", 3);
  write_file(tmp("d/.hidden"), "hidden", 6);
  write_file(tmp("d/.git/HEAD"), "ref", 3);
  dm_corpus *c = open1(tmp("d"), 0);
  CHECK(corpus_equals(c, (const uint8_t *)"ABBCCC", 6));
  CHECK(dm_corpus_nfiles(c) == 3 && strstr(dm_corpus_file(c, 2), "d/sub/c.txt"));
  dm_corpus_release(c);
  /* a file and a directory together, in the order given */
  c = dm_corpus_open(2, (const char *const[]){tmp("d/sub"), tmp("d/a.txt")}, 0);
  CHECK(corpus_equals(c, (const uint8_t *)"CCCA", 4));
  dm_corpus_release(c);
  mkdir(tmp("none"), 0755);
  mkdir(tmp("none/deeper"), 0755);
  write_file(tmp("none/.only_hidden"), "x", 1);
  EXPECT_ERROR(open1(tmp("none"), 0), "directory");
  EXPECT_ERROR(open1(tmp("none"), 0), "none' holds no files");
  mkdir(tmp("zeros"), 0755);
  write_file(tmp("zeros/e1"), "", 0);
  write_file(tmp("zeros/e2"), "", 0);
  EXPECT_ERROR(open1(tmp("zeros"), 0), "(2 files) holds no bytes");
}

/* windows that span files read the right bytes */
static void reads_across_files(void) {
  uint8_t *b = make_bytes(3000, 2);
  write_file(tmp("p1"), b, 1000);
  write_file(tmp("p2"), b + 1000, 7);
  write_file(tmp("p3"), b + 1007, 1993);
  dm_corpus *c = dm_corpus_open(3, (const char *const[]){tmp("p1"), tmp("p2"), tmp("p3")}, 500);
  CHECK(dm_corpus_size(c) == 3000 && dm_corpus_nfiles(c) == 3);
  bool ok = true;
  uint8_t got[64];
  for (int64_t pos = 960; pos < 1050; pos++) {
    dm_corpus_read(c, pos, 64, got);
    ok = ok && memcmp(got, b + pos, 64) == 0;
  }
  CHECK(ok);
  dm_corpus_release(c);
  free(b);
}

/* ---- zstd ------------------------------------------------------------------------------------ */

static size_t compress_to(const char *path, const uint8_t *src, size_t n) {
  ZSTD_CCtx *z = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(z, ZSTD_c_checksumFlag, 1);
  size_t cap = ZSTD_compressBound(n);
  uint8_t *dst = malloc(cap);
  size_t m = ZSTD_compress2(z, dst, cap, src, n);
  CHECK(!ZSTD_isError(m));
  write_file(path, dst, m);
  free(dst);
  ZSTD_freeCCtx(z);
  return m;
}

static void zstd_round_trip(void) {
  size_t n = 3 << 20;                         /* more than the first output buffer and many input chunks */
  uint8_t *b = make_bytes(n, 3);
  size_t m = compress_to(tmp("big.zst"), b, n);
  CHECK(m < n);
  dm_corpus *c = open1(tmp("big.zst"), 1000);
  CHECK(corpus_equals(c, b, (int64_t)n));
  dm_corpus_release(c);
  /* two frames back to back, and a raw file after them */
  uint8_t *z1, *z2;
  size_t n1, n2;
  compress_to(tmp("f1.zst"), b, 5000);
  compress_to(tmp("f2.zst"), b + 5000, 7000);
  z1 = slurp(tmp("f1.zst"), &n1);
  z2 = slurp(tmp("f2.zst"), &n2);
  uint8_t *both = malloc(n1 + n2);
  memcpy(both, z1, n1);
  memcpy(both + n1, z2, n2);
  write_file(tmp("frames.zst"), both, n1 + n2);
  write_file(tmp("tail.txt"), b + 12000, 500);
  c = dm_corpus_open(2, (const char *const[]){tmp("frames.zst"), tmp("tail.txt")}, 0);
  CHECK(corpus_equals(c, b, 12500));
  dm_corpus_release(c);
  /* a frame of nothing adds nothing */
  compress_to(tmp("nothing.zst"), b, 0);
  EXPECT_ERROR(open1(tmp("nothing.zst"), 0), "corpus is empty");
  free(z1); free(z2); free(both); free(b);
}

static void zstd_errors(void) {
  size_t n = 200000, m;
  uint8_t *b = make_bytes(n, 4);
  compress_to(tmp("good.zst"), b, n);
  uint8_t *z = slurp(tmp("good.zst"), &m);
  /* a flipped byte in the middle: the frame is read in place, so the read that decodes it fails,
  ** naming the file and the frame (the block decoder or the checksum catches it) */
  z[m / 2] ^= 0x5a;
  write_file(tmp("corrupt.zst"), z, m);
  dm_corpus *c = open1(tmp("corrupt.zst"), 0);
  uint8_t got[16];
  EXPECT_ERROR(dm_corpus_read(c, 100, 16, got), "corrupt.zst' is a corrupted zstd stream: frame 1");
  EXPECT_ERROR(dm_corpus_read(c, 100, 16, got), "at compressed byte offset 0");
  dm_corpus_release(c);
  z[m / 2] ^= 0x5a;
  /* a bad magic number fails at once, at the start */
  z[0] ^= 0xff;
  write_file(tmp("magic.zst"), z, m);
  EXPECT_ERROR(open1(tmp("magic.zst"), 0), "magic.zst' is a corrupted zstd stream");
  EXPECT_ERROR(open1(tmp("magic.zst"), 0), "Unknown frame descriptor (at compressed byte offset");
  z[0] ^= 0xff;
  /* cut short: the offset is where the file ends */
  write_file(tmp("short.zst"), z, m - 100);
  char want[64];
  snprintf(want, sizeof want, "(at compressed byte offset %zu)", m - 100);
  EXPECT_ERROR(open1(tmp("short.zst"), 0), "short.zst' is a truncated zstd stream");
  EXPECT_ERROR(open1(tmp("short.zst"), 0), want);
  write_file(tmp("zero.zst"), z, 0);
  EXPECT_ERROR(open1(tmp("zero.zst"), 0), "zero.zst' is a truncated zstd stream");
  free(z); free(b);
}

/* ---- training batches ------------------------------------------------------------------------ */

/* every row of x is the corpus at the drawn start; the prefix is the ctx bytes before it */
static bool batch_matches(const dm_corpus *c, const dm_batch_spec *s, int64_t k, const dm_tensor *x,
                          const dm_tensor *pre) {
  int64_t T1 = s->seq + 1;
  uint8_t *want = malloc((size_t)(T1 + s->ctx));
  bool ok = x->shape[0] == s->batch && x->shape[1] == T1 && pre->shape[0] == s->batch &&
            pre->shape[1] == s->ctx && x->dtype == s->dtype && pre->dtype == s->dtype;
  for (int64_t r = 0; ok && r < s->batch; r++) {
    int64_t start = dm_batch_start(c, s, k, r);
    dm_corpus_read(c, start - s->ctx, T1 + s->ctx, want);
    for (int64_t i = 0; i < s->ctx; i++) ok = ok && at64(pre, r * s->ctx + i) == want[i];
    for (int64_t i = 0; i < T1; i++) ok = ok && at64(x, r * T1 + i) == want[s->ctx + i];
  }
  free(want);
  return ok;
}

static bool same_bytes(const dm_tensor *a, const dm_tensor *b) {
  return dm_numel(a) == dm_numel(b) && a->dtype == b->dtype &&
         memcmp(dm_data(a), dm_data(b), (size_t)dm_numel(a) * dm_dtype_size(a->dtype)) == 0;
}

static void batches(void) {
  uint8_t *b = make_bytes(5000, 5);
  write_file(tmp("batch.txt"), b, 5000);
  dm_corpus *c = open1(tmp("batch.txt"), 1000);
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  dm_batch_spec s = spec(8, 31, 5, 42);
  dm_tensor *x, *p, *x2, *p2, *x3, *p3;
  dm_corpus_batch(c, &s, 7, &x, &p);
  CHECK(batch_matches(c, &s, 7, x, p));
  CHECK(dm_is_contiguous(x) && dm_is_contiguous(p) && x->storage == p->storage);
  dm_corpus_batch(c, &s, 7, &x2, &p2);
  CHECK(same_bytes(x, x2) && same_bytes(p, p2));           /* reproducible */
  dm_corpus_batch(c, &s, 8, &x3, &p3);
  CHECK(!same_bytes(x, x3));                               /* another k, other windows */
  dm_release(x2); dm_release(p2); dm_release(x3); dm_release(p3);
  /* row r depends on (seed, k, r) only: a bigger batch starts with the same rows */
  dm_batch_spec s16 = spec(16, 31, 5, 42);
  dm_corpus_batch(c, &s16, 7, &x2, &p2);
  CHECK(memcmp(dm_data(x2), dm_data(x), 8 * 32) == 0);
  dm_release(x2); dm_release(p2);
  dm_batch_spec other = spec(8, 31, 5, 43);
  dm_corpus_batch(c, &other, 7, &x2, &p2);
  CHECK(!same_bytes(x, x2));                               /* another seed */
  dm_release(x2); dm_release(p2);
  /* i32 and i64 hold the same values */
  dm_batch_spec wide = s;
  wide.dtype = DM_I64;
  dm_corpus_batch(c, &wide, 7, &x2, &p2);
  CHECK(x2->dtype == DM_I64 && batch_matches(c, &wide, 7, x2, p2));
  dm_release(x2); dm_release(p2);
  wide.dtype = DM_I32;
  dm_corpus_batch(c, &wide, 7, &x2, &p2);
  CHECK(x2->dtype == DM_I32 && batch_matches(c, &wide, 7, x2, p2));
  dm_release(x2); dm_release(p2);
  dm_release(x); dm_release(p);
  CHECK(dm_memory_stats(DM_CPU).allocated == before.allocated);
  /* no prefix */
  dm_batch_spec s0 = spec(3, 10, 0, 1);
  dm_corpus_batch(c, &s0, 0, &x, &p);
  CHECK(p->shape[0] == 3 && p->shape[1] == 0 && batch_matches(c, &s0, 0, x, p));
  dm_release(x); dm_release(p);
  /* errors */
  dm_batch_spec bad = s;
  bad.dtype = DM_F32;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "dtype must be u8, i32 or i64, got f32");
  bad = s; bad.seq = 0;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "seq must be >= 1, got 0");
  bad = s; bad.batch = 0;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "batch must be in 1..");
  bad = s; bad.ctx = -1;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "ctx must be >= 0");
  bad = s; bad.device = DM_META;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "meta device");
  bad = s; bad.seq = 4000;
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "train split of");
  EXPECT_ERROR(dm_corpus_batch(c, &bad, 0, &x, &p), "(4000 bytes) is shorter than one window of seq + 1 = 4001");
  EXPECT_ERROR(dm_corpus_batch(c, &s, -1, &x, &p), "k must be >= 0");
  dm_corpus_release(c);
  free(b);
}

/* every training window and its prefix lie in the train split; with few choices all are drawn */
static void windows_stay_in_train(void) {
  uint8_t *b = make_bytes(600, 6);
  write_file(tmp("small.txt"), b, 600);
  dm_corpus *c = open1(tmp("small.txt"), 200);           /* train: [0, 400) */
  int64_t seqs[3] = {1, 17, 394};                         /* 394: starts 0..5 */
  for (int i = 0; i < 3; i++) {
    dm_batch_spec s = spec(64, seqs[i], 9, (uint64_t)i);
    bool ok = true;
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t k = 0; k < 300; k++)
      for (int64_t r = 0; r < s.batch; r++) {
        int64_t st = dm_batch_start(c, &s, k, r);
        ok = ok && st >= 0 && st + s.seq + 1 <= 400;     /* prefix bytes lie before st: also train */
        if (st < lo) lo = st;
        if (st > hi) hi = st;
      }
    CHECK(ok);
    CHECK(lo == 0 && hi == 400 - (s.seq + 1));           /* both ends are reachable */
  }
  dm_batch_spec tight = spec(4, 399, 3, 9);               /* one possible start */
  dm_tensor *x, *p;
  dm_corpus_batch(c, &tight, 123, &x, &p);
  CHECK(batch_matches(c, &tight, 123, x, p) && dm_batch_start(c, &tight, 5, 2) == 0);
  CHECK(at64(p, 0) == 0 && at64(p, 2) == 0);             /* before the corpus start: pad 0 */
  CHECK(at64(x, 399) == b[399]);
  dm_release(x); dm_release(p);
  dm_corpus_release(c);
  free(b);
}

/* ---- the loader thread ------------------------------------------------------------------------ */

static void loader_matches_direct(void) {
  uint8_t *b = make_bytes(20000, 7);
  write_file(tmp("loader.txt"), b, 20000);
  dm_corpus *c = open1(tmp("loader.txt"), 2000);
  int depths[3] = {1, 4, 9};
  for (int d = 0; d < 3; d++) {
    dm_batch_spec s = spec(5, 64, 8, 1234);
    s.dtype = d == 1 ? DM_I64 : DM_U8;
    dm_loader *l = dm_loader_new(c, &s, 17, depths[d]);   /* a resumed run starts at its k */
    CHECK(dm_loader_position(l) == 17);
    bool ok = true;
    for (int64_t i = 0; i < 40; i++) {
      dm_tensor *x, *p, *x2, *p2;
      int64_t k = dm_loader_next(l, &x, &p);
      dm_corpus_batch(c, &s, 17 + i, &x2, &p2);
      ok = ok && k == 17 + i && same_bytes(x, x2) && same_bytes(p, p2);
      dm_release(x); dm_release(p); dm_release(x2); dm_release(p2);
    }
    CHECK(ok);
    CHECK(dm_loader_position(l) == 57);
    dm_loader_free(l);
  }
  /* the loader keeps the corpus alive; freeing a loader that is waiting joins at once */
  dm_batch_spec s = spec(2, 10, 0, 5);
  dm_loader *l = dm_loader_new(c, &s, 0, 4);
  int64_t start0 = dm_batch_start(c, &s, 0, 0);
  dm_corpus_release(c);
  dm_tensor *x, *p;
  dm_loader_next(l, &x, &p);
  CHECK(memcmp(dm_data(x), b + start0, 11) == 0);
  dm_release(x); dm_release(p);
  dm_loader_free(l);
  c = open1(tmp("loader.txt"), 0);
  l = dm_loader_new(c, &s, 0, 4);
  dm_corpus_release(c);
  dm_loader_free(l);                                      /* never read */
  free(b);
}

static int allocs, frees, fail_after;
static void *counting_alloc(size_t n) { return allocs++ >= fail_after ? NULL : malloc(n); }
static void counting_free(void *p, size_t n) { frees++; free(p); }

static void loader_errors(void) {
  uint8_t *b = make_bytes(3000, 8);
  write_file(tmp("lerr.txt"), b, 3000);
  dm_corpus *c = open1(tmp("lerr.txt"), 0);
  dm_batch_spec s = spec(4, 16, 2, 1);
  dm_tensor *x, *p;
  /* buffers come from the hook, go back through it, and a failed one is raised in this thread */
  dm_data_set_host_buffers(&(dm_host_buffers){counting_alloc, counting_free});
  allocs = frees = 0;
  fail_after = 1000;
  dm_loader *l = dm_loader_new(c, &s, 0, 3);
  for (int i = 0; i < 10; i++) { dm_loader_next(l, &x, &p); dm_release(x); dm_release(p); }
  dm_loader_free(l);
  CHECK(allocs == 3 && frees == 3);
  allocs = frees = 0;
  fail_after = 2;
  l = dm_loader_new(c, &s, 5, 3);
  for (int i = 0; i < 2; i++) { dm_loader_next(l, &x, &p); dm_release(x); dm_release(p); }
  EXPECT_ERROR(dm_loader_next(l, &x, &p), "data loader: batch 7: the host buffer allocator returned NULL for 76 bytes");
  EXPECT_ERROR(dm_loader_next(l, &x, &p), "batch 7");   /* and again: the loader stays failed */
  CHECK(dm_loader_position(l) == 7);
  dm_loader_free(l);
  CHECK(frees == 2);
  dm_data_set_host_buffers(NULL);
  EXPECT_ERROR(dm_data_set_host_buffers(&(dm_host_buffers){counting_alloc, NULL}), "both alloc and free");
  EXPECT_ERROR(dm_loader_new(c, &s, -1, 4), "start must be in 0 .. 2^62, got -1");
  EXPECT_ERROR(dm_loader_new(c, &s, INT64_MAX - 2, 4), "start must be in 0 .. 2^62");
  EXPECT_ERROR(dm_loader_new(c, &s, 0, 0), "depth must be in 1..1024, got 0");
  dm_batch_spec bad = s;
  bad.seq = 3000;
  EXPECT_ERROR(dm_loader_new(c, &bad, 0, 4), "shorter than one window");
  dm_corpus_release(c);
  free(b);
}

/* ---- held-out windows -------------------------------------------------------------------------- */

static void eval_windows(void) {
  uint8_t *b = make_bytes(1000, 9);
  write_file(tmp("eval.txt"), b, 1000);
  dm_corpus *c = open1(tmp("eval.txt"), 101);            /* held out: [899, 1000) */
  dm_batch_spec s = spec(0, 10, 4, 0);
  CHECK(dm_eval_window_count(c, 10) == 10);               /* (101 - 1) / 10 */
  CHECK(dm_eval_window_count(c, 100) == 1 && dm_eval_window_count(c, 101) == 0);
  dm_tensor *x, *p;
  dm_corpus_eval_windows(c, &s, -1, &x, &p);
  CHECK(x->shape[0] == 10 && x->shape[1] == 11 && p->shape[1] == 4);
  bool ok = true;
  for (int64_t i = 0; i < 10; i++) {
    int64_t start = 899 + i * 10;
    for (int64_t j = 0; j < 11; j++) ok = ok && at64(x, i * 11 + j) == b[start + j];
    for (int64_t j = 0; j < 4; j++) ok = ok && at64(p, i * 4 + j) == b[start - 4 + j];
  }
  CHECK(ok);
  CHECK(at64(x, 9 * 11 + 10) == b[999]);                  /* the last window ends at the last byte */
  dm_tensor *x2, *p2;
  dm_corpus_eval_windows(c, &s, 3, &x2, &p2);
  CHECK(x2->shape[0] == 3 && memcmp(dm_data(x2), dm_data(x), 33) == 0);
  dm_release(x); dm_release(p); dm_release(x2); dm_release(p2);
  EXPECT_ERROR(dm_corpus_eval_windows(c, &s, 11, &x, &p), "asked for 11 windows of seq + 1 = 11 bytes; the held-out split (101 bytes) holds 10");
  EXPECT_ERROR(dm_corpus_eval_windows(c, &s, 0, &x, &p), "asked for 0 windows");
  s.seq = 101;
  EXPECT_ERROR(dm_corpus_eval_windows(c, &s, -1, &x, &p), "shorter than one window of seq + 1 = 102");
  dm_corpus_release(c);
  c = open1(tmp("eval.txt"), 0);
  EXPECT_ERROR(dm_corpus_eval_windows(c, &s, -1, &x, &p), "has no held-out split");
  dm_corpus_release(c);
  free(b);
}

int main(void) {
  check_begin();
  if (!scratch_begin("data")) return 1;
  splits();
  missing_empty_and_odd_paths();
  directories();
  reads_across_files();
  zstd_round_trip();
  zstd_errors();
  batches();
  windows_stay_in_train();
  loader_matches_direct();
  loader_errors();
  eval_windows();
  scratch_end();
  return check_end();
}
