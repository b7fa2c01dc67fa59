/* zstd files read in place, frame by frame: the writer's frames and seek table, the index (by the
** table or by walking), reads through the shared cache, the loader, and the files decoded whole */
#define _GNU_SOURCE            /* nftw (scratch.h) */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include "check.h"
#include "scratch.h"
#include "data/data.h"
#include "data/files.h"
#include "data/zframes.h"
#include "core/alloc.h"
#include "core/tensor.h"

static bool exists(const char *path) { return access(path, F_OK) == 0; }

static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }

/* writes b[0, n) in frames of `frame` bytes, fed in pieces of `step` */
static void write_frames(const char *path, const uint8_t *b, int64_t n, int64_t frame, int64_t step) {
  char err[DM_DATA_ERRMAX];
  dm_zwriter *w = dm_zwriter_open(path, frame, 3, err);
  CHECK(w != NULL);
  for (int64_t at = 0; at < n; at += step) CHECK(dm_zwriter_add(w, b + at, at + step < n ? step : n - at, err));
  CHECK(dm_zwriter_bytes_in(w) == n);
  CHECK(!exists(path));                               /* nothing at the path until it is whole */
  CHECK(dm_zwriter_close(w, NULL, err));
}

/* the writer's file: one zstd stream to any decoder, indexed by its seek table */
static void writes_frames_and_a_seek_table(void) {
  int64_t n = 100000;
  uint8_t *b = make_bytes((size_t)n, 1);
  write_frames(tmp("w.zst"), b, n, 4096, 1000);
  size_t m;
  uint8_t *z = slurp(tmp("w.zst"), &m);
  CHECK(!exists(tmp("w.zst.tmp")));
  uint8_t *out = malloc((size_t)n);
  CHECK(ZSTD_decompress(out, (size_t)n, z, m) == (size_t)n && memcmp(out, b, (size_t)n) == 0);
  bool oom;
  dm_zframes *idx = dm_zframes_index(z, (int64_t)m, &oom);
  CHECK(idx && dm_zframes_count(idx) == 25 && dm_zframes_size(idx) == n);   /* 24 of 4096, one of 1696 */
  dm_zframes_free(idx);
  /* without the seek table (cut off), the frames are found by walking their headers */
  size_t table = 8 + 25 * 8 + 9;
  idx = dm_zframes_index(z, (int64_t)(m - table), &oom);
  CHECK(idx && dm_zframes_count(idx) == 25 && dm_zframes_size(idx) == n);
  dm_zframes_free(idx);
  /* a table whose frames pass the file's end is not trusted: walking still finds them */
  put32(z + m - table + 8, 1u << 30);
  idx = dm_zframes_index(z, (int64_t)m, &oom);
  CHECK(idx && dm_zframes_count(idx) == 25);
  dm_zframes_free(idx);
  /* a table whose decoded sizes lie: the first read of that frame says so, naming it */
  free(z);
  z = slurp(tmp("w.zst"), &m);
  put32(z + m - table + 8 + 4, 4000);                          /* frame 1 decodes to 4096, not 4000 */
  write_file(tmp("lies.zst"), z, m);
  dm_corpus *c = dm_corpus_open(1, (const char *const[]){tmp("lies.zst")}, 0);
  uint8_t got[8];
  EXPECT_ERROR(dm_corpus_read(c, 10, 8, got), "lies.zst' is a corrupted zstd stream: frame 1");
  dm_corpus_release(c);
  char err[DM_DATA_ERRMAX];
  CHECK(dm_zwriter_open(tmp("x.zst"), 0, 3, err) == NULL && strstr(err, "frame size must be in 1 .. 16777216 bytes, got 0"));
  CHECK(dm_zwriter_open(tmp("x.zst"), 100, 99, err) == NULL && strstr(err, "the level must be in 1 .."));
  CHECK(dm_zwriter_open("/nonexistent/dir/x.zst", 100, 3, err) == NULL && strstr(err, "cannot write '/nonexistent/dir/x.zst.tmp'"));
  dm_zwriter *w = dm_zwriter_open(tmp("gone.zst"), 100, 3, err);
  CHECK(dm_zwriter_add(w, b, 1000, err));
  dm_zwriter_abort(w);
  CHECK(!exists(tmp("gone.zst")) && !exists(tmp("gone.zst.tmp")));
  free(z); free(out); free(b);
}

