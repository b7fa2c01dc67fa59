/*
** cases_elementwise.c — unary ops, broadcasting binary ops and comparisons,
** where, and the in-place helpers, against plain loops in double.
**
** Inputs are drawn per op from a domain where the op is smooth (positive
** for log, sqrt, rsqrt, rdiv and pow; away from 0 for abs, relu and sign;
** away from the bounds for clamp; without near-ties for maximum and
** minimum), so that finite differences see a derivative.
*/
#include <math.h>
#include <string.h>
#include "harness.h"

#define TRIALS 6
#define PERF_TRIAL (TRIALS + 1)        /* 1-based: trial index TRIALS is the large one */
#define PERF_N 2048                    /* 2048 x 2048 = 4M elements */

/* ---- shapes --------------------------------------------------------------------------- */

/* a random shape of 0..4 dims, awkward sizes, at most ~3000 elements */
static int rand_shape(h_rng *r, int64_t *shape) {
  int nd = (int)h_int(r, 0, 4);
  int64_t n = 1;
  for (int d = 0; d < nd; d++) {
    shape[d] = h_size(r);
    while (n * shape[d] > 3000) shape[d] = (shape[d] + 1) / 2;
    n *= shape[d];
  }
  return nd;
}

/* pairs of shapes that broadcast in the ways that matter */
static void binary_shapes(h_rng *r, int k, int *na, int64_t *sa, int *nb, int64_t *sb) {
  int64_t s[DM_MAXDIM];
  int n;
  switch (k) {
  case 0: *na = 3; sa[0] = 5; sa[1] = 1; sa[2] = 3; *nb = 2; sb[0] = 7; sb[1] = 3; return;
  case 1: *na = 0; *nb = 1; sb[0] = 4; return;
  case 2:                                              /* the same shape */
    n = rand_shape(r, s);
    *na = *nb = n;
    memcpy(sa, s, sizeof s); memcpy(sb, s, sizeof s);
    return;
  case 3: case 4: {                                    /* one side with size-1 and missing dims */
    n = rand_shape(r, s);
    if (n == 0) { s[0] = 3; n = 1; }
    int drop = (int)h_int(r, 0, n - 1);
    int64_t *full = k == 3 ? sa : sb, *part = k == 3 ? sb : sa;
    int *nfull = k == 3 ? na : nb, *npart = k == 3 ? nb : na;
    *nfull = n;
    memcpy(full, s, sizeof s);
    *npart = n - drop;
    for (int d = 0; d < n - drop; d++) part[d] = h_int(r, 0, 1) ? 1 : s[d + drop];
    return;
  }
  default:                                             /* an outer product: [p, 1, q] with [1, m, 1] */
    *na = *nb = 3;
    sa[0] = h_size(r); sa[1] = 1; sa[2] = h_size(r);
    sb[0] = 1; sb[1] = h_size(r); sb[2] = 1;
    return;
  }
}

/* ---- value generators ------------------------------------------------------------------ */

typedef dm_tensor *(*gen_fn)(h_rng *r, int nd, const int64_t *shape);

static dm_tensor *map_uniform(h_rng *r, int nd, const int64_t *shape, double lo, double hi, bool either_sign) {
  dm_tensor *t = h_uniform_t(r, nd, shape, lo, hi);
  if (either_sign)
    for (int64_t i = 0; i < dm_numel(t); i++) if (h_int(r, 0, 1)) h_set(t, i, -h_get(t, i));
  return t;
}

