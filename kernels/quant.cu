/*
** quant.cu — the low-bit formats on CUDA (vm/quant.h has the contract and
** the rounding, shared with the CPU and the oracle): one thread a block of
** elements, its statistics then its values, in double as on the CPU.
*/
#include "common.cuh"
extern "C" {
#include "quant.h"
}

template <int DT> using S_ = typename dt<DT>::S;

template <int DT>
__global__ void quantize_k(S_<DT> *y, const S_<DT> *x, int64_t n, int64_t block, int64_t blocks_per_row,
                           int64_t n_blocks, int format) {
  DM_GRID_LOOP(j, n_blocks) {
    int64_t row = j / blocks_per_row, b = (j % blocks_per_row) * block;
    int64_t len = n - b < block ? n - b : block, at = row * n + b;
    double amax = 0, sum = 0;
    bool nan = false;
    for (int64_t i = 0; i < len; i++) {
      double a = fabs((double)dt<DT>::load(x[at + i]));
      nan |= a != a;
      amax = a > amax ? a : amax;
      sum += a;
    }
    double s = dm_quant_scale(format, amax, sum / (double)len);
    for (int64_t i = 0; i < len; i++) {
      double v = nan ? (double)NAN : s > 0 ? dm_quant_value(format, (double)dt<DT>::load(x[at + i]), s) : 0.0;
      y[at + i] = dt<DT>::store(v);
    }
  }
}

static void cuda_quantize(dm_tensor *y, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], per_row = (n + block - 1) / block, n_blocks = total / n * per_row;
  dm_dispatch_float(x->dtype, "quantize", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(quantize_k<DT>, n_blocks, (S_<DT> *)dm_data(y), (const S_<DT> *)dm_data(x), n, block, per_row,
              n_blocks, format);
  });
}

static const dm_kernel_entry kernels[] = {
  {"quantize", (dm_kernel_fn)cuda_quantize},
};
DM_CUDA_KERNELS(kernels)
