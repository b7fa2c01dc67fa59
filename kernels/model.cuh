/*
** model.cuh — what the model's kernel files (norm.cu, xent.cu, conv.cu,
** kda.cu, moe_*.cu, engram.cu, optim.cu) share beyond common.cuh: rows of
** strided tensors, a warp a row and 16-byte vectors, warp sums, device
** scratch, errors found on the device, deterministic column sums, a
** one-block scan and a stable bucket sort.
**
** Determinism. Nothing here adds floats with atomics: sums run in a fixed
** order (a warp's butterfly, then partials combined in index order), so
** every run gives the same bits. The bucket sort counts with plain stores
** (one warp owns a chunk and its counters) and is stable.
*/
#ifndef DM_KERNELS_MODEL_CUH
#define DM_KERNELS_MODEL_CUH

#include "common.cuh"
extern "C" {
#include "ops/prims.h"    /* DM_BS_CHUNK, dm_colsum_chunks */
}

/* ---- rows of strided tensors ------------------------------------------------------------ */

/* the first nd dims of a tensor: element r of them (row-major) is at
** dm_lead_off(L, r). Dims of size 1 are dropped and neighbours that step as
** one are merged, so a contiguous tensor's lead is one dim and an offset
** costs one product (a 64-bit division per element costs more than the
** memory traffic of most row kernels). */
struct dm_lead {
  int nd;
  int64_t shape[DM_MAXDIM], st[DM_MAXDIM];
};

static inline dm_lead dm_lead_of(const dm_tensor *t, int nd) {
  dm_lead L;
  memset(&L, 0, sizeof L);
  int64_t st[1][DM_MAXDIM] = {{0}};
  for (int d = 0; d < nd; d++) {
    L.shape[d] = t->shape[d];
    st[0][d] = t->strides[d];
  }
  L.nd = dm_coalesce(nd, L.shape, 1, st);       /* vm/core/coalesce.h */
  for (int d = L.nd; d < nd; d++) L.shape[d] = st[0][d] = 0;     /* past the merged dims: zeros */
  memcpy(L.st, st[0], sizeof L.st);
  return L;
}

__device__ __forceinline__ int64_t dm_lead_off(const dm_lead &L, int64_t r) {
  int64_t off = 0;
  for (int d = L.nd - 1; d > 0; d--) {
    int64_t s = L.shape[d], q = r / s;
    off += (r - q * s) * L.st[d];
    r = q;
  }
  return off + r * L.st[0];           /* r is below the outermost size: no division */
}

/* element i of a tensor of run-time dtype t, in double (for the few values a kernel reads once) */
__device__ __forceinline__ int dm_esize(int t) {
  return t == DM_F64 || t == DM_I64 ? 8 : t == DM_F32 || t == DM_I32 ? 4 : t == DM_U8 ? 1 : 2;
}
__device__ __forceinline__ double dm_ld(int t, const void *p, int64_t i) {
  return dm_load_any(t, (const char *)p + i * dm_esize(t));
}
__device__ __forceinline__ void dm_st(int t, void *p, int64_t i, double v) {
  dm_store_any(t, (char *)p + i * dm_esize(t), v);
}

/* the rows of t: every dim but the last, counted as one */
static inline int64_t dm_row_count(const dm_tensor *t) {
  int64_t d = t->shape[t->ndim - 1];
  return d ? dm_numel(t) / d : 0;
}

/* ---- a warp a row, 16-byte vectors (norm.cu, xent.cu, conv.cu) --------------------------------- */

/* warps a launch of rows needs: 8 rows a block of 256 */
static inline unsigned dm_row_blocks(int64_t rows) {
  int64_t b = (rows + 7) / 8, cap = (int64_t)dm_cuda_sm_count() * 32;
  return (unsigned)(b < 1 ? 1 : b < cap ? b : cap);
}

