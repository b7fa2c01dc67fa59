/*
** data.c — byte corpora (mmap or zstd), splits, training batches drawn by
** Philox, held-out windows, and the loader thread. See data.h.
**
** Opening builds the corpus step by step; each step reports failure into an
** error buffer, so everything built so far is freed before dm_error raises.
** The loader thread never calls dm_error or dm_alloc: it fills plain host
** buffers and leaves any error for the caller's thread to raise.
*/
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include "data/data.h"
#include "core/alloc.h"
#include "core/core.h"
#include "core/philox.h"

typedef struct part {
  char *path;
  const uint8_t *data;
  int64_t size;
  int64_t offset;          /* where the file starts in the stream */
  bool mapped;             /* munmap, else free */
} part;

struct dm_corpus {
  int refs;
  part *parts;             /* only files that hold bytes, in stream order */
  int nparts;
  int64_t size, eval_bytes;
  char name[256];          /* for messages: the first path, and how many more */
};

#define ERRMAX 1024

static bool fail(char *err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, ERRMAX, fmt, ap);
  va_end(ap);
  return false;
}

/* ---- the file list --------------------------------------------------------------------- */

typedef struct strlist { char **v; int n, cap; } strlist;

static bool strlist_take(strlist *l, char *s, char *err) {
  if (s && l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 16;
    char **v = realloc(l->v, sizeof *v * (size_t)cap);
    if (v) { l->v = v; l->cap = cap; }
  }
  if (!s || l->n == l->cap) { free(s); return fail(err, "corpus: out of host memory listing files"); }
  l->v[l->n++] = s;
  return true;
}

static void strlist_free(strlist *l) {
  for (int i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  *l = (strlist){0};
}

static char *join_path(const char *dir, const char *name) {
  size_t nd = strlen(dir);
  bool slash = nd > 0 && dir[nd - 1] == '/';
  char *p = malloc(nd + strlen(name) + 2);
  if (p) sprintf(p, slash ? "%s%s" : "%s/%s", dir, name);
  return p;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool walk(const char *dir, strlist *out, char *err);

/* a directory's entries in sorted order, hidden names skipped; directories recursed */
static bool walk_entries(const char *dir, strlist *names, strlist *out, char *err) {
  if (names->n > 1) qsort(names->v, (size_t)names->n, sizeof *names->v, cmp_str);
  for (int i = 0; i < names->n; i++) {
    char *path = join_path(dir, names->v[i]);
    struct stat st;
    if (!path) return fail(err, "corpus: out of host memory listing files");
    bool ok = true;
    if (stat(path, &st) != 0) ok = fail(err, "corpus: cannot open '%s': %s", path, strerror(errno));
    else if (S_ISDIR(st.st_mode)) ok = walk(path, out, err);
    else if (S_ISREG(st.st_mode)) { ok = strlist_take(out, path, err); path = NULL; }
    free(path);
    if (!ok) return false;
  }
  return true;
}

static bool walk(const char *dir, strlist *out, char *err) {
  DIR *d = opendir(dir);
  if (!d) return fail(err, "corpus: cannot read directory '%s': %s", dir, strerror(errno));
  strlist names = {0};
  bool ok = true;
  for (struct dirent *e; ok && (e = readdir(d));)
    if (e->d_name[0] != '.') ok = strlist_take(&names, strdup(e->d_name), err);
  closedir(d);
  if (ok) ok = walk_entries(dir, &names, out, err);
  strlist_free(&names);
  return ok;
}

static bool collect(const char *path, strlist *out, char *err) {
  struct stat st;
  if (stat(path, &st) != 0) return fail(err, "corpus: cannot open '%s': %s", path, strerror(errno));
  if (S_ISREG(st.st_mode)) return strlist_take(out, strdup(path), err);
  if (!S_ISDIR(st.st_mode)) return fail(err, "corpus: '%s' is neither a regular file nor a directory", path);
  int before = out->n;
  if (!walk(path, out, err)) return false;
  if (out->n == before)
    return fail(err, "corpus: directory '%s' holds no files (hidden names are skipped)", path);
  return true;
}

/* ---- mapped files that shrink ------------------------------------------------------------
** A mapped file cut short by another process makes the next read past its new end a SIGBUS.
** The mappings are registered here; a SIGBUS inside one ends the process with a message naming
** the file (exit status 1) instead of a signal's death; any other SIGBUS stays the default. The
** handler reads the table only (plain stores under a mutex add and remove its entries). */
#define MAPS_MAX 4096

static struct { const uint8_t *lo, *hi; const char *path; } maps[MAPS_MAX];
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

static void say(const char *s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
  (void)ctx;
  const uint8_t *a = si->si_addr;
  for (int i = 0; i < MAPS_MAX; i++) {
    const char *path = maps[i].path;
    if (path && a >= maps[i].lo && a < maps[i].hi) {
      say("dormouse: corpus: '");
      say(path);
      say("' became shorter while it was being read (another program truncated or rewrote it); "
          "the run stops. Its checkpoints are complete: resume once the corpus is whole again.\n");
      _exit(1);
    }
  }
  signal(sig, SIG_DFL);                   /* not ours: the default death, at the same place */
}

static void maps_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, NULL);
}

