/*
** hostable.c — Engram tables in host memory: the prefetch worker, the
** staging slots and the multi-threaded sparse Adam (hostable.h).
**
** Two staging slots: the one the last take returned (its unique rows wait
** for apply) and the one a prefetch fills. Each slot holds the lookups, the
** unique rows, the inverse map and the gathered rows, in buffers from the
** host buffer pair that only grow. A prefetch runs one worker thread; take
** joins it. The slot arrays are written by the worker between its start
** and its join, and by the caller's thread otherwise.
**
** On a device, take's copies of a slot's rows and inverse are queued on the
** device's one stream and the slot's fence is set after them; the slot is
** written again only once the stream has passed that fence (in training
** apply's copy of the gradients has already waited for it, so this costs
** nothing there). The copies go to that stream in order rather than to a
** side stream: the caching allocator reuses freed device memory on the
** stream's order, so a side stream writing a new block would first have to
** wait for the stream anyway, and the step that takes the rows needs them next.
*/
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "data/hostable.h"
#include "core/core.h"
#include "core/autograd.h"
#include "ops/engram.h"
#include "ops/index.h"

typedef struct slot {
  int64_t cap;                   /* lookups the buffers hold */
  int64_t n, nu;                 /* lookups, unique rows */
  int ndim;
  int64_t shape[DM_MAXDIM];      /* the lookups' shape, for local */
  int64_t *ids, *unique, *inverse, *counts, *scratch;   /* scratch: 4 * cap */
  float *rows;                   /* [cap, de] */
  double gather_ms;
  void *fence;                   /* the device has read rows and inverse once its stream passed it */
} slot;

struct dm_hostable {
  dm_tensor *table, *m, *v;
  int64_t R, de;
  int threads;
  dm_device device;
  dm_host_buffers hb;
  dm_hostable_fence_k fence;     /* NULL on the CPU (and the three together) */
  dm_hostable_fence_wait_k fence_wait;
  dm_hostable_fence_free_k fence_free;
  float *gstage;                 /* [gcap, de]: apply's gradients copied from the device */
  int64_t gcap;
  slot slots[2];
  int taken;                     /* the slot the last take returned */
  bool taken_live;               /* its rows still await apply */
  bool inflight;                 /* a prefetch fills slot 1 - taken, not yet taken */
  bool worker_running;           /* its worker has not been joined */
  pthread_t worker;
  float *w;                      /* the table's first element, for the worker (set before it starts) */
  dm_hostable_counters counters;
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

static void *plain_alloc(size_t n) { return malloc(n); }
static void plain_free(void *p, size_t n) { (void)n; free(p); }

/* ---- staging slots ---------------------------------------------------------------------------- */

/* the device has read what take copied from s (no-op on the CPU) */
static void slot_idle(dm_hostable *h, slot *s) {
  if (h->fence_wait) h->fence_wait(s->fence);
}

static void slot_release(dm_hostable *h, slot *s) {
  size_t c = (size_t)s->cap;
  if (!c) return;
  slot_idle(h, s);
  h->hb.free(s->ids, c * sizeof(int64_t));
  h->hb.free(s->unique, c * sizeof(int64_t));
  h->hb.free(s->inverse, c * sizeof(int64_t));
  h->hb.free(s->counts, c * sizeof(int64_t));
  h->hb.free(s->scratch, 4 * c * sizeof(int64_t));
  h->hb.free(s->rows, c * (size_t)h->de * sizeof(float));
  void *fence = s->fence;
  memset(s, 0, sizeof *s);
  s->fence = fence;
}

static void *buffer(dm_hostable *h, size_t nbytes) {
  void *p = h->hb.alloc(nbytes ? nbytes : 1);
  if (!p) dm_error("engram host table: out of host memory for %zu bytes of staging", nbytes);
  return p;
}

/* room for n lookups (caller's thread; the slot is idle) */
static void slot_reserve(dm_hostable *h, slot *s, int64_t n) {
  if (n <= s->cap && s->cap) return;
  slot_release(h, s);
  int64_t c = n > 0 ? n : 1;
  size_t ids = (size_t)c * sizeof(int64_t);
  s->ids = buffer(h, ids);
  s->unique = buffer(h, ids);
  s->inverse = buffer(h, ids);
  s->counts = buffer(h, ids);
  s->scratch = buffer(h, 4 * ids);
  s->rows = buffer(h, (size_t)c * (size_t)h->de * sizeof(float));
  s->cap = c;
}

/* ---- the prefetch worker ------------------------------------------------------------------------ */

static void *gather_main(void *arg) {
  dm_hostable *h = arg;
  slot *s = &h->slots[1 - h->taken];
  double t0 = now_ms();
  const float *w = h->w;
  s->nu = dm_engram_unique_host(s->ids, s->n, s->unique, s->inverse, s->counts, s->scratch);
  size_t row = (size_t)h->de * sizeof(float);
  for (int64_t i = 0; i < s->nu; i++) memcpy(s->rows + i * h->de, w + s->unique[i] * h->de, row);
  s->gather_ms = now_ms() - t0;
  return NULL;
}

static void join_worker(dm_hostable *h) {
  if (!h->worker_running) return;
  pthread_join(h->worker, NULL);
  h->worker_running = false;
}

/* ---- the C API ---------------------------------------------------------------------------------- */

static void check_state(const char *what, dm_tensor *t, const dm_tensor *table) {
  char a[128], b[128];
  dm_check_live(t);
  if (t->device != DM_CPU || t->dtype != DM_F32 || t->ndim != 2 || !dm_is_contiguous(t))
    dm_error("engram host table: %s must be a contiguous f32 CPU tensor [R, de], got %s %s of shape %s", what,
             dm_device_name(t->device), dm_dtype_name(t->dtype), dm_tensor_shape_str(t, a, sizeof a));
  if (table && !dm_same_shape(t, table))
    dm_error("engram host table: %s of shape %s does not match the table's %s", what,
             dm_tensor_shape_str(t, a, sizeof a), dm_tensor_shape_str(table, b, sizeof b));
}

/* the online cores, at most 8: Adam on a step's rows is bound by memory latency, not cores */
static int default_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : n > 8 ? 8 : (int)n;
}

