/*
** silu_mul.cu — the SiLU-gated product on CUDA (vm/ops/silu_mul.h has the
** contracts), forward and backward: element by element in a grid-stride
** loop, over operands of any strides (common.cuh's dm_layout).
*/
#include "common.cuh"
extern "C" {
#include "ops/silu_mul.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

/* L: y, a, b */
template <int DT>
__global__ void silu_mul_k(S_<DT> *y, const S_<DT> *a, const S_<DT> *b, dm_layout L, int64_t n) {
  typedef C_<DT> C;
  DM_GRID_LOOP(i, n) {
    int64_t off[3];
    dm_offsets<3>(L, i, off);
    C av = dt<DT>::load(a[off[1]]), s = 1 / (1 + exp(-av));
    y[off[0]] = dt<DT>::store(av * s * dt<DT>::load(b[off[2]]));
  }
}

static void cuda_silu_mul(dm_tensor *y, const dm_tensor *a, const dm_tensor *b) {
  int64_t n = dm_numel(y);
  if (n == 0) return;
  dm_layout L;
  const dm_tensor *ops[3] = {y, a, b};
  dm_layout_make(&L, y->ndim, y->shape, 3, ops);
  dm_dispatch_float(y->dtype, "silu_mul", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(silu_mul_k<DT>, n, (S_<DT> *)dm_data(y), (const S_<DT> *)dm_data(a), (const S_<DT> *)dm_data(b), L, n);
  });
}

/* L: the lead gradient, g, a, b; when both are wanted they are contiguous, so gb sits at ga's offset */
template <int DT>
__global__ void silu_mul_bwd_k(S_<DT> *ga, S_<DT> *gb, const S_<DT> *g, const S_<DT> *a, const S_<DT> *b,
                               dm_layout L, int64_t n) {
  typedef C_<DT> C;
  DM_GRID_LOOP(i, n) {
    int64_t off[4];
    dm_offsets<4>(L, i, off);
    C gv = dt<DT>::load(g[off[1]]), av = dt<DT>::load(a[off[2]]), bv = dt<DT>::load(b[off[3]]);
    C s = 1 / (1 + exp(-av));
    if (ga) ga[off[0]] = dt<DT>::store(gv * bv * (s * (1 + av * (1 - s))));
    if (gb) gb[off[0]] = dt<DT>::store(gv * av * s);
  }
}

static void cuda_silu_mul_bwd(dm_tensor *ga, dm_tensor *gb, const dm_tensor *g, const dm_tensor *a,
                              const dm_tensor *b) {
  dm_tensor *lead = ga ? ga : gb;
  if (!lead || dm_numel(lead) == 0) return;
  if (ga && gb && (!dm_is_contiguous(ga) || !dm_is_contiguous(gb)))
    dm_error("silu_mul_bwd: both gradients wanted, so both must be contiguous");
  int64_t n = dm_numel(lead);
  dm_layout L;
  const dm_tensor *ops[4] = {lead, g, a, b};
  dm_layout_make(&L, lead->ndim, lead->shape, 4, ops);
  dm_dispatch_float(lead->dtype, "silu_mul_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(silu_mul_bwd_k<DT>, n, ga ? (S_<DT> *)dm_data(ga) : NULL, gb ? (S_<DT> *)dm_data(gb) : NULL,
              (const S_<DT> *)dm_data(g), (const S_<DT> *)dm_data(a), (const S_<DT> *)dm_data(b), L, n);
  });
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(silu_mul, cuda_silu_mul),
  DM_KERNEL_ENTRY(silu_mul_bwd, cuda_silu_mul_bwd),
};
DM_CUDA_KERNELS(kernels)
