/*
** moe_route.cu — the routed experts' bookkeeping on CUDA (moe.cuh): routing gives each token a warp
** (k passes of an arg-max over the experts), or at a few rows a block; the sort by expert is the stable bucket sort of model.cuh,
** or at a few rows (dm_moe_few) one block that ranks them; then the offsets check, the inverse, the
** gated combine and its backward, capacity, the counters and the balancing step.
*/
#include "moe.cuh"

/* ---- routing ------------------------------------------------------------------------------------ */

/* what an arg-max pass keeps: the lowest untaken id (and whether its score
** is NaN: then it wins, as the CPU's sequential scan keeps it), and the best
** non-NaN score with the lowest id on ties */
struct pick {
  int64_t first;
  bool first_nan;
  double best;
  int64_t best_id;
};

__device__ __forceinline__ pick pick_join(pick a, pick b) {
  pick r = a;
  if (b.first >= 0 && (a.first < 0 || b.first < a.first)) { r.first = b.first; r.first_nan = b.first_nan; }
  if (b.best_id >= 0 && (a.best_id < 0 || b.best > a.best || (b.best == a.best && b.best_id < a.best_id))) {
    r.best = b.best;
    r.best_id = b.best_id;
  }
  return r;
}

__device__ __forceinline__ pick pick_shfl(pick a, int o) {
  pick b;
  b.first = __shfl_xor_sync(DM_FULL_MASK, a.first, o);
  b.first_nan = __shfl_xor_sync(DM_FULL_MASK, (int)a.first_nan, o);
  b.best = __shfl_xor_sync(DM_FULL_MASK, a.best, o);
  b.best_id = __shfl_xor_sync(DM_FULL_MASK, a.best_id, o);
  return b;
}

__device__ __forceinline__ double sigmoid_d(double x) { return 1 / (1 + exp(-x)); }

/* v as the compute type holds it: experts are picked on float values for float dtypes, as the CPU's f32 kernel does */
template <int DT> __device__ __forceinline__ double rnd(double v) { return (double)(C_<DT>)v; }

/* a chosen expert's gate is route_gate / S, S the sum of route_gate over the chosen: sigmoid(l), or
** exp(l - top) for the softmax form, top the largest chosen logit (cpu/moe.c computes the same) */
__device__ __forceinline__ double route_gate(int form, double l, double top) {
  return form == DM_MOE_ROUTE_SOFTMAX ? exp(l - top) : sigmoid_d(l);
}

/* the largest logit among a row's k chosen experts */
template <int DT> __device__ double chosen_max(const S_<DT> *row, const int64_t *id, int64_t k, int64_t e) {
  double top = -INFINITY;
  for (int64_t j = 0; j < k; j++)
    if (id[j] >= 0 && id[j] < e) top = fmax(top, (double)dt<DT>::load(row[id[j]]));
  return top;
}

/* pass j's pick among experts first, first + step, ... not taken by passes 0..j-1 (id), joined over
** the warp: every lane holds the warp's pick */
template <int DT>
__device__ pick warp_pick(const S_<DT> *row, const S_<DT> *bias, const int64_t *id, int64_t j, int64_t e, int form,
                          int64_t first, int64_t step) {
  pick p = {-1, false, 0, -1};
  for (int64_t x = first; x < e; x += step) {
    bool taken = false;
    for (int64_t q = 0; q < j; q++) taken = taken || id[q] == x;
    if (taken) continue;
    double l = (double)dt<DT>::load(row[x]);
    double s = form == DM_MOE_ROUTE_SOFTMAX ? l : rnd<DT>(sigmoid_d(l));
    double sel = bias ? rnd<DT>(s + (double)dt<DT>::load(bias[x])) : s;
    pick c = {x, sel != sel, sel, sel != sel ? -1 : x};
    p = pick_join(p, c);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) p = pick_join(p, pick_shfl(p, o));
  return p;
}

