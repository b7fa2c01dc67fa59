/*
** zframes.c — zstd files read in place frame by frame, and written in
** frames with a seek table. See zframes.h.
**
** The seek table is zstd's seekable format: a skippable frame (magic
** 0x184D2A5E) holding one entry a frame (its compressed and decoded sizes,
** 4 bytes each, little-endian; a checksum after them when the descriptor's
** top bit says so), then the number of frames (4 bytes), the descriptor (1
** byte) and the magic 0x8F92EAB1 (4 bytes).
*/
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zstd.h>
#include "data/files.h"
#include "data/zframes.h"

#define SKIPPABLE_MASK 0xFFFFFFF0u
#define SKIPPABLE_MAGIC 0x184D2A50u
#define SEEK_TABLE_MAGIC 0x184D2A5Eu
#define SEEKABLE_MAGIC 0x8F92EAB1u
#define FOOTER_BYTES 9

struct dm_zframes {
  const uint8_t *comp;
  int nframes;
  int64_t *at;             /* [nframes + 1]: where frame i's decoded bytes start; at[n] the size */
  int64_t *comp_at;        /* [nframes]: where frame i starts in the file */
  int64_t *comp_len;       /* [nframes] */
};

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void dm_zframes_free(dm_zframes *z) {
  if (!z) return;
  free(z->at);
  free(z->comp_at);
  free(z->comp_len);
  free(z);
}

int64_t dm_zframes_size(const dm_zframes *z) { return z->at[z->nframes]; }
int dm_zframes_count(const dm_zframes *z) { return z->nframes; }

/* room for cap frames; false: out of memory */
static bool reserve(dm_zframes *z, int cap) {
  int64_t *at = realloc(z->at, sizeof *at * (size_t)(cap + 1));
  if (at) z->at = at;
  int64_t *ca = realloc(z->comp_at, sizeof *ca * (size_t)cap);
  if (ca) z->comp_at = ca;
  int64_t *cl = realloc(z->comp_len, sizeof *cl * (size_t)cap);
  if (cl) z->comp_len = cl;
  return at && ca && cl;
}

/* adds a frame; false when it cannot be read in place (too large) or on no memory (*oom) */
static bool add_frame(dm_zframes *z, int *cap, int64_t comp_at, int64_t comp_len, int64_t size, bool *oom) {
  if (size > DM_ZFRAME_MAX) return false;
  if (z->nframes == *cap) {
    *cap = *cap ? 2 * *cap : 64;
    if (!reserve(z, *cap)) { *oom = true; return false; }
  }
  int i = z->nframes++;
  z->comp_at[i] = comp_at;
  z->comp_len[i] = comp_len;
  z->at[i + 1] = z->at[i] + size;
  return true;
}

/* the frames listed by a seek table at the file's end; false: no valid table */
static bool from_seek_table(dm_zframes *z, int *cap, const uint8_t *comp, int64_t n, bool *oom) {
  if (n < 8 + FOOTER_BYTES || le32(comp + n - 4) != SEEKABLE_MAGIC) return false;
  int64_t count = le32(comp + n - FOOTER_BYTES), entry = comp[n - 5] & 0x80 ? 12 : 8;
  int64_t table = count * entry + FOOTER_BYTES, start = n - 8 - table;
  if (count < 1 || start < 0 || le32(comp + start) != SEEK_TABLE_MAGIC || le32(comp + start + 4) != table)
    return false;
  int64_t off = 0;
  for (int64_t i = 0; i < count; i++) {
    const uint8_t *e = comp + start + 8 + i * entry;
    int64_t clen = le32(e), size = le32(e + 4);
    if (off + clen > start) return false;   /* the frames are not read here: a wrong size shows when one decodes */
    if (!add_frame(z, cap, off, clen, size, oom)) return false;
    off += clen;
  }
  return off == start;
}

