/*
** cpu/quant.c — the CPU kernel of the low-bit formats (vm/quant.h), in double.
*/
#include "../quant.h"
#include "vec.h"

/* one block of n elements, es bytes apart: its statistics, then each element */
static void quantize_block(dm_dtype dt, size_t es, char *y, const char *x, int64_t n, int format) {
  double amax = 0, sum = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; i++) {
    double a = fabs(ld(dt, x + i * es));
    nan |= a != a;
    if (a > amax) amax = a;
    sum += a;
  }
  double s = dm_quant_scale(format, amax, sum / (double)n);
  for (int64_t i = 0; i < n; i++) {
    double v = nan ? NAN : s > 0 ? dm_quant_value(format, ld(dt, x + i * es), s) : 0.0;
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

static const dm_kernel_entry kernels[] = {
  {"quantize", (dm_kernel_fn)cpu_quantize},
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