/* each warp of the grid takes rows r in turn */
#define DM_WARP_LOOP(r, rows)                                                                        \
  for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (rows);              \
       r += ((int64_t)gridDim.x * blockDim.x) >> 5)

/* 16 bytes of elements: V of them a load or a store (the vector kernels of rownorm and the conv) */
template <int DT> struct dm_vec16 { enum { V = 16 / (int)sizeof(typename dt<DT>::S) }; };

template <int DT, int V>
__device__ __forceinline__ void dm_vload16(typename dt<DT>::C *v, const typename dt<DT>::S *p) {
  uint4 raw = *(const uint4 *)p;
  const typename dt<DT>::S *e = (const typename dt<DT>::S *)&raw;
#pragma unroll
  for (int i = 0; i < V; i++) v[i] = dt<DT>::load(e[i]);
}

template <int DT, int V>
__device__ __forceinline__ void dm_vstore16(typename dt<DT>::S *p, const typename dt<DT>::C *v) {
  uint4 raw;
  typename dt<DT>::S *e = (typename dt<DT>::S *)&raw;
#pragma unroll
  for (int i = 0; i < V; i++) e[i] = dt<DT>::store(v[i]);
  *(uint4 *)p = raw;
}

/* ---- the KDA backward's arguments --------------------------------------------------------------- */

/* into the io struct of either KDA kernel (kda.cu, kda_chunk.cu): the incoming gradients, and
** the memory and dtype of each wanted gradient dq, dk, dv, dg, dbeta, ds0 (NULL: not wanted) */
template <typename IO>
static void kda_bind_backward(IO &A, const dm_tensor *dout, const dm_tensor *ds_final, dm_tensor *const outs[6]) {
  A.dout = dm_data(dout);
  A.odt = dout->dtype;
  A.dsf = ds_final ? dm_data(ds_final) : NULL;
  A.fdt = ds_final ? ds_final->dtype : DM_F32;
  void **ptr[6] = {&A.dq, &A.dk_, &A.dv_, &A.dg, &A.dbeta, &A.ds0};
  int *pdt[6] = {&A.dqdt, &A.dkdt, &A.dvdt, &A.dgdt, &A.dbdt, &A.ds0dt};
  for (int i = 0; i < 6; i++) {
    *ptr[i] = outs[i] ? dm_data(outs[i]) : NULL;
    *pdt[i] = outs[i] ? outs[i]->dtype : DM_F32;
  }
}

/* ---- sums ------------------------------------------------------------------------------- */

/* the butterfly: every lane ends with the same bits */
template <typename T> __device__ __forceinline__ T dm_warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DM_FULL_MASK, v, o);
  return v;
}

/* v combined over the block (every thread gets the same result): warps by the
** butterfly, then the warps in order. op is associative; blockDim a multiple of 32. */
template <typename T, typename Op> __device__ __forceinline__ T dm_block_reduce(T v, Op op) {
  __shared__ T ws[32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(DM_FULL_MASK, v, o));
  __syncthreads();                              /* ws may hold an earlier call's values */
  if (lane == 0) ws[w] = v;
  __syncthreads();
  T s = ws[0];
  for (int i = 1; i < nw; i++) s = op(s, ws[i]);
  return s;
}