/* the frames found by walking their headers; false: a frame that cannot be read in place */
static bool by_walking(dm_zframes *z, int *cap, const uint8_t *comp, int64_t n, bool *oom) {
  int64_t off = 0;
  while (off < n) {
    if (n - off < 8) return false;
    if ((le32(comp + off) & SKIPPABLE_MASK) == SKIPPABLE_MAGIC) {
      off += 8 + (int64_t)le32(comp + off + 4);
      continue;
    }
    unsigned long long size = ZSTD_getFrameContentSize(comp + off, (size_t)(n - off));
    size_t clen = ZSTD_findFrameCompressedSize(comp + off, (size_t)(n - off));
    if (size == ZSTD_CONTENTSIZE_UNKNOWN || size == ZSTD_CONTENTSIZE_ERROR || ZSTD_isError(clen)) return false;
    if (!add_frame(z, cap, off, (int64_t)clen, (int64_t)size, oom)) return false;
    off += (int64_t)clen;
  }
  return off == n && z->nframes > 0;        /* a skippable frame may claim bytes past the end */
}

dm_zframes *dm_zframes_index(const uint8_t *comp, int64_t n, bool *oom) {
  *oom = false;
  dm_zframes *z = calloc(1, sizeof *z);
  int cap = 0;
  if (!z || !reserve(z, 0)) { *oom = true; dm_zframes_free(z); return NULL; }
  z->comp = comp;
  z->at[0] = 0;
  bool ok = from_seek_table(z, &cap, comp, n, oom);
  if (!ok && !*oom) {
    z->nframes = 0;
    ok = by_walking(z, &cap, comp, n, oom);
  }
  if (!ok) { dm_zframes_free(z); return NULL; }
  return z;
}

/* ---- the cache of decoded frames ---------------------------------------------------------- */

typedef struct slot {
  const dm_zframes *z;     /* NULL: empty */
  int frame;
  uint8_t *bytes;
  size_t cap;
  uint64_t used;           /* the read that touched it last, for least-recently-used eviction */
} slot;

struct dm_zcache {
  pthread_mutex_t mu;
  ZSTD_DCtx *dctx;
  slot slots[DM_ZCACHE_SLOTS];
  uint64_t clock;
};

dm_zcache *dm_zcache_new(void) {
  dm_zcache *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->dctx = ZSTD_createDCtx();
  if (!c->dctx) { free(c); return NULL; }
  pthread_mutex_init(&c->mu, NULL);
  return c;
}

