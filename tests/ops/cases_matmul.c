/*
** cases_matmul.c — matmul against a plain triple loop in double.
**
** f32 tolerance: the harness measures max |out - ref| / max |ref|. An
** output element sums k products of unit normals; rounding the inputs to
** f32 and accumulating in f32 errs by about u * sqrt(k) (u = 6e-8) while
** max |ref| also grows like sqrt(k), so the ratio stays near 1e-7 whatever
** k is (measured: 3e-8 to 7e-7 over five seeds, the largest at k = 257).
** The worst-case bound k * u, relative to sum |a||b|, is 2e-6 at k = 33 and
** 1.5e-5 at k = 257; 2e-5 sits above both, while any real fault (a wrong or
** missing element, a dropped term of the sum) is an error of order 1/sqrt(k).
*/
#include "harness.h"

#define F32_TOL 2e-5

static int64_t mat_size(h_rng *r) {
  static const int64_t sizes[] = {1, 2, 3, 7, 17, 33};
  return sizes[h_next(r) % (sizeof sizes / sizeof sizes[0])];
}

/* a: batch_a ++ (ta ? [k, m] : [m, k]); b: batch_b ++ (tb ? [n, k] : [k, n]) */
static void make(h_rng *r, dm_tensor **in, dm_attrs *a, int nba, const int64_t *ba, int nbb,
                 const int64_t *bb, int64_t m, int64_t k, int64_t n, int flags) {
  bool ta = flags & 1, tb = flags & 2;
  int64_t sa[DM_MAXDIM], sb[DM_MAXDIM];
  for (int d = 0; d < nba; d++) sa[d] = ba[d];
  for (int d = 0; d < nbb; d++) sb[d] = bb[d];
  sa[nba] = ta ? k : m;
  sa[nba + 1] = ta ? m : k;
  sb[nbb] = tb ? n : k;
  sb[nbb + 1] = tb ? k : n;
  in[0] = h_randn(r, nba + 2, sa);
  in[1] = h_randn(r, nbb + 2, sb);
  *a = dm_attrs_of(2, (double[]){ta, tb});
}

static void oracle(dm_tensor *const *in, const dm_attrs *at, dm_tensor **expect) {
  const dm_tensor *a = in[0], *b = in[1];
  bool ta = at->v[0] != 0, tb = at->v[1] != 0;
  int na = a->ndim - 2, nb = b->ndim - 2, nd = na > nb ? na : nb;
  int64_t m = a->shape[na + (ta ? 1 : 0)], k = a->shape[na + (ta ? 0 : 1)];
  int64_t n = b->shape[nb + (tb ? 0 : 1)];
  int64_t shape[DM_MAXDIM];
  for (int d = 0; d < nd; d++) {
    int64_t x = d < nd - na ? 1 : a->shape[d - (nd - na)], y = d < nd - nb ? 1 : b->shape[d - (nd - nb)];
    shape[d] = x == 1 ? y : x;
  }
  shape[nd] = m;
  shape[nd + 1] = n;
  dm_tensor *out = h_new(DM_F64, nd + 2, shape);
  int64_t io[DM_MAXDIM], ia[DM_MAXDIM], ib[DM_MAXDIM];
  for (int64_t f = 0; f < dm_numel(out); f++) {
    h_unravel(out, f, io);
    for (int d = 0; d < na; d++) { int od = d + nd - na; ia[d] = a->shape[d] == 1 ? 0 : io[od]; }
    for (int d = 0; d < nb; d++) { int od = d + nd - nb; ib[d] = b->shape[d] == 1 ? 0 : io[od]; }
    int64_t i = io[nd], j = io[nd + 1];
    double s = 0;
    for (int64_t p = 0; p < k; p++) {
      ia[na] = ta ? p : i; ia[na + 1] = ta ? i : p;
      ib[nb] = tb ? j : p; ib[nb + 1] = tb ? p : j;
      s += h_at(a, ia) * h_at(b, ib);
    }
    h_set(out, f, s);
  }
  expect[0] = out;
}

/* trial t covers the transposes t & 3, so 8 trials see each twice */
static void in_2d(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  make(r, in, a, 0, NULL, 0, NULL, mat_size(r), mat_size(r), mat_size(r), t & 3);
}

static void in_batched(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  make(r, in, a, 1, (int64_t[]){3}, 1, (int64_t[]){3}, mat_size(r), mat_size(r), mat_size(r), t & 3);
}

static void in_broadcast(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  make(r, in, a, 2, (int64_t[]){2, 1}, 1, (int64_t[]){5}, mat_size(r), mat_size(r), mat_size(r), t & 3);
}

