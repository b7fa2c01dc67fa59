/*
** cases_quant.c — quantize against an oracle that knows each format only by
** its codes: every E4M3 and E2M1 bit pattern decoded, the nearest value
** taken (a tie to the code with an even last bit), so the kernels' rounding
** (vm/ops/quant.h) is checked, not repeated. Ternary rounds half to even by floor;
** binary takes the nearer of +1 and -1 (at 0, a tie, the even code: +1).
** Inputs are awkward: odd rows shorter and longer than a block, blocks of 1,
** 3, 7, 16, 32 and the format's own (0), a block of zeros, values whose
** blocks saturate the nvfp4 scale's rounding.
*/
#include <math.h>
#include "harness.h"
#include "ops/quant.h"
#include "ops/moe.h"

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

/* the code of the nearest value (as nearest() picks it); a zero of either sign is code 0 */
static int nearest_code(double (*value)(int), int n, double v) {
  double r = nearest(value, n, v);
  for (int c = 0; c < n; c++) if (value(c) == r) return c;
  return 0;
}

/* binary's codes: the sign bit */
static double binary_value(int code) { return code ? -1 : 1; }

/* an element's code: E4M3, E2M1, binary's sign bit, or ternary's 0 / 1 (+1) / 2 (-1) */
static int code_of(int format, double u) {
  if (format == DM_QUANT_FP8_E4M3) return nearest_code(e4m3_value, 256, u);
  if (format == DM_QUANT_NVFP4) return nearest_code(e2m1_value, 16, u);
  if (format == DM_QUANT_BINARY) return nearest_code(binary_value, 2, u);
  double q = fmax(-1, fmin(1, half_even(u)));
  return q > 0 ? 1 : q < 0 ? 2 : 0;
}

static double value_of(int format, int code) {
  if (format == DM_QUANT_FP8_E4M3) return e4m3_value(code);
  if (format == DM_QUANT_NVFP4) return e2m1_value(code);
  if (format == DM_QUANT_BINARY) return binary_value(code);
  return code == 1 ? 1 : code == 2 ? -1 : 0;
}

/* a block's scale, as the files keep it: a float32, or an E4M3 value for nvfp4 */
static double block_scale(int format, double amax, double absmean) {
  if (format == DM_QUANT_FP8_E4M3) return (float)(amax / 448);
  if (format == DM_QUANT_NVFP4) return nearest(e4m3_value, 256, amax / 6);
  return (float)absmean;
}

static int64_t block_of(int format, const dm_attrs *a) {
  return a->v[1] > 0 ? (int64_t)a->v[1] : (format == DM_QUANT_NVFP4 ? 16 : 32);
}

static int per_byte(int format) {
  return format == DM_QUANT_FP8_E4M3 ? 1 : format == DM_QUANT_NVFP4 ? 2 : format == DM_QUANT_TERNARY ? 4 : 8;
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
      double s = block_scale(format, amax, sum / (double)len);
      for (int64_t i = 0; i < len; i++) {
        double u = s > 0 ? h_get(x, at + i) / s : 0;
        h_set(ex[0], at + i, s > 0 ? value_of(format, code_of(format, u)) * s : 0);
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

/* codes and scales of each block, packed as quant.h lays them out */
static void o_encode(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  dm_tensor *x = in[0];
  int format = (int)a->v[0], per = per_byte(format), bits = 8 / per;
  int64_t block = block_of(format, a), n = x->shape[x->ndim - 1], rows = dm_numel(x) / n;
  int64_t row_bytes = (n + per - 1) / per, bpr = (n + block - 1) / block;
  int64_t shape[DM_MAXDIM];
  for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
  shape[x->ndim - 1] = row_bytes;
  ex[0] = h_new(DM_F64, x->ndim, shape);
  shape[x->ndim - 1] = bpr;
  ex[1] = h_new(DM_F64, x->ndim, shape);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t b = 0; b < n; b += block) {
      int64_t at = r * n + b, len = n - b < block ? n - b : block;
      double amax = 0, sum = 0;
      for (int64_t i = 0; i < len; i++) { amax = fmax(amax, fabs(h_get(x, at + i))); sum += fabs(h_get(x, at + i)); }
      double s = block_scale(format, amax, sum / (double)len);
      h_set(ex[1], r * bpr + b / block, format == DM_QUANT_NVFP4 ? nearest_code(e4m3_value, 256, s) : s);
      for (int64_t i = 0; i < len; i++) {
        int64_t j = b + i, byte = r * row_bytes + j / per;
        int code = s > 0 ? code_of(format, h_get(x, at + i) / s) : 0;
        h_set(ex[0], byte, h_get(ex[0], byte) + (double)(code << (bits * (j % per))));
      }
    }
  }
}