dm_hostable *dm_hostable_new(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_hostable_opts *o) {
  check_state("the table", table, NULL);
  check_state("m", m, table);
  check_state("v", v, table);
  if (o && o->buffers && (!o->buffers->alloc || !o->buffers->free))
    dm_error("engram host table: host buffers need both alloc and free");
  if (o && o->threads < 0) dm_error("engram host table: threads must be >= 0, got %d", o->threads);
  dm_device dev = o ? o->device : DM_CPU;
  dm_host_buffers hb = {plain_alloc, plain_free};
  dm_hostable_fence_k fence = NULL;
  dm_hostable_fence_wait_k fence_wait = NULL;
  dm_hostable_fence_free_k fence_free = NULL;
  if (dev != DM_CPU) {                /* the device's pinned memory and fences, when it has them */
    dm_hostable_buffers_k pinned = DM_KERNEL_FIND(hostable_buffers, dev);
    fence = DM_KERNEL_FIND(hostable_fence, dev);
    fence_wait = DM_KERNEL_FIND(hostable_fence_wait, dev);
    fence_free = DM_KERNEL_FIND(hostable_fence_free, dev);
    if (!fence || !fence_wait || !fence_free) fence = NULL, fence_wait = NULL, fence_free = NULL;
    if (pinned && fence && !(o && o->buffers)) pinned(&hb);
  }
  dm_hostable *h = calloc(1, sizeof *h);
  if (!h) dm_error("engram host table: out of host memory");
  h->R = table->shape[0];
  h->de = table->shape[1];
  h->threads = o && o->threads > 0 ? o->threads : default_threads();
  h->device = dev;
  h->hb = o && o->buffers ? *o->buffers : hb;
  h->fence = fence;
  h->fence_wait = fence_wait;
  h->fence_free = fence_free;
  h->taken = 1;                       /* the first prefetch fills slot 0 */
  dm_retain(table);
  dm_retain(m);
  dm_retain(v);
  h->table = table;
  h->m = m;
  h->v = v;
  return h;
}

