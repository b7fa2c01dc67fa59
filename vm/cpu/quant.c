/*
** cpu/quant.c — the CPU kernels of the low-bit formats and of LittleBit's
** binary factors (vm/ops/quant.h), in double.
*/
#include <string.h>
#include "ops/quant.h"
#include "ops/moe.h"
#include "vec.h"

/* a block's scale: amax and mean |x| of its n elements (NaN when one is NaN) */
static double block_scale(dm_dtype dt, size_t es, const char *x, int64_t n, int format) {
  double amax = 0, sum = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; i++) {
    double a = fabs(ld(dt, x + i * es));
    nan |= a != a;
    if (a > amax) amax = a;
    sum += a;
  }
  return nan ? NAN : dm_quant_scale(format, amax, sum / (double)n);
}

/* one block of n elements, es bytes apart: its scale, then each element */
static void quantize_block(dm_dtype dt, size_t es, char *y, const char *x, int64_t n, int format) {
  double s = block_scale(dt, es, x, n, format);
  for (int64_t i = 0; i < n; i++) {
    double v = s != s ? NAN : s > 0 ? dm_quant_value(format, ld(dt, x + i * es), s) : 0.0;
    st(dt, y + i * es, v);
  }
}

static void cpu_quantize(dm_tensor *y, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], rows = total / n;
  size_t es = dm_dtype_size(x->dtype);
  const char *xp = dm_data(x);
  char *yp = dm_data(y);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < n; b += block) {
      int64_t at = (r * n + b) * (int64_t)es, len = n - b < block ? n - b : block;
      quantize_block(x->dtype, es, yp + at, xp + at, len, format);
    }
}

static void cpu_quant_encode(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], rows = total / n;
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  int64_t row_bytes = codes->shape[codes->ndim - 1], bpr = scales->shape[scales->ndim - 1];
  size_t es = dm_dtype_size(x->dtype);
  const char *xp = dm_data(x);
  uint8_t *cp = dm_data(codes);
  for (int64_t r = 0; r < rows; r++) {
    uint8_t *crow = cp + r * row_bytes;
    memset(crow, 0, (size_t)row_bytes);
    for (int64_t b = 0, k = 0; b < n; b += block, k++) {
      const char *xb = xp + (r * n + b) * (int64_t)es;
      int64_t len = n - b < block ? n - b : block;
      double s = block_scale(x->dtype, es, xb, len, format);
      if (format == DM_QUANT_NVFP4) ((uint8_t *)dm_data(scales))[r * bpr + k] = (uint8_t)(s != s ? 0x7F : dm_e4m3_code(s));
      else ((float *)dm_data(scales))[r * bpr + k] = (float)s;
      for (int64_t i = 0; i < len; i++) {
        int64_t j = b + i;
        unsigned code = s != s ? 0 : dm_quant_code(format, ld(x->dtype, xb + i * es), s);
        crow[j / per] |= (uint8_t)(code << (bits * (j % per)));
      }
    }
  }
}

static void cpu_quant_decode(dm_tensor *y, const dm_tensor *codes, const dm_tensor *scales, int format, int64_t block) {
  int64_t total = dm_numel(y);
  if (total == 0) return;
  int64_t n = y->shape[y->ndim - 1], rows = total / n;
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  int64_t row_bytes = codes->shape[codes->ndim - 1], bpr = scales->shape[scales->ndim - 1];
  unsigned mask = (1u << bits) - 1;
  const uint8_t *cp = dm_data(codes);
  float *yp = dm_data(y);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < n; j++) {
      int64_t k = r * bpr + j / block;
      double s = format == DM_QUANT_NVFP4 ? dm_e4m3_value(((const uint8_t *)dm_data(scales))[k])
                                          : ((const float *)dm_data(scales))[k];
      unsigned code = (cp[r * row_bytes + j / per] >> (bits * (j % per))) & mask;
      yp[r * n + j] = (float)dm_quant_code_value(format, code, s);
    }
}

