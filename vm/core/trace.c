/*
** trace.c — the fingerprints of op calls (trace.h).
*/
#include <stdlib.h>
#include <string.h>
#include "core/trace.h"
#include "core/core.h"
#include "core/graph.h"
#include "io/ckpt.h"

static struct {
  bool on;
  int depth;                    /* open op calls; only depth 0 → 1 is recorded */
  bool hashing;                 /* the copies a hash makes are no calls of the run */
  dm_trace_entry *entries;
  int64_t n, cap;
  char **labels;                /* the marks' and tensors' labels, owned until the next start */
  int64_t nlabels, caplabels;
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

void dm_trace_start(void) {
  if (dm_cuda_graph_capturing()) dm_error("trace: cannot hash ops while a CUDA graph is being captured");
  for (int64_t i = 0; i < T.nlabels; i++) free(T.labels[i]);
  T.nlabels = 0;
  T.n = 0;
  T.depth = 0;
  T.on = true;
}

void dm_trace_stop(void) { T.on = false; }
bool dm_trace_on(void) { return T.on; }

static uint64_t hash_one(const dm_tensor *t, uint64_t seed) {
  if (!t) return dm_xxh64("absent", 6, seed);
  uint64_t head[2 + DM_MAXDIM] = {(uint64_t)t->dtype, (uint64_t)t->ndim};
  for (int d = 0; d < t->ndim; d++) head[2 + d] = (uint64_t)t->shape[d];
  seed = dm_xxh64(head, sizeof head, seed);
  dm_tensor *host = t->device == DM_CPU && dm_is_contiguous(t) ? (dm_retain((dm_tensor *)t), (dm_tensor *)t)
                                                                : dm_to_device(t, DM_CPU);
  seed = dm_xxh64(dm_data(host), (size_t)dm_numel(host) * dm_dtype_size(host->dtype), seed);
  dm_release(host);
  return seed;
}

uint64_t dm_trace_hash(int n, dm_tensor *const *t) {
  bool was = T.hashing;
  T.hashing = true;
  uint64_t h = 0x646f726d6f757365ull;      /* "dormouse" */
  for (int i = 0; i < n; i++) h = hash_one(t[i], h);
  T.hashing = was;
  return h;
}

static void add(const char *name, int kind, uint64_t in, uint64_t out) {
  T.entries = grow(T.entries, &T.cap, T.n + 1, sizeof *T.entries);
  T.entries[T.n++] = (dm_trace_entry){name, kind, in, out};
}

static const char *own_label(const char *label) {
  T.labels = grow(T.labels, &T.caplabels, T.nlabels + 1, sizeof *T.labels);
  size_t len = strlen(label) + 1;
  char *copy = malloc(len);
  if (!copy) dm_error("trace: out of host memory");
  memcpy(copy, label, len);
  return T.labels[T.nlabels++] = copy;
}

bool dm_trace_enter(int n_in, dm_tensor *const *in, const dm_attrs *a, uint64_t *in_hash) {
  if (!T.on || T.hashing) return false;
  if (dm_cuda_graph_capturing())          /* a hash copies to the host: no capture holds that */
    dm_error("trace: an op is being captured into a CUDA graph while the trace is on (run with graph = false)");
  bool outermost = T.depth++ == 0;
  if (!outermost) return false;
  uint64_t h = dm_trace_hash(n_in, in);
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
  if (outermost) add(name, kind, in_hash, dm_trace_hash(n_out, out));
}

void dm_trace_mark(const char *label) {
  if (T.on) add(own_label(label), DM_TRACE_MARK, 0, 0);
}

void dm_trace_tensor(const char *label, dm_tensor *t) {
  if (T.on) add(own_label(label), DM_TRACE_TENSOR, 0, dm_trace_hash(1, &t));
}

/* an error unwound through open calls: none is open now */
static void recover(void) {
  T.depth = 0;
  T.hashing = false;
}
__attribute__((constructor)) static void register_recovery(void) { dm_on_error_unwind(recover); }

const dm_trace_entry *dm_trace_entries(int64_t *n) {
  *n = T.n;
  return T.entries;
}
