/*
** data.c — byte corpora (mmap or zstd), splits, training batches drawn by
** Philox, held-out windows, and the loader thread. See data.h.
**
** Opening builds the corpus step by step; each step reports failure into an
** error buffer, so everything built so far is freed before dm_error raises.
** The loader thread never calls dm_error or dm_alloc: it fills plain host
** buffers and leaves any error for the caller's thread to raise.
*/
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "data/data.h"
#include "data/files.h"
#include "data/zframes.h"
#include "core/alloc.h"
#include "core/core.h"
#include "core/philox.h"

/* A part is a slice of one file placed in the stream; a source's train segment is where its rows
** start. A single source keeps its file order: train, then its tail, contiguous as in the files. */
typedef struct part {
  int file;
  int64_t at, size;        /* bytes [at, at + size) of the file */
  int64_t offset;          /* where the slice starts in the stream */
} part;

typedef struct source {
  int64_t begin, end;      /* its train bytes in the stream */
  double upto;             /* the weights' running share up to and including this source */
  char name[160];          /* for messages: its first path, and how many more */
} source;

struct dm_corpus {
  int refs;
  dm_file *files;          /* only files that hold bytes: the sources' in order, then the eval source's */
  int nfiles;
  part *parts;             /* in stream order */
  int nparts;
  source *sources;
  int nsources;
  int64_t size, eval_bytes;
  dm_zcache *frames;       /* decoded frames of the zstd files read in place (zframes.h) */
  char name[256];          /* for messages: the first path, and how many more */
};

#define fail dm_data_fail
#define ERRMAX DM_DATA_ERRMAX

/* ---- opening and closing --------------------------------------------------------------- */

static void corpus_destroy(dm_corpus *c) {
  if (!c) return;
  for (int i = 0; i < c->nfiles; i++) dm_file_unload(&c->files[i]);
  free(c->files);
  free(c->parts);
  free(c->sources);
  dm_zcache_free(c->frames);
  free(c);
}

static void name_paths(char *name, size_t n, int npaths, const char *const *paths) {
  if (npaths == 1) snprintf(name, n, "'%s'", paths[0]);
  else snprintf(name, n, "'%s' and %d more", paths[0], npaths - 1);
}

/* loads one source's files after those loaded so far; files without bytes are dropped */
static bool load_source(dm_corpus *c, const dm_source *src, int64_t *bytes, char *err) {
  dm_pathlist files = {0};
  bool ok = true;
  for (int i = 0; ok && i < src->npaths; i++) ok = dm_paths_collect(src->paths[i], &files, err);
  dm_file *grown = ok ? realloc(c->files, sizeof *grown * (size_t)(c->nfiles + files.n)) : c->files;
  if (ok && !grown && files.n > 0) ok = fail(err, "corpus: out of host memory");
  if (grown) c->files = grown;
  *bytes = 0;
  for (int i = 0; ok && i < files.n; i++) {
    dm_file *f = &c->files[c->nfiles];
    *f = (dm_file){.path = files.v[i]};
    files.v[i] = NULL;
    ok = dm_file_load(f, err);
    if (!ok || f->size == 0) { dm_file_unload(f); continue; }
    *bytes += f->size;
    c->nfiles++;
  }
  char name[160];
  name_paths(name, sizeof name, src->npaths, src->paths);
  if (ok && *bytes == 0)
    ok = fail(err, "corpus is empty: %s (%d file%s) holds no bytes", name, files.n, files.n == 1 ? "" : "s");
  dm_pathlist_free(&files);
  return ok;
}

/* places bytes [lo, hi) of files [f0, f1) (counted as one stream) after the parts so far */
static void place(dm_corpus *c, int f0, int f1, int64_t lo, int64_t hi) {
  int64_t at = 0;
  for (int i = f0; i < f1 && at < hi; at += c->files[i].size, i++) {
    int64_t a = lo > at ? lo : at, b = hi < at + c->files[i].size ? hi : at + c->files[i].size;
    if (a >= b) continue;
    c->parts[c->nparts++] = (part){i, a - at, b - a, c->size};
    c->size += b - a;
  }
}

