/*
** cases_engram.c — the Engram ops against plain loops.
**
** engram_index's oracle builds the layout itself (primes by trial
** division) and computes every key from the spec's words: the n bytes in
** base 256 for a direct order, the XOR of byte * multiplier reduced modulo
** the sub-table's prime otherwise. Only the multipliers come from engram.h:
** they are the definition. Indices are compared exactly (f32_tol 1e-12:
** the outputs are integers, the same in every variant).
*/
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"
#include "ops/engram.h"

#define TRIALS 6
#define PERF_TRIAL (TRIALS + 1)        /* 1-based: trial index TRIALS is the large one */
#define EXACT 1e-12

/* i64 values lo..hi as dtype dt (u8, i32 or i64) */
static dm_tensor *ints_as(h_rng *r, dm_dtype dt, int nd, const int64_t *shape, int64_t lo, int64_t hi) {
  dm_tensor *t = h_indices(r, nd, shape, lo, hi);
  if (dt == DM_I64) return t;
  dm_tensor *c = dm_tensor_like_dtype(t, dt);
  dm_copy_(c, t);
  dm_release(t);
  return c;
}

static const dm_dtype byte_dtypes[3] = {DM_U8, DM_I32, DM_I64};

/* ---- engram_index ------------------------------------------------------------------------------ */

typedef struct { int norders; int64_t orders[8]; int64_t heads, rows, B, T, P; } index_trial;

static void in_index(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  static const index_trial fixed[] = {
    {3, {1, 2, 3}, 1, 65536, 2, 7, 1},        /* two direct orders, a prefix shorter than 2 */
    {3, {3, 4, 5}, 1, 4194304, 3, 17, -1},    /* b1's layout, no prefix */
    {2, {2, 3}, 3, 1024, 1, 1, 5},            /* three heads, one byte, a long prefix */
    {2, {1, 8}, 2, 300, 5, 13, 0},            /* a direct order with two heads; an empty prefix */
    {1, {2}, 1, 65536, 2, 31, 9},             /* exactly 256^2 rows: direct */
  };
  index_trial t;
  if (k < 5) t = fixed[k];
  else if (k == TRIALS) t = (index_trial){3, {3, 4, 5}, 1, 4194304, 8, 1024, 4};   /* perf: b1 */
  else {
    t.norders = (int)h_int(r, 1, 3);
    int64_t o = 0;
    for (int i = 0; i < t.norders; i++) t.orders[i] = o = o + h_int(r, 1, 2);
    t.heads = h_int(r, 1, 2);
    t.rows = h_int(r, 64, 200000);
    t.B = h_size(r);
    t.T = h_size(r);
    t.P = h_int(r, -1, 6);
  }
  int64_t xs[2] = {t.B, t.T}, ps[2] = {t.B, t.P};
  /* a small alphabet in half the trials, so n-grams repeat */
  int64_t hi = k % 2 ? 255 : 3;
  in[0] = ints_as(r, byte_dtypes[k % 3], 2, xs, 0, hi);
  in[1] = t.P < 0 ? NULL : ints_as(r, byte_dtypes[(k + 1) % 3], 2, ps, 0, hi);
  *a = dm_attrs_of(2, (double[]){(double)t.heads, (double)t.rows});
  a->nlist = t.norders;
  memcpy(a->list, t.orders, sizeof(int64_t) * (size_t)t.norders);
}

static bool prime_by_division(int64_t n) {
  if (n < 2) return false;
  for (int64_t q = 2; q * q <= n; q++)
    if (n % q == 0) return false;
  return true;
}

