/*
** trace.c — the fingerprints of op calls (trace.h).
*/
#include <stdlib.h>
#include <string.h>
#include "core/trace.h"
#include "core/core.h"
#include "core/graph.h"
#include "io/ckpt.h"

/* one run's trace: its entries and the labels they point at, owned here */
typedef struct trace_log {
  dm_trace_entry *entries;
  int64_t n, cap;
  char **labels;
  int64_t nlabels, caplabels;
} trace_log;

static struct {
  bool on;
  int depth;                    /* open op calls; only depth 0 → 1 is recorded */
  bool hashing;                 /* the copies a hash makes are no calls of the run */
  trace_log now, kept;          /* the trace being made, and the one dm_trace_keep set aside */
} T;

static void *grow(void *p, int64_t *cap, int64_t need, size_t size) {
  if (need <= *cap) return p;
  int64_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  void *q = realloc(p, (size_t)c * size);
  if (!q) dm_error("trace: out of host memory for %lld entries", (long long)need);
  *cap = c;
  return q;
}

static void log_clear(trace_log *g) {
  for (int64_t i = 0; i < g->nlabels; i++) free(g->labels[i]);
  g->nlabels = 0;
  g->n = 0;
}

void dm_trace_start(void) {
  if (dm_cuda_graph_capturing()) dm_error("trace: cannot hash ops while a CUDA graph is being captured");
  log_clear(&T.now);
  T.depth = 0;
  T.on = true;
}

void dm_trace_keep(void) {
  trace_log old = T.kept;
  T.kept = T.now;
  T.now = old;
  log_clear(&T.now);
}

void dm_trace_stop(void) { T.on = false; }
bool dm_trace_on(void) { return T.on; }

static uint64_t hash_one(const dm_tensor *t, uint64_t seed) {
  if (!t) return dm_xxh64("absent", 6, seed);
  uint64_t head[2 + DM_MAXDIM] = {(uint64_t)t->dtype, (uint64_t)t->ndim};
  for (int d = 0; d < t->ndim; d++) head[2 + d] = (uint64_t)t->shape[d];
  seed = dm_xxh64(head, sizeof head, seed);
  if (t->device == DM_META) return seed;          /* shapes only: no values to read */
  dm_tensor *host = t->device == DM_CPU && dm_is_contiguous(t) ? (dm_retain((dm_tensor *)t), (dm_tensor *)t)
                                                                : dm_to_device(t, DM_CPU);
  seed = dm_xxh64(dm_data(host), (size_t)dm_numel(host) * dm_dtype_size(host->dtype), seed);
  dm_release(host);
  return seed;
}

/* the hash of n tensors (NULL ones count as an absent tensor) */
static uint64_t trace_hash(int n, dm_tensor *const *t) {
  bool was = T.hashing;
  T.hashing = true;
  uint64_t h = 0x646f726d6f757365ull;      /* "dormouse" */
  for (int i = 0; i < n; i++) h = hash_one(t[i], h);
  T.hashing = was;
  return h;
}

static void add(const char *name, int kind, uint64_t in, uint64_t out) {
  trace_log *g = &T.now;
  g->entries = grow(g->entries, &g->cap, g->n + 1, sizeof *g->entries);
  g->entries[g->n++] = (dm_trace_entry){name, kind, in, out};
}

static const char *own_label(const char *label) {
  trace_log *g = &T.now;
  g->labels = grow(g->labels, &g->caplabels, g->nlabels + 1, sizeof *g->labels);
  size_t len = strlen(label) + 1;
  char *copy = malloc(len);
  if (!copy) dm_error("trace: out of host memory");
  memcpy(copy, label, len);
  return g->labels[g->nlabels++] = copy;
}

bool dm_trace_enter(int n_in, dm_tensor *const *in, const dm_attrs *a, uint64_t *in_hash) {
  if (!T.on || T.hashing) return false;
  if (dm_cuda_graph_capturing())          /* a hash copies to the host: no capture holds that */
    dm_error("trace: an op is being captured into a CUDA graph while the trace is on (run with graph = false)");
  bool outermost = T.depth++ == 0;
  if (!outermost) return false;
  uint64_t h = trace_hash(n_in, in);
  if (a) {                                /* the given values only: the struct's tail is not cleared */
    h = dm_xxh64(a->v, sizeof(double) * (size_t)a->nv, h);
    h = dm_xxh64(a->list, sizeof(int64_t) * (size_t)a->nlist, h);
  }
  *in_hash = h;
  return true;
}

void dm_trace_leave(bool outermost, const char *name, int kind, uint64_t in_hash, int n_out,
                    dm_tensor *const *out) {
  if (!T.on || T.hashing) return;
  if (T.depth > 0) T.depth--;
  if (outermost) add(name, kind, in_hash, trace_hash(n_out, out));
}

void dm_trace_mark(const char *label) {
  if (T.on) add(own_label(label), DM_TRACE_MARK, 0, 0);
}

void dm_trace_tensor(const char *label, dm_tensor *t) {
  if (T.on) add(own_label(label), DM_TRACE_TENSOR, 0, trace_hash(1, &t));
}

/* an error unwound through open calls: none is open now */
static void recover(void) {
  T.depth = 0;
  T.hashing = false;
}
__attribute__((constructor)) static void register_recovery(void) { dm_on_error_unwind(recover); }

const dm_trace_entry *dm_trace_entries(bool kept, int64_t *n) {
  const trace_log *g = kept ? &T.kept : &T.now;
  *n = g->n;
  return g->entries;
}

static bool same_entry(const dm_trace_entry *a, const dm_trace_entry *b) {
  return a->kind == b->kind && a->in == b->in && a->out == b->out &&
         (a->name == b->name || !strcmp(a->name, b->name));
}

int64_t dm_trace_parting(int64_t *mark) {
  const trace_log *a = &T.kept, *b = &T.now;
  int64_t i = 0, n = a->n < b->n ? a->n : b->n;
  *mark = -1;
  for (; i < n && same_entry(&a->entries[i], &b->entries[i]); i++)
    if (a->entries[i].kind == DM_TRACE_MARK) *mark = i;
  return i == n && a->n == b->n ? -1 : i;
}