void dm_hostable_free(dm_hostable *h) {
  if (!h) return;
  join_worker(h);
  for (int i = 0; i < 2; i++) {
    slot_release(h, &h->slots[i]);
    if (h->fence_free) h->fence_free(h->slots[i].fence);
  }
  if (h->gcap) h->hb.free(h->gstage, (size_t)h->gcap * (size_t)h->de * sizeof(float));
  dm_release(h->table);
  dm_release(h->m);
  dm_release(h->v);
  free(h);
}

void dm_hostable_set_threads(dm_hostable *h, int threads) {
  if (threads < 1) dm_error("engram host table: threads must be >= 1, got %d", threads);
  h->threads = threads;
}

int dm_hostable_threads(const dm_hostable *h) { return h->threads; }
dm_hostable_counters dm_hostable_counters_of(const dm_hostable *h) { return h->counters; }

void dm_hostable_prefetch(dm_hostable *h, dm_tensor *idx) {
  const char *what = "engram host table prefetch";
  if (h->inflight) dm_error("%s: the previous prefetch has not been taken", what);
  dm_check_live(h->table);
  dm_check_live(idx);
  if (idx->dtype != DM_I64 && idx->dtype != DM_I32)
    dm_error("%s: indices must be i64 or i32, got %s", what, dm_dtype_name(idx->dtype));
  DM_RUN(index_check, idx->device, idx, h->R, 0, what);
  slot *s = &h->slots[1 - h->taken];
  int64_t n = dm_numel(idx);
  slot_idle(h, s);                    /* the worker rewrites what an earlier take copied from s */
  slot_reserve(h, s, n);
  dm_tensor *host = idx->device == DM_CPU ? (dm_retain(idx), idx) : dm_to_device(idx, DM_CPU);
  dm_tensor *ids = host->dtype == DM_I64 ? dm_contiguous(host) : dm_cast(host, DM_I64);
  dm_release(host);
  memcpy(s->ids, dm_data(ids), (size_t)n * sizeof(int64_t));
  s->n = n;
  s->ndim = ids->ndim;
  memcpy(s->shape, ids->shape, sizeof s->shape);
  dm_release(ids);
  h->w = dm_data(h->table);
  if (pthread_create(&h->worker, NULL, gather_main, h) != 0)
    dm_error("%s: could not start the worker thread", what);
  h->worker_running = true;
  h->inflight = true;
}

/* a new tensor on dev holding the host array p of shape [ndim, shape] */
static dm_tensor *to_device(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, void *p) {
  dm_tensor *src = dm_tensor_wrap(DM_CPU, dt, ndim, shape, p);
  dm_tensor *out = dm_tensor_new(dev, dt, ndim, shape);
  dm_copy_(out, src);
  dm_release(src);
  return out;
}

void dm_hostable_take(dm_hostable *h, dm_tensor **rows, dm_tensor **local, dm_tensor **unique) {
  if (!h->inflight) dm_error("engram host table take: nothing was prefetched");
  double t0 = now_ms();
  join_worker(h);
  double waited = now_ms() - t0;
  int f = 1 - h->taken;
  slot *s = &h->slots[f];
  int64_t rs[2] = {s->nu, h->de};
  *rows = to_device(h->device, DM_F32, 2, rs, s->rows);
  *local = to_device(h->device, DM_I64, s->ndim, s->shape, s->inverse);
  if (h->fence) h->fence(&s->fence);  /* the copies above are queued, not done */
  *unique = to_device(DM_CPU, DM_I64, 1, &s->nu, s->unique);
  h->taken = f;
  h->taken_live = true;
  h->inflight = false;
  dm_hostable_counters *c = &h->counters;
  c->steps++;
  c->lookups = s->n;
  c->unique = s->nu;
  c->unique_fraction = s->n ? (double)s->nu / (double)s->n : 0;
  c->total_lookups += s->n;
  c->total_unique += s->nu;
  c->gather_ms = s->gather_ms;
  c->wait_ms = waited;
}

