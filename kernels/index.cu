/*
** index.cu — gather, index_select, scatter_add, index_add and index_check
** on CUDA.
**
** As on the CPU (vm/cpu/index.c), one walk serves the data kernels: each
** position p of the walked shape finds, through the index, a position k
** along dim in the "indexed" operand, then either copies (pick:
** direct[p] = indexed[p with p[dim] = k]) or accumulates
** (indexed[p with p[dim] = k] += direct[p]).
**
** Accumulation into a float dtype is deterministic and gives the CPU's
** bits. The sources are sorted by destination (a stable LSD radix sort, 8
** bits a pass, on model.cuh's bucket sort), and one thread sums each
** destination element over its sources in increasing source position, from
** the element's current value. A 16-bit destination sums in f32 and rounds
** once (a rounding at every add would lose a hot row's small adds), as the
** CPU does. A destination hit m times costs m
** dependent adds in one thread; index_add's consecutive threads take
** consecutive elements of a slice, so its loads coalesce. The cost: four
** int64 arrays of the n sources as scratch (vm/ops/index.h
** dm_index_accumulate_scratch; n is index_add's index length, scatter_add's
** index elements); a pass of the sort for up to 256 destinations (index_add's
** slices, scatter_add's elements) and one more each factor of 256; a keys and
** a sums kernel (index_add's has a thread per source element, and all but
** those of the first source of each destination return at once). Integer
** dtypes add with atomics: their sums are exact, so the order does not
** matter (u8 adds saturate at 255, as on the CPU).
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
#include "model.cuh"        /* dm_bucket_sort, dm_scratch */
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