/* a warp a token: k passes of a max over the untaken experts, then the gates */
template <int DT>
__global__ void route_k(int64_t *idx, S_<DT> *w, const S_<DT> *lg, const S_<DT> *bias, int64_t n, int64_t e,
                        int64_t k, int form) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < n;
       t += ((int64_t)gridDim.x * blockDim.x) >> 5) {
    const S_<DT> *row = lg + t * e;
    int64_t *id = idx + t * k;
    for (int64_t j = 0; j < k; j++) {
      pick p = warp_pick<DT>(row, bias, id, j, e, form, lane, 32);
      int64_t best = p.first_nan || p.best_id < 0 ? p.first : p.best_id;
      if (lane == 0) id[j] = best;
      __syncwarp();
    }
    double top = chosen_max<DT>(row, id, k, e), sum = 0;
    for (int64_t j = 0; j < k; j++) sum += route_gate(form, (double)dt<DT>::load(row[id[j]]), top);
    for (int64_t j = lane; j < k; j += 32)
      w[t * k + j] = dt<DT>::store(route_gate(form, (double)dt<DT>::load(row[id[j]]), top) / sum);
    __syncwarp();
  }
}

/* A few rows (dm_moe_few: decoding's one token a stream among many experts): a block a token, its
** threads over the experts, the warps' picks joined through shared memory; the same picks and gates
** as route_k (pick_join chooses alike in any order) */
#define ROUTE_FEW_THREADS 256
template <int DT>
__global__ void __launch_bounds__(ROUTE_FEW_THREADS) route_few_k(int64_t *idx, S_<DT> *w, const S_<DT> *lg,
                                                                 const S_<DT> *bias, int64_t e, int64_t k,
                                                                 int form) {
  __shared__ pick part[ROUTE_FEW_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x;
  const S_<DT> *row = lg + t * e;
  int64_t *id = idx + t * k;
  for (int64_t j = 0; j < k; j++) {
    pick p = warp_pick<DT>(row, bias, id, j, e, form, threadIdx.x, ROUTE_FEW_THREADS);
    if (lane == 0) part[warp] = p;
    __syncthreads();
    if (warp == 0) {
      pick none = {-1, false, 0, -1};
      p = lane < ROUTE_FEW_THREADS / 32 ? part[lane] : none;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) p = pick_join(p, pick_shfl(p, o));
      if (lane == 0) id[j] = p.first_nan || p.best_id < 0 ? p.first : p.best_id;
    }
    __syncthreads();                                   /* id[j] seen by the block's next pass */
  }
  if (threadIdx.x < k) {
    double top = chosen_max<DT>(row, id, k, e), sum = 0;
    for (int64_t j = 0; j < k; j++) sum += route_gate(form, (double)dt<DT>::load(row[id[j]]), top);
    int64_t j = threadIdx.x;
    w[t * k + j] = dt<DT>::store(route_gate(form, (double)dt<DT>::load(row[id[j]]), top) / sum);
  }
}

static unsigned warp_blocks(int64_t n) {
  int64_t b = (n + 7) / 8, cap = (int64_t)dm_cuda_sm_count() * 32;
  return (unsigned)(b < 1 ? 1 : b < cap ? b : cap);
}

/* keys per bucket (nb buckets; keys checked, a bad one recorded under `what`) */
static void bucket_counts(int64_t *counts, const int64_t *keys, int64_t n, int64_t nb, const char *what) {
  size_t ob = (size_t)dm_bucket_offsets_scratch(nb);      /* then the sort's: dm_bucket_counts_scratch */
  int64_t *off = (int64_t *)dm_scratch(ob);
  dm_bsort s;
  memset(&s, 0, sizeof s);
  s.n = n; s.nb = nb; s.key = keys; s.offsets = off; s.counts = counts; s.what = name_id(what);
  dm_bucket_sort(s);
  dm_scratch_free(off, ob);
}

