/*
** index.cu — gather, index_select, scatter_add, index_add and index_check
** on CUDA.
**
** As on the CPU (vm/cpu/index.c), one walk serves the four data kernels:
** each position p of the walked shape finds, through the index, a position
** k along dim in the "indexed" operand, then either copies (pick:
** direct[p] = indexed[p with p[dim] = k]) or accumulates
** (indexed[p with p[dim] = k] += direct[p]). Accumulation uses atomic adds,
** so repeated indices add up in an unspecified order: float sums may differ
** in the last bits from run to run (u8 adds saturate at 255, as on the CPU).
**
** Index checks. The CPU checks every index before the op allocates; a GPU
** check that raised at the op would make the host wait for the device at
** every embedding and gather (and could not be captured in a CUDA graph).
** So by default index_check only notes the op's name, the data kernels
** check every index they read, skip an index out of range (a pick writes
** 0) and record the first one in host memory the device can reach, and
** the error is raised at the next synchronisation point (a copy to the
** host, .item(), dm.cuda.synchronize()), naming the index, the size and the
** op. With DM_DEBUG >= 1, index_check runs a checking kernel and waits for
** it, raising at the op itself with the CPU's message.
*/
#include "common.cuh"
#include "ops/patch.h"
#include "ops/index.h"

static int current_op;              /* dm_cuda_name_id of the op that last checked its indices */

__device__ __forceinline__ int64_t read_index(int t, const char *p) {
  return t == DM_I64 ? *(const int64_t *)p : t == DM_I32 ? *(const int32_t *)p : *(const uint8_t *)p;
}


/* what every walk needs beyond its operands */
struct walk_args {
  int idt;                  /* the index's dtype */
  int ies;                  /* its element size */
  int64_t kstride;          /* the indexed operand's stride along dim */
  int64_t size, base;
  int what;
  dm_device_error *err;
};

/* the 0-based position named by the index at idx + off, or -1 (recorded) when out of range */
__device__ __forceinline__ int64_t position(const walk_args &w, const char *idx, int64_t off) {
  int64_t v = read_index(w.idt, idx + off * w.ies), k = v - w.base;
  if (k >= 0 && k < w.size) return k;
  dm_report(w.err, w.what, v, w.size, w.base);
  return -1;
}

/* L's operands: 0 direct, 1 idx, 2 indexed (stride 0 along dim) */
template <int ES>
__global__ void pick_k(typename bits<ES>::T *direct, const char *idx, const typename bits<ES>::T *indexed,
                       dm_layout L, int64_t n, walk_args w) {
  DM_GRID_LOOP(i, n) {
    int64_t off[3];
    dm_offsets<3>(L, i, off);
    int64_t k = position(w, idx, off[1]);
    direct[off[0]] = k < 0 ? 0 : indexed[off[2] + k * w.kstride];
  }
}

template <int DT> __device__ __forceinline__ void atomic_add(typename dt<DT>::S *p, typename dt<DT>::S v) {
  if constexpr (DT == DM_F32 || DT == DM_F64 || DT == DM_I32) atomicAdd(p, v);
  else if constexpr (DT == DM_I64) atomicAdd((unsigned long long *)p, (unsigned long long)v);
  else if constexpr (DT == DM_BF16) atomicAdd((__nv_bfloat16 *)p, __ushort_as_bfloat16(v));
  else if constexpr (DT == DM_F16) atomicAdd((__half *)p, __ushort_as_half(v));
  else {                                        /* u8: a CAS on the word holding the byte */
    unsigned int *word = (unsigned int *)((uintptr_t)p & ~(uintptr_t)3);
    int shift = (int)((uintptr_t)p & 3) * 8;
    unsigned int old = *word, seen;
    do {
      seen = old;
      unsigned int sum = ((seen >> shift) & 0xffu) + v;
      sum = sum > 255 ? 255 : sum;
      old = atomicCAS(word, seen, (seen & ~(0xffu << shift)) | (sum << shift));
    } while (old != seen);
  }
}

template <int DT>
__global__ void accumulate_k(const typename dt<DT>::S *direct, const char *idx, typename dt<DT>::S *indexed,
                             dm_layout L, int64_t n, walk_args w) {
  DM_GRID_LOOP(i, n) {
    int64_t off[3];
    dm_offsets<3>(L, i, off);
    int64_t k = position(w, idx, off[1]);
    if (k >= 0) atomic_add<DT>(indexed + off[2] + k * w.kstride, direct[off[0]]);
  }
}

/* the walk over `shape`: direct with its strides, idx with its own (per
** element) or along dim only (1-D), indexed with stride 0 along dim */
static int64_t walk_make(dm_layout *L, walk_args *w, const int64_t *shape, const dm_tensor *direct,
                         const dm_tensor *idx, const dm_tensor *indexed, int dim, int64_t base, bool along_dim) {
  int nd = direct->ndim;
  int64_t st[3][DM_MAXDIM], n = 1;
  for (int d = 0; d < nd; d++) {
    n *= shape[d];
    st[0][d] = direct->strides[d];
    st[1][d] = along_dim ? (d == dim ? idx->strides[0] : 0) : idx->strides[d];
    st[2][d] = d == dim ? 0 : indexed->strides[d];
  }
  dm_layout_from(L, nd, shape, 3, st);
  w->idt = (int)idx->dtype;
  w->ies = (int)dm_dtype_size(idx->dtype);
  w->kstride = indexed->strides[dim];
  w->size = indexed->shape[dim];
  w->base = base;
  w->what = current_op;
  w->err = dm_cuda_device_error();
  return n;
}