/* each source's share of the held-out bytes, by weight; the last takes what rounding leaves */
static int64_t tail_of(const dm_source *sources, int n, int i, int64_t eval_bytes, double total) {
  if (i < n - 1) return (int64_t)((double)eval_bytes * sources[i].weight / total);
  int64_t rest = eval_bytes;
  for (int j = 0; j < n - 1; j++) rest -= tail_of(sources, n, j, eval_bytes, total);
  return rest;
}

static bool check_sources(int n, const dm_source *sources, const dm_source *eval, int64_t eval_bytes,
                          char *err) {
  if (n < 1) return fail(err, "corpus: no path given");
  for (int s = 0; s <= n; s++) {
    const dm_source *src = s < n ? &sources[s] : eval;
    if (!src) break;
    if (src->npaths < 1 && s == n) return fail(err, "corpus: the eval source names no path");
    if (src->npaths < 1) return n == 1 ? fail(err, "corpus: no path given") : fail(err, "corpus: source %d names no path", s + 1);
    for (int i = 0; i < src->npaths; i++)
      if (!src->paths[i] || !src->paths[i][0]) return fail(err, "corpus: path %d is empty", i + 1);
    if (s < n && !(src->weight > 0 && src->weight < 1e300))
      return fail(err, "corpus: source %d ('%s') has weight %g; a weight must be a number > 0", s + 1,
                  src->paths[0], src->weight);
  }
  if (eval_bytes < 0) return fail(err, "corpus: eval_bytes must be >= 0, got %lld", (long long)eval_bytes);
  if (eval && eval_bytes == 0)
    return fail(err, "corpus: an eval source ('%s') needs eval_bytes > 0: the bytes of it that are held out",
                eval->paths[0]);
  return true;
}

/* the sources' train segments, then the held-out bytes: each source's tail, or the eval source's */
static bool lay_out(dm_corpus *c, int n, const dm_source *sources, const int *first, const int64_t *bytes,
                    int64_t eval_bytes, bool has_eval, char *err) {
  double total = 0;
  for (int s = 0; s < n; s++) total += sources[s].weight;
  int64_t tails[n];
  for (int s = 0; s < n; s++) {
    tails[s] = has_eval ? 0 : tail_of(sources, n, s, eval_bytes, total);
    if (tails[s] >= bytes[s]) {
      if (n == 1)
        return fail(err, "corpus %s: eval_bytes (%lld) must be smaller than the corpus size (%lld bytes)",
                    c->name, (long long)eval_bytes, (long long)bytes[s]);
      return fail(err, "corpus: source %d (%s) holds %lld bytes; its share of eval_bytes, %lld, leaves none "
                  "to train on", s + 1, c->sources[s].name, (long long)bytes[s], (long long)tails[s]);
    }
  }
  if (has_eval && eval_bytes > bytes[n])
    return fail(err, "corpus: the eval source %s holds %lld bytes, fewer than eval_bytes (%lld)",
                c->sources[n].name, (long long)bytes[n], (long long)eval_bytes);
  c->parts = calloc((size_t)(2 * c->nfiles + 1), sizeof *c->parts);
  if (!c->parts) return fail(err, "corpus: out of host memory");
  double share = 0;
  for (int s = 0; s < n; s++) {
    c->sources[s].begin = c->size;
    place(c, first[s], first[s + 1], 0, bytes[s] - tails[s]);
    c->sources[s].end = c->size;
    share += sources[s].weight;
    c->sources[s].upto = s == n - 1 ? 1.0 : share / total;
  }
  if (has_eval) place(c, first[n], first[n + 1], bytes[n] - eval_bytes, bytes[n]);
  else for (int s = 0; s < n; s++) place(c, first[s], first[s + 1], bytes[s] - tails[s], bytes[s]);
  c->eval_bytes = eval_bytes;
  return true;
}

