/*
** cases_index.c — gather, index_select, scatter_add and embedding against
** plain loops over the index.
**
** Indices are drawn with replacement from a small range, so repeated
** indices are the rule: the backwards of gather, index_select and embedding
** and the forward of scatter_add must add them up. Trials alternate the
** base (1 as Lua passes it, 0) and the index dtype (i64, i32); the harness
** adds non-contiguous copies of every input, the index included.
*/
#include <string.h>
#include "harness.h"

static void small_shape(h_rng *r, int nd, int64_t *shape) {
  static const int64_t sizes[] = {1, 2, 3, 5, 7};
  for (int d = 0; d < nd; d++) shape[d] = sizes[h_next(r) % 5];
}

/* indices in base .. base+size-1, as i64 or (odd trials) i32 */
static dm_tensor *make_index(h_rng *r, int t, int nd, const int64_t *shape, int64_t size, int64_t base) {
  dm_tensor *idx = h_indices(r, nd, shape, base, base + size - 1);
  if (t % 2 == 0) return idx;
  dm_tensor *i32 = dm_tensor_like_dtype(idx, DM_I32);
  dm_copy_(i32, idx);
  dm_release(idx);
  return i32;
}

static int64_t trial_base(int t) { return t % 3 == 2 ? 0 : 1; }

/* ---- gather, scatter_add: an index of x's dims ---------------------------------------------- */

static void in_gather(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 1, 3), dim = (int)h_int(r, 0, nd - 1);
  int64_t xs[DM_MAXDIM], is[DM_MAXDIM], base = trial_base(t);
  small_shape(r, nd, xs);
  for (int d = 0; d < nd; d++) is[d] = d == dim ? h_int(r, 1, 6) : h_int(r, 1, xs[d]);
  in[0] = h_randn(r, nd, xs);
  in[1] = make_index(r, t, nd, is, xs[dim], base);
  *a = dm_attrs_of(2, (double[]){dim, (double)base});
}

static void or_gather(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0], *idx = in[1];
  int dim = (int)a->v[0];
  dm_tensor *e = h_new(DM_F64, idx->ndim, idx->shape);
  int64_t p[DM_MAXDIM];
  for (int64_t f = 0; f < dm_numel(e); f++) {
    h_unravel(e, f, p);
    p[dim] = (int64_t)h_at(idx, p) - (int64_t)a->v[1];
    h_set(e, f, h_at(x, p));
  }
  expect[0] = e;
}

/* src may be larger than the index in every dim; only the part the index covers is added */
static void in_scatter_add(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 1, 3), dim = (int)h_int(r, 0, nd - 1);
  int64_t xs[DM_MAXDIM], is[DM_MAXDIM], ss[DM_MAXDIM], base = trial_base(t);
  small_shape(r, nd, xs);
  for (int d = 0; d < nd; d++) {
    is[d] = d == dim ? h_int(r, 1, 8) : h_int(r, 1, xs[d]);
    ss[d] = is[d] + h_int(r, 0, 2);
  }
  in[0] = h_randn(r, nd, xs);
  in[1] = make_index(r, t, nd, is, xs[dim], base);
  in[2] = h_randn(r, nd, ss);
  *a = dm_attrs_of(2, (double[]){dim, (double)base});
}

static void or_scatter_add(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0], *idx = in[1], *src = in[2];
  int dim = (int)a->v[0];
  dm_tensor *e = h_new(DM_F64, x->ndim, x->shape);
  for (int64_t f = 0; f < dm_numel(e); f++) h_set(e, f, h_get(x, f));
  int64_t p[DM_MAXDIM], q[DM_MAXDIM];
  for (int64_t f = 0; f < dm_numel(idx); f++) {
    h_unravel(idx, f, p);
    memcpy(q, p, sizeof q);
    q[dim] = (int64_t)h_at(idx, p) - (int64_t)a->v[1];
    h_set_at(e, q, h_at(e, q) + h_at(src, p));
  }
  expect[0] = e;
}

/* ---- index_select, embedding: a 1-D index, or ids of any shape ------------------------------ */

/* more indices than positions in half the trials, so some repeat */
static void in_index_select(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = (int)h_int(r, 1, 3), dim = (int)h_int(r, 0, nd - 1);
  int64_t xs[DM_MAXDIM], base = trial_base(t);
  small_shape(r, nd, xs);
  int64_t n = t < 3 ? xs[dim] * 2 + 1 : h_int(r, 1, 4);
  in[0] = h_randn(r, nd, xs);
  in[1] = make_index(r, t, 1, &n, xs[dim], base);
  *a = dm_attrs_of(2, (double[]){dim, (double)base});
}