void dm_hostable_gather(dm_hostable *h, dm_tensor *idx, dm_tensor **rows, dm_tensor **local,
                        dm_tensor **unique) {
  dm_hostable_prefetch(h, idx);
  dm_hostable_take(h, rows, local, unique);
}

/* ---- apply: sparse Adam over threads ----------------------------------------------------------- */

typedef struct adam_job {
  float *w, *m, *v;
  const float *g;
  const int64_t *rows;
  int64_t lo, hi, de;
  const dm_engram_adam_hp *hp;
} adam_job;

static void *adam_main(void *arg) {
  const adam_job *j = arg;
  dm_engram_adam_rows_f32(j->w, j->m, j->v, j->de, j->rows, j->g, j->lo, j->hi, j->hp);
  return NULL;
}

/* rows[0, n) in `threads` contiguous chunks; the caller runs chunk 0 and any that did not start */
static void adam_threads(dm_hostable *h, const int64_t *rows, int64_t n, const float *g,
                         const dm_engram_adam_hp *hp) {
  enum { MAXT = 256 };
  int nt = h->threads < MAXT ? h->threads : MAXT;
  if (nt > n / 64) nt = n / 64 > 0 ? (int)(n / 64) : 1;   /* at least 64 rows a thread */
  adam_job jobs[MAXT];
  pthread_t tid[MAXT];
  bool started[MAXT] = {false};
  for (int t = 0; t < nt; t++)
    jobs[t] = (adam_job){dm_data(h->table), dm_data(h->m), dm_data(h->v), g, rows,
                         n * t / nt, n * (t + 1) / nt, h->de, hp};
  for (int t = 1; t < nt; t++) started[t] = pthread_create(&tid[t], NULL, adam_main, &jobs[t]) == 0;
  adam_main(&jobs[0]);
  for (int t = 1; t < nt; t++) {
    if (started[t]) pthread_join(tid[t], NULL);
    else {
      adam_main(&jobs[t]);
      h->counters.thread_fallbacks++;
    }
  }
}

/* the rows of the prefetch in flight that an update of rows[0, n) (increasing) changed: copy them again */
static void refresh(dm_hostable *h, const int64_t *rows, int64_t n, slot *next) {
  const float *w = dm_data(h->table);
  size_t row = (size_t)h->de * sizeof(float);
  for (int64_t i = 0, j = 0; i < n && j < next->nu;) {
    if (rows[i] < next->unique[j]) i++;
    else if (rows[i] > next->unique[j]) j++;
    else {
      memcpy(next->rows + j * h->de, w + next->unique[j] * h->de, row);
      i++;
      j++;
    }
  }
}

/* the table, m and v may be written (they are live and no tape wants them) */
static void check_writable(dm_hostable *h, const char *what) {
  dm_tensor *state[3] = {h->table, h->m, h->v};
  for (int i = 0; i < 3; i++) {
    dm_check_live(state[i]);
    if (state[i]->requires_grad && dm_grad_enabled())
      dm_error("%s: in-place update of a tensor that requires grad; wrap it in dm.no_grad", what);
  }
}

/* grads [n, de] f32 as contiguous host memory: a CPU tensor as it is, a device's through the
** pinned staging buffer (one copy, which waits for the device). *hold is what to release after. */
static const float *host_grads(dm_hostable *h, dm_tensor *grads, dm_tensor **hold) {
  if (grads->device == DM_CPU) {
    *hold = dm_contiguous(grads);
    return dm_data(*hold);
  }
  int64_t n = grads->shape[0];
  if (n > h->gcap) {
    size_t row = (size_t)h->de * sizeof(float);
    if (h->gcap) h->hb.free(h->gstage, (size_t)h->gcap * row);
    h->gcap = 0;
    h->gstage = buffer(h, (size_t)n * row);
    h->gcap = n;
  }
  *hold = dm_tensor_wrap(DM_CPU, DM_F32, 2, grads->shape, h->gstage);
  dm_copy_(*hold, grads);
  return h->gstage;
}