/* a corpus reads a framed file in place: any range, across frames and files, and its batches */
static void reads_in_place(void) {
  int64_t n = 300000;
  uint8_t *b = make_bytes((size_t)n, 2);
  write_frames(tmp("a.zst"), b, 200000, 3000, 7777);        /* 67 frames: more than the cache holds */
  write_file(tmp("b.txt"), b + 200000, 100000);
  dm_corpus *c = dm_corpus_open(2, (const char *const[]){tmp("a.zst"), tmp("b.txt")}, 5000);
  CHECK(dm_corpus_size(c) == n && dm_corpus_whole(c, 0) == 0);
  uint8_t got[9000];
  bool ok = true;
  uint32_t seed = 7;
  for (int i = 0; i < 400; i++) {                           /* random ranges: hits, misses, evictions */
    seed = seed * 1664525u + 1013904223u;
    int64_t len = 1 + (seed >> 8) % 9000, at = (int64_t)((seed * 2654435761u) % (uint32_t)(n - len));
    dm_corpus_read(c, at, len, got);
    ok = ok && memcmp(got, b + at, (size_t)len) == 0;
  }
  CHECK(ok);
  /* the loader thread reads it too, while this thread reads other frames */
  dm_batch_spec s = {.batch = 16, .seq = 511, .ctx = 8, .seed = 3, .dtype = DM_U8, .device = DM_CPU};
  dm_loader *l = dm_loader_new(c, &s, 0, 4);
  for (int k = 0; k < 20; k++) {
    dm_tensor *x, *p;
    dm_loader_next(l, &x, &p);
    for (int64_t r = 0; r < s.batch; r++) {
      int64_t start = dm_batch_start(c, &s, k, r);
      ok = ok && memcmp((uint8_t *)dm_data(x) + r * 512, b + start, 512) == 0;
    }
    dm_corpus_read(c, (k * 10007) % 290000, 64, got);
    ok = ok && memcmp(got, b + (k * 10007) % 290000, 64) == 0;
    dm_release(x);
    dm_release(p);
  }
  CHECK(ok);
  dm_loader_free(l);
  dm_corpus_release(c);
  free(b);
}

/* a corrupted frame read by the loader ends the next batch with the file and the frame named */
static void corrupted_frames(void) {
  int64_t n = 60000;
  uint8_t *b = make_bytes((size_t)n, 3);
  write_frames(tmp("c.zst"), b, n, 2000, n);
  size_t m;
  uint8_t *z = slurp(tmp("c.zst"), &m);
  for (size_t off = 0, len; off < m && z[off + 3] != 0x18; off += len) {    /* to the seek table (0x184D2A5E, little-endian) */
    len = ZSTD_findFrameCompressedSize(z + off, m - off);
    z[off + len / 2] ^= 0x55;                               /* every frame damaged inside, its header whole */
  }
  write_file(tmp("bad.zst"), z, m);
  dm_corpus *c = dm_corpus_open(1, (const char *const[]){tmp("bad.zst")}, 0);
  dm_batch_spec s = {.batch = 2, .seq = 63, .ctx = 0, .seed = 1, .dtype = DM_U8, .device = DM_CPU};
  dm_loader *l = dm_loader_new(c, &s, 0, 2);
  dm_tensor *x, *p;
  EXPECT_ERROR(dm_loader_next(l, &x, &p), "data loader: batch 0: corpus: '");
  EXPECT_ERROR(dm_loader_next(l, &x, &p), "bad.zst' is a corrupted zstd stream: frame");
  dm_loader_free(l);
  EXPECT_ERROR(dm_corpus_batch(c, &s, 0, &x, &p), "is a corrupted zstd stream");
  dm_corpus_release(c);
  free(z); free(b);
}

/* a frame above DM_ZFRAME_MAX, or one without its size, is decoded whole at open and said so */
static void decoded_whole(void) {
  size_t n = (size_t)DM_ZFRAME_MAX + 4096;
  uint8_t *b = make_bytes(n, 4);
  size_t cap = ZSTD_compressBound(n);
  uint8_t *z = malloc(cap);
  size_t m = ZSTD_compress(z, cap, b, n, 1);
  CHECK(!ZSTD_isError(m));
  write_file(tmp("big.zst"), z, m);
  dm_corpus *c = dm_corpus_open(1, (const char *const[]){tmp("big.zst")}, 0);
  CHECK(dm_corpus_size(c) == (int64_t)n && dm_corpus_whole(c, 0) == (int64_t)n);
  uint8_t got[64];
  dm_corpus_read(c, (int64_t)n - 64, 64, got);
  CHECK(memcmp(got, b + n - 64, 64) == 0);
  dm_corpus_release(c);
  /* a streamed frame (no content size in its header) */
  ZSTD_CCtx *cc = ZSTD_createCCtx();
  ZSTD_outBuffer out = {z, cap, 0};
  ZSTD_inBuffer in = {b, 5000, 0}, none = {b, 0, 0};
  ZSTD_compressStream2(cc, &out, &in, ZSTD_e_continue);        /* the size unknown when the frame starts */
  while (ZSTD_compressStream2(cc, &out, &none, ZSTD_e_end) != 0) {}
  ZSTD_freeCCtx(cc);
  write_file(tmp("stream.zst"), z, out.pos);
  c = dm_corpus_open(1, (const char *const[]){tmp("stream.zst")}, 0);
  CHECK(dm_corpus_size(c) == 5000 && dm_corpus_whole(c, 0) == 5000);
  dm_corpus_release(c);
  free(z); free(b);
}

int main(void) {
  check_begin();
  if (!scratch_begin("zframes")) return 1;
  writes_frames_and_a_seek_table();
  reads_in_place();
  corrupted_frames();
  decoded_whole();
  scratch_end();
  return check_end();
}