static void or_index_select(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0], *idx = in[1];
  int dim = (int)a->v[0];
  int64_t shape[DM_MAXDIM], p[DM_MAXDIM];
  memcpy(shape, x->shape, sizeof shape);
  shape[dim] = idx->shape[0];
  dm_tensor *e = h_new(DM_F64, x->ndim, shape);
  for (int64_t f = 0; f < dm_numel(e); f++) {
    h_unravel(e, f, p);
    p[dim] = (int64_t)h_get(idx, p[dim]) - (int64_t)a->v[1];
    h_set(e, f, h_at(x, p));
  }
  expect[0] = e;
}

/* a vocabulary of 1-5 rows, ids of 0-3 dims (0-based class ids, as Lua passes them; base 1 in trial 5) */
static void in_embedding(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int64_t v = h_int(r, 1, 5), ts[2] = {v, h_size(r)}, is[DM_MAXDIM], base = t == 5 ? 1 : 0;
  int nd = t == 4 ? 0 : (int)h_int(r, 1, 3);
  if (t == 6) { ts[0] = v = 256; ts[1] = 512; nd = 2; }   /* perf: a byte vocabulary, 8 x 1024 ids */
  small_shape(r, nd, is);
  if (t == 6) { is[0] = 8; is[1] = 1024; }
  in[0] = h_randn(r, 2, ts);
  in[1] = make_index(r, t, nd, is, v, base);
  *a = dm_attrs_of(1, (double[]){(double)base});
}

static void or_embedding(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *table = in[0], *ids = in[1];
  int64_t shape[DM_MAXDIM], dim = table->shape[1];
  memcpy(shape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  shape[ids->ndim] = dim;
  dm_tensor *e = h_new(DM_F64, ids->ndim + 1, shape);
  for (int64_t f = 0; f < dm_numel(e); f++) {
    int64_t row[2] = {(int64_t)h_get(ids, f / dim) - (int64_t)a->v[0], f % dim};
    h_set(e, f, h_at(table, row));
  }
  expect[0] = e;
}

/* ---- patch_index: bytes of a small alphabet (so that breaks come often), random breaks ---------- */

static dm_tensor *as_u8(dm_tensor *t) {
  dm_tensor *u = dm_tensor_like_dtype(t, DM_U8);
  dm_copy_(u, t);
  dm_release(t);
  return u;
}

static void in_patch(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const int64_t lengths[] = {1, 2, 5, 17, 64, 300};
  int64_t xs[2] = {h_int(r, 1, 3), lengths[t % 6]}, bs[1] = {256};
  const int64_t min_len = h_int(r, 1, 3), max_len = min_len + h_int(r, 0, 4);
  in[0] = as_u8(h_indices(r, 2, xs, 60, 60 + h_int(r, 1, 8)));
  in[1] = as_u8(h_indices(r, 1, bs, 0, 1));
  *a = dm_attrs_of(3, (double[]){(double)min_len, (double)max_len,
                                 (double)((xs[1] + min_len - 1) / min_len + h_int(r, 0, 2))});
}

/* the starts first, then each byte's patch: the rule read off vm/ops/patch.h's comment */
static void or_patch(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0], *breaks = in[1];
  const int64_t B = x->shape[0], T = x->shape[1], lo = (int64_t)a->v[0], hi = (int64_t)a->v[1];
  const int64_t S = (int64_t)a->v[2], ps[2] = {B, S};
  dm_tensor *pool = h_new(DM_F64, 2, ps), *ctx = h_new(DM_F64, 2, x->shape), *count = h_new(DM_F64, 1, &B);
  for (int64_t b = 0; b < B; b++) {
    int64_t patch = -1, len = 0;
    for (int64_t t = 0; t < T; t++) {
      const int64_t before[2] = {b, t - 1};
      const bool opens = t == 0 || len == hi || (len >= lo && h_get(breaks, (int64_t)h_at(x, before)) != 0);
      if (opens) {
        if (patch >= 0) h_set(pool, b * S + patch, (double)(1 + b * T + t - 1));
        patch++;
        len = 0;
      }
      len++;
      h_set(ctx, b * T + t, patch == 0 ? 0 : (double)(1 + b * S + patch - 1));
    }
    if (T > 0) h_set(pool, b * S + patch, (double)(1 + b * T + T - 1));
    h_set(count, b, (double)(patch + 1));
  }
  expect[0] = pool;
  expect[1] = ctx;
  expect[2] = count;
}

static const dm_case cases[] = {
  {.op = "gather", .label = "repeated indices", .inputs = in_gather, .oracle = or_gather},
  {.op = "scatter_add", .label = "repeated, larger src", .inputs = in_scatter_add, .oracle = or_scatter_add},
  {.op = "index_select", .label = "repeated indices", .inputs = in_index_select, .oracle = or_index_select},
  {.op = "embedding", .label = "small vocab, 0-3 dim ids", .inputs = in_embedding, .oracle = or_embedding,
   .perf_trial = 7},
  {.op = "patch_index", .label = "awkward lengths, random breaks", .inputs = in_patch, .oracle = or_patch,
   .trials = 12, .no_grad = true},
};
DM_REGISTER_CASES(cases)
