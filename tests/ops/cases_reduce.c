/*
** cases_reduce.c — reductions, sum_to and softmax against plain loops in double.
**
** The reduction trials walk every (ndim, dim, keepdim) of 1-4 dim tensors,
** dim -1 (all dims) included: 28 combinations, then the same again with the
** reduced dim (or, for all dims, a random one) forced to size 1, then 0-d
** tensors. Sizes are odd (1, 2, 3, 5, 7, 13, 17, 31; smaller for 3-4 dims).
**
** Inputs are multiples of 2^-10 (of a power of two for the distinct values
** of max and min), exactly representable in f32: the f32 runs then differ from the
** oracle only by the kernel's own rounding, never by cancellation of input
** rounding in a sum near zero. max, min and their gradients get distinct
** values (no ties); ties are tested separately (the first position wins).
** norm gets |x| in [0.25, 2] (no zeros, where it is not differentiable).
*/
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "harness.h"

enum { K_SUM, K_MEAN, K_MAX, K_MIN, K_ARGMAX, K_ARGMIN, K_LSE, K_NORM };

#define NCOMBO 28
#define REDUCE_TRIALS (2 * NCOMBO + 2)
#define PERF_TRIAL 1000                 /* the [4096, 1024] input, never tested */

/* ---- shapes -------------------------------------------------------------------- */

typedef struct combo { int ndim, dim; bool keep; } combo;

/* trial t -> ndim 1..4 with dim -1..ndim-1 and keepdim 0/1; then 0-d tensors */
static combo combo_of(int t) {
  if (t >= 2 * NCOMBO) return (combo){0, t == 2 * NCOMBO ? -1 : 0, t & 1};
  int c = t % NCOMBO;
  for (int nd = 1;; nd++) {
    int n = 2 * (nd + 1);
    if (c < n) return (combo){nd, c / 2 - 1, c & 1};
    c -= n;
  }
}

static int64_t small_size(h_rng *r) {
  static const int64_t sizes[] = {1, 2, 3, 5, 7};
  return sizes[h_next(r) % 5];
}

/* a random shape for trial t; the second round forces the reduced dim to 1 */
static void trial_shape(h_rng *r, int t, int ndim, int dim, int64_t *shape) {
  for (int d = 0; d < ndim; d++) shape[d] = ndim <= 2 ? h_size(r) : small_size(r);
  if (t >= NCOMBO && t < 2 * NCOMBO && ndim > 0) shape[dim >= 0 ? dim : (int)h_int(r, 0, ndim - 1)] = 1;
}

/* ---- values ---------------------------------------------------------------------- */

static double quantize(double v, double q) { return round(v / q) * q; }

static dm_tensor *values(h_rng *r, int ndim, const int64_t *shape, double lo, double hi) {
  dm_tensor *t = h_uniform_t(r, ndim, shape, lo, hi);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, quantize(h_get(t, i), 1.0 / 1024));
  return t;
}

/* distinct values (a shuffle of multiples of a power of two, within about
** [-4, 4] so the finite differences of large sums stay accurate): no ties */
static dm_tensor *distinct(h_rng *r, int ndim, const int64_t *shape) {
  dm_tensor *t = h_new(DM_F64, ndim, shape);
  int64_t n = dm_numel(t);
  double *p = dm_data(t), step = 1;
  while (step * (double)n > 8) step /= 2;
  for (int64_t i = 0; i < n; i++) p[i] = (double)(i - n / 2) * step;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = h_int(r, 0, i);
    double v = p[i]; p[i] = p[j]; p[j] = v;
  }
  return t;
}

/* |x| in [0.25, 2], either sign */
static dm_tensor *away_from_zero(h_rng *r, int ndim, const int64_t *shape) {
  dm_tensor *t = values(r, ndim, shape, 0.25, 2);
  for (int64_t i = 0; i < dm_numel(t); i++) if (h_next(r) & 1) h_set(t, i, -h_get(t, i));
  return t;
}

/* ---- the oracle: one pass per output over the elements it reduces ---------------- */

/* the output's flat position (keepdim order) and the position k within the reduced dims */
static void locate(const dm_tensor *x, unsigned mask, int64_t flat, int64_t *o, int64_t *k) {
  int64_t idx[DM_MAXDIM];
  h_unravel(x, flat, idx);
  *o = 0;
  *k = 0;
  for (int d = 0; d < x->ndim; d++) {
    if ((mask >> d) & 1) *k = *k * x->shape[d] + idx[d];
    else *o = *o * x->shape[d] + idx[d];
  }
}

