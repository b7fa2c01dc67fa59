/*
** quant.h — low-bit number formats for the expert banks: the rounding each
** format applies, shared by the op family (vm/ops/quant.c), every backend's
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
**   binary    s = mean(|x|), q = s for x >= 0, -s for x < 0       (absmean signs, one bit; LittleBit's
**             banks are their latents' signs, which this keeps exactly)
**
** Rounding is to nearest, ties to even, in double; a block of zeros stays
** zeros, and a NaN in a block makes the whole block NaN (loud, not hidden).
*/
#ifndef DM_QUANT_H
#define DM_QUANT_H

#include <math.h>
#include "core/ops.h"

#include "core/hd.h"

/* the formats, in the order of the op's attribute spellings (DM_QUANT_SPELLINGS) */
enum { DM_QUANT_FP8_E4M3, DM_QUANT_NVFP4, DM_QUANT_TERNARY, DM_QUANT_BINARY, DM_QUANT_NFORMATS };
#define DM_QUANT_SPELLINGS "fp8_e4m3|nvfp4|ternary|binary"

/* elements per scale block when the call gives 0: MX-style 32 for fp8, NVFP4's 16, 32 for the others */
DM_HD int dm_quant_default_block(int format) { return format == DM_QUANT_NVFP4 ? 16 : 32; }

/* the largest magnitude each element format holds */
#define DM_E4M3_MAX 448.0
#define DM_E2M1_MAX 6.0

/* v rounded to the nearest E4M3 value (3 mantissa bits; subnormals step 2^-9; |v| > 448 saturates) */
DM_HD double dm_round_e4m3(double v) {
  double a = fabs(v);
  if (!(a > 0)) return v;                          /* zero, or NaN passed on */
  if (a > DM_E4M3_MAX) a = DM_E4M3_MAX;
  int e;
  frexp(a, &e);                                    /* a = m 2^e, m in [0.5, 1): leading bit 2^(e-1) */
  int lead = e - 1 < -6 ? -6 : e - 1;              /* below 2^-6 the subnormals share one step */
  /* a / step by its exact reciprocal, a power of two (a division costs a dozen operations on a GPU) */
  return copysign(rint(a * ldexp(1.0, 3 - lead)) * ldexp(1.0, lead - 3), v);
}

/* v rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; beyond 6 saturates) */
DM_HD double dm_round_e2m1(double v) {
  double a = fabs(v);
  if (!(a > 0)) return v;
  if (a > DM_E2M1_MAX) a = DM_E2M1_MAX;
  double step = a < 2 ? 0.5 : a < 4 ? 1.0 : 2.0;
  return copysign(rint(a * (1 / step)) * step, v);                 /* 1 / step: 2, 1 or 0.5, exact */
}

/* A block's scale from its amax and mean |x| (0: the block is zeros): a float32 for fp8_e4m3 and
** ternary, an E4M3 value for nvfp4, so that a file's scales give back exactly these values */
DM_HD double dm_quant_scale(int format, double amax, double absmean) {
  switch (format) {
  case DM_QUANT_FP8_E4M3: return (float)(amax / DM_E4M3_MAX);
  case DM_QUANT_NVFP4: return dm_round_e4m3(amax / DM_E2M1_MAX);
  default: return (float)absmean;
  }
}

/* One element of a block, given the block's scale (s > 0) */
DM_HD double dm_quant_value(int format, double x, double s) {
  double u = x / s;
  switch (format) {
  case DM_QUANT_FP8_E4M3: return dm_round_e4m3(u) * s;
  case DM_QUANT_NVFP4: return dm_round_e2m1(u) * s;
  case DM_QUANT_BINARY: return u < 0 ? -s : s;
  default: { double r = rint(u); return (r > 1 ? 1 : r < -1 ? -1 : r) * s; }
  }
}

/* ---- codes: the formats as bits (the files' form) ---------------------------------------------- */

/* the E4M3FN code of a value dm_round_e4m3 gave (sign, 4 exponent bits biased by 7, 3 mantissa bits) */
DM_HD unsigned dm_e4m3_code(double r) {
  unsigned sign = r < 0 ? 0x80u : 0u;
  double a = fabs(r);
  if (!(a > 0)) return sign;
  int e;
  frexp(a, &e);
  if (e - 1 < -6) return sign | (unsigned)rint(a * 512);            /* subnormal: m 2^-9 */
  return sign | (unsigned)(e - 1 + 7) << 3 | ((unsigned)rint(ldexp(a, -(e - 1)) * 8) - 8);
}

DM_HD double dm_e4m3_value(unsigned code) {
  unsigned e = (code >> 3) & 15, m = code & 7;
  double v = e == 0 ? ldexp((double)m, -9) : ldexp(8.0 + m, (int)e - 10);
  if (e == 15 && m == 7) v = NAN;
  return code & 0x80u ? -v : v;
}

/* the E2M1 code (sign, 2 exponent bits biased by 1, 1 mantissa bit) of a value dm_round_e2m1 gave */
DM_HD unsigned dm_e2m1_code(double r) {
  double a = fabs(r);
  unsigned mag = a < 0.25 ? 0 : a < 0.75 ? 1 : a < 1.25 ? 2 : a < 1.75 ? 3 : a < 2.5 ? 4 : a < 3.5 ? 5 : a < 5 ? 6 : 7;
  return (r < 0 ? 8u : 0u) | mag;
}