static void maps_add(const part *p) {
  pthread_once(&maps_once, maps_install);
  pthread_mutex_lock(&maps_lock);
  for (int i = 0; i < MAPS_MAX; i++)
    if (!maps[i].path) {
      maps[i].lo = p->data;
      maps[i].hi = p->data + p->size;
      maps[i].path = p->path;          /* set last: the handler tests it first */
      break;
    }
  pthread_mutex_unlock(&maps_lock);
}

static void maps_remove(const part *p) {
  pthread_mutex_lock(&maps_lock);
  for (int i = 0; i < MAPS_MAX; i++)
    if (maps[i].path && maps[i].lo == p->data) { maps[i].path = NULL; break; }
  pthread_mutex_unlock(&maps_lock);
}

/* ---- loading one file ------------------------------------------------------------------ */

static bool map_file(part *p, char *err) {
  int fd = open(p->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(err, "corpus: cannot read '%s': %s", p->path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return fail(err, "corpus: cannot read '%s': %s", p->path, strerror(errno));
  }
  p->size = (int64_t)st.st_size;
  if (p->size > 0) {
    void *m = mmap(NULL, (size_t)p->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      close(fd);
      return fail(err, "corpus: cannot map '%s': %s", p->path, strerror(errno));
    }
    p->data = m;
    p->mapped = true;
    maps_add(p);
  }
  close(fd);
  return true;
}

static bool grow(uint8_t **buf, size_t *cap, size_t need) {
  size_t c = *cap ? *cap : (size_t)1 << 20;
  while (c < need) c *= 2;
  uint8_t *b = realloc(*buf, c);
  if (!b) return false;
  *buf = b;
  *cap = c;
  return true;
}

typedef struct inflater {
  ZSTD_DCtx *z;
  uint8_t *in, *out;
  size_t in_cap, len, cap;
  size_t last;             /* the decoder's last return: 0 when a frame has just ended */
} inflater;

/* decode one chunk of compressed input that starts at compressed offset base */
static bool inflate_chunk(inflater *f, const part *p, size_t n, int64_t base, char *err) {
  ZSTD_inBuffer in = {f->in, n, 0};
  bool full = false;
  while (in.pos < in.size || full) {
    size_t step = ZSTD_DStreamOutSize();
    if (f->cap - f->len < step && !grow(&f->out, &f->cap, f->len + step))
      return fail(err, "corpus: out of host memory decompressing '%s' (%zu bytes so far)", p->path, f->len);
    ZSTD_outBuffer out = {f->out + f->len, f->cap - f->len, 0};
    f->last = ZSTD_decompressStream(f->z, &out, &in);
    if (ZSTD_isError(f->last))
      return fail(err, "corpus: '%s' is a corrupted zstd stream: %s (at compressed byte offset %lld)",
                  p->path, ZSTD_getErrorName(f->last), (long long)(base + (int64_t)in.pos));
    f->len += out.pos;
    full = out.pos == out.size;     /* the decoder may hold more output */
  }
  return true;
}

static bool inflate_all(inflater *f, FILE *fp, const part *p, char *err) {
  int64_t base = 0;
  for (;;) {
    size_t n = fread(f->in, 1, f->in_cap, fp);
    if (n == 0) break;
    if (!inflate_chunk(f, p, n, base, err)) return false;
    base += (int64_t)n;
  }
  if (ferror(fp))
    return fail(err, "corpus: cannot read '%s' at compressed byte offset %lld", p->path, (long long)base);
  if (base == 0 || f->last != 0)
    return fail(err, "corpus: '%s' is a truncated zstd stream: the file ends inside a frame "
                "(at compressed byte offset %lld)", p->path, (long long)base);
  return true;
}

static bool inflate_file(part *p, char *err) {
  FILE *fp = fopen(p->path, "rb");
  if (!fp) return fail(err, "corpus: cannot read '%s': %s", p->path, strerror(errno));
  inflater f = {ZSTD_createDCtx(), NULL, NULL, ZSTD_DStreamInSize(), 0, 0, 1};
  f.in = malloc(f.in_cap);
  bool ok = f.z && f.in ? inflate_all(&f, fp, p, err)
                        : fail(err, "corpus: out of host memory opening '%s'", p->path);
  fclose(fp);
  ZSTD_freeDCtx(f.z);
  free(f.in);
  if (!ok || f.len == 0) { free(f.out); return ok; }
  uint8_t *fit = realloc(f.out, f.len);      /* give back the slack of the last doubling */
  p->data = fit ? fit : f.out;
  p->size = (int64_t)f.len;
  return true;
}

static bool is_zst(const char *path) {
  size_t n = strlen(path);
  return n >= 4 && strcmp(path + n - 4, ".zst") == 0;
}

/* ---- opening and closing --------------------------------------------------------------- */

static void corpus_destroy(dm_corpus *c) {
  if (!c) return;
  for (int i = 0; i < c->nparts; i++) {
    part *p = &c->parts[i];
    if (p->mapped) { maps_remove(p); munmap((void *)p->data, (size_t)p->size); }
    else free((void *)p->data);
    free(p->path);
  }
  free(c->parts);
  free(c);
}

/* load every file in order; files without bytes are dropped from the stream */
static bool load_parts(dm_corpus *c, strlist *files, char *err) {
  c->parts = calloc((size_t)files->n, sizeof *c->parts);
  if (!c->parts) return fail(err, "corpus: out of host memory");
  for (int i = 0; i < files->n; i++) {
    part *p = &c->parts[c->nparts];
    p->path = files->v[i];
    files->v[i] = NULL;
    bool ok = is_zst(p->path) ? inflate_file(p, err) : map_file(p, err);
    if (!ok || p->size == 0) { free(p->path); *p = (part){0}; }
    if (!ok) return false;
    if (p->size == 0) continue;
    p->offset = c->size;
    c->size += p->size;
    c->nparts++;
  }
  return true;
}

static void set_name(dm_corpus *c, int npaths, const char *const *paths) {
  if (npaths == 1) snprintf(c->name, sizeof c->name, "'%s'", paths[0]);
  else snprintf(c->name, sizeof c->name, "'%s' and %d more", paths[0], npaths - 1);
}

dm_corpus *dm_corpus_open(int npaths, const char *const *paths, int64_t eval_bytes) {
  if (npaths < 1) dm_error("corpus: no path given");
  for (int i = 0; i < npaths; i++)
    if (!paths[i] || !paths[i][0]) dm_error("corpus: path %d is empty", i + 1);
  if (eval_bytes < 0) dm_error("corpus: eval_bytes must be >= 0, got %lld", (long long)eval_bytes);
  char err[ERRMAX];
  strlist files = {0};
  dm_corpus *c = calloc(1, sizeof *c);
  bool ok = c ? true : fail(err, "corpus: out of host memory");
  for (int i = 0; ok && i < npaths; i++) ok = collect(paths[i], &files, err);
  if (ok) ok = load_parts(c, &files, err);
  if (ok) set_name(c, npaths, paths);
  if (ok && c->size == 0)
    ok = fail(err, "corpus is empty: %s (%d file%s) holds no bytes", c->name, files.n, files.n == 1 ? "" : "s");
  if (ok && eval_bytes >= c->size)
    ok = fail(err, "corpus %s: eval_bytes (%lld) must be smaller than the corpus size (%lld bytes)",
              c->name, (long long)eval_bytes, (long long)c->size);
  strlist_free(&files);
  if (!ok) {
    corpus_destroy(c);
    dm_error("%s", err);
  }
  c->refs = 1;
  c->eval_bytes = eval_bytes;
  return c;
}

void dm_corpus_retain(dm_corpus *c) { c->refs++; }

void dm_corpus_release(dm_corpus *c) {
  if (c && --c->refs == 0) corpus_destroy(c);
}

int64_t dm_corpus_size(const dm_corpus *c) { return c->size; }
int64_t dm_corpus_train_size(const dm_corpus *c) { return c->size - c->eval_bytes; }
int64_t dm_corpus_eval_size(const dm_corpus *c) { return c->eval_bytes; }
int dm_corpus_nfiles(const dm_corpus *c) { return c->nparts; }

const char *dm_corpus_file(const dm_corpus *c, int i) {
  if (i < 0 || i >= c->nparts) dm_error("corpus: file %d of %d", i + 1, c->nparts);
  return c->parts[i].path;
}

/* ---- reading ------------------------------------------------------------------------------- */

int64_t dm_corpus_span(const dm_corpus *c, int64_t pos, const uint8_t **p) {
  *p = NULL;
  if (pos < 0 || pos >= c->size) return 0;
  int lo = 0, hi = c->nparts - 1;        /* the last part starting at or before pos */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (c->parts[mid].offset <= pos) lo = mid;
    else hi = mid - 1;
  }
  const part *q = &c->parts[lo];
  *p = q->data + (pos - q->offset);
  return q->offset + q->size - pos;
}