/* integer dtypes only: float sums go through the sort (below) */
template <int DT> __device__ __forceinline__ void atomic_add(typename dt<DT>::S *p, typename dt<DT>::S v) {
  if constexpr (DT == DM_I32) atomicAdd(p, v);
  else if constexpr (DT == DM_I64) atomicAdd((unsigned long long *)p, (unsigned long long)v);
  else {                                        /* u8: a CAS on the word holding the byte */
    static_assert(DT == DM_U8, "atomic_add: integer dtypes only");
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
** element) or along dim only (1-D), indexed with stride 0 along dim; with
** `number` (scatter_add's sort keys), a fourth operand: the indexed
** operand's row-major element numbers, 0 along dim */
static int64_t walk_make(dm_layout *L, walk_args *w, const int64_t *shape, const dm_tensor *direct,
                         const dm_tensor *idx, const dm_tensor *indexed, int dim, int64_t base, bool along_dim,
                         const int64_t *number = NULL) {
  int nd = direct->ndim;
  int64_t st[DM_LMAXOPS][DM_MAXDIM], n = 1;
  for (int d = 0; d < nd; d++) {
    n *= shape[d];
    st[0][d] = direct->strides[d];
    st[1][d] = along_dim ? (d == dim ? idx->strides[0] : 0) : idx->strides[d];
    st[2][d] = d == dim ? 0 : indexed->strides[d];
    st[3][d] = number && d != dim ? number[d] : 0;
  }
  dm_layout_from(L, nd, shape, number ? 4 : 3, st);
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

static void cuda_gather(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  pick(out, x, idx, dim, base, false);
}

static void cuda_index_select(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  pick(out, x, idx, dim, base, true);
}

/* ---- deterministic float sums: the sources sorted by destination ------------------------------- */

/* Each source gets a key, its destination (index_add: the slice, scatter_add:
** the element's row-major number), and an index out of range the key `top`,
** past every destination: it sorts last and is left out. *mx ends as the
** largest key the sort must order, top - 1, or top where an index was out of
** range, so that a radix pass which only the key top would need (top a power
** of 2: 256 rows of a byte embedding) is skipped on the device. */
__device__ __forceinline__ int64_t source_key(int64_t *mx, int64_t p, int64_t k, int64_t top) {
  if (p == 0 || k < 0) atomicMax((long long *)mx, (long long)(k < 0 ? top : top - 1));
  return k < 0 ? top : k;
}

/* index_add: the destination slice of source slice p */
__global__ void slice_keys_k(int64_t *key, int64_t *mx, const char *idx, int64_t istride, int64_t n, walk_args w) {
  DM_GRID_LOOP(p, n) key[p] = source_key(mx, p, position(w, idx, p * istride), w.size);
}

/* scatter_add: the destination element of idx's element p, and (val) the source's offset; L is
** walk_make's with the row-major numbers, `kstep` the number's step along dim */
__global__ void element_keys_k(int64_t *key, int64_t *val, int64_t *mx, const char *idx, dm_layout L, int64_t n,
                               walk_args w, int64_t kstep, int64_t top) {
  DM_GRID_LOOP(p, n) {
    int64_t off[4];
    dm_offsets<4>(L, p, off);
    int64_t k = position(w, idx, off[1]);
    key[p] = source_key(mx, p, k < 0 ? -1 : off[3] + k * kstep, top);
    val[p] = off[0];
  }
}

/* v (the compute type: float for 16-bit dtypes) plus the sources at sorted positions r, r+1, ...
** in blocks of B while the whole block has key k (sk is sorted: when the block's last has it, all
** have), in order; r ends past them. A block's B loads go out before its adds, so a run waits for
** memory once a block, not once an add. */
template <int B, int DT, typename At>
__device__ __forceinline__ typename dt<DT>::C run_blocks(typename dt<DT>::C v, const int64_t *sk, int64_t n, int64_t k,
                                                         int64_t &r, At at) {
  for (; r + B <= n && sk[r + B - 1] == k; r += B) {
    typename dt<DT>::S x[B];
#pragma unroll
    for (int j = 0; j < B; j++) x[j] = at(r + j);
#pragma unroll
    for (int j = 0; j < B; j++) v += dt<DT>::load(x[j]);
  }
  return v;
}

/* d plus the sources of the run that starts at sorted position q, in increasing source position,
** summed in the compute type and rounded once: blocks of 16 for a long run (a byte embedding's
** space row: thousands), then of 4, then singly */
template <int DT, typename At>
__device__ __forceinline__ typename dt<DT>::S run_sum(typename dt<DT>::S d, const int64_t *sk, int64_t n, int64_t q,
                                                      At at) {
  const int64_t k = sk[q];
  int64_t r = q;
  typename dt<DT>::C v = dt<DT>::load(d);
  v = run_blocks<16, DT>(v, sk, n, k, r, at);
  v = run_blocks<4, DT>(v, sk, n, k, r, at);
  return dt<DT>::store(run_blocks<1, DT>(v, sk, n, k, r, at));
}

/* whether sorted position q starts a run of destination sk[q] that is summed (not the key top) */
__device__ __forceinline__ bool run_head(const int64_t *sk, int64_t q, int64_t top) {
  return sk[q] != top && (q == 0 || sk[q - 1] != sk[q]);
}

/* index_add: thread t = q R + e sums element e of the slices (L: the dims other than dim, operands
** 0 dst and 1 src; R elements) where q heads a run; sp: the sorted source slices */
template <int DT>
__global__ void slice_sums_k(typename dt<DT>::S *dst, const typename dt<DT>::S *src, const int64_t *sk,
                             const int64_t *sp, int64_t n, dm_layout L, int64_t R, int64_t dstep, int64_t sstep,
                             int64_t top) {
  const int64_t total = n * R;
  DM_GRID_LOOP(t, total) {
    const int64_t q = t / R, e = t - q * R;
    if (!run_head(sk, q, top)) continue;
    int64_t off[2];
    dm_offsets<2>(L, e, off);
    typename dt<DT>::S *d = dst + off[0] + sk[q] * dstep;
    const typename dt<DT>::S *s = src + off[1];
    *d = run_sum<DT>(*d, sk, n, q, [&](int64_t r) { return s[sp[r] * sstep]; });
  }
}

/* scatter_add: a thread a run head q, for the destination element numbered sk[q] (D: dst's
** layout); sv: the sorted sources' offsets */
template <int DT>
__global__ void element_sums_k(typename dt<DT>::S *dst, const typename dt<DT>::S *src, const int64_t *sk,
                               const int64_t *sv, int64_t n, dm_layout D, int64_t top) {
  DM_GRID_LOOP(q, n) {
    if (!run_head(sk, q, top)) continue;
    int64_t off[1];
    dm_offsets<1>(D, sk[q], off);
    dst[off[0]] = run_sum<DT>(dst[off[0]], sk, n, q, [&](int64_t r) { return src[sv[r]]; });
  }
}

/* n sources into destinations keyed 0 .. top - 1: keys(key, val, mx) writes the keys (and, for
** scatter_add, the values; index_add's are the positions), sums(sk, sv) sums the sorted runs */
template <typename Keys, typename Sums>
static void sorted_accumulate(int64_t n, int64_t top, bool values, Keys keys, Sums sums) {
  size_t nb = (size_t)dm_index_sort_arrays(n);
  int64_t *mem = (int64_t *)dm_scratch(nb);
  int64_t *const k[2] = {mem, mem + 2 * n}, *const v[2] = {mem + n, mem + 3 * n}, *mx = mem + 4 * n;
  DM_CU(cudaMemsetAsync(mx, 0, sizeof *mx, dm_cuda_stream()));
  keys(k[1], v[1], mx);                         /* the pair the sort may reuse for its input */
  const int bits = 64 - __builtin_clzll((unsigned long long)top | 1);     /* top itself fits */
  const int r = dm_radix_sort(n, k[1], values ? v[1] : NULL, k, v, bits, mx);
  sums(k[r], v[r]);
  dm_scratch_free(mem, nb);
}

/* index_add: source slice p (along dim) into destination slice idx[p] - base */
template <int DT>
static void index_add_sorted(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  typedef typename dt<DT>::S S;
  const int64_t n = src->shape[dim], top = dst->shape[dim];
  int64_t shape[DM_MAXDIM], st[DM_LMAXOPS][DM_MAXDIM], R = 1;
  int m = 0;
  for (int d = 0; d < src->ndim; d++)          /* the dims other than dim: a slice's elements */
    if (d != dim) {
      shape[m] = src->shape[d];
      st[0][m] = dst->strides[d];
      st[1][m] = src->strides[d];
      R *= shape[m++];
    }
  if (n * R == 0) return;
  dm_layout L;
  dm_layout_from(&L, m, shape, 2, st);
  walk_args w = {(int)idx->dtype, (int)dm_dtype_size(idx->dtype), 0, top, base, current_op, dm_cuda_device_error()};
  const int64_t istride = idx->strides[0], dstep = dst->strides[dim], sstep = src->strides[dim];
  sorted_accumulate(n, top, false,
    [&](int64_t *key, int64_t *, int64_t *mx) {
      DM_LAUNCH(slice_keys_k, n, key, mx, (const char *)dm_data(idx), istride, n, w);
    },
    [&](const int64_t *sk, const int64_t *sp) {
      DM_LAUNCH(slice_sums_k<DT>, n * R, (S *)dm_data(dst), (const S *)dm_data(src), sk, sp, n, L, R, dstep, sstep,
                top);
    });
}

/* scatter_add: src's element at each position p of idx's shape into dst at p with p[dim] = idx[p] - base */
template <int DT>
static void scatter_add_sorted(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  typedef typename dt<DT>::S S;
  int64_t number[DM_MAXDIM], top = 1;          /* dst's row-major element numbers */
  for (int d = dst->ndim - 1; d >= 0; d--) {
    number[d] = top;
    top *= dst->shape[d];
  }
  dm_layout L, D;
  walk_args w;
  const int64_t n = walk_make(&L, &w, idx->shape, src, idx, dst, dim, base, false, number);
  if (n == 0) return;
  const dm_tensor *ops[1] = {dst};
  dm_layout_make(&D, dst->ndim, dst->shape, 1, ops);
  const int64_t kstep = number[dim];
  sorted_accumulate(n, top, true,
    [&](int64_t *key, int64_t *val, int64_t *mx) {
      DM_LAUNCH(element_keys_k, n, key, val, mx, (const char *)dm_data(idx), L, n, w, kstep, top);
    },
    [&](const int64_t *sk, const int64_t *sv) {
      DM_LAUNCH(element_sums_k<DT>, n, (S *)dm_data(dst), (const S *)dm_data(src), sk, sv, n, D, top);
    });
}

/* ---- scatter_add, index_add ---------------------------------------------------------------- */

/* integers: atomic adds in any order over the walk (exact sums) */
template <int DT>
static void accumulate_atomic(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base,
                              bool along_dim) {
  typedef typename dt<DT>::S S;
  dm_layout L;
  walk_args w;
  int64_t n = walk_make(&L, &w, along_dim ? src->shape : idx->shape, src, idx, dst, dim, base, along_dim);
  if (n == 0) return;
  DM_LAUNCH(accumulate_k<DT>, n, (const S *)dm_data(src), (const char *)dm_data(idx), (S *)dm_data(dst), L, n, w);
}

static void accumulate(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base,
                       bool along_dim) {
  dm_dispatch_all(dst->dtype, "scatter_add", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    if constexpr (DT == DM_I32 || DT == DM_I64 || DT == DM_U8)
      accumulate_atomic<DT>(dst, idx, src, dim, base, along_dim);
    else if (along_dim) index_add_sorted<DT>(dst, idx, src, dim, base);
    else scatter_add_sorted<DT>(dst, idx, src, dim, base);
  });
}

static void cuda_scatter_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate(dst, idx, src, dim, base, false);
}

static void cuda_index_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate(dst, idx, src, dim, base, true);
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