struct dm_op_add { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct dm_op_max { template <typename T> __device__ T operator()(T a, T b) const { return a > b ? a : b; } };

template <typename T> __device__ __forceinline__ T dm_block_sum(T v) { return dm_block_reduce(v, dm_op_add()); }

/* ---- scratch ---------------------------------------------------------------------------- */

/* device memory for a kernel's intermediates; freed stream-ordered (later launches reuse it) */
static inline void *dm_scratch(size_t n) { return dm_alloc(DM_CUDA, n ? n : 1); }
static inline void dm_scratch_free(void *p, size_t n) { dm_free(DM_CUDA, p, n ? n : 1); }

/* ---- errors found on the device ------------------------------------------------------------ */


/* ---- column sums ---------------------------------------------------------------------------- */

/* out[j] = sum over rows r of f(r, j), in double: pass one sums chunks of rows
** (32 columns by 8 row lanes a block, the lanes combined in order), pass two
** sums the chunks in order and hands each total to put(j, total). */
#define DM_COLSUM_LANES 8

template <typename F>
static __global__ void dm_colsum_part_k(F f, int64_t rows, int64_t cols, int64_t per, double *part) {
  __shared__ double sm[DM_COLSUM_LANES][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x, r0 = (int64_t)blockIdx.y * per;
  const int64_t r1 = r0 + per < rows ? r0 + per : rows;
  double acc = 0;
  if (j < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += DM_COLSUM_LANES) acc += (double)f(r, j);
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    double s = sm[0][threadIdx.x];
    for (int y = 1; y < DM_COLSUM_LANES; y++) s += sm[y][threadIdx.x];
    part[(int64_t)blockIdx.y * cols + j] = s;
  }
}

template <typename G>
static __global__ void dm_colsum_join_k(G put, const double *part, int64_t nchunk, int64_t cols) {
  DM_GRID_LOOP(j, cols) {
    double s = 0;
    for (int64_t c = 0; c < nchunk; c++) s += part[c * cols + j];
    put(j, s);
  }
}

template <typename F, typename G> static void dm_colsum(int64_t rows, int64_t cols, F f, G put) {
  if (cols <= 0) return;
  const int64_t cb = (cols + 31) / 32, nchunk = dm_colsum_chunks(rows, cols, dm_cuda_sm_count());
  int64_t per = (rows + nchunk - 1) / nchunk;
  size_t nb = (size_t)dm_colsum_scratch(rows, cols, dm_cuda_sm_count());
  double *part = (double *)dm_scratch(nb);
  dm_colsum_part_k<F><<<dim3((unsigned)cb, (unsigned)nchunk), dim3(32, DM_COLSUM_LANES), 0, dm_cuda_stream()>>>(
      f, rows, cols, per, part);
  DM_CU_LAUNCHED();
  DM_LAUNCH(dm_colsum_join_k<G>, cols, put, part, nchunk, cols);
  dm_scratch_free(part, nb);
}

/* ---- a one-block scan --------------------------------------------------------------------------- */

#define DM_SCAN_THREADS 1024

/* the exclusive prefix of v over the block (1024 threads); *total gets the sum */
__device__ __forceinline__ int64_t dm_block_exscan(int64_t v, int64_t *total) {
  __shared__ int64_t ws[32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int64_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int64_t y = __shfl_up_sync(DM_FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) ws[w] = x;
  __syncthreads();
  if (w == 0) {
    int64_t t = lane < nw ? ws[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int64_t y = __shfl_up_sync(DM_FULL_MASK, t, o);
      if (lane >= o) t += y;
    }
    ws[lane] = t;
  }
  __syncthreads();
  *total = ws[nw - 1];
  return x - v + (w > 0 ? ws[w - 1] : 0);
}

/* out[i] = in[0] + ... + in[i-1] for i = 0..n (out has n + 1 values; in and out may be one array) */
static __global__ void dm_scan_k(const int64_t *in, int64_t *out, int64_t n) {
  const int64_t per = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
  const int64_t hi = lo + per < n ? lo + per : n;
  int64_t s = 0;
  for (int64_t i = lo; i < hi; i++) s += in[i];
  int64_t total, run = dm_block_exscan(s, &total);
  __syncthreads();                              /* every read before any write */
  for (int64_t i = lo; i < hi; i++) {
    int64_t v = in[i];
    out[i] = run;
    run += v;
  }
  if (threadIdx.x == 0) out[n] = total;
}

static inline void dm_scan(const int64_t *in, int64_t *out, int64_t n) {
  dm_scan_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>(in, out, n);
  DM_CU_LAUNCHED();
}

/* ---- the stable bucket sort --------------------------------------------------------------------- */

/* One pass of a stable counting sort of n int64 keys into nb buckets: a
** key's bucket is (key >> shift) & (nb - 1) when radix (nb a power of two),
** else the key itself (checked against 0..nb-1: an outside key is recorded
** as an error of op `what` and left out). Each one-warp block owns a chunk
** of DM_BS_CHUNK keys and its row of counters; tiles of 32 keys are ranked
** within the tile by __match_any_sync, so equal buckets keep their order. */
/* DM_BS_CHUNK: vm/ops/moe.h */

struct dm_bsort {
  int64_t n, nb;
  int shift;
  bool radix;
  const int64_t *key, *val;      /* val NULL: the positions 0..n-1 */
  int64_t *key_out, *val_out;    /* NULL: not wanted */
  int64_t *inv_out;              /* inv_out[val] = sorted position (NULL: not wanted) */
  int64_t *offsets;              /* [nb + 1] (required) */
  int64_t *counts;               /* [nb]: keys per bucket (NULL: not wanted) */
  const int64_t *maxkey;         /* a radix pass whose digit is 0 for every key (*maxkey >> shift == 0,
                                    shift > 0) is the identity and skipped; NULL: never */
  int what;                      /* dm_cuda_name_id of the op, for out-of-range keys */
  dm_device_error *err;
  int64_t *cnt;                  /* [blocks, nb] scratch */
};

__device__ __forceinline__ bool dm_bsort_skip(const dm_bsort &s) {
  return s.maxkey && s.shift > 0 && ((*s.maxkey) >> s.shift) == 0;
}

/* the bucket of key i, or -1 (past the end, or out of range) */
__device__ __forceinline__ int64_t dm_bsort_bucket(const dm_bsort &s, int64_t i, bool report) {
  if (i >= s.n) return -1;
  int64_t k = s.key[i];
  if (s.radix) return (k >> s.shift) & (s.nb - 1);
  if (k >= 0 && k < s.nb) return k;
  if (report) dm_report(s.err, s.what, k, s.nb, 0);
  return -1;
}

static __global__ void dm_bsort_count_k(dm_bsort s) {
  if (dm_bsort_skip(s)) return;
  const int lane = threadIdx.x;
  int64_t *cnt = s.cnt + (int64_t)blockIdx.x * s.nb;
  const int64_t lo = (int64_t)blockIdx.x * DM_BS_CHUNK;
  for (int64_t t = lo; t < lo + DM_BS_CHUNK && t < s.n; t += 32) {
    int64_t b = dm_bsort_bucket(s, t + lane, true);
    unsigned mask = __match_any_sync(DM_FULL_MASK, b);
    if (b >= 0 && lane == __ffs(mask) - 1) cnt[b] += __popc(mask);
    __syncwarp();
  }
}

/* per bucket: the counters become each chunk's exclusive start within the bucket; totals into offsets */
static __global__ void dm_bsort_prefix_k(dm_bsort s, int64_t nblocks) {
  if (dm_bsort_skip(s)) return;
  DM_GRID_LOOP(b, s.nb) {
    int64_t run = 0;
    for (int64_t k = 0; k < nblocks; k++) {
      int64_t c = s.cnt[k * s.nb + b];
      s.cnt[k * s.nb + b] = run;
      run += c;
    }
    s.offsets[b] = run;
    if (s.counts) s.counts[b] = run;
  }
}

static __global__ void dm_bsort_place_k(dm_bsort s) {
  const int lane = threadIdx.x;
  const bool skip = dm_bsort_skip(s);
  int64_t *cnt = s.cnt + (int64_t)blockIdx.x * s.nb;
  const int64_t lo = (int64_t)blockIdx.x * DM_BS_CHUNK;
  for (int64_t t = lo; t < lo + DM_BS_CHUNK && t < s.n; t += 32) {
    int64_t i = t + lane, pos = i;
    int64_t b = skip ? -1 : dm_bsort_bucket(s, i, false);
    unsigned mask = __match_any_sync(DM_FULL_MASK, b);
    if (!skip && b >= 0) pos = s.offsets[b] + cnt[b] + __popc(mask & ((1u << lane) - 1));
    __syncwarp();
    if (!skip && b >= 0 && lane == __ffs(mask) - 1) cnt[b] += __popc(mask);
    __syncwarp();
    if (i < s.n && (skip || b >= 0)) {
      int64_t v = s.val ? s.val[i] : i;
      if (s.key_out) s.key_out[pos] = s.key[i];
      if (s.val_out) s.val_out[pos] = v;
      if (s.inv_out) s.inv_out[v] = pos;
    }
  }
}

/* one pass; s.cnt is taken here. offsets[nb] = the number of keys placed. */
static inline void dm_bucket_sort(dm_bsort s) {
  if (s.n <= 0) {
    DM_CU(cudaMemsetAsync(s.offsets, 0, sizeof(int64_t) * (size_t)(s.nb + 1), dm_cuda_stream()));
    if (s.counts) DM_CU(cudaMemsetAsync(s.counts, 0, sizeof(int64_t) * (size_t)s.nb, dm_cuda_stream()));
    return;
  }
  int64_t nblocks = (s.n + DM_BS_CHUNK - 1) / DM_BS_CHUNK;
  size_t nbytes = (size_t)dm_bucket_sort_scratch(s.n, s.nb);      /* nblocks rows of nb */
  s.cnt = (int64_t *)dm_scratch(nbytes);
  s.err = dm_cuda_device_error();
  cudaStream_t st = dm_cuda_stream();
  DM_CU(cudaMemsetAsync(s.cnt, 0, nbytes, st));
  dm_bsort_count_k<<<(unsigned)nblocks, 32, 0, st>>>(s);
  DM_CU_LAUNCHED();
  DM_LAUNCH(dm_bsort_prefix_k, s.nb, s, nblocks);
  dm_scan(s.offsets, s.offsets, s.nb);           /* bucket totals -> their starts */
  if (s.key_out || s.val_out || s.inv_out) {
    dm_bsort_place_k<<<(unsigned)nblocks, 32, 0, st>>>(s);
    DM_CU_LAUNCHED();
  }
  dm_scratch_free(s.cnt, nbytes);
}

/* ---- the stable radix sort ---------------------------------------------------------------------- */

/* n keys in 0 .. 2^bits - 1 sorted stably, 8 bits a pass (dm_bucket_sort), each with a value:
** val_in's, or (val_in NULL) its position. Pass 0 reads key_in and val_in and writes the pair
** (k[0], v[0]); each later pass reads one pair and writes the other. key_in and val_in are left
** as they were unless they are k[1] and v[1] (an array the sort may reuse). A pass above *maxkey
** (device; NULL: none) is skipped on the device. Returns the pair that holds the result.
** Scratch: dm_radix_sort_scratch (vm/ops/prims.h). */
static inline int dm_radix_sort(int64_t n, const int64_t *key_in, const int64_t *val_in, int64_t *const k[2],
                                int64_t *const v[2], int bits, const int64_t *maxkey) {
  const int passes = bits > 8 ? (bits + 7) / 8 : 1;
  const size_t ob = (size_t)dm_radix_sort_offsets();
  int64_t *off = (int64_t *)dm_scratch(ob);
  int out = 0;
  for (int q = 0; q < passes; q++) {
    out = q % 2;
    dm_bsort s;
    memset(&s, 0, sizeof s);
    s.n = n; s.nb = 256; s.shift = 8 * q; s.radix = true;
    s.key = q == 0 ? key_in : k[out ^ 1];
    s.val = q == 0 ? val_in : v[out ^ 1];
    s.key_out = k[out]; s.val_out = v[out];
    s.offsets = off;
    s.maxkey = maxkey;
    dm_bucket_sort(s);
  }
  dm_scratch_free(off, ob);
  return out;
}

#endif