/* the update of rows[0, n) with grads, once everything is checked */
static void apply_rows(dm_hostable *h, const int64_t *rows, int64_t n, dm_tensor *grads,
                       const dm_engram_adam_hp *hp) {
  dm_tensor *hold;
  const float *g = host_grads(h, grads, &hold);
  double t0 = now_ms();
  join_worker(h);                     /* the worker reads rows this update writes */
  adam_threads(h, rows, n, g, hp);
  if (h->inflight) refresh(h, rows, n, &h->slots[1 - h->taken]);
  h->counters.apply_ms = now_ms() - t0;
  dm_release(hold);
  h->taken_live = false;
  dm_mark_written(h->table);
  dm_mark_written(h->m);
  dm_mark_written(h->v);
}

static void check_grads(const char *what, dm_tensor *grads, int64_t n, int64_t de, const char *which) {
  char sg[128];
  dm_check_live(grads);
  if (grads->dtype != DM_F32 || grads->ndim != 2 || grads->shape[0] != n || grads->shape[1] != de)
    dm_error("%s: gradients must be f32 [%lld, %lld] (%s), got %s of shape %s", what, (long long)n,
             (long long)de, which, dm_dtype_name(grads->dtype), dm_tensor_shape_str(grads, sg, sizeof sg));
}

void dm_hostable_apply(dm_hostable *h, dm_tensor *grads, double lr, double beta1, double beta2, double eps,
                       int64_t step) {
  const char *what = "engram host table apply";
  if (!h->taken_live) dm_error("%s: no rows await an update (take first; apply once per take)", what);
  slot *s = &h->slots[h->taken];
  check_writable(h, what);
  check_grads(what, grads, s->nu, h->de, "the rows of the last take");
  dm_engram_adam_hp hp = dm_engram_adam_prepare(lr, beta1, beta2, eps, step);
  apply_rows(h, s->unique, s->nu, grads, &hp);
}

void dm_hostable_apply_rows(dm_hostable *h, dm_tensor *rows, dm_tensor *grads, double lr, double beta1,
                            double beta2, double eps, int64_t step) {
  const char *what = "engram host table apply";
  char sr[128];
  check_writable(h, what);
  dm_check_live(rows);
  if (rows->dtype != DM_I64 || rows->ndim != 1)
    dm_error("%s: rows must be i64 [n], got %s of shape %s", what, dm_dtype_name(rows->dtype),
             dm_tensor_shape_str(rows, sr, sizeof sr));
  check_grads(what, grads, rows->shape[0], h->de, "one row per row named");
  dm_engram_adam_hp hp = dm_engram_adam_prepare(lr, beta1, beta2, eps, step);
  dm_tensor *host = rows->device == DM_CPU ? (dm_retain(rows), rows) : dm_to_device(rows, DM_CPU);
  dm_tensor *r = dm_contiguous(host);
  dm_release(host);
  const int64_t *p = dm_data(r);
  int64_t n = rows->shape[0];
  for (int64_t i = 0; i < n; i++) {   /* the threads split the rows: two must never share one */
    if (p[i] < 0 || p[i] >= h->R || (i > 0 && p[i] <= p[i - 1])) {
      int64_t bad = p[i];
      dm_release(r);
      dm_error("%s: rows must be distinct, increasing and in 0..%lld; row %lld is %lld%s", what,
               (long long)(h->R - 1), (long long)i, (long long)bad,
               i > 0 && bad >= 0 && bad < h->R ? " (after a row not below it)" : "");
    }
  }
  apply_rows(h, p, n, grads, &hp);
  dm_release(r);
}