/* A few keys (dm_moe_few): one block ranks them all, each key against every other, instead of the
** bucket sort's passes over the experts. A key's sorted position is the keys below it plus the equal ones
** before it (stable); offsets[x] the keys below x; counts[x] the keys equal to x. A key out of range is
** recorded and placed after every expert (as the bucket sort leaves it out of the offsets). Any output may be
** NULL. */
#define FEW_SORT_THREADS 1024
__global__ void __launch_bounds__(FEW_SORT_THREADS) few_sort_k(int64_t *perm, int64_t *off, int64_t *inv,
                                                              int64_t *counts, const int64_t *key, int64_t n,
                                                              int64_t e, dm_device_error *err, int what) {
  __shared__ int64_t ks[DM_MOE_FEW_ROWS];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int64_t k = key[i];
    if (k < 0 || k >= e) { dm_report(err, what, k, e, 0); k = e; }
    ks[i] = k;
  }
  __syncthreads();
  for (int64_t a = threadIdx.x; perm && a < n; a += blockDim.x) {
    int64_t pos = 0, ka = ks[a];
    for (int64_t b = 0; b < n; b++) pos += ks[b] < ka || (ks[b] == ka && b < a);
    perm[pos] = a;
    if (inv) inv[a] = pos;
  }
  for (int64_t x = threadIdx.x; x <= e; x += blockDim.x) {
    int64_t below = 0, at = 0;
    for (int64_t b = 0; b < n; b++) { below += ks[b] < x; at += ks[b] == x; }
    if (off) off[x] = below;
    if (counts && x < e) counts[x] = at;
  }
}

static void few_sort(int64_t *perm, int64_t *off, int64_t *inv, int64_t *counts, const int64_t *key, int64_t n,
                     int64_t e, const char *what) {
  few_sort_k<<<1, FEW_SORT_THREADS, 0, dm_cuda_stream()>>>(perm, off, inv, counts, key, n, e, dm_cuda_device_error(),
                                                           name_id(what));
  DM_CU_LAUNCHED();
}

static void cuda_route(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, const dm_tensor *logits,
                       const dm_tensor *bias, int form) {
  int64_t n = logits->shape[0], e = logits->shape[1], k = idx->shape[1];
  bool few = dm_moe_few(e, n * k);
  if (n > 0 && k > 0)
    dm_dispatch_float(logits->dtype, "moe_route", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      const S_<DT> *b = bias ? (const S_<DT> *)dm_data(bias) : NULL;
      if (few && k <= ROUTE_FEW_THREADS)
        route_few_k<DT><<<(unsigned)n, ROUTE_FEW_THREADS, 0, dm_cuda_stream()>>>(
            (int64_t *)dm_data(idx), (S_<DT> *)dm_data(w), (const S_<DT> *)dm_data(logits), b, e, k, form);
      else
        route_k<DT><<<warp_blocks(n), DM_THREADS, 0, dm_cuda_stream()>>>(
            (int64_t *)dm_data(idx), (S_<DT> *)dm_data(w), (const S_<DT> *)dm_data(logits), b, n, e, k, form);
      DM_CU_LAUNCHED();
    });
  if (few)
    few_sort(NULL, NULL, NULL, (int64_t *)dm_data(counts), (const int64_t *)dm_data(idx), n * k, e, "moe_route");
  else
    bucket_counts((int64_t *)dm_data(counts), (const int64_t *)dm_data(idx), n * k, e, "moe_route");
}

/* sigmoid: w_j = s_j / S, dL/ds_i = (gw_i - sum_j gw_j w_j) / S, then ds/dlogit = s (1 - s);
** softmax: dL/dlogit_i = w_i (gw_i - sum_j gw_j w_j); zero off the chosen */
template <int DT>
__global__ void route_bwd_k(S_<DT> *gl, const S_<DT> *gw, const S_<DT> *lg, const int64_t *idx, int64_t n,
                            int64_t e, int64_t k, int form) {
  DM_GRID_LOOP(i, n * e) {
    int64_t t = i / e, x = i - t * e, jx = -1;
    const int64_t *row = idx + t * k;
    for (int64_t j = 0; j < k; j++)
      if (row[j] == x) jx = j;
    double v = 0;
    if (jx >= 0) {
      double top = chosen_max<DT>(lg + t * e, row, k, e), sum = 0, gdotw = 0;
      for (int64_t j = 0; j < k; j++)
        if (row[j] >= 0 && row[j] < e) sum += route_gate(form, (double)dt<DT>::load(lg[t * e + row[j]]), top);
      for (int64_t j = 0; j < k; j++)
        if (row[j] >= 0 && row[j] < e)
          gdotw += (double)dt<DT>::load(gw[t * k + j]) *
                   route_gate(form, (double)dt<DT>::load(lg[t * e + row[j]]), top) / sum;
      double l = (double)dt<DT>::load(lg[i]), gj = (double)dt<DT>::load(gw[t * k + jx]) - gdotw;
      double s = sigmoid_d(l);
      v = form == DM_MOE_ROUTE_SOFTMAX ? route_gate(form, l, top) / sum * gj : gj / sum * s * (1 - s);
    }
    gl[i] = dt<DT>::store(v);
  }
}