static dm_tensor *gen_normal(h_rng *r, int nd, const int64_t *s) {
  dm_tensor *t = h_randn(r, nd, s);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, 2 * h_get(t, i));
  return t;
}
static dm_tensor *gen_wide(h_rng *r, int nd, const int64_t *s) { return map_uniform(r, nd, s, -60, 60, false); }
static dm_tensor *gen_pos(h_rng *r, int nd, const int64_t *s) { return map_uniform(r, nd, s, 0.5, 3, false); }
static dm_tensor *gen_away0(h_rng *r, int nd, const int64_t *s) { return map_uniform(r, nd, s, 0.1, 3, true); }
static dm_tensor *gen_divisor(h_rng *r, int nd, const int64_t *s) { return map_uniform(r, nd, s, 0.5, 2, true); }
/* maximum/minimum: a sits in the lower part of unit cells, b in the upper, never closer than 0.2 */
static dm_tensor *gen_cells(h_rng *r, int nd, const int64_t *s, double lo, double hi) {
  dm_tensor *t = h_uniform_t(r, nd, s, lo, hi);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, h_get(t, i) + (double)h_int(r, -3, 3));
  return t;
}
static dm_tensor *gen_cell_lo(h_rng *r, int nd, const int64_t *s) { return gen_cells(r, nd, s, 0.1, 0.4); }
static dm_tensor *gen_cell_hi(h_rng *r, int nd, const int64_t *s) { return gen_cells(r, nd, s, 0.6, 0.9); }
/* small integers as floats, so that comparisons meet equal values */
static dm_tensor *gen_ints(h_rng *r, int nd, const int64_t *s) {
  dm_tensor *t = h_new(DM_F64, nd, s);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, (double)h_int(r, -2, 2));
  return t;
}
static dm_tensor *gen_i64(h_rng *r, int nd, const int64_t *s) { return h_indices(r, nd, s, -50, 50); }
/* clamp to [-0.5, 0.7]: values at least 0.05 away from both bounds */
static dm_tensor *gen_clamp(h_rng *r, int nd, const int64_t *s) {
  dm_tensor *t = gen_normal(r, nd, s);
  for (int64_t i = 0; i < dm_numel(t); i++) {
    double x = h_get(t, i);
    if (fabs(x + 0.5) < 0.05 || fabs(x - 0.7) < 0.05) h_set(t, i, x + 0.13);
  }
  return t;
}

/* ---- unary ------------------------------------------------------------------------------- */

static void unary_inputs(h_rng *r, int k, dm_tensor **in, gen_fn gen) {
  int64_t shape[DM_MAXDIM] = {PERF_N, PERF_N};
  int nd = k == TRIALS ? 2 : rand_shape(r, shape);
  in[0] = gen(r, nd, shape);
}

#define UNARY_INPUTS(fname, gen, ...)                                                     \
  static void fname(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {                        \
    double v[] = {0, __VA_ARGS__};                                                          \
    unary_inputs(r, k, in, gen);                                                           \
    *a = dm_attrs_of((int)(sizeof v / sizeof v[0]) - 1, v + 1);                             \
  }
UNARY_INPUTS(in_normal, gen_normal)
UNARY_INPUTS(in_wide, gen_wide)
UNARY_INPUTS(in_pos, gen_pos)
UNARY_INPUTS(in_away0, gen_away0)
UNARY_INPUTS(in_affine, gen_normal, -1.3, 0.4)
UNARY_INPUTS(in_rdiv, gen_pos, 1.7)
UNARY_INPUTS(in_clamp, gen_clamp, -0.5, 0.7)
UNARY_INPUTS(in_clamp_lo, gen_clamp, -0.5, INFINITY)
UNARY_INPUTS(in_clamp_hi, gen_clamp, -INFINITY, 0.7)

/* pow: a different exponent per trial, on a positive base */
static void in_pow(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  static const double ps[] = {2.5, -1.5, 3, 0.5, 2, -0.3, 1.7};
  unary_inputs(r, k, in, gen_pos);
  *a = dm_attrs_of(1, &ps[k % 7]);
}

/* y = expr(x, p, q) with p = v[0], q = v[1] */
#define UNARY_ORACLE(fname, expr)                                                          \
  static void fname(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {              \
    const double p = a->v[0], q = a->v[1];                                                  \
    (void)p; (void)q;                                                                      \
    ex[0] = h_new(DM_F64, in[0]->ndim, in[0]->shape);                                       \
    for (int64_t i = 0; i < dm_numel(in[0]); i++) {                                         \
      double x = h_get(in[0], i);                                                           \
      h_set(ex[0], i, (expr));                                                              \
    }                                                                                      \
  }
UNARY_ORACLE(ref_neg, -x)
UNARY_ORACLE(ref_exp, exp(x))
UNARY_ORACLE(ref_log, log(x))
UNARY_ORACLE(ref_sqrt, sqrt(x))
UNARY_ORACLE(ref_rsqrt, 1.0 / sqrt(x))
UNARY_ORACLE(ref_tanh, tanh(x))
UNARY_ORACLE(ref_sigmoid, x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)))
UNARY_ORACLE(ref_silu, x >= 0 ? x / (1.0 + exp(-x)) : x * exp(x) / (1.0 + exp(x)))
UNARY_ORACLE(ref_softplus, x > 30 ? x + exp(-x) : log1p(exp(x)))
UNARY_ORACLE(ref_abs, x < 0 ? -x : x)
UNARY_ORACLE(ref_relu, x > 0 ? x : 0.0)
UNARY_ORACLE(ref_square, x * x)
UNARY_ORACLE(ref_sign, x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0)
UNARY_ORACLE(ref_pow, pow(x, p))
UNARY_ORACLE(ref_clamp, x < p ? p : x > q ? q : x)
UNARY_ORACLE(ref_affine, p * x + q)
UNARY_ORACLE(ref_rdiv, p / x)