static void in_decode(h_rng *r, int trial, dm_tensor **in, dm_attrs *a) {
  static const int64_t rows[] = {1, 3, 5, 17, 33, 64};
  static const int64_t blocks[] = {0, 1, 3, 16, 32};
  int format = trial % DM_QUANT_NFORMATS, per = per_byte(format);
  int64_t block = blocks[h_next(r) % 5], n = rows[h_next(r) % 6];
  int64_t eff = block > 0 ? block : (format == DM_QUANT_NVFP4 ? 16 : 32);
  int64_t lead = h_int(r, 1, 4), cshape[2] = {lead, (n + per - 1) / per}, sshape[2] = {lead, (n + eff - 1) / eff};
  dm_tensor *codes = h_new(DM_F64, 2, cshape), *scales = h_new(DM_F64, 2, sshape);
  for (int64_t i = 0; i < dm_numel(codes); i++) {                  /* valid codes, never E4M3's NaN */
    int64_t c = h_int(r, 0, 255);
    if (format == DM_QUANT_FP8_E4M3 && (c & 0x7F) == 0x7F) c = 0x7E;
    if (format == DM_QUANT_TERNARY) {                              /* four codes of 0, 1, 2: never 3 */
      c = 0;
      for (int e = 0; e < 4; e++) c |= h_int(r, 0, 2) << (2 * e);
    }
    h_set(codes, i, (double)c);
  }
  for (int64_t i = 0; i < dm_numel(scales); i++)
    h_set(scales, i, format == DM_QUANT_NVFP4 ? (double)h_int(r, 1, 0x7E) : ldexp(1 + h_int(r, 0, 255) / 256.0, (int)h_int(r, -20, 4)));
  in[0] = dm_cast(codes, DM_U8);
  in[1] = format == DM_QUANT_NVFP4 ? dm_cast(scales, DM_U8) : scales;
  if (format == DM_QUANT_NVFP4) dm_release(scales);
  dm_release(codes);
  a->nv = 3;
  a->v[0] = format;
  a->v[1] = (double)block;
  a->v[2] = (double)n;
}

static void o_decode(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  int format = (int)a->v[0], per = per_byte(format), bits = 8 / per;
  int64_t block = block_of(format, a), n = (int64_t)a->v[2], rows = in[0]->shape[0];
  int64_t row_bytes = in[0]->shape[1], bpr = in[1]->shape[1], shape[2] = {rows, n};
  ex[0] = h_new(DM_F64, 2, shape);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < n; j++) {
      double sv = h_get(in[1], r * bpr + j / block);
      double s = format == DM_QUANT_NVFP4 ? e4m3_value((int)sv) : sv;
      int code = ((int)h_get(in[0], r * row_bytes + j / per) >> (bits * (j % per))) & ((1 << bits) - 1);
      h_set(ex[0], r * n + j, value_of(format, code) * s);
    }
}

/* LittleBit's factor: row * sign(x) * col, x [E, m, n], row [E, m, 1], col [E, 1, n] */
static void in_littlebit(h_rng *r, int trial, dm_tensor **in, dm_attrs *a) {
  int64_t E = h_int(r, 1, 3), m = h_size(r), n = h_size(r);
  in[0] = h_randn(r, 3, (int64_t[]){E, m, n});
  in[1] = h_randn(r, 3, (int64_t[]){E, m, 1});
  in[2] = h_randn(r, 3, (int64_t[]){E, 1, n});
  if (trial % 2 == 0) h_set(in[0], 0, 0);         /* sign(0) = 0 */
  a->nv = 0;
}