static void cuda_route_bwd(dm_tensor *glogits, const dm_tensor *gw, const dm_tensor *logits, const dm_tensor *idx,
                           int form) {
  int64_t n = logits->shape[0], e = logits->shape[1], k = idx->shape[1];
  if (n * e == 0) return;
  dm_dispatch_float(logits->dtype, "moe_route_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(route_bwd_k<DT>, n * e, (S_<DT> *)dm_data(glogits), (const S_<DT> *)dm_data(gw),
              (const S_<DT> *)dm_data(logits), (const int64_t *)dm_data(idx), n, e, k, form);
  });
}

/* ---- the sort by expert, offsets, inverse ----------------------------------------------------------- */

static void cuda_sort(dm_tensor *perm, dm_tensor *offsets, dm_tensor *inv, const dm_tensor *idx) {
  if (dm_moe_few(offsets->shape[0] - 1, dm_numel(idx))) {
    few_sort((int64_t *)dm_data(perm), (int64_t *)dm_data(offsets), (int64_t *)dm_data(inv), NULL,
             (const int64_t *)dm_data(idx), dm_numel(idx), offsets->shape[0] - 1, "moe_sort");
    return;
  }
  dm_bsort s;
  memset(&s, 0, sizeof s);
  s.n = dm_numel(idx);
  s.nb = offsets->shape[0] - 1;
  s.key = (const int64_t *)dm_data(idx);
  s.val_out = (int64_t *)dm_data(perm);
  s.inv_out = (int64_t *)dm_data(inv);
  s.offsets = (int64_t *)dm_data(offsets);
  s.what = name_id("moe_sort");
  dm_bucket_sort(s);
}

/* One block: the first expert (in expert order) whose offsets decrease, found by every thread at once
** (a single thread walking 1,025 offsets took ~115 us of dependent loads at b1); then found =
** {kind (0 fine, 1 a decrease, 2 the ends), expert, value, value} */
#define CHECK_THREADS 1024
__global__ void __launch_bounds__(CHECK_THREADS) check_offsets_k(const int64_t *off, int64_t s, int64_t e,
                                                                 int64_t rows, int64_t *found, dm_device_error *err,
                                                                 int what) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = ~0ull;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < e; i += blockDim.x)
    if (off[(i + 1) * s] < off[i * s]) atomicMin(&first, (unsigned long long)i);
  __syncthreads();
  if (threadIdx.x) return;
  int64_t kind = 0, x = 0, v1 = 0, v2 = 0;
  if (first != ~0ull) { kind = 1; x = (int64_t)first; v1 = off[x * s]; v2 = off[(x + 1) * s]; }
  else if (off[0] != 0 || off[e * s] != rows) { kind = 2; v1 = off[0]; v2 = off[e * s]; }
  if (found) {
    found[0] = kind; found[1] = x; found[2] = v1; found[3] = v2;
  } else if (kind)
    dm_report(err, what, kind == 1 ? v2 : off[0] != 0 ? v1 : v2, rows + 1, 0);
}

static void cuda_check_offsets(const dm_tensor *offsets, int64_t rows, const char *what) {
  int64_t e = offsets->shape[0] - 1;
  if (e < 0) return;
  const size_t nb = (size_t)dm_moe_offsets_check_scratch(e, dm_debug_level());
  bool now = nb > 0;
  int64_t *found = now ? (int64_t *)dm_scratch(nb) : NULL, got[4];
  check_offsets_k<<<1, CHECK_THREADS, 0, dm_cuda_stream()>>>((const int64_t *)dm_data(offsets), offsets->strides[0], e, rows,
                                                 found, dm_cuda_device_error(), name_id(what));
  DM_CU_LAUNCHED();
  if (!now) return;
  DM_CU(cudaMemcpyAsync(got, found, sizeof got, cudaMemcpyDeviceToHost, dm_cuda_stream()));
  DM_CU(cudaStreamSynchronize(dm_cuda_stream()));
  dm_scratch_free(found, nb);
  if (got[0] == 1)
    dm_error("%s: offsets decrease at expert %lld (%lld then %lld); they must run from 0 up to N * k = %lld",
             what, (long long)got[1], (long long)got[2], (long long)got[3], (long long)rows);
  if (got[0] == 2)
    dm_error("%s: offsets run from %lld to %lld; they must run from 0 to N * k = %lld", what, (long long)got[2],
             (long long)got[3], (long long)rows);
}