/* no checks, no errors: the loader thread calls this */
static void copy_bytes(const dm_corpus *c, int64_t pos, int64_t n, uint8_t *dst) {
  if (pos < 0) {
    int64_t pad = -pos < n ? -pos : n;
    memset(dst, 0, (size_t)pad);
    dst += pad; pos += pad; n -= pad;
  }
  while (n > 0) {
    const uint8_t *p;
    int64_t m = dm_corpus_span(c, pos, &p);
    if (m > n) m = n;
    memcpy(dst, p, (size_t)m);
    dst += m; pos += m; n -= m;
  }
}

void dm_corpus_read(const dm_corpus *c, int64_t pos, int64_t n, uint8_t *dst) {
  if (n < 0 || pos > c->size - n)
    dm_error("corpus %s: cannot read %lld bytes at offset %lld of %lld", c->name, (long long)n,
             (long long)pos, (long long)c->size);
  copy_bytes(c, pos, n, dst);
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

static void fill_rows(const dm_corpus *c, const dm_batch_spec *s, start_fn start, int64_t k,
                      int64_t rows, void *buf) {
  size_t es = dm_dtype_size(s->dtype), xw = (size_t)(s->seq + 1) * es, pw = (size_t)s->ctx * es;
  char *x = buf, *pre = x + (size_t)rows * xw;
  for (int64_t r = 0; r < rows; r++) {
    int64_t at = start(c, s, k, r);
    char *xr = x + (size_t)r * xw, *pr = pre + (size_t)r * pw;
    copy_bytes(c, at, s->seq + 1, (uint8_t *)xr);
    widen(s->dtype, xr, s->seq + 1);
    copy_bytes(c, at - s->ctx, s->ctx, (uint8_t *)pr);
    widen(s->dtype, pr, s->ctx);
  }
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
  dm_tensor *all;
  if (s->device == DM_CPU) {
    all = dm_tensor_new(DM_CPU, s->dtype, 1, &n);
    fill_rows(c, s, start, k, rows, dm_data(all));
  } else {
    void *host = malloc((size_t)n * dm_dtype_size(s->dtype));
    if (!host) dm_error("data: out of host memory for %lld rows", (long long)rows);
    fill_rows(c, s, start, k, rows, host);
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
  int64_t train = dm_corpus_train_size(c);
  if (train < s->seq + 1)
    dm_error("data batch: the train split of %s (%lld bytes) is shorter than one window of "
             "seq + 1 = %lld bytes", c->name, (long long)train, (long long)s->seq + 1);
}

int64_t dm_batch_start(const dm_corpus *c, const dm_batch_spec *s, int64_t k, int64_t row) {
  uint32_t r[4];
  uint64_t uk = (uint64_t)k;
  dm_philox((uint32_t)s->seed, (uint32_t)(s->seed >> 32), (uint32_t)uk, (uint32_t)(uk >> 32),
            (uint32_t)row, DATA_STREAM, r);
  uint64_t u = (uint64_t)r[0] << 32 | r[1];
  uint64_t choices = (uint64_t)(dm_corpus_train_size(c) - s->seq);   /* starts 0 .. train - (T+1) */
  return (int64_t)(((unsigned __int128)u * choices) >> 64);        /* u * choices / 2^64 */
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
    if (slot) fill_rows(l->corpus, &l->spec, dm_batch_start, k, l->spec.batch, slot);
    pthread_mutex_lock(&l->mu);
    if (slot) { l->slots[i] = slot; l->produced++; }
    else {
      l->failed = true;
      snprintf(l->err, sizeof l->err, "the host buffer allocator returned NULL for %zu bytes", l->slot_bytes);
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