static void or_index(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  static const uint64_t mult[8] = DM_ENGRAM_MULTIPLIERS;
  const dm_tensor *x = in[0], *prefix = in[1];
  int64_t B = x->shape[0], T = x->shape[1], P = prefix ? prefix->shape[1] : 0;
  int64_t K = (int64_t)a->v[0], R = (int64_t)a->v[1];
  int nsub = a->nlist * (int)K;
  int order[64];
  bool direct[64];
  int64_t offset[64], size[64], total = 0, below = R;
  for (int i = 0, s = 0; i < a->nlist; i++)
    for (int h = 0; h < K; h++, s++) {
      order[s] = (int)a->list[i];
      direct[s] = pow(256, order[s]) <= (double)R;
      if (direct[s]) size[s] = (int64_t)pow(256, order[s]);
      else {
        size[s] = below;
        while (!prime_by_division(size[s])) size[s]--;
        below = size[s] - 1;
      }
      offset[s] = total;
      total += size[s];
    }
  int64_t shape[3] = {B, T, nsub};
  dm_tensor *e = h_new(DM_I64, 3, shape);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int s = 0; s < nsub; s++) {
        uint64_t key = 0, mix = 0;
        for (int j = 0; j < order[s]; j++) {
          int64_t p = t - j, at[2] = {b, p}, pat[2] = {b, P + p};
          uint64_t byte = p >= 0 ? (uint64_t)h_at(x, at) : P + p >= 0 ? (uint64_t)h_at(prefix, pat) : 0;
          key += byte * (uint64_t)pow(256, j);
          mix ^= byte * mult[j];
        }
        int64_t row = direct[s] ? (int64_t)key : (int64_t)(mix % (uint64_t)size[s]);
        h_set(e, (b * T + t) * nsub + s, (double)(offset[s] + row));
      }
  expect[0] = e;
}

/* ---- engram_unique ---------------------------------------------------------------------------- */

static void in_unique(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, 1, 3);
  for (int64_t d = 0, n = 1; d < nd; n *= shape[d++]) {   /* at most ~3000 lookups: the oracle is quadratic */
    shape[d] = h_size(r);
    while (n * shape[d] > 3000) shape[d] = (shape[d] + 1) / 2;
  }
  if (k == 0) { nd = 1; shape[0] = 0; }                      /* no lookups at all */
  if (k == TRIALS) { nd = 3; shape[0] = 8; shape[1] = 1024; shape[2] = 3; }   /* perf: b1's lookups */
  int64_t hi = k == TRIALS ? 12582912 : k % 2 ? 6 : (int64_t)1 << 40;
  in[0] = ints_as(r, k % 3 == 2 ? DM_I32 : DM_I64, nd, shape, 0, k % 3 == 2 && hi > 1000 ? 1 << 30 : hi);
  if (k % 4 == 1) *a = dm_attrs_of(2, (double[]){0, 1});        /* the padded (static) form */
  else *a = dm_attrs_of(k == 3 ? 1 : 0, (double[]){7});        /* trial 3: every value below 7 */
}

static void or_unique(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *idx = in[0];
  int64_t M = dm_numel(idx), U = 0;
  double *vals = calloc((size_t)(M ? M : 1), sizeof *vals);
  for (int64_t i = 0; i < M; i++) {           /* insertion into a sorted list of distinct values */
    double v = h_get(idx, i);
    int64_t j = 0;
    while (j < U && vals[j] < v) j++;
    if (j < U && vals[j] == v) continue;
    memmove(vals + j + 1, vals + j, sizeof *vals * (size_t)(U - j));
    vals[j] = v;
    U++;
  }
  bool padded = a->nv > 1 && a->v[1] != 0;
  int64_t n = padded ? M : U, one = 1;          /* padded: rows and counts of M, the tail 0 */
  expect[0] = h_new(DM_I64, 1, &n);
  expect[1] = h_new(DM_I64, idx->ndim, idx->shape);
  expect[2] = h_new(DM_I64, 1, &n);
  expect[3] = h_new(DM_I64, 1, &one);
  h_set(expect[3], 0, (double)U);
  for (int64_t j = 0; j < n; j++) { h_set(expect[0], j, 0); h_set(expect[2], j, 0); }
  for (int64_t i = 0; i < M; i++) {
    int64_t lo = 0, hi = U - 1;               /* binary search: vals[lo] == the value */
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (vals[mid] < h_get(idx, i)) lo = mid + 1; else hi = mid;
    }
    int64_t j = lo;
    h_set(expect[1], i, (double)j);
    h_set(expect[2], j, h_get(expect[2], j) + 1);
  }
  for (int64_t j = 0; j < U; j++) h_set(expect[0], j, vals[j]);
  free(vals);
}

/* ---- engram_sparse_grad ------------------------------------------------------------------------- */