static void o_littlebit(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  (void)a;
  const dm_tensor *x = in[0];
  int64_t E = x->shape[0], m = x->shape[1], n = x->shape[2];
  ex[0] = h_new(DM_F64, 3, x->shape);
  for (int64_t e = 0; e < E; e++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double v = h_get(x, (e * m + i) * n + j);
        double s = v > 0 ? 1 : v < 0 ? -1 : 0;
        h_set(ex[0], (e * m + i) * n + j, h_get(in[1], e * m + i) * s * h_get(in[2], e * n + j));
      }
}

/* ---- bank_fp8: the fp8 banks' codes (ops/moe.h) ---------------------------------------------- */

/* banks [E, m, n] with rows shorter and longer than a block of 32, not multiples of it, b1's D row
** (5461), values of any bits (rounded to bf16 by the op first), some rows of zeros */
static void in_bank(h_rng *r, int trial, dm_tensor **in, dm_attrs *a) {
  static const int64_t cols[] = {1, 16, 31, 32, 33, 64, 100, 5461};
  int64_t shape[3] = {h_int(r, 1, 3), h_int(r, 1, 4), cols[trial % 8]};
  in[0] = h_randn(r, 3, shape);
  double scale = ldexp(1, (int)h_int(r, -12, 4));
  for (int64_t i = 0; i < dm_numel(in[0]); i++) h_set(in[0], i, h_get(in[0], i) * scale);
  if (trial % 3 == 0)
    for (int64_t i = 0; i < shape[2]; i++) h_set(in[0], i, 0);
  *a = dm_attrs_of(1, (double[]){(double)DM_BF16});
}

static double as_bf16(double v) {
  uint16_t b;
  dm_store(DM_BF16, &b, v);
  return dm_load(DM_BF16, &b);
}

/* each block's scale amax / 448 of the bf16 values, each code the nearest E4M3 code of value / scale,
** the padding to a multiple of 32 codes zeros */
static void o_bank(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  (void)a;
  dm_tensor *x = in[0];
  int64_t n = x->shape[2], rows = dm_numel(x) / n, nq = (n + 31) / 32 * 32, nb = nq / 32;
  int64_t sq[3] = {x->shape[0], x->shape[1], nq}, ss[3] = {x->shape[0], x->shape[1], nb};
  ex[0] = h_new(DM_F64, 3, sq);
  ex[1] = h_new(DM_F64, 3, ss);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < nb; b++) {
      double amax = 0;
      for (int64_t j = 32 * b; j < n && j < 32 * b + 32; j++) amax = fmax(amax, fabs(as_bf16(h_get(x, r * n + j))));
      double s = (float)(amax / 448);
      h_set(ex[1], r * nb + b, s);
      for (int64_t j = 32 * b; j < n && j < 32 * b + 32; j++)
        h_set(ex[0], r * nq + j, s > 0 ? code_of(DM_QUANT_FP8_E4M3, as_bf16(h_get(x, r * n + j)) / s) : 0);
    }
}

static const dm_case cases[] = {
  {"quantize", "fp8_e4m3, nvfp4, ternary, binary; odd rows and blocks", in_quantize, o_quantize, .trials = 36,
   .f32_tol = 1e-6, .no_grad = true},
  {"quant_encode", "codes and scales; odd rows and blocks", in_quantize, o_encode, .trials = 36, .no_grad = true},
  {"quant_decode", "valid codes, any scales", in_decode, o_decode, .trials = 24, .no_grad = true},
  /* the sign's gradient is passed straight through, which finite differences cannot see:
  ** the backward is checked against the composition (tests/lua/littlebit_spec.lua) */
  {"littlebit", "awkward E, m, n; a zero", in_littlebit, o_littlebit, .trials = 12, .no_grad = true},
  {"bank_fp8", "rows of 1 to 5461, padded to 32; rows of zeros", in_bank, o_bank, .trials = 16, .no_grad = true},
};
DM_REGISTER_CASES(cases)