/* an fp8 bank (ops/moe.h): each row's blocks of 32 of x's values as round_to holds them, the
** padding codes zeros */
static void cpu_bank_fp8(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, dm_dtype round_to) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], rows = total / n, nq = dm_bank_fp8_cols(n), nb = dm_bank_fp8_blocks(n);
  size_t es = dm_dtype_size(x->dtype);
  const char *xp = dm_data(x);
  uint8_t *cp = dm_data(codes);
  float *sp = dm_data(scales);
  double v[DM_BANK_FP8_BLOCK];
  unsigned char held[8];
  memset(cp, 0, (size_t)(rows * nq));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < nb; b++) {
      int64_t at = b * DM_BANK_FP8_BLOCK, len = n - at < DM_BANK_FP8_BLOCK ? n - at : DM_BANK_FP8_BLOCK;
      double amax = 0;
      bool nan = false;
      for (int64_t i = 0; i < len; i++) {
        dm_store(round_to, held, ld(x->dtype, xp + (r * n + at + i) * (int64_t)es));
        v[i] = dm_load(round_to, held);
        nan |= v[i] != v[i];
        if (fabs(v[i]) > amax) amax = fabs(v[i]);
      }
      double s = nan ? NAN : dm_quant_scale(DM_QUANT_FP8_E4M3, amax, 0);
      sp[r * nb + b] = (float)s;
      for (int64_t i = 0; i < len && s == s; i++)
        cp[r * nq + at + i] = (uint8_t)dm_quant_code(DM_QUANT_FP8_E4M3, v[i], s);
    }
}

static void cpu_littlebit(dm_tensor *w, const dm_tensor *x, const dm_tensor *row, const dm_tensor *col) {
  int64_t E = x->shape[0], m = x->shape[1], n = x->shape[2];
  size_t es = dm_dtype_size(x->dtype);
  const char *xp = dm_data(x), *rp = dm_data(row), *cp = dm_data(col);
  char *wp = dm_data(w);
  for (int64_t e = 0; e < E; e++)
    for (int64_t i = 0; i < m; i++) {
      double r = ld(x->dtype, rp + (e * m + i) * (int64_t)es);
      for (int64_t j = 0; j < n; j++) {
        int64_t at = ((e * m + i) * n + j) * (int64_t)es;
        st(x->dtype, wp + at, r * dm_sign(ld(x->dtype, xp + at)) * ld(x->dtype, cp + (e * n + j) * (int64_t)es));
      }
    }
}

static void cpu_littlebit_bwd(dm_tensor *gx, dm_tensor *grow, dm_tensor *gcol, const dm_tensor *g, const dm_tensor *x,
                              const dm_tensor *row, const dm_tensor *col) {
  int64_t E = x->shape[0], m = x->shape[1], n = x->shape[2];
  dm_dtype dt = x->dtype;
  size_t es = dm_dtype_size(dt);
  const char *gp = dm_data(g), *xp = dm_data(x), *rp = dm_data(row), *cp = dm_data(col);
  for (int64_t e = 0; e < E; e++) {
    for (int64_t j = 0; gcol && j < n; j++) {                 /* the column sums, over the rows */
      double sum = 0;
      for (int64_t i = 0; i < m; i++) {
        int64_t at = ((e * m + i) * n + j) * (int64_t)es;
        sum += ld(dt, gp + at) * dm_sign(ld(dt, xp + at)) * ld(dt, rp + (e * m + i) * (int64_t)es);
      }
      st(dt, (char *)dm_data(gcol) + (e * n + j) * (int64_t)es, sum);
    }
    for (int64_t i = 0; i < m; i++) {
      double r = ld(dt, rp + (e * m + i) * (int64_t)es), sum = 0;
      for (int64_t j = 0; j < n; j++) {
        int64_t at = ((e * m + i) * n + j) * (int64_t)es;
        double gv = ld(dt, gp + at), cv = ld(dt, cp + (e * n + j) * (int64_t)es);
        if (gx) st(dt, (char *)dm_data(gx) + at, gv * r * cv);
        sum += gv * dm_sign(ld(dt, xp + at)) * cv;
      }
      if (grow) st(dt, (char *)dm_data(grow) + (e * m + i) * (int64_t)es, sum);
    }
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(bank_fp8, cpu_bank_fp8),
  DM_KERNEL_ENTRY(littlebit, cpu_littlebit),
  DM_KERNEL_ENTRY(littlebit_bwd, cpu_littlebit_bwd),
  DM_KERNEL_ENTRY(quantize, cpu_quantize),
  DM_KERNEL_ENTRY(quant_encode, cpu_quant_encode),
  DM_KERNEL_ENTRY(quant_decode, cpu_quant_decode),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
