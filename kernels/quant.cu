/*
** quant.cu — the low-bit formats on CUDA (vm/quant.h has the contract and
** the rounding, shared with the CPU and the oracle): quantize gives one
** thread a block of elements, its statistics then its values, in double as
** on the CPU; quant_encode finds the blocks' scales first, then writes each
** byte of codes; quant_decode reads one element a thread.
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

/* the codes: first each block's scale (one thread a block), then each byte of codes (one thread a
** byte, its elements' scales read back from the first pass: blocks need not align with bytes) */
template <int DT>
__global__ void encode_scales_k(float *sf32, uint8_t *s8, const S_<DT> *x, int64_t n, int64_t block,
                                int64_t blocks_per_row, int64_t n_blocks, int format) {
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
    double sc = nan ? (double)NAN : dm_quant_scale(format, amax, sum / (double)len);
    if (s8) s8[j] = (uint8_t)(sc != sc ? 0x7F : dm_e4m3_code(sc));
    else sf32[j] = (float)sc;
  }
}

__device__ __forceinline__ double scale_at(const float *sf32, const uint8_t *s8, int64_t k) {
  return s8 ? dm_e4m3_value(s8[k]) : (double)sf32[k];
}

template <int DT>
__global__ void encode_codes_k(uint8_t *codes, const float *sf32, const uint8_t *s8, const S_<DT> *x, int64_t n,
                               int64_t block, int64_t blocks_per_row, int64_t row_bytes, int64_t n_bytes, int format) {
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  DM_GRID_LOOP(q, n_bytes) {
    int64_t row = q / row_bytes, first = (q % row_bytes) * per;
    unsigned byte = 0;
    for (int e = 0; e < per && first + e < n; e++) {
      int64_t j = first + e;
      double sc = scale_at(sf32, s8, row * blocks_per_row + j / block);
      unsigned code = sc != sc ? 0 : dm_quant_code(format, (double)dt<DT>::load(x[row * n + j]), sc);
      byte |= code << (bits * e);
    }
    codes[q] = (uint8_t)byte;
  }
}

static void cuda_quant_encode(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], rows = total / n;
  int64_t bpr = scales->shape[scales->ndim - 1], row_bytes = codes->shape[codes->ndim - 1];
  float *sf32 = scales->dtype == DM_F32 ? (float *)dm_data(scales) : NULL;
  uint8_t *s8 = scales->dtype == DM_U8 ? (uint8_t *)dm_data(scales) : NULL;
  dm_dispatch_float(x->dtype, "quant_encode", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *xp = (const S_<DT> *)dm_data(x);
    DM_LAUNCH(encode_scales_k<DT>, rows * bpr, sf32, s8, xp, n, block, bpr, rows * bpr, format);
    DM_LAUNCH(encode_codes_k<DT>, rows * row_bytes, (uint8_t *)dm_data(codes), sf32, s8, xp, n, block, bpr,
              row_bytes, rows * row_bytes, format);
  });
}

__global__ void decode_k(float *y, const uint8_t *codes, const float *sf32, const uint8_t *s8, int64_t n,
                         int64_t block, int64_t blocks_per_row, int64_t row_bytes, int64_t total, int format) {
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  unsigned mask = (1u << bits) - 1;
  DM_GRID_LOOP(i, total) {
    int64_t row = i / n, j = i % n;
    double sc = scale_at(sf32, s8, row * blocks_per_row + j / block);
    unsigned code = (codes[row * row_bytes + j / per] >> (bits * (j % per))) & mask;
    y[i] = (float)dm_quant_code_value(format, code, sc);
  }
}

static void cuda_quant_decode(dm_tensor *y, const dm_tensor *codes, const dm_tensor *scales, int format,
                              int64_t block) {
  int64_t total = dm_numel(y);
  if (total == 0) return;
  int64_t n = y->shape[y->ndim - 1];
  const float *sf32 = scales->dtype == DM_F32 ? (const float *)dm_data(scales) : NULL;
  const uint8_t *s8 = scales->dtype == DM_U8 ? (const uint8_t *)dm_data(scales) : NULL;
  DM_LAUNCH(decode_k, total, (float *)dm_data(y), (const uint8_t *)dm_data(codes), sf32, s8, n, block,
            scales->shape[scales->ndim - 1], codes->shape[codes->ndim - 1], total, format);
}

static const dm_kernel_entry kernels[] = {
  {"quantize", (dm_kernel_fn)cuda_quantize},
  {"quant_encode", (dm_kernel_fn)cuda_quant_encode},
  {"quant_decode", (dm_kernel_fn)cuda_quant_decode},
};
DM_CUDA_KERNELS(kernels)