static unsigned mask_of(const dm_tensor *x, int dim) {
  if (x->ndim == 0) return 0;
  return dim < 0 ? (1u << x->ndim) - 1 : 1u << dim;
}

static int out_shape(const dm_tensor *x, unsigned mask, bool keep, int64_t *shape) {
  int n = 0;
  for (int d = 0; d < x->ndim; d++)
    if (!((mask >> d) & 1)) shape[n++] = x->shape[d];
    else if (keep) shape[n++] = 1;
  return n;
}

static void oracle_reduce(int kind, dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0];
  unsigned mask = mask_of(x, (int)a->v[0]);
  int64_t shape[DM_MAXDIM];
  int nd = out_shape(x, mask, a->v[1] != 0, shape);
  bool ints = !dm_dtype_is_float(x->dtype);
  dm_tensor *val = h_new(kind == K_SUM && ints ? DM_I64 : DM_F64, nd, shape);
  dm_tensor *pos = h_new(DM_I64, nd, shape);
  int64_t nout = dm_numel(val), n = dm_numel(x);
  double *acc = calloc((size_t)nout, sizeof *acc), *m = calloc((size_t)nout, sizeof *m);
  int64_t *bi = calloc((size_t)nout, sizeof *bi), *cnt = calloc((size_t)nout, sizeof *cnt);
  double p = a->v[2];
  for (int64_t i = 0; i < n; i++) {            /* max and position first (logsumexp shifts by it) */
    int64_t o, k;
    locate(x, mask, i, &o, &k);
    double v = h_get(x, i);
    bool lower = kind == K_MIN || kind == K_ARGMIN;
    bool wins = (lower ? v < m[o] : v > m[o]) || (isnan(v) && !isnan(m[o]));   /* the first NaN wins */
    if (cnt[o]++ == 0 || wins) { m[o] = v; bi[o] = k; }
  }
  for (int64_t i = 0; i < n; i++) {
    int64_t o, k;
    locate(x, mask, i, &o, &k);
    double v = h_get(x, i);
    acc[o] += kind == K_LSE ? exp(v - m[o]) : kind == K_NORM ? pow(fabs(v), p) : v;
  }
  for (int64_t o = 0; o < nout; o++) {
    double r = acc[o];
    if (kind == K_MEAN) r /= (double)cnt[o];
    if (kind == K_MAX || kind == K_MIN) r = m[o];
    if (kind == K_LSE) r = isinf(m[o]) || isnan(m[o]) ? m[o] : m[o] + log(acc[o]);
    if (kind == K_NORM) r = pow(acc[o], 1 / p);
    h_set(val, o, r);
    h_set(pos, o, (double)(bi[o] + (int64_t)a->v[2]));
  }
  free(acc); free(m); free(bi); free(cnt);
  bool index_only = kind == K_ARGMAX || kind == K_ARGMIN;
  bool both = kind == K_MAX || kind == K_MIN;
  expect[0] = index_only ? pos : val;
  if (both) expect[1] = pos;
  else dm_release(index_only ? val : pos);
}

#define ORACLE(name, kind) \
  static void name(dm_tensor *const *in, const dm_attrs *a, dm_tensor **e) { oracle_reduce(kind, in, a, e); }
ORACLE(o_sum, K_SUM)
ORACLE(o_mean, K_MEAN)
ORACLE(o_max, K_MAX)
ORACLE(o_min, K_MIN)
ORACLE(o_argmax, K_ARGMAX)
ORACLE(o_argmin, K_ARGMIN)
ORACLE(o_lse, K_LSE)
ORACLE(o_norm, K_NORM)

/* ---- inputs ---------------------------------------------------------------------------- */

static const int64_t perf_shape[2] = {4096, 1024};

/* the trial's shape and attrs {dim, keepdim, third}; values by the caller */
static void reduce_attrs(h_rng *r, int t, int *ndim, int64_t *shape, dm_attrs *a, double third) {
  if (t == PERF_TRIAL - 1) {
    *ndim = 2;
    memcpy(shape, perf_shape, sizeof perf_shape);
    *a = dm_attrs_of(3, (double[]){1, 0, third});
    return;
  }
  combo c = combo_of(t);
  *ndim = c.ndim;
  trial_shape(r, t, c.ndim, c.dim, shape);
  *a = dm_attrs_of(3, (double[]){c.dim, c.keep, third});
}

static void in_plain(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, 0);
  in[0] = values(r, nd, shape, -2, 2);
}