__global__ void invert_k(int64_t *inv, const int64_t *perm, int64_t rows, dm_device_error *err, int what) {
  DM_GRID_LOOP(p, rows) {
    int64_t a = perm[p];
    if (a >= 0 && a < rows) inv[a] = p;
    else dm_report(err, what, a, rows, 0);
  }
}

static void cuda_invert(dm_tensor *inv, const dm_tensor *perm) {
  int64_t rows = dm_numel(perm);
  if (rows == 0) return;
  DM_LAUNCH(invert_k, rows, (int64_t *)dm_data(inv), (const int64_t *)dm_data(perm), rows, dm_cuda_device_error(),
            name_id("moe_invert"));
}

/* ---- combine --------------------------------------------------------------------------------------------- */

/* y[t] = sum over j in order of w[t, j] rows[inv[t k + j]] (w NULL: 1) */
template <int DT>
__global__ void combine_k(S_<DT> *y, const S_<DT> *rows, const int64_t *inv, const S_<DT> *w, int64_t n, int64_t f,
                          int64_t k, int64_t nrows, dm_device_error *err, int what) {
  typedef C_<DT> C;
  DM_GRID_LOOP(i, n * f) {
    int64_t t = i / f, c = i - t * f;
    C acc = 0;
    for (int64_t j = 0; j < k; j++) {
      int64_t a = t * k + j, p = inv[a];
      if (p < 0 || p >= nrows) {
        if (c == 0) dm_report(err, what, p, nrows, 0);
        continue;
      }
      C s = w ? dt<DT>::load(w[a]) : (C)1;
      acc += s * dt<DT>::load(rows[p * f + c]);
    }
    y[i] = dt<DT>::store(acc);
  }
}

/* the same, 8 columns a thread in 16-byte loads and stores (2-byte dtypes, f a multiple of 8, aligned rows) */
template <int DT>
__global__ void combine8_k(u16 *y, const u16 *rows, const int64_t *inv, const u16 *w, int64_t n, int64_t f8, int64_t k,
                           int64_t nrows, dm_device_error *err, int what) {
  DM_GRID_LOOP(i, n * f8) {
    int64_t t = i / f8, c = i - t * f8;
    float acc[8] = {};
    for (int64_t j = 0; j < k; j++) {
      int64_t a = t * k + j, p = inv[a];
      if (p < 0 || p >= nrows) {
        if (c == 0) dm_report(err, what, p, nrows, 0);
        continue;
      }
      float s = w ? dt<DT>::load(w[a]) : 1.f;
      uint4 v = *(const uint4 *)(rows + (p * f8 + c) * 8);
      const u16 *e = (const u16 *)&v;
#pragma unroll
      for (int q = 0; q < 8; q++) acc[q] += s * dt<DT>::load(e[q]);
    }
    uint4 o;
    u16 *oe = (u16 *)&o;
#pragma unroll
    for (int q = 0; q < 8; q++) oe[q] = dt<DT>::store(acc[q]);
    *(uint4 *)(y + i * 8) = o;
  }
}

static void cuda_combine(dm_tensor *y, const dm_tensor *rows, const dm_tensor *inv, const dm_tensor *w) {
  int64_t n = y->shape[0], f = y->shape[1], k = n ? dm_numel(inv) / n : 0;
  if (n * f == 0) return;
  dm_dispatch_float(y->dtype, "moe_combine", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    if constexpr (DT == DM_BF16 || DT == DM_F16) {
      if (f % 8 == 0 && dm_aligned(dm_data(y), 16) && dm_aligned(dm_data(rows), 16)) {
        DM_LAUNCH(combine8_k<DT>, n * (f / 8), (u16 *)dm_data(y), (const u16 *)dm_data(rows),
                  (const int64_t *)dm_data(inv), w ? (const u16 *)dm_data(w) : NULL, n, f / 8, k, n * k,
                  dm_cuda_device_error(), name_id("moe_combine"));
        return;
      }
    }
    DM_LAUNCH(combine_k<DT>, n * f, (S_<DT> *)dm_data(y), (const S_<DT> *)dm_data(rows),
              (const int64_t *)dm_data(inv), w ? (const S_<DT> *)dm_data(w) : NULL, n, f, k, n * k,
              dm_cuda_device_error(), name_id("moe_combine"));
  });
}