void dm_zcache_free(dm_zcache *c) {
  if (!c) return;
  for (int i = 0; i < DM_ZCACHE_SLOTS; i++) free(c->slots[i].bytes);
  ZSTD_freeDCtx(c->dctx);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* the slot holding frame f of z, decoded now if it is not there; NULL with err on failure */
static slot *frame_slot(dm_zcache *c, const dm_zframes *z, int f, const char *path, char *err, size_t errlen) {
  slot *s = &c->slots[0];
  for (int i = 0; i < DM_ZCACHE_SLOTS; i++) {
    slot *t = &c->slots[i];
    if (t->z == z && t->frame == f) { t->used = ++c->clock; return t; }
    if (t->used < s->used) s = t;
  }
  size_t size = (size_t)(z->at[f + 1] - z->at[f]);
  s->z = NULL;
  if (s->cap < size) {
    uint8_t *b = realloc(s->bytes, size);
    if (!b) {
      snprintf(err, errlen, "corpus: out of host memory decoding a frame of %zu bytes of '%s'", size, path);
      return NULL;
    }
    s->bytes = b;
    s->cap = size;
  }
  size_t got = ZSTD_decompressDCtx(c->dctx, s->bytes, size, z->comp + z->comp_at[f], (size_t)z->comp_len[f]);
  if (ZSTD_isError(got) || got != size) {
    snprintf(err, errlen, "corpus: '%s' is a corrupted zstd stream: frame %d (at compressed byte offset %lld) "
             "does not decode: %s", path, f + 1, (long long)z->comp_at[f],
             ZSTD_isError(got) ? ZSTD_getErrorName(got) : "its size differs from its header's");
    return NULL;
  }
  *s = (slot){z, f, s->bytes, s->cap, ++c->clock};
  return s;
}

/* the frame holding decoded byte at: the last whose start is at or before it */
static int frame_of(const dm_zframes *z, int64_t at) {
  int lo = 0, hi = z->nframes - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (z->at[mid] <= at) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

bool dm_zframes_read(const dm_zframes *z, dm_zcache *cache, const char *path, int64_t at, int64_t n,
                     uint8_t *dst, char *err, size_t errlen) {
  pthread_mutex_lock(&cache->mu);
  bool ok = true;
  for (int f = n > 0 ? frame_of(z, at) : 0; ok && n > 0; f++) {
    slot *s = frame_slot(cache, z, f, path, err, errlen);
    if (!s) { ok = false; break; }
    int64_t from = at - z->at[f], m = z->at[f + 1] - at;
    if (m > n) m = n;
    memcpy(dst, s->bytes + from, (size_t)m);
    dst += m; at += m; n -= m;
  }
  pthread_mutex_unlock(&cache->mu);
  return ok;
}

/* ---- writing -------------------------------------------------------------------------------- */

struct dm_zwriter {
  FILE *out;
  char *path, *tmp;
  ZSTD_CCtx *cctx;
  uint8_t *buf, *packed;   /* a frame's decoded bytes so far; its compressed form */
  size_t frame, fill, packed_cap;
  uint32_t *sizes;         /* compressed and decoded size of each frame written */
  int nframes, cap;
  int64_t in, written;
};

void dm_zwriter_abort(dm_zwriter *w) {
  if (!w) return;
  if (w->out) fclose(w->out);
  if (w->tmp) unlink(w->tmp);
  ZSTD_freeCCtx(w->cctx);
  free(w->buf);
  free(w->packed);
  free(w->sizes);
  free(w->path);
  free(w->tmp);
  free(w);
}

dm_zwriter *dm_zwriter_open(const char *path, int64_t frame_bytes, int level, char *err) {
  if (frame_bytes < 1 || frame_bytes > DM_ZFRAME_MAX) {
    dm_data_fail(err, "zstd frames: the frame size must be in 1 .. %lld bytes, got %lld",
                 (long long)DM_ZFRAME_MAX, (long long)frame_bytes);
    return NULL;
  }
  if (level < 1 || level > ZSTD_maxCLevel()) {
    dm_data_fail(err, "zstd frames: the level must be in 1 .. %d, got %d", ZSTD_maxCLevel(), level);
    return NULL;
  }
  dm_zwriter *w = calloc(1, sizeof *w);
  size_t bound = ZSTD_compressBound((size_t)frame_bytes);
  if (w) {
    w->path = strdup(path);
    w->tmp = malloc(strlen(path) + 5);
    w->cctx = ZSTD_createCCtx();
    w->buf = malloc((size_t)frame_bytes);
    w->packed = malloc(bound);
  }
  if (!w || !w->path || !w->tmp || !w->cctx || !w->buf || !w->packed) {
    if (w) { free(w->tmp); w->tmp = NULL; }
    dm_zwriter_abort(w);
    dm_data_fail(err, "zstd frames: out of host memory");
    return NULL;
  }
  sprintf(w->tmp, "%s.tmp", path);
  w->frame = (size_t)frame_bytes;
  w->packed_cap = bound;
  ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_checksumFlag, 1);
  w->out = fopen(w->tmp, "wb");
  if (!w->out) {
    dm_data_fail(err, "zstd frames: cannot write '%s': %s", w->tmp, strerror(errno));
    free(w->tmp);
    w->tmp = NULL;
    dm_zwriter_abort(w);
    return NULL;
  }
  return w;
}

static bool emit(dm_zwriter *w, const void *p, size_t n, char *err) {
  if (fwrite(p, 1, n, w->out) != n) return dm_data_fail(err, "zstd frames: cannot write '%s': %s", w->tmp, strerror(errno));
  w->written += (int64_t)n;
  return true;
}

static bool flush_frame(dm_zwriter *w, char *err) {
  if (w->fill == 0) return true;
  size_t n = ZSTD_compress2(w->cctx, w->packed, w->packed_cap, w->buf, w->fill);
  if (ZSTD_isError(n)) return dm_data_fail(err, "zstd frames: compressing: %s", ZSTD_getErrorName(n));
  if (w->nframes == w->cap) {
    int cap = w->cap ? 2 * w->cap : 256;
    uint32_t *s = realloc(w->sizes, sizeof *s * 2 * (size_t)cap);
    if (!s) return dm_data_fail(err, "zstd frames: out of host memory");
    w->sizes = s;
    w->cap = cap;
  }
  w->sizes[2 * w->nframes] = (uint32_t)n;
  w->sizes[2 * w->nframes + 1] = (uint32_t)w->fill;
  w->nframes++;
  w->fill = 0;
  return emit(w, w->packed, n, err);
}

bool dm_zwriter_add(dm_zwriter *w, const uint8_t *bytes, int64_t n, char *err) {
  w->in += n;
  while (n > 0) {
    size_t m = w->frame - w->fill < (size_t)n ? w->frame - w->fill : (size_t)n;
    memcpy(w->buf + w->fill, bytes, m);
    w->fill += m; bytes += m; n -= (int64_t)m;
    if (w->fill == w->frame && !flush_frame(w, err)) return false;
  }
  return true;
}

static bool write_seek_table(dm_zwriter *w, char *err) {
  uint8_t head[8], entry[8], foot[FOOTER_BYTES];
  put_le32(head, SEEK_TABLE_MAGIC);
  put_le32(head + 4, (uint32_t)(8 * w->nframes + FOOTER_BYTES));
  if (!emit(w, head, 8, err)) return false;
  for (int i = 0; i < w->nframes; i++) {
    put_le32(entry, w->sizes[2 * i]);
    put_le32(entry + 4, w->sizes[2 * i + 1]);
    if (!emit(w, entry, 8, err)) return false;
  }
  put_le32(foot, (uint32_t)w->nframes);
  foot[4] = 0;                                 /* no checksums in the table: each frame has its own */
  put_le32(foot + 5, SEEKABLE_MAGIC);
  return emit(w, foot, FOOTER_BYTES, err);
}

bool dm_zwriter_close(dm_zwriter *w, int64_t *written, char *err) {
  bool ok = flush_frame(w, err) && write_seek_table(w, err);
  if (written) *written = w->written;
  if (ok && (fflush(w->out) != 0 || fsync(fileno(w->out)) != 0))
    ok = dm_data_fail(err, "zstd frames: cannot write '%s': %s", w->tmp, strerror(errno));
  if (fclose(w->out) != 0 && ok) ok = dm_data_fail(err, "zstd frames: cannot write '%s': %s", w->tmp, strerror(errno));
  w->out = NULL;
  if (ok && rename(w->tmp, w->path) != 0)
    ok = dm_data_fail(err, "zstd frames: cannot rename '%s' to '%s': %s", w->tmp, w->path, strerror(errno));
  if (ok) { free(w->tmp); w->tmp = NULL; }        /* renamed: nothing to remove */
  dm_zwriter_abort(w);
  return ok;
}

static bool to_writer(void *w, const uint8_t *bytes, size_t n, char *err) {
  return dm_zwriter_add(w, bytes, (int64_t)n, err);
}

bool dm_zwriter_add_file(dm_zwriter *w, const char *path, char *err) {
  if (dm_is_zst(path)) return dm_zst_decode(path, to_writer, w, err);     /* decoded as it is read */
  FILE *f = fopen(path, "rb");
  if (!f) return dm_data_fail(err, "zstd frames: cannot read '%s': %s", path, strerror(errno));
  size_t cap = (size_t)1 << 20;
  uint8_t *in = malloc(cap);
  bool ok = in ? true : dm_data_fail(err, "zstd frames: out of host memory reading '%s'", path);
  for (size_t got; ok && (got = fread(in, 1, cap, f)) > 0;) ok = dm_zwriter_add(w, in, (int64_t)got, err);
  if (ok && ferror(f)) ok = dm_data_fail(err, "zstd frames: cannot read '%s'", path);
  fclose(f);
  free(in);
  return ok;
}

int64_t dm_zwriter_bytes_in(const dm_zwriter *w) { return w->in; }