static bool open_into(dm_corpus *c, int n, const dm_source *sources, const dm_source *eval, int64_t eval_bytes,
                      char *err) {
  int m = n + (eval != NULL);
  int first[m + 1];
  int64_t bytes[m];
  c->sources = calloc((size_t)m, sizeof *c->sources);
  if (!c->sources) return fail(err, "corpus: out of host memory");
  for (int s = 0; s < m; s++) {
    const dm_source *src = s < n ? &sources[s] : eval;
    name_paths(c->sources[s].name, sizeof c->sources[s].name, src->npaths, src->paths);
    first[s] = c->nfiles;
    if (!load_source(c, src, &bytes[s], err)) return false;
  }
  first[m] = c->nfiles;
  c->frames = dm_zcache_new();
  if (!c->frames) return fail(err, "corpus: out of host memory");
  name_paths(c->name, sizeof c->name, sources[0].npaths, sources[0].paths);
  if (n > 1) snprintf(c->name, sizeof c->name, "%s and %d more source%s", c->sources[0].name, n - 1, n > 2 ? "s" : "");
  c->nsources = n;
  return lay_out(c, n, sources, first, bytes, eval_bytes, eval != NULL, err);
}

dm_corpus *dm_corpus_open_sources(int nsources, const dm_source *sources, const dm_source *eval,
                                  int64_t eval_bytes) {
  char err[ERRMAX];
  if (!check_sources(nsources, sources, eval, eval_bytes, err)) dm_error("%s", err);
  dm_corpus *c = calloc(1, sizeof *c);
  if (!c) dm_error("corpus: out of host memory");
  if (!open_into(c, nsources, sources, eval, eval_bytes, err)) {
    corpus_destroy(c);
    dm_error("%s", err);
  }
  c->refs = 1;
  return c;
}

dm_corpus *dm_corpus_open(int npaths, const char *const *paths, int64_t eval_bytes) {
  dm_source one = {npaths, paths, 1.0};
  return dm_corpus_open_sources(1, &one, NULL, eval_bytes);
}

void dm_corpus_retain(dm_corpus *c) { c->refs++; }

void dm_corpus_release(dm_corpus *c) {
  if (c && --c->refs == 0) corpus_destroy(c);
}

int64_t dm_corpus_size(const dm_corpus *c) { return c->size; }
int64_t dm_corpus_train_size(const dm_corpus *c) { return c->size - c->eval_bytes; }
int64_t dm_corpus_eval_size(const dm_corpus *c) { return c->eval_bytes; }
int dm_corpus_nfiles(const dm_corpus *c) { return c->nfiles; }

const char *dm_corpus_file(const dm_corpus *c, int i) {
  if (i < 0 || i >= c->nfiles) dm_error("corpus: file %d of %d", i + 1, c->nfiles);
  return c->files[i].path;
}

int dm_corpus_nsources(const dm_corpus *c) { return c->nsources; }

void dm_corpus_source(const dm_corpus *c, int i, int64_t *begin, int64_t *end, double *share) {
  if (i < 0 || i >= c->nsources) dm_error("corpus: source %d of %d", i + 1, c->nsources);
  *begin = c->sources[i].begin;
  *end = c->sources[i].end;
  *share = c->sources[i].upto - (i > 0 ? c->sources[i - 1].upto : 0.0);
}

/* ---- reading ------------------------------------------------------------------------------- */

/* the part holding pos: the last starting at or before it */
static const part *part_of(const dm_corpus *c, int64_t pos) {
  int lo = 0, hi = c->nparts - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (c->parts[mid].offset <= pos) lo = mid;
    else hi = mid - 1;
  }
  return &c->parts[lo];
}

/* No dm_error: the loader thread calls this. Positions before 0 read as pad bytes 0; false with
** a message in err when a zstd frame does not decode. */
static bool copy_bytes(const dm_corpus *c, int64_t pos, int64_t n, uint8_t *dst, char *err, size_t errlen) {
  if (pos < 0) {
    int64_t pad = -pos < n ? -pos : n;
    memset(dst, 0, (size_t)pad);
    dst += pad; pos += pad; n -= pad;
  }
  while (n > 0) {
    const part *q = part_of(c, pos);
    const dm_file *f = &c->files[q->file];
    int64_t from = q->at + (pos - q->offset), m = q->offset + q->size - pos;
    if (m > n) m = n;
    if (f->data) memcpy(dst, f->data + from, (size_t)m);
    else if (!dm_zframes_read(f->frames, c->frames, f->path, from, m, dst, err, errlen)) return false;
    dst += m; pos += m; n -= m;
  }
  return true;
}

