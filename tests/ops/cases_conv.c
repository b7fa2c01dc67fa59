/*
** cases_conv.c — causal_conv1d against plain loops in double.
**
** Values are multiples of 2^-10 (values.h). Shapes are awkward: T = 1,
** K = 1..4 with dilations 1, 2, 3, 5, channel counts for CUDA's vector
** kernels and not. causal_conv1d also runs split in two with the cache
** carried, against the whole sequence in one call.
*/
#include <math.h>
#include "harness.h"
#include "values.h"
#include "ops/conv.h"

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

static const dm_case cases[] = {
  {"causal_conv1d", "zeros for the past", in_conv, o_conv, .trials = 16},
  {"causal_conv1d", "a cache", in_conv_cache, o_conv, .trials = 16},
  {"causal_conv1d", "split = whole", in_conv_split, o_conv_split, .trials = 16},
  {"causal_conv1d", "silu of the conv", in_conv_silu, o_conv, .trials = 16},
};
DM_REGISTER_CASES(cases)
