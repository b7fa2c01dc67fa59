/*
** quant.h — low-bit number formats for the expert banks: the rounding each
** format applies, shared by the op family (vm/ops_quant.c), every backend's
** kernels (vm/cpu/quant.c, kernels/quant.cu) and the oracle of the op suite,
** so that all of them round alike.
**
** "quantize" maps x, viewed as rows (the last dim) cut into blocks of `block`
** elements (a row's last block may be shorter), to the values the format can
** hold, block by block, and returns them dequantised (x's dtype and shape):
**
**   fp8_e4m3  s = amax / 448, q = e4m3(x / s) s            (OCP E4M3FN: saturating, no infinity)
**   nvfp4     s = e4m3(amax / 6), q = e2m1(x / s) s        (values 0, .5, 1, 1.5, 2, 3, 4, 6; an
**             e4m3 scale per block of 16, without NVFP4's second, per-tensor f32 scale: banks'
**             block maxima sit well inside e4m3's range)
**   ternary   s = mean(|x|), q = clamp(round(x / s), -1, 1) s                 (absmean, BitNet b1.58)
**
** Rounding is to nearest, ties to even, in double; a block of zeros stays
** zeros, and a NaN in a block makes the whole block NaN (loud, not hidden).
*/
#ifndef DM_QUANT_H
#define DM_QUANT_H

#include <math.h>
#include "ops.h"

#ifdef __CUDACC__
#define DM_QUANT_FN static inline __host__ __device__
#else
#define DM_QUANT_FN static inline
#endif

/* the formats, in the order of the op's attribute spellings (DM_QUANT_SPELLINGS) */
enum { DM_QUANT_FP8_E4M3, DM_QUANT_NVFP4, DM_QUANT_TERNARY, DM_QUANT_NFORMATS };
#define DM_QUANT_SPELLINGS "fp8_e4m3|nvfp4|ternary"

/* elements per scale block when the call gives 0: MX-style 32 for fp8, NVFP4's 16, 32 for ternary */
DM_QUANT_FN int dm_quant_default_block(int format) { return format == DM_QUANT_NVFP4 ? 16 : 32; }

/* the largest magnitude each element format holds */
#define DM_E4M3_MAX 448.0
#define DM_E2M1_MAX 6.0

/* v rounded to the nearest E4M3 value (3 mantissa bits; subnormals step 2^-9; |v| > 448 saturates) */
DM_QUANT_FN double dm_round_e4m3(double v) {
  double a = fabs(v);
  if (!(a > 0)) return v;                          /* zero, or NaN passed on */
  if (a > DM_E4M3_MAX) a = DM_E4M3_MAX;
  int e;
  frexp(a, &e);                                    /* a = m 2^e, m in [0.5, 1): leading bit 2^(e-1) */
  int lead = e - 1 < -6 ? -6 : e - 1;              /* below 2^-6 the subnormals share one step */
  double step = ldexp(1.0, lead - 3);
  return copysign(rint(a / step) * step, v);
}

/* v rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; beyond 6 saturates) */
DM_QUANT_FN double dm_round_e2m1(double v) {
  double a = fabs(v);
  if (!(a > 0)) return v;
  if (a > DM_E2M1_MAX) a = DM_E2M1_MAX;
  double step = a < 2 ? 0.5 : a < 4 ? 1.0 : 2.0;
  return copysign(rint(a / step) * step, v);
}

/* A block's scale from its amax and mean |x| (0: the block is zeros) */
DM_QUANT_FN double dm_quant_scale(int format, double amax, double absmean) {
  switch (format) {
  case DM_QUANT_FP8_E4M3: return amax / DM_E4M3_MAX;
  case DM_QUANT_NVFP4: return dm_round_e4m3(amax / DM_E2M1_MAX);
  default: return absmean;
  }
}

/* One element of a block, given the block's scale (s > 0) */
DM_QUANT_FN double dm_quant_value(int format, double x, double s) {
  double u = x / s;
  switch (format) {
  case DM_QUANT_FP8_E4M3: return dm_round_e4m3(u) * s;
  case DM_QUANT_NVFP4: return dm_round_e2m1(u) * s;
  default: { double r = rint(u); return (r > 1 ? 1 : r < -1 ? -1 : r) * s; }
  }
}

/* "quantize": y = the blocks of x through the format, dequantised; x and y contiguous, of one
** shape and dtype; rows of n elements (the last dim), blocks of `block` (>= 1) within a row */
typedef void (*dm_quantize_k)(dm_tensor *y, const dm_tensor *x, int format, int64_t block);

dm_tensor *dm_quantize(dm_tensor *x, int format, int64_t block);

#endif