void dm_corpus_read(const dm_corpus *c, int64_t pos, int64_t n, uint8_t *dst) {
  if (n < 0 || pos > c->size - n)
    dm_error("corpus %s: cannot read %lld bytes at offset %lld of %lld", c->name, (long long)n,
             (long long)pos, (long long)c->size);
  char err[ERRMAX];
  if (!copy_bytes(c, pos, n, dst, err, sizeof err)) dm_error("%s", err);
}

int64_t dm_corpus_whole(const dm_corpus *c, int i) {
  if (i < 0 || i >= c->nfiles) dm_error("corpus: file %d of %d", i + 1, c->nfiles);
  const dm_file *f = &c->files[i];
  return f->decoded_whole ? f->size : 0;
}

/* ---- windows into tensors -------------------------------------------------------------------
** A batch of `rows` windows is one allocation: x [rows, T+1] first, then
** prefix [rows, ctx]; both tensors are views of it. Bytes are read into the
** row and widened in place from the end, so i32 and i64 need no scratch. */

typedef int64_t (*start_fn)(const dm_corpus *c, const dm_batch_spec *s, int64_t k, int64_t row);

static void widen(dm_dtype dt, void *row, int64_t n) {
  const uint8_t *b = row;
  if (dt == DM_I32) for (int64_t i = n - 1; i >= 0; i--) ((int32_t *)row)[i] = b[i];
  if (dt == DM_I64) for (int64_t i = n - 1; i >= 0; i--) ((int64_t *)row)[i] = b[i];
}

/* false with a message in err when a zstd frame does not decode (no dm_error: the loader calls it) */
static bool fill_rows(const dm_corpus *c, const dm_batch_spec *s, start_fn start, int64_t k,
                      int64_t rows, void *buf, char *err, size_t errlen) {
  size_t es = dm_dtype_size(s->dtype), xw = (size_t)(s->seq + 1) * es, pw = (size_t)s->ctx * es;
  char *x = buf, *pre = x + (size_t)rows * xw;
  for (int64_t r = 0; r < rows; r++) {
    int64_t at = start(c, s, k, r);
    char *xr = x + (size_t)r * xw, *pr = pre + (size_t)r * pw;
    if (!copy_bytes(c, at, s->seq + 1, (uint8_t *)xr, err, errlen) ||
        !copy_bytes(c, at - s->ctx, s->ctx, (uint8_t *)pr, err, errlen))
      return false;
    widen(s->dtype, xr, s->seq + 1);
    widen(s->dtype, pr, s->ctx);
  }
  return true;
}

static int64_t rows_numel(const dm_batch_spec *s, int64_t rows) { return rows * (s->seq + 1 + s->ctx); }

static void split(dm_tensor *all, const dm_batch_spec *s, int64_t rows, dm_tensor **x, dm_tensor **prefix) {
  int64_t xs[2] = {rows, s->seq + 1}, xst[2] = {s->seq + 1, 1};
  int64_t ps[2] = {rows, s->ctx}, pst[2] = {s->ctx, 1};
  *x = dm_tensor_view(all, 2, xs, xst, 0);
  *prefix = dm_tensor_view(all, 2, ps, pst, rows * (s->seq + 1));
  dm_release(all);
}

/* a tensor on dev holding a copy of n elements of host memory */
static dm_tensor *upload(const void *host, dm_dtype dt, int64_t n, dm_device dev) {
  dm_tensor *t = dm_tensor_new(dev, dt, 1, &n);
  if (dev == DM_CPU) { memcpy(dm_data(t), host, (size_t)n * dm_dtype_size(dt)); return t; }
  dm_tensor *h = dm_tensor_wrap(DM_CPU, dt, 1, &n, (void *)host);
  dm_copy_(t, h);
  dm_release(h);
  return t;
}

