/*
** common.cuh — what the CUDA kernel files share: element types, the walk
** over strided operands, vector loads and the launch helpers.
**
** Element types. Each dtype has a storage type S and a compute type C:
** float for f32, bf16 and f16, double for f64 and the integers (as the CPU
** kernels do). Loads widen, stores round to nearest even (bf16, f16) or
** clamp and truncate (integers), as dm_store does, so results match the CPU.
**
** Strided operands. A dm_layout lines up to four operands over one shape
** (element strides, 0 where an operand is broadcast), with size-1 dims
** dropped and dims merged where every operand steps through them as one,
** as vm/cpu/iter.c does. A kernel maps a flat index to each operand's
** offset with offsets<N>(); a layout that ends as one dim of unit (or zero,
** for a broadcast scalar) strides can take the 16-byte vector paths.
*/
#ifndef DM_KERNELS_COMMON_CUH
#define DM_KERNELS_COMMON_CUH

#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdbool.h>
#include <string.h>
#include <limits.h>
#include <type_traits>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" {
#include "core/ops.h"
#include "core/core.h"
#include "core/alloc.h"
#include "internal.h"
#include "core/coalesce.h"
}

#define DM_THREADS 256
#define DM_FULL_MASK 0xffffffffu

/* ---- element types ---------------------------------------------------------------- */

__device__ __forceinline__ double dm_clampd(double v, double lo, double hi) {
  return v != v ? 0 : v < lo ? lo : v > hi ? hi : v;
}

template <int DT> struct dt;
template <> struct dt<DM_F32> {
  typedef float S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return v; }
  template <typename X> static __device__ __forceinline__ S store(X v) { return (float)v; }
};
template <> struct dt<DM_F64> {
  typedef double S; typedef double C;
  static __device__ __forceinline__ C load(S v) { return v; }
  template <typename X> static __device__ __forceinline__ S store(X v) { return (double)v; }
};
template <> struct dt<DM_BF16> {
  typedef uint16_t S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return __uint_as_float((uint32_t)v << 16); }
  template <typename X> static __device__ __forceinline__ S store(X v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn((float)v));
  }
};
template <> struct dt<DM_F16> {
  typedef uint16_t S; typedef float C;
  static __device__ __forceinline__ C load(S v) { return __half2float(__ushort_as_half(v)); }
  template <typename X> static __device__ __forceinline__ S store(X v) {
    return __half_as_ushort(__float2half_rn((float)v));
  }
};
template <> struct dt<DM_I32> {
  typedef int32_t S; typedef double C;
  static __device__ __forceinline__ C load(S v) { return v; }
  template <typename X> static __device__ __forceinline__ S store(X v) {
    return (int32_t)dm_clampd((double)v, -2147483648.0, 2147483647.0);
  }
};
template <> struct dt<DM_I64> {
  typedef int64_t S; typedef double C;
  static __device__ __forceinline__ C load(S v) { return (double)v; }
  template <typename X> static __device__ __forceinline__ S store(X v) {
    return (int64_t)dm_clampd((double)v, -9.2233720368547748e18, 9.2233720368547748e18);
  }
};
template <> struct dt<DM_U8> {
  typedef uint8_t S; typedef double C;
  static __device__ __forceinline__ C load(S v) { return v; }
  template <typename X> static __device__ __forceinline__ S store(X v) {
    return (uint8_t)dm_clampd((double)v, 0, 255);
  }
};

/* any dtype at run time, for the generic paths (casts, arange, random numbers) */
__device__ __forceinline__ double dm_load_any(int t, const void *p) {
  switch (t) {
  case DM_F32: return *(const float *)p;
  case DM_F64: return *(const double *)p;
  case DM_BF16: return dt<DM_BF16>::load(*(const uint16_t *)p);
  case DM_F16: return dt<DM_F16>::load(*(const uint16_t *)p);
  case DM_I32: return *(const int32_t *)p;
  case DM_I64: return (double)*(const int64_t *)p;
  default: return *(const uint8_t *)p;
  }
}

__device__ __forceinline__ void dm_store_any(int t, void *p, double v) {
  switch (t) {
  case DM_F32: *(float *)p = (float)v; break;
  case DM_F64: *(double *)p = v; break;
  case DM_BF16: *(uint16_t *)p = dt<DM_BF16>::store(v); break;
  case DM_F16: *(uint16_t *)p = dt<DM_F16>::store(v); break;
  case DM_I32: *(int32_t *)p = dt<DM_I32>::store(v); break;
  case DM_I64: *(int64_t *)p = dt<DM_I64>::store(v); break;
  default: *(uint8_t *)p = dt<DM_U8>::store(v); break;
  }
}

/* an unsigned type of n bytes, for moving elements as bits */
template <int N> struct bits;
template <> struct bits<1> { typedef uint8_t T; };
template <> struct bits<2> { typedef uint16_t T; };
template <> struct bits<4> { typedef uint32_t T; };
template <> struct bits<8> { typedef uint64_t T; };

/* Run f(std::integral_constant<int, DT>) for t's dtype; the float ones only,
** or every dtype. */
template <typename F> static void dm_dispatch_float(dm_dtype t, const char *what, F f) {
  switch (t) {
  case DM_F32: f(std::integral_constant<int, DM_F32>()); break;
  case DM_F64: f(std::integral_constant<int, DM_F64>()); break;
  case DM_BF16: f(std::integral_constant<int, DM_BF16>()); break;
  case DM_F16: f(std::integral_constant<int, DM_F16>()); break;
  default: dm_error("%s: no CUDA kernel for dtype %s", what, dm_dtype_name(t));
  }
}