static void pick(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base, bool along_dim) {
  dm_layout L;
  walk_args w;
  int64_t n = walk_make(&L, &w, along_dim ? out->shape : idx->shape, out, idx, x, dim, base, along_dim);
  if (n == 0) return;
  dm_dispatch_size(dm_dtype_size(out->dtype), [&](auto size) {
    constexpr int ES = decltype(size)::value;
    typedef typename bits<ES>::T E;
    DM_LAUNCH(pick_k<ES>, n, (E *)dm_data(out), (const char *)dm_data(idx), (const E *)dm_data(x), L, n, w);
  });
}

static void accumulate(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base,
                       bool along_dim) {
  dm_layout L;
  walk_args w;
  int64_t n = walk_make(&L, &w, along_dim ? src->shape : idx->shape, src, idx, dst, dim, base, along_dim);
  if (n == 0) return;
  dm_dispatch_all(dst->dtype, "scatter_add", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    DM_LAUNCH(accumulate_k<DT>, n, (const S *)dm_data(src), (const char *)dm_data(idx), (S *)dm_data(dst), L, n, w);
  });
}

static void cuda_gather(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  pick(out, x, idx, dim, base, false);
}

static void cuda_index_select(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  pick(out, x, idx, dim, base, true);
}

/* 16-bit destinations accumulate in f32 and round once: a bf16 atomic add
** rounds at every addition, and an embedding row hit many times drifts. */
static void accumulate_rounded_once(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim,
                                    int64_t base, bool along_dim) {
  if (dst->dtype != DM_BF16 && dst->dtype != DM_F16) { accumulate(dst, idx, src, dim, base, along_dim); return; }
  dm_tensor *acc = dm_tensor_like_dtype(dst, DM_F32), *src32 = dm_tensor_like_dtype(src, DM_F32);
  dm_copy_(acc, dst);
  dm_copy_(src32, src);
  accumulate(acc, idx, src32, dim, base, along_dim);
  dm_copy_(dst, acc);
  dm_release(acc);
  dm_release(src32);
}

static void cuda_scatter_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate_rounded_once(dst, idx, src, dim, base, false);
}

static void cuda_index_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate_rounded_once(dst, idx, src, dim, base, true);
}

/* ---- index_check -------------------------------------------------------------------------- */

__global__ void check_k(const char *idx, dm_layout L, int64_t n, walk_args w) {
  DM_GRID_LOOP(i, n) {
    int64_t off[1];
    dm_offsets<1>(L, i, off);
    position(w, idx, off[0]);
  }
}

static void cuda_index_check(const dm_tensor *idx, int64_t size, int64_t base, const char *what) {
  current_op = dm_cuda_name_id(what);
  int64_t n = dm_numel(idx);
  if (dm_debug_level() < 1 || n == 0) return;
  dm_layout L;
  const dm_tensor *ops[1] = {idx};
  dm_layout_make(&L, idx->ndim, idx->shape, 1, ops);
  walk_args w = {(int)idx->dtype, (int)dm_dtype_size(idx->dtype), 0, size, base, current_op,
                 dm_cuda_device_error()};
  DM_LAUNCH(check_k, n, (const char *)dm_data(idx), L, n, w);
  DM_CU(cudaStreamSynchronize(dm_cuda_stream()));
  dm_device_error e;
  if (dm_cuda_take_device_error(&e))
    dm_error("%s: index %lld is out of range for a dim of size %lld (indices count from %lld)",
             dm_cuda_name_of(e.what), e.value, e.size, e.base);
}

/* the patch rule a thread a row (vm/ops/patch.h): a row's bytes are sequential by the rule, and a
** batch has few rows; T = 1,024 takes a few microseconds */
__global__ void patch_k(int64_t *pool, int64_t *ctx, int64_t *count, const uint8_t *x, const uint8_t *breaks,
                        int64_t B, int64_t T, int64_t slots, int64_t min_len, int64_t max_len) {
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b < B) count[b] = dm_patch_row(x + b * T, T, breaks, min_len, max_len, b, slots, pool + b * slots, ctx + b * T);
}

static void cuda_patch_index(dm_tensor *pool, dm_tensor *ctx, dm_tensor *count, const dm_tensor *x,
                             const dm_tensor *breaks, int64_t min_len, int64_t max_len) {
  const int64_t B = x->shape[0];
  if (B == 0) return;
  DM_LAUNCH(patch_k, B, (int64_t *)dm_data(pool), (int64_t *)dm_data(ctx), (int64_t *)dm_data(count),
            (const uint8_t *)dm_data(x), (const uint8_t *)dm_data(breaks), B, x->shape[1], pool->shape[1], min_len,
            max_len);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(gather, cuda_gather),
  DM_KERNEL_ENTRY(index_select, cuda_index_select),
  DM_KERNEL_ENTRY(scatter_add, cuda_scatter_add),
  DM_KERNEL_ENTRY(index_add, cuda_index_add),
  DM_KERNEL_ENTRY(index_check, cuda_index_check),
  DM_KERNEL_ENTRY(patch_index, cuda_patch_index),
};
DM_CUDA_KERNELS(kernels)