static void make_rows(const dm_corpus *c, const dm_batch_spec *s, start_fn start, int64_t k, int64_t rows,
                      dm_tensor **x, dm_tensor **prefix) {
  int64_t n = rows_numel(s, rows);
  char err[ERRMAX];
  dm_tensor *all;
  if (s->device == DM_CPU) {
    all = dm_tensor_new(DM_CPU, s->dtype, 1, &n);
    if (!fill_rows(c, s, start, k, rows, dm_data(all), err, sizeof err)) { dm_release(all); dm_error("%s", err); }
  } else {
    void *host = malloc((size_t)n * dm_dtype_size(s->dtype));
    if (!host) dm_error("data: out of host memory for %lld rows", (long long)rows);
    if (!fill_rows(c, s, start, k, rows, host, err, sizeof err)) { free(host); dm_error("%s", err); }
    all = upload(host, s->dtype, n, s->device);
    free(host);
  }
  split(all, s, rows, x, prefix);
}

/* the checks shared by training batches and held-out windows */
static void check_window_spec(const dm_corpus *c, const dm_batch_spec *s, const char *what) {
  if (s->seq < 1) dm_error("%s: seq must be >= 1, got %lld", what, (long long)s->seq);
  if (s->ctx < 0) dm_error("%s: ctx must be >= 0, got %lld", what, (long long)s->ctx);
  if (s->dtype != DM_U8 && s->dtype != DM_I32 && s->dtype != DM_I64)
    dm_error("%s: dtype must be u8, i32 or i64, got %s", what, dm_dtype_name(s->dtype));
  if (s->device == DM_META) dm_error("%s: byte windows hold data; the meta device holds none", what);
  if (!dm_device_available(s->device))
    dm_error("%s: device '%s' is not available", what, dm_device_name(s->device));
  if (s->seq > (INT64_C(1) << 40) || s->ctx > (INT64_C(1) << 40))
    dm_error("%s: seq (%lld) and ctx (%lld) must be below 2^40", what, (long long)s->seq, (long long)s->ctx);
}

/* ---- training batches ---------------------------------------------------------------------- */

/* the fourth Philox counter word: keeps these draws apart from dm_rand's stream of the same seed */
#define DATA_STREAM 0x44415441u    /* "DATA" */

void dm_batch_check(const dm_corpus *c, const dm_batch_spec *s) {
  check_window_spec(c, s, "data batch");
  if (s->batch < 1 || s->batch > INT32_MAX)
    dm_error("data batch: batch must be in 1..%d, got %lld", INT32_MAX, (long long)s->batch);
  if (s->first_row < 0 || s->first_row > INT32_MAX - s->batch)
    dm_error("data batch: first_row must be in 0..%lld, got %lld", (long long)(INT32_MAX - s->batch),
             (long long)s->first_row);
  for (int i = 0; i < c->nsources; i++) {
    const source *src = &c->sources[i];
    if (src->end - src->begin >= s->seq + 1) continue;
    if (c->nsources == 1)
      dm_error("data batch: the train split of %s (%lld bytes) is shorter than one window of "
               "seq + 1 = %lld bytes", c->name, (long long)(src->end - src->begin), (long long)s->seq + 1);
    dm_error("data batch: the train split of source %d, %s (%lld bytes), is shorter than one window of "
             "seq + 1 = %lld bytes", i + 1, src->name, (long long)(src->end - src->begin),
             (long long)s->seq + 1);
  }
}

/* which source a row reads: the first whose running weight share passes a uniform draw */
static const source *pick_source(const dm_corpus *c, const uint32_t r[4]) {
  if (c->nsources == 1) return &c->sources[0];
  double v = (double)(((uint64_t)r[2] << 32 | r[3]) >> 11) * 0x1p-53;     /* [0, 1) */
  for (int i = 0; i < c->nsources - 1; i++)
    if (v < c->sources[i].upto) return &c->sources[i];
  return &c->sources[c->nsources - 1];
}