/* ---- binary ------------------------------------------------------------------------------ */

static void binary_inputs(h_rng *r, int k, dm_tensor **in, gen_fn ga, gen_fn gb, bool perf_bias) {
  int na, nb;
  int64_t sa[DM_MAXDIM], sb[DM_MAXDIM];
  if (k == TRIALS) {                                   /* perf: 4M with 4M, or with a [2048] bias row */
    na = 2; sa[0] = sa[1] = PERF_N;
    nb = perf_bias ? 1 : 2; sb[0] = sb[1] = PERF_N;
  } else binary_shapes(r, k, &na, sa, &nb, sb);
  in[0] = ga(r, na, sa);
  in[1] = gb(r, nb, sb);
}

#define BINARY_INPUTS(fname, ga, gb, bias)                                                 \
  static void fname(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { binary_inputs(r, k, in, ga, gb, bias); }
BINARY_INPUTS(in2_normal, gen_normal, gen_normal, false)
BINARY_INPUTS(in2_bias, gen_normal, gen_normal, true)
BINARY_INPUTS(in2_div, gen_normal, gen_divisor, false)
BINARY_INPUTS(in2_cells, gen_cell_lo, gen_cell_hi, false)
BINARY_INPUTS(in2_cells_rev, gen_cell_hi, gen_cell_lo, false)
BINARY_INPUTS(in2_ints, gen_ints, gen_ints, false)
BINARY_INPUTS(in2_i64, gen_i64, gen_i64, false)

/* t's value at the output index idx (right-aligned, size-1 dims broadcast) */
static double bcast_at(const dm_tensor *t, int nd, const int64_t *idx) {
  int64_t ti[DM_MAXDIM];
  for (int d = 0; d < t->ndim; d++) {
    int od = d + nd - t->ndim;
    ti[d] = t->shape[d] == 1 ? 0 : idx[od];
  }
  return h_at(t, ti);
}

/* the broadcast shape of n tensors */
static int bcast_shape(int n, dm_tensor *const *ts, int64_t *shape) {
  int nd = 0;
  for (int i = 0; i < n; i++) if (ts[i]->ndim > nd) nd = ts[i]->ndim;
  for (int d = 0; d < nd; d++) {
    shape[d] = 1;
    for (int i = 0; i < n; i++) {
      int td = d - (nd - ts[i]->ndim);
      if (td >= 0 && ts[i]->shape[td] != 1) shape[d] = ts[i]->shape[td];
    }
  }
  return nd;
}

#define BINARY_ORACLE(fname, expr)                                                         \
  static void fname(dm_tensor *const *in, const dm_attrs *at, dm_tensor **ex) {             \
    int64_t shape[DM_MAXDIM], idx[DM_MAXDIM];                                               \
    int nd = bcast_shape(2, in, shape);                                                     \
    ex[0] = h_new(DM_F64, nd, shape);                                                       \
    for (int64_t i = 0; i < dm_numel(ex[0]); i++) {                                         \
      h_unravel(ex[0], i, idx);                                                             \
      double a = bcast_at(in[0], nd, idx), b = bcast_at(in[1], nd, idx);                    \
      h_set(ex[0], i, (expr));                                                              \
    }                                                                                      \
  }
BINARY_ORACLE(ref_add, a + b)
BINARY_ORACLE(ref_sub, a - b)
BINARY_ORACLE(ref_mul, a * b)
BINARY_ORACLE(ref_div, a / b)
BINARY_ORACLE(ref_maximum, a > b ? a : b)
BINARY_ORACLE(ref_minimum, a < b ? a : b)
BINARY_ORACLE(ref_eq, a == b)
BINARY_ORACLE(ref_ne, a != b)
BINARY_ORACLE(ref_lt, a < b)
BINARY_ORACLE(ref_le, a <= b)
BINARY_ORACLE(ref_gt, a > b)
BINARY_ORACLE(ref_ge, a >= b)

/* ---- where ------------------------------------------------------------------------------- */

/* cond u8 of 0/1, or f64 of 0, 1.5, -2 (nonzero is true); three shapes broadcast */
static void where_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a, bool float_cond) {
  int na, nb;
  int64_t sa[DM_MAXDIM], sb[DM_MAXDIM], sc[DM_MAXDIM];
  int nc;
  if (k == TRIALS) {
    na = nb = nc = 2;
    sa[0] = sa[1] = sb[0] = sb[1] = sc[0] = sc[1] = PERF_N;
  } else {
    binary_shapes(r, k, &na, sa, &nb, sb);
    nc = k % 2 ? na : nb;                              /* cond takes one side's shape, a dim set to 1 */
    memcpy(sc, k % 2 ? sa : sb, sizeof sc);
    if (nc > 0) sc[h_int(r, 0, nc - 1)] = 1;
  }
  dm_tensor *c = h_new(float_cond ? DM_F64 : DM_U8, nc, sc);
  static const double fvals[] = {0, 1.5, -2};
  for (int64_t i = 0; i < dm_numel(c); i++) h_set(c, i, float_cond ? fvals[h_int(r, 0, 2)] : (double)h_int(r, 0, 1));
  in[0] = c;
  in[1] = gen_normal(r, na, sa);
  in[2] = gen_normal(r, nb, sb);
}
static void in_where(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { where_inputs(r, k, in, a, false); }
static void in_where_f(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { where_inputs(r, k, in, a, true); }

static void ref_where(dm_tensor *const *in, const dm_attrs *at, dm_tensor **ex) {
  int64_t shape[DM_MAXDIM], idx[DM_MAXDIM];
  int nd = bcast_shape(3, in, shape);
  ex[0] = h_new(DM_F64, nd, shape);
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) {
    h_unravel(ex[0], i, idx);
    bool c = bcast_at(in[0], nd, idx) != 0;
    h_set(ex[0], i, c ? bcast_at(in[1], nd, idx) : bcast_at(in[2], nd, idx));
  }
}

/* ---- in place ------------------------------------------------------------------------------ */

/* a and a b that broadcasts to it (cases 3 and 0 of binary_shapes give a the full shape) */
static void inplace_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a, int nin) {
  int na, nb;
  int64_t sa[DM_MAXDIM], sb[DM_MAXDIM];
  if (k == TRIALS) { na = 2; sa[0] = sa[1] = PERF_N; nb = 1; sb[0] = PERF_N; }
  else if (k == 0) { na = 2; sa[0] = 7; sa[1] = 3; nb = 0; }
  else if (k == 1) { na = 3; sa[0] = 5; sa[1] = 1; sa[2] = 3; nb = 2; sb[0] = 1; sb[1] = 3; }
  else binary_shapes(r, 3, &na, sa, &nb, sb);
  in[0] = gen_normal(r, na, sa);
  if (nin == 2) in[1] = gen_normal(r, nb, sb);
  double v[2] = {k % 2 ? 0.7 : -1.25, 0.3};
  *a = dm_attrs_of(2, v);
}
static void in_add_(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { inplace_inputs(r, k, in, a, 2); }
static void in_affine_(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { inplace_inputs(r, k, in, a, 1); }

/* a += alpha b, a *= b: b broadcasts to a, so the binary oracles give a's shape */
BINARY_ORACLE(ref_add_, a + at->v[0] * b)

/* ---- the cases --------------------------------------------------------------------------------- */

#define U(op, label, in, ref, ...) {op, label, in, ref, TRIALS, __VA_ARGS__}
static const dm_case cases[] = {
  U("neg", "normal", in_normal, ref_neg),
  U("exp", "normal", in_normal, ref_exp, .perf_trial = PERF_TRIAL),
  U("log", "positive", in_pos, ref_log),
  U("sqrt", "positive", in_pos, ref_sqrt),
  U("rsqrt", "positive", in_pos, ref_rsqrt),
  U("tanh", "normal", in_normal, ref_tanh),
  U("tanh", "wide", in_wide, ref_tanh),
  U("sigmoid", "normal", in_normal, ref_sigmoid),
  U("sigmoid", "wide", in_wide, ref_sigmoid),
  U("silu", "normal", in_normal, ref_silu, .perf_trial = PERF_TRIAL),
  U("silu", "wide", in_wide, ref_silu),
  U("softplus", "normal", in_normal, ref_softplus),
  U("softplus", "wide (no overflow)", in_wide, ref_softplus),
  U("abs", "away from 0", in_away0, ref_abs),
  U("relu", "away from 0", in_away0, ref_relu),
  U("square", "normal", in_normal, ref_square),
  U("sign", "away from 0", in_away0, ref_sign, .no_grad = true),
  U("pow", "positive base", in_pow, ref_pow),
  U("clamp", "[-0.5, 0.7]", in_clamp, ref_clamp),
  U("clamp", "[-0.5, inf]", in_clamp_lo, ref_clamp),
  U("clamp", "[-inf, 0.7]", in_clamp_hi, ref_clamp),
  U("affine", "-1.3 x + 0.4", in_affine, ref_affine, .perf_trial = PERF_TRIAL),
  U("rdiv", "1.7 / x", in_rdiv, ref_rdiv),

  U("add", "broadcast", in2_normal, ref_add, .perf_trial = PERF_TRIAL),
  U("add", "bias row", in2_bias, ref_add, .perf_trial = PERF_TRIAL),
  U("add", "i64", in2_i64, ref_add, .no_grad = true),
  U("sub", "broadcast", in2_normal, ref_sub),
  U("mul", "broadcast", in2_normal, ref_mul, .perf_trial = PERF_TRIAL),
  U("div", "broadcast", in2_div, ref_div),
  U("maximum", "a below b", in2_cells, ref_maximum),
  U("maximum", "a above b", in2_cells_rev, ref_maximum),
  U("minimum", "a below b", in2_cells, ref_minimum),
  U("minimum", "a above b", in2_cells_rev, ref_minimum),
  U("eq", "small ints", in2_ints, ref_eq, .no_grad = true),
  U("eq", "i64", in2_i64, ref_eq, .no_grad = true),
  U("ne", "small ints", in2_ints, ref_ne, .no_grad = true),
  U("lt", "small ints", in2_ints, ref_lt, .no_grad = true, .perf_trial = PERF_TRIAL),
  U("le", "small ints", in2_ints, ref_le, .no_grad = true),
  U("gt", "small ints", in2_ints, ref_gt, .no_grad = true),
  U("ge", "small ints", in2_ints, ref_ge, .no_grad = true),

  U("where", "u8 cond", in_where, ref_where, .perf_trial = PERF_TRIAL),
  U("where", "f64 cond", in_where_f, ref_where),

  U("add_", "b broadcast, alpha", in_add_, ref_add_, .no_grad = true, .perf_trial = PERF_TRIAL),
  U("mul_", "b broadcast", in_add_, ref_mul, .no_grad = true),
  U("affine_", "scale, shift", in_affine_, ref_affine, .no_grad = true, .perf_trial = PERF_TRIAL),
};
DM_REGISTER_CASES(cases)
