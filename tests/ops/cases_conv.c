/*
** cases_blocks.c — the building blocks (rmsnorm, l2norm, cross_entropy,
** causal_conv1d, silu_mul) against plain loops in double.
**
** Values are multiples of 2^-10, exact in f32, so that the f32 runs differ
** from the oracle only by the kernels' own rounding. Shapes are awkward:
** odd row lengths, 1-D inputs, T = 1, K = 1..4 with dilations 1, 2, 3, 5,
** V = 1 to 257 with ignored rows. causal_conv1d also runs split in two with
** the cache carried, against the whole sequence in one call.
*/
#include <math.h>
#include <string.h>
#include "harness.h"
#include "ops/conv.h"

#define PERF 1000                  /* the trial index of the large perf inputs (never tested) */

/* ---- values and shapes ----------------------------------------------------------------- */

static double quantize(double v) { return round(v * 1024) / 1024; }

/* normal values times scale, quantized */
static dm_tensor *normal(h_rng *r, int nd, const int64_t *shape, double scale) {
  dm_tensor *t = h_randn(r, nd, shape);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, quantize(scale * h_get(t, i)));
  return t;
}

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

/* [lead..., last]: 0..max_lead leading dims of awkward sizes, at most ~100 rows; returns ndim */
static int rows_shape(h_rng *r, int64_t *shape, int64_t last, int max_lead) {
  int nd = (int)h_int(r, 0, max_lead);
  int64_t n = 1;
  for (int d = 0; d < nd; d++) {
    shape[d] = h_size(r);
    while (n * shape[d] > 100) shape[d] = (shape[d] + 1) / 2;
    n *= shape[d];
  }
  shape[nd] = last;
  return nd + 1;
}

/* ---- rmsnorm and l2norm ------------------------------------------------------------------ */

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
static void o_l2(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) { oracle_norm(in, a, ex, false, NULL); }

/* ---- cross_entropy ----------------------------------------------------------------------- */

static const int64_t classes[] = {256, 1, 2, 3, 5, 7, 13, 17, 31, 256, 64, 257};
static const int64_t ignores[] = {-1, 2, -100, 0};

/* logits [lead..., V] (0..2 leading dims), targets [lead...] of i64, i32 or u8 with
** about a quarter of the rows at ignore_index (when there is one), never all of them */
static void in_ce(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM] = {8192, 256};
  int64_t v = k == PERF ? 256 : classes[k % 12], ignore = k == PERF ? -1 : ignores[k % 4];
  /* few rows at large V: finite differences of a mean over many rows lose their digits */
  int nd = k == PERF ? 2 : rows_shape(r, shape, v, v >= 64 ? 1 : 2);
  in[0] = normal(r, nd, shape, 3);
  dm_dtype tdt = k % 3 == 0 ? DM_I64 : k % 3 == 1 ? DM_I32 : ignore >= -1 ? DM_U8 : DM_I32;
  dm_tensor *t = h_new(tdt, nd - 1, shape);
  int64_t rows = dm_numel(t);
  for (int64_t i = 0; i < rows; i++) {
    bool skip = ignore != -1 && i > 0 && h_int(r, 0, 3) == 0;
    int64_t c = h_int(r, 0, v - 1);
    if (c == ignore && v > 1) c = (c + 1) % v;       /* only the chosen rows are ignored */
    h_set(t, i, (double)(skip ? ignore : c));
  }
  in[1] = t;
  double at[2] = {(double)ignore, (double)(k == PERF ? DM_CE_MEAN : k % 3)};
  *a = dm_attrs_of(2, at);
}

static void o_ce(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *x = in[0], *t = in[1];
  int64_t v = x->shape[x->ndim - 1], rows = dm_numel(t), ignore = (int64_t)a->v[0], kept = 0;
  int red = (int)a->v[1];
  dm_tensor *each = h_new(DM_F64, t->ndim, t->shape);
  double total = 0;
  for (int64_t r = 0; r < rows; r++) {
    int64_t target = (int64_t)h_get(t, r);
    if (ignore != -1 && target == ignore) continue;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < v; j++) m = fmax(m, h_get(x, r * v + j));
    for (int64_t j = 0; j < v; j++) s += exp(h_get(x, r * v + j) - m);
    double l = m + log(s) - h_get(x, r * v + target);
    h_set(each, r, l);
    total += l;
    kept++;
  }
  if (red == DM_CE_NONE) { ex[0] = each; return; }
  dm_release(each);
  ex[0] = h_new(DM_F64, 0, NULL);
  h_set(ex[0], 0, red == DM_CE_MEAN ? total / (double)kept : total);
}

/* ---- causal_conv1d ------------------------------------------------------------------------ */

static const int64_t dilations[] = {1, 2, 3, 5};
static const int64_t kernels[] = {4, 4, 1, 4, 2, 4, 3, 4};
static const int64_t lengths[] = {1, 2, 3, 5, 7, 13, 17, 31};

/* x [B, T, C], w [C, K], with a cache [B, (K-1) dil, C] or none */
static void conv_inputs_k(h_rng *r, int k, dm_tensor **in, dm_attrs *a, bool cache, int64_t min_t, int64_t kforce) {
  int64_t b = h_int(r, 1, 3), t = lengths[h_next(r) % 8], c = h_size(r) % 9 + 1;
  if (k % 3 == 0) c = 8 * (c % 5 + 1);   /* a multiple of 8 channels: CUDA's channel-vector kernels, every dtype */
  int64_t kk = kforce ? kforce : kernels[k % 8], dil = dilations[k % 4];
  if (t < min_t) t = min_t;
  int64_t xs[3] = {b, t, c}, ws[2] = {c, kk}, cs[3] = {b, (kk - 1) * dil, c};
  in[0] = normal(r, 3, xs, 1);
  in[1] = normal(r, 2, ws, 0.5);
  if (cache) in[2] = normal(r, 3, cs, 1);
  double v = (double)dil;
  *a = dm_attrs_of(1, &v);
}