/* base 1 (as Lua passes) on odd trials, 0 on even ones */
static void in_distinct(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, (t / 2) & 1);
  in[0] = distinct(r, nd, shape);
}

/* Column mode: the reduced dim is not the last, and long enough for the
** kernel to take it in several pieces; the kept last dim sometimes exceeds a
** block of lanes (256). [R, C] over dim 0, or [2, R, C] over dim 1. */
static void column_shape(h_rng *r, int t, int *nd, int64_t *shape, int *dim) {
  static const int64_t rs[] = {9, 17, 33}, cs[] = {3, 7, 300};
  *nd = 2 + t % 2;
  *dim = *nd - 2;
  shape[0] = 2;
  shape[*nd - 2] = rs[h_next(r) % 3];
  shape[*nd - 1] = cs[h_next(r) % 3];
}

static void in_columns(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd, dim;
  int64_t shape[DM_MAXDIM];
  column_shape(r, t, &nd, shape, &dim);
  *a = dm_attrs_of(3, (double[]){dim, t & 2 ? 1 : 0, t & 4 ? 1 : 0});
  in[0] = distinct(r, nd, shape);
}

static void in_columns_norm(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd, dim;
  int64_t shape[DM_MAXDIM];
  column_shape(r, t, &nd, shape, &dim);
  *a = dm_attrs_of(3, (double[]){dim, t & 2 ? 1 : 0, t & 4 ? 3 : 2});
  in[0] = away_from_zero(r, nd, shape);
}

/* Distinct values in a view with the dims reversed. Only grad mode runs the op
** on the view itself (test mode copies inputs): there an all-dims reduction
** walks several rows, and max's positions must count across them. */
static void in_reversed(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd;
  int64_t shape[DM_MAXDIM], rev[DM_MAXDIM], strides[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, t & 1);
  for (int d = 0; d < nd; d++) rev[d] = shape[nd - 1 - d];
  dm_tensor *base = distinct(r, nd, rev);
  for (int d = 0; d < nd; d++) strides[d] = base->strides[nd - 1 - d];
  in[0] = dm_tensor_view(base, nd, shape, strides, 0);
  dm_release(base);
}

/* values from {0, 1, 2}: many ties, which go to the first position */
static void in_ties(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, 1);
  in[0] = h_new(DM_F64, nd, shape);
  for (int64_t i = 0; i < dm_numel(in[0]); i++) h_set(in[0], i, (double)h_int(r, 0, 2));
}

/* Rows of 2^20 + 13 (one or two of them): the CUDA reduction splits each row over many blocks and
** joins a few hundred partials an output; values from {0, 1, 2} on odd trials (ties go to the first) */
static void in_long(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int64_t shape[2] = {1 + t % 2, (1 << 20) + 13};
  *a = dm_attrs_of(3, (double[]){1, t & 2 ? 1 : 0, 0});
  in[0] = h_new(DM_F64, 2, shape);
  for (int64_t i = 0; i < dm_numel(in[0]); i++)
    h_set(in[0], i, t & 1 ? (double)h_int(r, 0, 2) : h_uniform(r, -2, 2));
}

/* every third trial is shifted by 100: exp would overflow in f32 without the
** max shift (a larger shift makes the finite differences of a loss near
** 100 * sum(w) lose the 1e-6 they are checked to) */
static void in_lse(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, 0);
  in[0] = values(r, nd, shape, -4, 4);
  if (t % 3 == 2)
    for (int64_t i = 0; i < dm_numel(in[0]); i++) h_set(in[0], i, h_get(in[0], i) + 100);
}

static void in_norm(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const double ps[] = {2, 1, 3, 0.5, 1.5};
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, ps[t % 5]);
  in[0] = away_from_zero(r, nd, shape);
}

/* NaN, inf and -inf sprinkled in (one in 16 each); not differentiable there */
static void sprinkle(h_rng *r, dm_tensor *t, bool nan, bool inf) {
  for (int64_t i = 0; i < dm_numel(t); i++) {
    uint64_t u = h_next(r) % 16;
    if (u == 0) h_set(t, i, -INFINITY);
    else if (u == 1 && nan) h_set(t, i, NAN);
    else if (u == 2 && inf) h_set(t, i, INFINITY);
  }
}

static void in_special(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in_distinct(r, t, in, a);
  sprinkle(r, in[0], true, true);
}