int64_t dm_batch_start(const dm_corpus *c, const dm_batch_spec *s, int64_t k, int64_t row) {
  row += s->first_row;
  uint32_t r[4];
  uint64_t uk = (uint64_t)k;
  dm_philox((uint32_t)s->seed, (uint32_t)(s->seed >> 32), (uint32_t)uk, (uint32_t)(uk >> 32),
            (uint32_t)row, DATA_STREAM, r);
  const source *src = pick_source(c, r);
  uint64_t u = (uint64_t)r[0] << 32 | r[1];
  uint64_t choices = (uint64_t)(src->end - src->begin - s->seq);    /* starts begin .. end - (T+1) */
  return src->begin + (int64_t)(((unsigned __int128)u * choices) >> 64);   /* u * choices / 2^64 */
}

void dm_corpus_batch(const dm_corpus *c, const dm_batch_spec *s, int64_t k, dm_tensor **x,
                     dm_tensor **prefix) {
  dm_batch_check(c, s);
  if (k < 0) dm_error("data batch: k must be >= 0, got %lld", (long long)k);
  make_rows(c, s, dm_batch_start, k, s->batch, x, prefix);
}

/* ---- held-out windows ---------------------------------------------------------------------- */

int64_t dm_eval_window_count(const dm_corpus *c, int64_t seq) {
  if (seq < 1) dm_error("eval windows: seq must be >= 1, got %lld", (long long)seq);
  return c->eval_bytes > seq ? (c->eval_bytes - 1) / seq : 0;
}

static int64_t eval_start(const dm_corpus *c, const dm_batch_spec *s, int64_t k, int64_t row) {
  return dm_corpus_train_size(c) + row * s->seq;
}

void dm_corpus_eval_windows(const dm_corpus *c, const dm_batch_spec *s, int64_t n, dm_tensor **x,
                            dm_tensor **prefix) {
  check_window_spec(c, s, "eval windows");
  if (c->eval_bytes == 0)
    dm_error("eval windows: corpus %s has no held-out split (open it with eval_bytes > 0)", c->name);
  int64_t all = dm_eval_window_count(c, s->seq);
  if (all == 0)
    dm_error("eval windows: the held-out split of %s (%lld bytes) is shorter than one window of "
             "seq + 1 = %lld bytes", c->name, (long long)c->eval_bytes, (long long)s->seq + 1);
  if (n == 0 || n > all)
    dm_error("eval windows: asked for %lld windows of seq + 1 = %lld bytes; the held-out split "
             "(%lld bytes) holds %lld", (long long)n, (long long)s->seq + 1, (long long)c->eval_bytes,
             (long long)all);
  make_rows(c, s, eval_start, 0, n < 0 ? all : n, x, prefix);
}

/* ---- host buffers ---------------------------------------------------------------------------- */

static void *malloc_buffer(size_t n) { return malloc(n); }
static void free_buffer(void *p, size_t n) { free(p); }
static dm_host_buffers host_buffers = {malloc_buffer, free_buffer};

void dm_data_set_host_buffers(const dm_host_buffers *hb) {
  if (hb && (!hb->alloc || !hb->free)) dm_error("data: host buffers need both alloc and free");
  host_buffers = hb ? *hb : (dm_host_buffers){malloc_buffer, free_buffer};
}

/* ---- the loader thread ----------------------------------------------------------------------
** Batches `produced` and `consumed` are the next to fill and the next to
** hand out; the thread fills only while produced - consumed < depth, so the
** slot being copied out (consumed % depth) is never the one being filled. */

struct dm_loader {
  dm_corpus *corpus;
  dm_batch_spec spec;
  dm_host_buffers hb;
  int depth;
  size_t slot_bytes;
  void **slots;                 /* allocated by the thread on first use */
  int64_t produced, consumed;
  bool stop, failed;
  char err[256];
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t can_fill, can_take;
};