template <typename F> static void dm_dispatch_all(dm_dtype t, const char *what, F f) {
  switch (t) {
  case DM_I32: f(std::integral_constant<int, DM_I32>()); break;
  case DM_I64: f(std::integral_constant<int, DM_I64>()); break;
  case DM_U8: f(std::integral_constant<int, DM_U8>()); break;
  default: dm_dispatch_float(t, what, f);
  }
}

/* by element size: f(std::integral_constant<int, bytes>) */
template <typename F> static void dm_dispatch_size(size_t es, F f) {
  switch (es) {
  case 1: f(std::integral_constant<int, 1>()); break;
  case 2: f(std::integral_constant<int, 2>()); break;
  case 4: f(std::integral_constant<int, 4>()); break;
  default: f(std::integral_constant<int, 8>()); break;
  }
}

/* ---- vectors ------------------------------------------------------------------------- */

/* V elements moved as one load or store of V * sizeof(S) bytes (at most 16) */
template <typename S, int V> struct alignas(sizeof(S) * V) dm_vec { S v[V]; };

static inline bool dm_aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* ---- strided operands -------------------------------------------------------------------- */

#define DM_LMAXOPS 4

struct dm_layout {
  int ndim;
  int64_t shape[DM_MAXDIM];
  int64_t st[DM_LMAXOPS][DM_MAXDIM];   /* element strides */
};

/* nops operands over `shape` with element strides st[k][d], size-1 dims
** dropped and dims merged where every operand steps through them as one */
static inline void dm_layout_from(dm_layout *L, int ndim, const int64_t *shape, int nops,
                                  const int64_t (*st)[DM_MAXDIM]) {
  memset(L, 0, sizeof *L);
  memcpy(L->shape, shape, (size_t)ndim * sizeof *shape);
  for (int k = 0; k < nops; k++) memcpy(L->st[k], st[k], (size_t)ndim * sizeof st[k][0]);
  L->ndim = dm_coalesce_layout(ndim, L->shape, nops, L->st);   /* vm/core/coalesce.h */
}

/* operands t[0..nops-1] (NULL: stride 0) broadcast over `shape`, right-aligned */
static inline void dm_layout_make(dm_layout *L, int ndim, const int64_t *shape, int nops,
                                  const dm_tensor *const *t) {
  int64_t st[DM_LMAXOPS][DM_MAXDIM];
  for (int k = 0; k < nops; k++)
    for (int d = 0; d < ndim; d++) {
      int td = t[k] ? d - (ndim - t[k]->ndim) : -1;
      st[k][d] = (td < 0 || t[k]->shape[td] == 1) ? 0 : t[k]->strides[td];
    }
  dm_layout_from(L, ndim, shape, nops, st);
}

/* one dim, every operand of unit stride or a broadcast scalar (stride 0) */
static inline bool dm_layout_flat(const dm_layout *L, int nops) {
  if (L->ndim != 1) return false;
  for (int k = 0; k < nops; k++) if (L->st[k][0] != 0 && L->st[k][0] != 1) return false;
  return true;
}

/* the element offset of flat index i in each operand (innermost dim fastest) */
template <int N>
__device__ __forceinline__ void dm_offsets(const dm_layout &L, int64_t i, int64_t (&off)[N]) {
#pragma unroll
  for (int k = 0; k < N; k++) off[k] = 0;
  for (int d = L.ndim - 1; d > 0; d--) {
    int64_t s = L.shape[d], q = i / s, r = i - q * s;
    i = q;
#pragma unroll
    for (int k = 0; k < N; k++) off[k] += r * L.st[k][d];
  }
#pragma unroll
  for (int k = 0; k < N; k++) off[k] += i * L.st[k][0];
}

/* ---- launching ----------------------------------------------------------------------------- */

/* a device-side error (an index out of range): the first is recorded, raised at the next
** synchronisation (kernels/runtime.c) */
__device__ __forceinline__ void dm_report(dm_device_error *e, int what, int64_t v, int64_t size, int64_t base) {
  if (atomicCAS(&e->flag, 0, 1) == 0) {
    e->what = what;
    e->value = v;
    e->size = size;
    e->base = base;
    __threadfence_system();
  }
}

#define DM_GRID_LOOP(i, n)                                                               \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);              \
       i += (int64_t)gridDim.x * blockDim.x)

/* blocks for `work` threads' worth of items, grid-stride beyond a few waves */
static inline unsigned dm_grid(int64_t work, int threads = DM_THREADS) {
  int64_t blocks = (work + threads - 1) / threads;
  int64_t cap = (int64_t)dm_cuda_sm_count() * (2048 / threads) * 4;
  if (blocks > cap) blocks = cap;
  return (unsigned)(blocks < 1 ? 1 : blocks);
}

#define DM_LAUNCH(kernel, work, ...) do {                                                \
    kernel<<<dm_grid(work), DM_THREADS, 0, dm_cuda_stream()>>>(__VA_ARGS__);             \
    DM_CU_LAUNCHED();                                                                    \
  } while (0)

/* the same name registered for DM_CUDA as the CPU one */
#define DM_CUDA_KERNELS(table) DM_REGISTER_KERNELS(DM_CUDA, table)

#endif