/* i32, i64 and u8 inputs in turn, small values with ties */
static void in_ints(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const dm_dtype dts[] = {DM_I32, DM_I64, DM_U8};
  int nd;
  int64_t shape[DM_MAXDIM];
  reduce_attrs(r, t, &nd, shape, a, t & 1);
  in[0] = h_new(dts[t % 3], nd, shape);
  for (int64_t i = 0; i < dm_numel(in[0]); i++)
    h_set(in[0], i, (double)h_int(r, dts[t % 3] == DM_U8 ? 0 : -50, 200));
}

/* ---- sum_to ------------------------------------------------------------------------------ */

/* x of 1-4 dims (0-d on the last trials); the target drops some leading dims
** and keeps each other dim or makes it 1; trial 3 of each 8 is the same shape */
static void in_sum_to(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd = t >= 30 ? 0 : 1 + t % 4;
  int64_t shape[DM_MAXDIM], target[DM_MAXDIM];
  for (int d = 0; d < nd; d++) shape[d] = nd <= 2 ? h_size(r) : small_size(r);
  int lead = t % 8 == 3 ? 0 : (int)h_int(r, 0, nd);
  for (int d = lead; d < nd; d++) target[d - lead] = t % 8 != 3 && (h_next(r) & 1) ? 1 : shape[d];
  *a = dm_attrs_list(nd - lead, target);
  in[0] = values(r, nd, shape, -2, 2);
}

static void o_sum_to(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0];
  dm_tensor *out = h_new(DM_F64, a->nlist, a->list);
  int lead = x->ndim - a->nlist;
  int64_t idx[DM_MAXDIM], oidx[DM_MAXDIM];
  for (int64_t i = 0; i < dm_numel(x); i++) {
    h_unravel(x, i, idx);
    for (int d = 0; d < a->nlist; d++) oidx[d] = a->list[d] == 1 ? 0 : idx[d + lead];
    h_set_at(out, oidx, h_at(out, oidx) + h_get(x, i));
  }
  expect[0] = out;
}

/* ---- softmax ---------------------------------------------------------------------------- */

/* every (ndim 1..4, dim), then the same with that dim of size 1, then a 0-d
** tensor; every third trial shifted by -1000 (or +1000) */
static void in_softmax(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd, dim;
  int64_t shape[DM_MAXDIM];
  if (t == PERF_TRIAL - 1) {
    nd = 2; dim = 1;
    memcpy(shape, perf_shape, sizeof perf_shape);
  } else if (t >= 20) {
    nd = 0; dim = 0;
  } else {
    int c = t % 10;
    for (nd = 1; c >= nd; nd++) c -= nd;
    dim = c;
    for (int d = 0; d < nd; d++) shape[d] = nd <= 2 ? h_size(r) : small_size(r);
    if (t >= 10) shape[dim] = 1;
  }
  *a = dm_attrs_of(1, (double[]){dim});
  in[0] = values(r, nd, shape, -4, 4);
  if (t % 3 == 2)
    for (int64_t i = 0; i < dm_numel(in[0]); i++) h_set(in[0], i, h_get(in[0], i) + (t & 1 ? 1000 : -1000));
}

/* -inf (masked) entries, and NaN or inf in a few trials */
static void in_softmax_special(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in_softmax(r, t, in, a);
  sprinkle(r, in[0], t % 4 == 1, t % 4 == 3);
}

static void in_softmax_columns(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  int nd, dim;
  int64_t shape[DM_MAXDIM];
  column_shape(r, t, &nd, shape, &dim);
  *a = dm_attrs_of(1, (double[]){dim});
  in[0] = values(r, nd, shape, -4, 4);
}

static void oracle_softmax(bool lg, dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  const dm_tensor *x = in[0];
  unsigned mask = mask_of(x, (int)a->v[0]);
  int64_t rshape[DM_MAXDIM];
  int rnd = out_shape(x, mask, true, rshape);
  int64_t nr = 1, n = dm_numel(x);
  for (int d = 0; d < rnd; d++) nr *= rshape[d];
  double *m = malloc(sizeof(double) * (size_t)nr), *s = calloc((size_t)nr, sizeof *s);
  for (int64_t o = 0; o < nr; o++) m[o] = -INFINITY;
  int64_t o, k;
  for (int64_t i = 0; i < n; i++) { locate(x, mask, i, &o, &k); m[o] = fmax(m[o], h_get(x, i)); }
  for (int64_t i = 0; i < n; i++) { locate(x, mask, i, &o, &k); s[o] += exp(h_get(x, i) - m[o]); }
  dm_tensor *y = h_new(DM_F64, x->ndim, x->shape);
  for (int64_t i = 0; i < n; i++) {
    locate(x, mask, i, &o, &k);
    double v = h_get(x, i) - m[o];
    h_set(y, i, lg ? v - log(s[o]) : exp(v) / s[o]);
  }
  free(m); free(s);
  expect[0] = y;
}