/* grows[inv[a]] = w[a] gy[a / k] and gw[a] = gy[a / k] . rows[inv[a]] (0 for a bad inv), a block an
** assignment, so that each row is read once and every load has the block's threads in flight (as two
** kernels, the dot products a warp a row, they took 0.65 ms a call at b1). The dot product's order is
** fixed (dm_block_sum). */
#define COMBINE_BWD_THREADS 256
template <int DT>
__global__ void __launch_bounds__(COMBINE_BWD_THREADS) combine_bwd_k(S_<DT> *grows, S_<DT> *gw, const S_<DT> *gy,
                                                                     const S_<DT> *yr, const int64_t *inv,
                                                                     const S_<DT> *w, int64_t rows, int64_t f,
                                                                     int64_t k) {
  typedef C_<DT> C;
  for (int64_t a = blockIdx.x; a < rows; a += gridDim.x) {
    const int64_t p = inv[a];
    const bool ok = p >= 0 && p < rows;
    const S_<DT> *g = gy + (a / k) * f;
    const C wa = grows && ok ? dt<DT>::load(w[a]) : (C)0;
    C s = 0;
    if (ok) {
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < f; c += COMBINE_BWD_THREADS) {
        const C gv = dt<DT>::load(g[c]);
        if (grows) grows[p * f + c] = dt<DT>::store(wa * gv);
        if (gw) s += gv * dt<DT>::load(yr[p * f + c]);
      }
    }
    if (gw) {
      s = dm_block_sum(s);
      if (threadIdx.x == 0) gw[a] = dt<DT>::store(s);
    }
  }
}

static void cuda_combine_bwd(dm_tensor *grows, dm_tensor *gw, const dm_tensor *gy, const dm_tensor *rows,
                             const dm_tensor *inv, const dm_tensor *w) {
  int64_t n = w->shape[0], k = w->shape[1], f = gy->shape[1], na = n * k;
  if (na == 0) return;
  dm_dispatch_float(gy->dtype, "moe_combine_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *pg = (const S_<DT> *)dm_data(gy);
    const int64_t *pi = (const int64_t *)dm_data(inv);
    if (!gw && (!grows || f == 0)) return;
    const int64_t cap = (int64_t)dm_cuda_sm_count() * (2048 / COMBINE_BWD_THREADS) * 4;
    combine_bwd_k<DT><<<(unsigned)(na < cap ? na : cap), COMBINE_BWD_THREADS, 0, dm_cuda_stream()>>>(
        grows ? (S_<DT> *)dm_data(grows) : NULL, gw ? (S_<DT> *)dm_data(gw) : NULL, pg,
        gw ? (const S_<DT> *)dm_data(rows) : NULL, pi, (const S_<DT> *)dm_data(w), na, f, k);
    DM_CU_LAUNCHED();
  });
}

/* ---- capacity, counters, balancing ----------------------------------------------------------------------- */

/* out = w where the rank within the expert is under capacity, else 0; key[a] = the expert of a dropped
** assignment, E for a kept one (the drops are then the bucket counts) */
template <int DT>
__global__ void capacity_k(S_<DT> *out, int64_t *key, const S_<DT> *w, const int64_t *idx, const int64_t *inv,
                           const int64_t *off, int64_t rows, int64_t e, int64_t cap, dm_device_error *err, int what) {
  DM_GRID_LOOP(a, rows) {
    int64_t x = idx[a];
    bool ok = x >= 0 && x < e, keep = false;
    if (ok) keep = inv[a] - off[x] < cap;
    else dm_report(err, what, x, e, 0);
    out[a] = keep ? w[a] : dt<DT>::store(0);
    if (key) key[a] = keep || !ok ? e : x;
  }
}

