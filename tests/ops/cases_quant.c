/*
** cases_quant.c — quantize against an oracle that knows each format only by
** its codes: every E4M3 and E2M1 bit pattern decoded, the nearest value
** taken (a tie to the code with an even last bit), so the kernels' rounding
** (vm/quant.h) is checked, not repeated. Ternary rounds half to even by floor.
** Inputs are awkward: odd rows shorter and longer than a block, blocks of 1,
** 3, 7, 16, 32 and the format's own (0), a block of zeros, values whose
** blocks saturate the nvfp4 scale's rounding.
*/
#include <math.h>
#include "harness.h"
#include "quant.h"

/* the value of an E4M3FN code (NaN for S.1111.111) */
static double e4m3_value(int code) {
  int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  double v = e == 0 ? m / 8.0 * ldexp(1, -6) : (1 + m / 8.0) * ldexp(1, e - 7);
  return s ? -v : v;
}

/* the value of an E2M1 code */
static double e2m1_value(int code) {
  int s = code >> 3, e = (code >> 1) & 3, m = code & 1;
  double v = e == 0 ? m * 0.5 : (1 + m / 2.0) * ldexp(1, e - 1);
  return s ? -v : v;
}

/* the nearest of the n codes' values to v; a tie goes to the even code */
static double nearest(double (*value)(int), int n, double v) {
  int best = -1;
  double dist = INFINITY;
  for (int c = 0; c < n; c++) {
    double x = value(c);
    if (isnan(x)) continue;
    double d = fabs(x - v);
    if (d < dist || (d == dist && (c & 1) == 0 && (best & 1) == 1)) { dist = d; best = c; }
  }
  double r = value(best);
  return r == 0 ? copysign(0.0, v) : r;
}

static double half_even(double u) {
  double f = floor(u + 0.5);
  if (f - u == 0.5 && fmod(f, 2) != 0) f -= 1;     /* exactly halfway: the even neighbour */
  return f;
}

static void o_quantize(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  dm_tensor *x = in[0];
  int format = (int)a->v[0];
  int64_t block = a->v[1] > 0 ? (int64_t)a->v[1] : (format == DM_QUANT_NVFP4 ? 16 : 32);
  int64_t total = dm_numel(x), n = x->ndim ? x->shape[x->ndim - 1] : 1;
  ex[0] = h_new(DM_F64, x->ndim, x->shape);
  for (int64_t row = 0; row < total / n; row++)
    for (int64_t b = 0; b < n; b += block) {
      int64_t at = row * n + b, len = n - b < block ? n - b : block;
      double amax = 0, sum = 0;
      for (int64_t i = 0; i < len; i++) { amax = fmax(amax, fabs(h_get(x, at + i))); sum += fabs(h_get(x, at + i)); }
      double s = format == DM_QUANT_FP8_E4M3 ? amax / 448
               : format == DM_QUANT_NVFP4 ? nearest(e4m3_value, 256, amax / 6) : sum / (double)len;
      for (int64_t i = 0; i < len; i++) {
        double u = s > 0 ? h_get(x, at + i) / s : 0, q;
        if (format == DM_QUANT_FP8_E4M3) q = nearest(e4m3_value, 256, u);
        else if (format == DM_QUANT_NVFP4) q = nearest(e2m1_value, 16, u);
        else q = fmax(-1, fmin(1, half_even(u)));
        h_set(ex[0], at + i, s > 0 ? q * s : 0);
      }
    }
}

static void in_quantize(h_rng *r, int trial, dm_tensor **in, dm_attrs *a) {
  static const int64_t rows[] = {1, 3, 5, 17, 31, 33, 64, 100};
  static const int64_t blocks[] = {0, 1, 3, 7, 16, 32};
  int64_t shape[3] = {h_int(r, 1, 4), h_int(r, 1, 3), rows[h_next(r) % 8]};
  int nd = (int)h_int(r, 1, 3);
  const int64_t *sh = shape + (3 - nd);
  in[0] = h_randn(r, nd, sh);
  double scale = ldexp(1, (int)h_int(r, -12, 6));    /* banks' magnitudes, and far from them */
  for (int64_t i = 0; i < dm_numel(in[0]); i++) {
    double v = round(h_get(in[0], i) * 256) / 256 * scale;   /* few bits: exact in bf16's products */
    h_set(in[0], i, v);
  }
  if (dm_numel(in[0]) > 4 && trial % 3 == 0)          /* a run of zeros: a block of them stays zeros */
    for (int64_t i = 0; i < 4; i++) h_set(in[0], i, 0);
  a->nv = 2;
  a->v[0] = trial % DM_QUANT_NFORMATS;
  a->v[1] = (double)blocks[h_next(r) % 6];
}

static const dm_case cases[] = {
  {"quantize", "fp8_e4m3, nvfp4, ternary; odd rows and blocks", in_quantize, o_quantize, .trials = 36,
   .f32_tol = 1e-6, .no_grad = true},
};
DM_REGISTER_CASES(cases)
