/*
** cases_norm.c — the row norms (rmsnorm, l2norm, add_rmsnorm) against plain
** loops in double.
**
** Values are multiples of 2^-10 (values.h). Shapes are awkward: odd row
** lengths and 1-D inputs, and rows wide enough for CUDA's vector kernels.
*/
#include <math.h>
#include "harness.h"
#include "values.h"
#include "ops/norm.h"

/* uniform in [lo, hi], either sign, quantized */
static dm_tensor *signed_uniform(h_rng *r, int nd, const int64_t *shape, double lo, double hi) {
  dm_tensor *t = h_uniform_t(r, nd, shape, lo, hi);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, quantize((h_next(r) & 1 ? -1 : 1) * h_get(t, i)));
  return t;
}

/* a row length: small odd ones, and a few larger */
static int64_t row_size(h_rng *r) {
  static const int64_t sizes[] = {1, 2, 3, 5, 7, 13, 17, 31, 64, 100, 129};
  return sizes[h_next(r) % (sizeof sizes / sizeof sizes[0])];
}

static const double epss[] = {1e-6, 1e-5, 1e-3, 0.25};

static void norm_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a, bool gain) {
  int64_t shape[DM_MAXDIM] = {8192, 2048};
  int64_t last = row_size(r);
  if (k % 4 == 3) last = k % 8 == 3 ? 256 : 520;   /* rows wide enough for CUDA's vector kernels in every dtype */
  int nd = k == PERF ? 2 : rows_shape(r, shape, last, 2);
  in[0] = normal(r, nd, shape, 1.5);
  if (gain) in[1] = signed_uniform(r, 1, &shape[nd - 1], 0.5, 1.5);
  double eps = epss[k % 4];
  *a = dm_attrs_of(1, &eps);
}

static void in_rms_gain(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { norm_inputs(r, k, in, a, true); }

/* l2norm's: eps, and a scale (a power of two, or not) */
static void in_l2(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  static const double scales[] = {1, 0.125, -0.5, 0.3};
  norm_inputs(r, k, in, a, false);
  double v[2] = {a->v[0], scales[k % 4 == 3 ? (k / 4) % 4 : k % 3]};
  *a = dm_attrs_of(2, v);
}
static void in_rms_plain(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { norm_inputs(r, k, in, a, false); }

/* y = x / sqrt(sum(x^2) / div + eps) * gain along the last dim */
static void oracle_norm(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex, bool rms, const dm_tensor *gain) {
  const dm_tensor *x = in[0];
  int64_t d = x->shape[x->ndim - 1], rows = dm_numel(x) / d;
  ex[0] = h_new(DM_F64, x->ndim, x->shape);
  for (int64_t r = 0; r < rows; r++) {
    double ss = 0;
    for (int64_t j = 0; j < d; j++) ss += h_get(x, r * d + j) * h_get(x, r * d + j);
    double s = 1 / sqrt((rms ? ss / (double)d : ss) + a->v[0]);
    for (int64_t j = 0; j < d; j++) h_set(ex[0], r * d + j, h_get(x, r * d + j) * s * (gain ? h_get(gain, j) : 1));
  }
}

static void o_rms(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) { oracle_norm(in, a, ex, true, in[1]); }
static void o_l2(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  oracle_norm(in, a, ex, false, NULL);
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) h_set(ex[0], i, h_get(ex[0], i) * a->v[1]);
}

/* add_rmsnorm: h and y of one shape, a gain */
static void in_add_rms(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  norm_inputs(r, k, in, a, true);
  in[2] = in[1];
  in[1] = normal(r, in[0]->ndim, in[0]->shape, 0.75);
}

/* s = h + y, u = rmsnorm(s) * gain */
static void o_add_rms(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *h = in[0], *y = in[1];
  dm_tensor *s = h_new(DM_F64, h->ndim, h->shape);
  for (int64_t i = 0; i < dm_numel(h); i++) h_set(s, i, h_get(h, i) + h_get(y, i));
  dm_tensor *args[2] = {s, in[2]};
  oracle_norm(args, a, &ex[1], true, in[2]);
  ex[0] = s;
}

static const dm_case cases[] = {
  {"rmsnorm", "gain, odd rows", in_rms_gain, o_rms, .trials = 12, .perf_trial = PERF + 1},
  {"rmsnorm", "no gain", in_rms_plain, o_rms, .trials = 8},
  {"l2norm", "odd rows, scaled", in_l2, o_l2, .trials = 12},
  {"add_rmsnorm", "gain, odd rows", in_add_rms, o_add_rms, .trials = 12, .perf_trial = PERF + 1},
};
DM_REGISTER_CASES(cases)