DM_HD double dm_e2m1_value(unsigned code) {
  const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return code & 8u ? -mags[code & 7] : mags[code & 7];
}

/* binary's 1-bit codes: 0 is +1, 1 is -1 (a sign bit) */
DM_HD unsigned dm_binary_code(double u) { return u < 0 ? 1u : 0u; }
DM_HD double dm_binary_value(unsigned code) { return code ? -1.0 : 1.0; }

/* ternary's 2-bit codes: 0 is 0, 1 is +1, 2 is -1 */
DM_HD unsigned dm_ternary_code(double q) { return q > 0 ? 1u : q < 0 ? 2u : 0u; }
DM_HD double dm_ternary_value(unsigned code) { return code == 1 ? 1.0 : code == 2 ? -1.0 : 0.0; }

/* elements per byte of a format's codes: 1 (E4M3), 2 (E2M1, the lower nibble first), 4 (ternary,
** the lowest two bits first), 8 (binary, the lowest bit first); a row of n elements takes
** ceil(n / per) bytes */
DM_HD int dm_quant_per_byte(int format) {
  return format == DM_QUANT_FP8_E4M3 ? 1 : format == DM_QUANT_NVFP4 ? 2 : format == DM_QUANT_TERNARY ? 4 : 8;
}
DM_HD int dm_quant_code_bits(int format) { return 8 / dm_quant_per_byte(format); }

/* the code of one element of a block (scale s > 0; 0 gives the zero code), and its value back */
DM_HD unsigned dm_quant_code(int format, double x, double s) {
  if (!(s > 0)) return 0;
  double u = x / s;
  switch (format) {
  case DM_QUANT_FP8_E4M3: return dm_e4m3_code(dm_round_e4m3(u));
  case DM_QUANT_NVFP4: return dm_e2m1_code(dm_round_e2m1(u));
  case DM_QUANT_BINARY: return dm_binary_code(u);
  default: { double r = rint(u); return dm_ternary_code(r > 1 ? 1 : r < -1 ? -1 : r); }
  }
}

DM_HD double dm_quant_code_value(int format, unsigned code, double s) {
  double v = format == DM_QUANT_FP8_E4M3 ? dm_e4m3_value(code) : format == DM_QUANT_NVFP4 ? dm_e2m1_value(code)
           : format == DM_QUANT_BINARY ? dm_binary_value(code) : dm_ternary_value(code);
  return v * s;
}

/* "quant_encode": x [..., n] (contiguous) to codes [..., ceil(n / per_byte)] u8 and scales
** [..., ceil(n / block)]: f32 (fp8_e4m3, ternary) or E4M3 codes in u8 (nvfp4). A block with a NaN
** gets scale NaN (f32) or the E4M3 NaN code. "quant_decode": the values back, y [..., n] f32. */
typedef void (*dm_quant_encode_k)(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, int format,
                                  int64_t block);
typedef void (*dm_quant_decode_k)(dm_tensor *y, const dm_tensor *codes, const dm_tensor *scales, int format,
                                  int64_t block);

/* "quantize": y = the blocks of x through the format, dequantised; x and y contiguous, of one
** shape and dtype; rows of n elements (the last dim), blocks of `block` (>= 1) within a row */
typedef void (*dm_quantize_k)(dm_tensor *y, const dm_tensor *x, int format, int64_t block);

/* "littlebit": w = row * sign(x) * col for LittleBit's binary factors (nn/moe.lua), x [E, m, n],
** row [E, m, 1], col [E, 1, n], all contiguous, of x's dtype; sign(0) = 0, sign(NaN) = NaN.
** "littlebit_bwd": given g = dL/dw, gx = g * row * col (the sign's gradient passed straight
** through), grow [E, m, 1] = sum over n of g * sign(x) * col, gcol [E, 1, n] = sum over m of
** g * sign(x) * row; an output not wanted is NULL. The sums run in f32 (double on the CPU). */
typedef void (*dm_littlebit_k)(dm_tensor *w, const dm_tensor *x, const dm_tensor *row, const dm_tensor *col);
typedef void (*dm_littlebit_bwd_k)(dm_tensor *gx, dm_tensor *grow, dm_tensor *gcol, const dm_tensor *g,
                                   const dm_tensor *x, const dm_tensor *row, const dm_tensor *col);

/* the sign LittleBit's factors use: -1, 0 or 1, NaN passed on */
DM_HD double dm_sign(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : x; }

dm_tensor *dm_quantize(dm_tensor *x, int format, int64_t block);
dm_tensor *dm_quant_encode(dm_tensor *x, int format, int64_t block, dm_tensor **scales);
dm_tensor *dm_quant_decode(dm_tensor *codes, dm_tensor *scales, int format, int64_t block, int64_t n);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(littlebit, dm_littlebit_k)
DM_KERNEL_TYPE(littlebit_bwd, dm_littlebit_bwd_k)
DM_KERNEL_TYPE(quant_decode, dm_quant_decode_k)
DM_KERNEL_TYPE(quant_encode, dm_quant_encode_k)
DM_KERNEL_TYPE(quantize, dm_quantize_k)

#endif