static void in_sparse_grad(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t M = k == 0 ? 0 : h_int(r, 1, 40), de = h_size(r), U = h_int(r, 1, 7);
  if (k == TRIALS) { M = 8 * 1024 * 3; de = 32; U = 20000; }  /* perf: b1's lookups */
  int64_t gs[2] = {M, de}, is[2] = {M, 1};
  if (k % 2 && M % 2 == 0) { is[0] = 2; is[1] = M / 2; }       /* an inverse of another shape */
  in[0] = h_randn(r, 2, gs);
  in[1] = ints_as(r, k % 3 == 2 ? DM_I32 : DM_I64, k == TRIALS ? 1 : 2, is, 0, U - 1);
  U += k == 4 ? 3 : 0;                                          /* trailing rows nobody looked up */
  *a = dm_attrs_of(1, (double[]){(double)U});
}

static void or_sparse_grad(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *g = in[0], *inv = in[1];
  int64_t U = (int64_t)a->v[0], de = g->shape[1], shape[2] = {U, de};
  dm_tensor *e = h_new(DM_F64, 2, shape);
  for (int64_t p = 0; p < g->shape[0]; p++) {
    int64_t u = (int64_t)h_get(inv, p);
    for (int64_t c = 0; c < de; c++) h_set(e, u * de + c, h_get(e, u * de + c) + h_get(g, p * de + c));
  }
  expect[0] = e;
}

/* ---- engram_alpha ---------------------------------------------------------------------------- */

/* values of either sign, |x| in [0.3, 2]: rmsnorm of one value is smooth away from 0 */
static dm_tensor *away0(h_rng *r, int nd, const int64_t *shape) {
  dm_tensor *t = h_uniform_t(r, nd, shape, 0.3, 2);
  for (int64_t i = 0; i < dm_numel(t); i++) if (h_int(r, 0, 1)) h_set(t, i, -h_get(t, i));
  return t;
}

static void in_alpha(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, 1, 3);
  for (int d = 0; d < nd; d++) shape[d] = h_size(r);
  if (k == 0) { nd = 1; shape[0] = 1; }                          /* one token of one channel */
  if (k == TRIALS) { nd = 3; shape[0] = 8; shape[1] = 1024; shape[2] = 2048; }   /* perf: b1 */
  in[0] = away0(r, nd, shape);
  in[1] = away0(r, nd, shape);
  in[2] = k % 2 ? h_uniform_t(r, 1, &shape[nd - 1], -1.5, 1.5) : NULL;
  *a = dm_attrs_of(1, (double[]){k == 2 ? 0.5 : 1e-6});
}

static void or_alpha(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *u = in[0], *kx = in[1], *w = in[2];
  int64_t d = u->shape[u->ndim - 1], N = dm_numel(u) / d;
  double eps = a->v[0];
  dm_tensor *e = h_new(DM_F64, u->ndim - 1, u->shape);
  for (int64_t n = 0; n < N; n++) {
    double su = 0, sk = 0;
    for (int64_t i = 0; i < d; i++) {
      su += h_get(u, n * d + i) * h_get(u, n * d + i);
      sk += h_get(kx, n * d + i) * h_get(kx, n * d + i);
    }
    double nu = sqrt(su / d + eps), nk = sqrt(sk / d + eps), s = 0;
    for (int64_t i = 0; i < d; i++)
      s += (w ? h_get(w, i) : 1) * (h_get(u, n * d + i) / nu) * (h_get(kx, n * d + i) / nk);
    h_set(e, n, 1 / (1 + exp(-s / sqrt((double)d))));
  }
  expect[0] = e;
}

static const dm_case cases[] = {
  {.op = "engram_index", .label = "direct, hashed, heads", .inputs = in_index, .oracle = or_index,
   .trials = TRIALS, .f32_tol = EXACT, .no_grad = true, .perf_trial = PERF_TRIAL},
  {.op = "engram_unique", .label = "repeats, empty, i32", .inputs = in_unique, .oracle = or_unique,
   .trials = TRIALS, .f32_tol = EXACT, .no_grad = true, .perf_trial = PERF_TRIAL},
  {.op = "engram_sparse_grad", .label = "repeats, unused rows", .inputs = in_sparse_grad,
   .oracle = or_sparse_grad, .trials = TRIALS, .perf_trial = PERF_TRIAL},
  {.op = "engram_alpha", .label = "with and without gain", .inputs = in_alpha, .oracle = or_alpha,
   .trials = TRIALS, .perf_trial = PERF_TRIAL},
};
DM_REGISTER_CASES(cases)