static void *loader_main(void *arg) {
  dm_loader *l = arg;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    while (!l->stop && (l->failed || l->produced - l->consumed >= l->depth))
      pthread_cond_wait(&l->can_fill, &l->mu);
    if (l->stop) break;
    int64_t k = l->produced;
    int i = (int)(k % l->depth);
    void *slot = l->slots[i];
    pthread_mutex_unlock(&l->mu);
    if (!slot) slot = l->hb.alloc(l->slot_bytes);
    char err[sizeof l->err];
    bool filled = slot && fill_rows(l->corpus, &l->spec, dm_batch_start, k, l->spec.batch, slot, err, sizeof err);
    pthread_mutex_lock(&l->mu);
    if (slot) l->slots[i] = slot;
    if (filled) l->produced++;
    else {
      l->failed = true;
      if (slot) memcpy(l->err, err, sizeof l->err);
      else snprintf(l->err, sizeof l->err, "the host buffer allocator returned NULL for %zu bytes", l->slot_bytes);
    }
    pthread_cond_signal(&l->can_take);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

static void loader_destroy(dm_loader *l) {
  for (int i = 0; i < l->depth; i++)
    if (l->slots[i]) l->hb.free(l->slots[i], l->slot_bytes);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->can_fill);
  pthread_cond_destroy(&l->can_take);
  free(l->slots);
  free(l);
}

dm_loader *dm_loader_new(dm_corpus *c, const dm_batch_spec *s, int64_t start, int64_t depth) {
  dm_batch_check(c, s);
  if (start < 0 || start > DM_LOADER_MAX_START)
    dm_error("data loader: start must be in 0 .. 2^62, got %lld", (long long)start);
  if (depth < 1 || depth > 1024) dm_error("data loader: depth must be in 1..1024, got %lld", (long long)depth);
  dm_loader *l = calloc(1, sizeof *l);
  void **slots = calloc((size_t)depth, sizeof *slots);
  if (!l || !slots) { free(l); free(slots); dm_error("data loader: out of host memory"); }
  *l = (dm_loader){.corpus = c, .spec = *s, .hb = host_buffers, .depth = (int)depth, .slots = slots,
                   .produced = start, .consumed = start};
  l->slot_bytes = (size_t)rows_numel(s, s->batch) * dm_dtype_size(s->dtype);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->can_fill, NULL);
  pthread_cond_init(&l->can_take, NULL);
  dm_corpus_retain(c);
  int rc = pthread_create(&l->thread, NULL, loader_main, l);
  if (rc != 0) {
    dm_corpus_release(c);
    loader_destroy(l);
    dm_error("data loader: cannot start its thread: %s", strerror(rc));
  }
  return l;
}

int64_t dm_loader_next(dm_loader *l, dm_tensor **x, dm_tensor **prefix) {
  pthread_mutex_lock(&l->mu);
  while (l->produced == l->consumed && !l->failed) pthread_cond_wait(&l->can_take, &l->mu);
  int64_t k = l->consumed;
  if (l->produced == k) {
    char msg[sizeof l->err];
    memcpy(msg, l->err, sizeof msg);
    pthread_mutex_unlock(&l->mu);
    dm_error("data loader: batch %lld: %s", (long long)k, msg);
  }
  const void *slot = l->slots[k % l->depth];
  pthread_mutex_unlock(&l->mu);
  /* copy out before releasing the slot; if this raises, batch k is handed out next time */
  dm_tensor *all = upload(slot, l->spec.dtype, rows_numel(&l->spec, l->spec.batch), l->spec.device);
  pthread_mutex_lock(&l->mu);
  l->consumed++;
  pthread_cond_signal(&l->can_fill);
  pthread_mutex_unlock(&l->mu);
  split(all, &l->spec, l->spec.batch, x, prefix);
  return k;
}

int64_t dm_loader_position(const dm_loader *l) { return l->consumed; }

void dm_loader_free(dm_loader *l) {
  if (!l) return;
  pthread_mutex_lock(&l->mu);
  l->stop = true;
  pthread_cond_broadcast(&l->can_fill);
  pthread_mutex_unlock(&l->mu);
  pthread_join(l->thread, NULL);
  dm_corpus_release(l->corpus);
  loader_destroy(l);
}