/* batch pairs: a batched against a 2-D b (a linear layer, which the kernel
** and the backward fold into one product), the reverse, size-1 batch dims
** on either side, and both sides broadcast at once */
static void in_mixed(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const struct { int na, nb; int64_t ba[3], bb[3]; } pairs[] = {
    {1, 0, {4}, {0}}, {0, 2, {0}, {2, 3}}, {1, 1, {1}, {3}},
    {3, 3, {2, 1, 3}, {1, 4, 1}}, {1, 1, {3}, {1}}, {2, 0, {2, 3}, {0}},
  };
  int p = t % 6;
  make(r, in, a, pairs[p].na, pairs[p].ba, pairs[p].nb, pairs[p].bb, mat_size(r), mat_size(r), mat_size(r),
       t & 3);
}

/* m, k, n of 1 in turn (outer products, dot products, matrix-vector), and an
** empty inner dim (the output is all zeros) */
static void in_ones(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int64_t d[3] = {mat_size(r), mat_size(r), mat_size(r)};
  int which = t % 4;
  if (which < 3) d[which] = 1;
  else d[1] = 0;
  make(r, in, a, 1, (int64_t[]){2}, 2, (int64_t[]){1, 1}, d[0], d[1], d[2], (t / 4) & 3);
}

/* inputs that are transposed views: BLAS reads them through the flipped
** flag. The test mode's copies are contiguous, but the grad mode runs the
** forward and backward on these views; trials 4-7 have a 2-D b, where the
** backward folds a's batch into its rows (a copy when a is a view). */
static dm_tensor *transposed_view(dm_tensor *t) {
  int nd = t->ndim;
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  for (int d = 0; d < nd; d++) { shape[d] = t->shape[d]; strides[d] = t->strides[d]; }
  shape[nd - 2] = t->shape[nd - 1]; shape[nd - 1] = t->shape[nd - 2];
  strides[nd - 2] = t->strides[nd - 1]; strides[nd - 1] = t->strides[nd - 2];
  dm_tensor *v = dm_tensor_view(t, nd, shape, strides, t->offset);
  dm_release(t);
  return v;
}

static void in_views(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  make(r, in, a, 1, (int64_t[]){2}, t < 4, (int64_t[]){2}, mat_size(r), mat_size(r), mat_size(r), t & 3);
  in[0] = transposed_view(in[0]);
  in[1] = transposed_view(in[1]);
  a->v[0] = !a->v[0];
  a->v[1] = !a->v[1];
}

/* sizes large enough for OpenBLAS's blocked and threaded paths; the perf
** trial (index 6, never run by test or grad) is 1024 x 1024 x 1024 */
static void in_large(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  if (t == 6) { make(r, in, a, 0, NULL, 0, NULL, 1024, 1024, 1024, 0); return; }
  make(r, in, a, 1, (int64_t[]){2}, 0, NULL, 129, 257, 65, t & 3);
}

/* a few rows against a weight read transposed (a linear layer at generation's row a stream): on
** CUDA in 16 bits the rows kernel (kernels/rows_product.cu) where k is a multiple of 8, cuBLASLt
** where it is not (k = 12, 36); rows as [m, k], [1, m, k] and [m, 1, k] */
static void in_rows(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const int64_t ks[] = {8, 64, 264, 520, 12, 36}, ns[] = {1, 7, 33, 130};
  int64_t m = 1 + (int64_t)(h_next(r) % 8), k = ks[t % 6], n = ns[h_next(r) % 4];
  int shape_of = t % 3;
  if (shape_of == 0) make(r, in, a, 0, NULL, 0, NULL, m, k, n, 2);
  else make(r, in, a, 1, (int64_t[]){shape_of == 1 ? 1 : m}, 0, NULL, shape_of == 1 ? m : 1, k, n, 2);
}

static const dm_case cases[] = {
  {"matmul", "2-D, each transpose", in_2d, oracle, .trials = 8, .f32_tol = F32_TOL},
  {"matmul", "batched [3]", in_batched, oracle, .trials = 8, .f32_tol = F32_TOL},
  {"matmul", "broadcast [2,1] x [5]", in_broadcast, oracle, .trials = 8, .f32_tol = F32_TOL},
  {"matmul", "batch pairs", in_mixed, oracle, .trials = 12, .f32_tol = F32_TOL},
  {"matmul", "size-1 and empty dims", in_ones, oracle, .trials = 16, .f32_tol = F32_TOL},
  {"matmul", "transposed views", in_views, oracle, .trials = 8, .f32_tol = F32_TOL},
  {"matmul", "a few rows against a weight", in_rows, oracle, .trials = 18, .f32_tol = F32_TOL},
  {"matmul", "large", in_large, oracle, .trials = 4, .f32_tol = F32_TOL, .perf_trial = 7},
};
DM_REGISTER_CASES(cases)
