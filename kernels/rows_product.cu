/*
** rows_product.cu — a few rows against a weight, x [m, k] @ w[n, k]^T with m <= 8,
** in bf16 or f16 (out in the inputs' dtype or f32): generation's products, one
** row a stream. The work is reading w once; cuBLASLt's kernels for one row
** leave much of the bandwidth unused, so here a warp takes one output column
** at a time, its lanes reading w's row in 16-byte words (8 elements) and x's
** matching words, and sums in f32: each lane its words in order, then the
** lanes by a fixed butterfly, so every run gives the same bits.
**
** dm_cuda_rows_product takes the product when it fits (gemm.c asks first):
** the inputs 16-bit, w a 2-D weight read transposed (a linear layer), k a
** multiple of 8, the rows and w's rows on 16-byte boundaries; else cuBLASLt.
** It is off unless DM_ROWS_PRODUCT=1, until its device checks have run.
*/
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
extern "C" {
#include "internal.h"
}

#define ROWS_MAX 8
#define ROWS_THREADS 256
#define WORD 8                                   /* 16-bit elements in a 16-byte word */

/* the 8 elements of a word, as floats */
template <int DT> __device__ __forceinline__ void unpack(uint4 u, float *f) {
  const uint16_t *h = reinterpret_cast<const uint16_t *>(&u);
#pragma unroll
  for (int i = 0; i < WORD; i++) f[i] = dt<DT>::load(h[i]);
}

/* out[r, j] = sum_c x[r, c] w[j, c] for r < R: x at row stride ldx, w at ldw, out at ldo */
template <int DT, int ODT, int R>
__global__ void __launch_bounds__(ROWS_THREADS)
rows_product_k(typename dt<ODT>::S *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *w,
               int64_t ldw, int n, int k) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (ROWS_THREADS / 32);
  for (int j = blockIdx.x * (ROWS_THREADS / 32) + (threadIdx.x >> 5); j < n; j += warps) {
    const uint16_t *wj = w + (int64_t)j * ldw;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
#pragma unroll 4
    for (int c = lane * WORD; c < k; c += 32 * WORD) {
      float wf[WORD], xf[WORD];
      unpack<DT>(__ldg(reinterpret_cast<const uint4 *>(wj + c)), wf);
#pragma unroll
      for (int r = 0; r < R; r++) {
        unpack<DT>(__ldg(reinterpret_cast<const uint4 *>(x + r * ldx + c)), xf);
#pragma unroll
        for (int i = 0; i < WORD; i++) acc[r] = fmaf(wf[i], xf[i], acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], s);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; r++) out[r * ldo + j] = dt<ODT>::store(acc[r]);
    }
  }
}

template <int DT, int ODT>
static void launch_rows(void *out, int64_t ldo, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                        int m, int n, int k) {
  typedef typename dt<ODT>::S O;
  int blocks = (int)((n + ROWS_THREADS / 32 - 1) / (ROWS_THREADS / 32));
  int cap = dm_cuda_sm_count() * 8;
  if (blocks > cap) blocks = cap;
  cudaStream_t st = dm_cuda_stream();
  O *o = (O *)out;
  switch (m) {
#define ROWS_CASE(R) \
  case R: rows_product_k<DT, ODT, R><<<blocks, ROWS_THREADS, 0, st>>>(o, ldo, x, ldx, w, ldw, n, k); break;
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
  }
  DM_CU_LAUNCHED();
}

static bool on_words(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* x's rows as one stride through every dim but the last (the dims of size 1 skipped); false if none */
static bool row_stride(const dm_tensor *x, int64_t *rows, int64_t *ld) {
  int nd = x->ndim;
  int64_t r = 1, stride = x->shape[nd - 1];
  bool seen = false;
  for (int d = nd - 2; d >= 0; d--) {
    if (x->shape[d] == 1) continue;
    if (seen) return false;                   /* rows in two dims: not at one stride in general */
    seen = true;
    r = x->shape[d];
    stride = x->strides[d];
  }
  *rows = r;
  *ld = stride;
  return true;
}

/* DM_ROWS_PRODUCT=1 turns the kernel on: off by default until its device checks
** (tests/gpu/check.lua's rows kernel) and timings have run */
static bool rows_kernel_on(void) {
  static int on = -1;
  if (on < 0) {
    const char *s = getenv("DM_ROWS_PRODUCT");
    on = s && *s && strcmp(s, "0") != 0;
  }
  return on;
}

extern "C" bool dm_cuda_rows_product(dm_tensor *out, const dm_tensor *a, const dm_tensor *b, bool ta, bool tb) {
  if (!rows_kernel_on()) return false;
  dm_dtype dt = a->dtype, odt = out->dtype;
  if (ta || !tb || b->ndim != 2 || (dt != DM_BF16 && dt != DM_F16) || (odt != dt && odt != DM_F32)) return false;
  int64_t m, ldx, k = a->shape[a->ndim - 1], n = b->shape[0];
  if (!row_stride(a, &m, &ldx) || m < 1 || m > ROWS_MAX || a->strides[a->ndim - 1] != 1 || b->strides[1] != 1)
    return false;
  int64_t ldw = b->strides[0];
  /* (n and k well inside int: the loops step past them by a grid and by 256) */
  if (k < WORD || k % WORD || ldx % WORD || ldw % WORD || n > (1 << 30) || k > (1 << 30)) return false;
  if (!dm_is_contiguous(out) || !on_words(dm_data(a)) || !on_words(dm_data(b))) return false;
  const uint16_t *x = (const uint16_t *)dm_data(a), *w = (const uint16_t *)dm_data(b);
  void *o = dm_data(out);
  if (dt == DM_BF16 && odt == DM_BF16) launch_rows<DM_BF16, DM_BF16>(o, n, x, ldx, w, ldw, (int)m, (int)n, (int)k);
  else if (dt == DM_BF16) launch_rows<DM_BF16, DM_F32>(o, n, x, ldx, w, ldw, (int)m, (int)n, (int)k);
  else if (odt == DM_F16) launch_rows<DM_F16, DM_F16>(o, n, x, ldx, w, ldw, (int)m, (int)n, (int)k);
  else launch_rows<DM_F16, DM_F32>(o, n, x, ldx, w, ldw, (int)m, (int)n, (int)k);
  return true;
}