static void cuda_capacity(dm_tensor *out, dm_tensor *drops, const dm_tensor *w, const dm_tensor *idx,
                          const dm_tensor *inv, const dm_tensor *offsets, int64_t capacity) {
  int64_t rows = dm_numel(w), e = offsets->shape[0] - 1;
  /* dm_moe_capacity_scratch: these and bucket_counts's */
  size_t kb = (size_t)dm_moe_capacity_keys(rows), cb = (size_t)dm_moe_capacity_counts(e);
  int64_t *key = drops ? (int64_t *)dm_scratch(kb) : NULL;
  if (rows > 0)
    dm_dispatch_float(w->dtype, "moe_capacity", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      DM_LAUNCH(capacity_k<DT>, rows, (S_<DT> *)dm_data(out), key, (const S_<DT> *)dm_data(w),
                (const int64_t *)dm_data(idx), (const int64_t *)dm_data(inv), (const int64_t *)dm_data(offsets), rows,
                e, capacity, dm_cuda_device_error(), name_id("moe_capacity"));
    });
  if (!drops) return;
  int64_t *counts = (int64_t *)dm_scratch(cb);       /* E + 1 buckets: the last holds the kept */
  bucket_counts(counts, key, rows, e + 1, "moe_capacity");
  DM_CU(cudaMemcpyAsync(dm_data(drops), counts, sizeof(int64_t) * (size_t)e, cudaMemcpyDeviceToDevice,
                        dm_cuda_stream()));
  dm_scratch_free(counts, cb);
  dm_scratch_free(key, kb);
}

/* one block: the busiest share, the load's entropy (nats), the dead experts */
__global__ void counters_k(double *stats, const int64_t *c, int64_t e) {
  int64_t total = 0, most = 0, dead = 0;
  for (int64_t x = threadIdx.x; x < e; x += blockDim.x) {
    total += c[x];
    most = c[x] > most ? c[x] : most;
    dead += c[x] == 0;
  }
  total = dm_block_sum(total);
  most = dm_block_reduce(most, dm_op_max());
  dead = dm_block_sum(dead);
  double h = 0;
  for (int64_t x = threadIdx.x; x < e && total > 0; x += blockDim.x)
    if (c[x] > 0) {
      double p = (double)c[x] / (double)total;
      h -= p * log(p);
    }
  h = dm_block_sum(h);
  if (threadIdx.x == 0) {
    stats[0] = total > 0 ? (double)most / (double)total : 0;
    stats[1] = h;
    stats[2] = (double)dead;
  }
}

static void cuda_counters(dm_tensor *stats, const dm_tensor *counts) {
  counters_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>((double *)dm_data(stats), (const int64_t *)dm_data(counts),
                                                         counts->shape[0]);
  DM_CU_LAUNCHED();
}

/* bias[x] += gamma sign(total - c E): the mean compared exactly, in integers */
__global__ void balance_k(void *bias, int bdt, const int64_t *c, int64_t e, double gamma) {
  int64_t total = 0;
  for (int64_t x = threadIdx.x; x < e; x += blockDim.x) total += c[x];
  total = dm_block_sum(total);
  for (int64_t x = threadIdx.x; x < e; x += blockDim.x) {
    int64_t diff = total - c[x] * e;
    dm_st(bdt, bias, x, dm_ld(bdt, bias, x) + gamma * (double)((diff > 0) - (diff < 0)));
  }
}

static void cuda_balance(dm_tensor *bias, const dm_tensor *counts, double gamma) {
  balance_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>(dm_data(bias), bias->dtype, (const int64_t *)dm_data(counts),
                                                         counts->shape[0], gamma);
  DM_CU_LAUNCHED();
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(moe_route, cuda_route),
  DM_KERNEL_ENTRY(moe_route_bwd, cuda_route_bwd),
  DM_KERNEL_ENTRY(moe_sort, cuda_sort),
  DM_KERNEL_ENTRY(moe_check_offsets, cuda_check_offsets),
  DM_KERNEL_ENTRY(moe_invert, cuda_invert),
  DM_KERNEL_ENTRY(moe_combine, cuda_combine),
  DM_KERNEL_ENTRY(moe_combine_bwd, cuda_combine_bwd),
  DM_KERNEL_ENTRY(moe_capacity, cuda_capacity),
  DM_KERNEL_ENTRY(moe_counters, cuda_counters),
  DM_KERNEL_ENTRY(moe_balance, cuda_balance),
};
DM_CUDA_KERNELS(kernels)