static void conv_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a, bool cache, int64_t min_t) {
  conv_inputs_k(r, k, in, a, cache, min_t, 0);
}

static void in_conv(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { conv_inputs(r, k, in, a, false, 1); }
static void in_conv_cache(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { conv_inputs(r, k, in, a, true, 1); }
static void in_conv_split(h_rng *r, int k, dm_tensor **in, dm_attrs *a) { conv_inputs(r, k, in, a, k & 1, 2); }
/* silu of the convolution, with a cache in every other trial; every fourth with K = 9,
** past what CUDA's fused run kernels take (they fall back to composing) */
static void in_conv_silu(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  conv_inputs_k(r, k, in, a, k & 1, 1, k % 4 == 3 ? 9 : 0);
  double v[2] = {a->v[0], 1};
  *a = dm_attrs_of(2, v);
}

/* xin[b, pos, c] for pos in -P..T-1: the cache (or zeros) then x */
static double conv_in(const dm_tensor *x, const dm_tensor *cache, int64_t p, int64_t b, int64_t pos, int64_t c) {
  if (pos >= 0) return h_at(x, (int64_t[]){b, pos, c});
  return cache ? h_at(cache, (int64_t[]){b, p + pos, c}) : 0;
}

static void o_conv(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *x = in[0], *w = in[1], *cache = in[2];
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], dil = (int64_t)a->v[0];
  int64_t P = (K - 1) * dil, cs[3] = {B, P, C};
  ex[0] = h_new(DM_F64, 3, x->shape);
  ex[1] = h_new(DM_F64, 3, cs);
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = 0; c < C; c++) {
      for (int64_t t = 0; t < T; t++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++) s += h_at(w, (int64_t[]){c, k}) * conv_in(x, cache, P, b, t - (K - 1 - k) * dil, c);
        if (a->nv > 1 && a->v[1] == 1) s = s / (1 + exp(-s));      /* silu */
        h_set_at(ex[0], (int64_t[]){b, t, c}, s);
      }
      for (int64_t j = 0; j < P; j++) h_set_at(ex[1], (int64_t[]){b, j, c}, conv_in(x, cache, P, b, T - P + j, c));
    }
}

/* the expected outputs are the op's own, run on [0, T/2) and then on [T/2, T)
** with the cache carried: the same sums in the same order, so equal to the
** whole in f64 to the last bit */
static void o_conv_split(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  dm_tensor *x = in[0], *w = in[1], *cache = in[2];
  int64_t T = x->shape[1], t1 = T / 2, dil = (int64_t)a->v[0];
  dm_tensor *x1 = dm_narrow(x, 1, 0, t1), *x2 = dm_narrow(x, 1, t1, T - t1), *c1, *c2;
  dm_tensor *y1 = dm_causal_conv1d(x1, w, cache, dil, &c1);
  dm_tensor *y2 = dm_causal_conv1d(x2, w, c1, dil, &c2);
  ex[0] = h_new(DM_F64, 3, x->shape);
  int64_t idx[3];
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) {
    h_unravel(ex[0], i, idx);
    bool first = idx[1] < t1;
    if (!first) idx[1] -= t1;
    h_set(ex[0], i, h_at(first ? y1 : y2, idx));
  }
  ex[1] = c2;
  dm_release(x1); dm_release(x2); dm_release(y1); dm_release(y2); dm_release(c1);
}

/* ---- silu_mul ------------------------------------------------------------------------------ */

static void in_silu_mul(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, 0, 3);
  for (int d = 0; d < nd; d++) shape[d] = h_size(r);
  in[0] = normal(r, nd, shape, 3);
  in[1] = normal(r, nd, shape, 1);
}

static void o_silu_mul(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  ex[0] = h_new(DM_F64, in[0]->ndim, in[0]->shape);
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) {
    double x = h_get(in[0], i);
    h_set(ex[0], i, x / (1 + exp(-x)) * h_get(in[1], i));
  }
}

static const dm_case cases[] = {
  {"rmsnorm", "gain, odd rows", in_rms_gain, o_rms, .trials = 12, .perf_trial = PERF + 1},
  {"rmsnorm", "no gain", in_rms_plain, o_rms, .trials = 8},
  {"l2norm", "odd rows", in_rms_plain, o_l2, .trials = 12},
  {"cross_entropy", "V 1..257, ignored rows", in_ce, o_ce, .trials = 24, .perf_trial = PERF + 1},
  {"causal_conv1d", "zeros for the past", in_conv, o_conv, .trials = 16},
  {"causal_conv1d", "a cache", in_conv_cache, o_conv, .trials = 16},
  {"causal_conv1d", "split = whole", in_conv_split, o_conv_split, .trials = 16},
  {"causal_conv1d", "silu of the conv", in_conv_silu, o_conv, .trials = 16},
  {"silu_mul", "any shape", in_silu_mul, o_silu_mul, .trials = 8},
};
DM_REGISTER_CASES(cases)