static void o_softmax(dm_tensor *const *in, const dm_attrs *a, dm_tensor **e) { oracle_softmax(false, in, a, e); }
static void o_log_softmax(dm_tensor *const *in, const dm_attrs *a, dm_tensor **e) { oracle_softmax(true, in, a, e); }

#define T REDUCE_TRIALS
static const dm_case cases[] = {
  {"sum", "NaN and infinities", in_special, o_sum, .trials = T, .no_grad = true},
  {"sum", "columns", in_columns, o_sum, .trials = 8},
  {"sum", "every dim, keepdim", in_plain, o_sum, .trials = T, .perf_trial = PERF_TRIAL},
  {"sum", "reversed views", in_reversed, o_sum, .trials = T},
  {"sum", "integer inputs", in_ints, o_sum, .trials = T, .no_grad = true},
  {"sum", "long rows", in_long, o_sum, .trials = 4, .no_grad = true},
  {"mean", "columns", in_columns, o_mean, .trials = 8},
  {"mean", "every dim, keepdim", in_plain, o_mean, .trials = T},
  {"max", "NaN and infinities", in_special, o_max, .trials = T, .no_grad = true},
  {"max", "columns", in_columns, o_max, .trials = 8},
  {"max", "every dim, distinct", in_distinct, o_max, .trials = T},
  {"max", "reversed views", in_reversed, o_max, .trials = T},
  {"max", "ties", in_ties, o_max, .trials = T, .no_grad = true},
  {"max", "integer inputs", in_ints, o_max, .trials = T, .no_grad = true},
  {"max", "long rows", in_long, o_max, .trials = 4, .no_grad = true},
  {"argmax", "long rows", in_long, o_argmax, .trials = 4, .no_grad = true},
  {"min", "NaN and infinities", in_special, o_min, .trials = T, .no_grad = true},
  {"min", "columns", in_columns, o_min, .trials = 8},
  {"min", "every dim, distinct", in_distinct, o_min, .trials = T},
  {"min", "reversed views", in_reversed, o_min, .trials = T},
  {"min", "ties", in_ties, o_min, .trials = T, .no_grad = true},
  {"argmax", "NaN and infinities", in_special, o_argmax, .trials = T, .no_grad = true},
  {"argmax", "columns", in_columns, o_argmax, .trials = 8},
  {"argmax", "every dim, distinct", in_distinct, o_argmax, .trials = T},
  {"argmax", "ties", in_ties, o_argmax, .trials = T},
  {"argmax", "integer inputs", in_ints, o_argmax, .trials = T},
  {"argmin", "NaN and infinities", in_special, o_argmin, .trials = T, .no_grad = true},
  {"argmin", "columns", in_columns, o_argmin, .trials = 8},
  {"argmin", "every dim, distinct", in_distinct, o_argmin, .trials = T},
  {"argmin", "ties", in_ties, o_argmin, .trials = T},
  {"logsumexp", "NaN and infinities", in_special, o_lse, .trials = T, .no_grad = true},
  {"logsumexp", "columns", in_columns, o_lse, .trials = 8},
  {"logsumexp", "every dim, shifted", in_lse, o_lse, .trials = T, .perf_trial = PERF_TRIAL},
  {"norm", "columns", in_columns_norm, o_norm, .trials = 8},
  {"norm", "every dim, p 2 1 3 .5 1.5", in_norm, o_norm, .trials = T},
  {"sum_to", "leading and size-1 dims", in_sum_to, o_sum_to, .trials = 32},
  {"softmax", "-inf, NaN and inf", in_softmax_special, o_softmax, .trials = 21, .no_grad = true},
  {"softmax", "columns", in_softmax_columns, o_softmax, .trials = 8},
  {"softmax", "every dim, shifted", in_softmax, o_softmax, .trials = 21, .perf_trial = PERF_TRIAL},
  {"log_softmax", "-inf, NaN and inf", in_softmax_special, o_log_softmax, .trials = 21, .no_grad = true},
  {"log_softmax", "columns", in_softmax_columns, o_log_softmax, .trials = 8},
  {"log_softmax", "every dim, shifted", in_softmax, o_log_softmax, .trials = 21,
   .perf_trial = PERF_TRIAL},
};
DM_REGISTER_CASES(cases)
