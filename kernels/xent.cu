/*
** xent.cu — cross-entropy on CUDA (vm/ops/xent.h has the contracts): the
** targets' check, the loss with its log-softmax, and the backward.
**
** Each row gets one warp: its lanes stride through the row (any strides; a
** row's first element is found through its leading dims) and combine by a
** butterfly, in the compute type (float for f32, bf16 and f16; double for
** f64). The mean and the sum over rows go through partial sums in a fixed
** order (model.cuh), never atomics: every run gives the same bits.
**
** Targets out of range follow index_check's convention (index.cu): by
** default cross_entropy_check does nothing, the kernels skip a bad target
** (its loss is NaN) and record it, and the error is raised at the next
** synchronisation; with DM_DEBUG >= 1 the check runs at the op and raises
** the CPU's message.
*/
#include "model.cuh"
extern "C" {
#include "ops/xent.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

__device__ __forceinline__ int64_t target_at(int tdt, const void *p, int64_t off) {
  return tdt == DM_I64 ? ((const int64_t *)p)[off] : tdt == DM_I32 ? ((const int32_t *)p)[off]
                                                                      : ((const uint8_t *)p)[off];
}

__device__ __forceinline__ bool ignored(int64_t t, int64_t ignore_index) {
  return ignore_index != -1 && t == ignore_index;
}

static int ce_name(void) {
  static int id = -1;
  if (id < 0) id = dm_cuda_name_id("cross_entropy");
  return id;
}

/* With DM_DEBUG >= 1: the first bad target, found by one thread in row order (a debugging aid) */
__global__ void ce_first_bad_k(const void *t, int tdt, dm_lead Lt, int64_t rows, int64_t classes, int64_t ignore,
                               int64_t *found) {
  found[0] = -1;
  for (int64_t r = 0; r < rows; r++) {
    int64_t v = target_at(tdt, t, dm_lead_off(Lt, r));
    if (!ignored(v, ignore) && (v < 0 || v >= classes)) {
      found[0] = r;
      found[1] = v;
      return;
    }
  }
}

static void cuda_ce_check(const dm_tensor *targets, int64_t classes, int64_t ignore_index) {
  int64_t rows = dm_numel(targets);
  size_t nb = (size_t)dm_ce_check_scratch(rows, dm_debug_level());
  if (nb == 0) return;
  int64_t *found = (int64_t *)dm_scratch(nb), got[2];
  ce_first_bad_k<<<1, 1, 0, dm_cuda_stream()>>>(dm_data(targets), targets->dtype, dm_lead_of(targets, targets->ndim),
                                                rows, classes, ignore_index, found);
  DM_CU_LAUNCHED();
  DM_CU(cudaMemcpyAsync(got, found, sizeof got, cudaMemcpyDeviceToHost, dm_cuda_stream()));
  DM_CU(cudaStreamSynchronize(dm_cuda_stream()));
  dm_scratch_free(found, nb);
  if (got[0] >= 0)
    dm_error("cross_entropy: target %lld at row %lld of %lld is out of range for %lld classes "
             "(class ids 0..%lld%s)", (long long)got[1], (long long)got[0] + 1, (long long)rows, (long long)classes,
             (long long)classes - 1, ignore_index == -1 ? "" : ", or ignore_index");
}

/* the logsumexp of a row: the max and the exps in the compute type, the log in double, as the CPU
** (a loss near 0 is the difference of two such numbers); NaN passed over by the max, carried by the sum */
template <int DT>
__device__ __forceinline__ double row_lse(const S_<DT> *xr, int64_t xs, int64_t V, int lane) {
  typedef C_<DT> C;
  C m = -INFINITY;
  for (int64_t j = lane; j < V; j += 32) {
    C v = dt<DT>::load(xr[j * xs]);
    m = v > m ? v : m;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    C u = __shfl_xor_sync(DM_FULL_MASK, m, o);
    m = u > m ? u : m;
  }
  if (isinf(m)) return m;                       /* every entry -inf, or one +inf: no shift works */
  C s = 0;
  for (int64_t j = lane; j < V; j += 32) s += exp(dt<DT>::load(xr[j * xs]) - m);
  return (double)m + log((double)dm_warp_sum(s));
}

/* per row: lse, and the loss (NONE: into loss; else the row's term into part, NaN for a bad target) */
template <int DT>
__global__ void ce_k(C_<DT> *loss, C_<DT> *lse, double *part, const S_<DT> *x, dm_lead Lx, int64_t xs,
                     const void *tg, int tdt, dm_lead Lt, int64_t rows, int64_t V, int64_t ignore,
                     dm_device_error *err, int what) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + dm_lead_off(Lx, r);
    double l = row_lse<DT>(xr, xs, V, lane);
    if (lane == 0) {
      int64_t t = target_at(tdt, tg, dm_lead_off(Lt, r));
      double v = 0;
      if (!ignored(t, ignore)) {
        if (t >= 0 && t < V) v = l - (double)dt<DT>::load(xr[t * xs]);
        else {
          dm_report(err, what, t, V, 0);
          v = NAN;
        }
      }
      if (lse) lse[r] = (C)l;
      if (loss) loss[r] = (C)v;
      else part[r] = v;
    }
  }
}

/* one block: the rows' terms summed in a fixed order; mean divides by the rows kept */
template <typename C>
__global__ void ce_total_k(C *loss, const double *part, const void *tg, int tdt, dm_lead Lt, int64_t rows,
                           int64_t ignore, int mean) {
  const int64_t per = (rows + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
  const int64_t hi = lo + per < rows ? lo + per : rows;
  double s = 0;
  int64_t kept = 0;
  for (int64_t r = lo; r < hi; r++) {
    s += part[r];
    kept += !ignored(target_at(tdt, tg, dm_lead_off(Lt, r)), ignore);
  }
  s = dm_block_sum(s);
  kept = dm_block_sum(kept);
  if (threadIdx.x == 0) loss[0] = (C)(mean ? s / (double)kept : s);    /* 0/0: NaN for a mean over no rows */
}

static void cuda_ce(dm_tensor *loss, dm_tensor *lse, const dm_tensor *logits, const dm_tensor *targets,
                    int64_t ignore_index, int reduction) {
  int64_t rows = dm_row_count(logits), V = logits->shape[logits->ndim - 1];
  dm_lead Lx = dm_lead_of(logits, logits->ndim - 1), Lt = dm_lead_of(targets, targets->ndim);
  int64_t xs = logits->strides[logits->ndim - 1];
  dm_dispatch_float(logits->dtype, "cross_entropy", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef C_<DT> C;
    bool none = reduction == DM_CE_NONE;
    size_t nb = (size_t)dm_ce_scratch(rows, !none);
    double *part = none ? NULL : (double *)dm_scratch(nb);
    if (rows > 0) {
      ce_k<DT><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          none ? (C *)dm_data(loss) : NULL, lse ? (C *)dm_data(lse) : NULL, part, (const S_<DT> *)dm_data(logits),
          Lx, xs, dm_data(targets), targets->dtype, Lt, rows, V, ignore_index, dm_cuda_device_error(), ce_name());
      DM_CU_LAUNCHED();
    }
    if (!none) {
      ce_total_k<C><<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>((C *)dm_data(loss), part, dm_data(targets),
                                                                 targets->dtype, Lt, rows, ignore_index,
                                                                 reduction == DM_CE_MEAN);
      DM_CU_LAUNCHED();
      dm_scratch_free(part, nb);
    }
  });
}

/* the rows kept, for the mean's gradient (one block) */
__global__ void ce_kept_k(int64_t *kept, const void *tg, int tdt, dm_lead Lt, int64_t rows, int64_t ignore) {
  int64_t k = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) k += !ignored(target_at(tdt, tg, dm_lead_off(Lt, r)), ignore);
  k = dm_block_sum(k);
  if (threadIdx.x == 0) kept[0] = k;
}

/* gx = c (softmax - onehot), c the row's share of the loss's gradient (0 on ignored rows) */
template <int DT>
__global__ void ce_bwd_k(S_<DT> *gx, const C_<DT> *g, dm_lead Lg, const S_<DT> *x, dm_lead Lx, int64_t xs,
                         const void *tg, int tdt, dm_lead Lt, const C_<DT> *lse, int64_t rows, int64_t V,
                         int64_t ignore, int reduction, const int64_t *kept, dm_device_error *err, int what) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    int64_t t = target_at(tdt, tg, dm_lead_off(Lt, r));
    double c = 0;
    if (!ignored(t, ignore)) {
      if (reduction == DM_CE_NONE) c = (double)g[dm_lead_off(Lg, r)];
      else c = reduction == DM_CE_MEAN ? (double)g[0] / (double)kept[0] : (double)g[0];
    }
    S_<DT> *gr = gx + r * V;
    if (c == 0) {
      for (int64_t j = lane; j < V; j += 32) gr[j] = dt<DT>::store(0);
      continue;
    }
    if (t < 0 || t >= V) {
      if (lane == 0) dm_report(err, what, t, V, 0);
      t = -1;
    }
    const S_<DT> *xr = x + dm_lead_off(Lx, r);
    C l = lse[r], cc = (C)c;
    for (int64_t j = lane; j < V; j += 32) {
      C p = cc * exp(dt<DT>::load(xr[j * xs]) - l);
      gr[j] = dt<DT>::store(j == t ? p - cc : p);
    }
  }
}

static void cuda_ce_bwd(dm_tensor *gx, const dm_tensor *g, const dm_tensor *logits, const dm_tensor *targets,
                        const dm_tensor *lse, int64_t ignore_index, int reduction) {
  int64_t rows = dm_row_count(logits), V = logits->shape[logits->ndim - 1];
  if (rows == 0) return;
  dm_lead Lx = dm_lead_of(logits, logits->ndim - 1), Lt = dm_lead_of(targets, targets->ndim);
  dm_lead Lg = dm_lead_of(g, g->ndim);
  if (g->dtype != lse->dtype)
    dm_error("cross_entropy_bwd: the loss's gradient is %s, expected %s", dm_dtype_name(g->dtype),
             dm_dtype_name(lse->dtype));
  int64_t *kept = NULL;
  const size_t kb = (size_t)dm_ce_bwd_scratch(reduction == DM_CE_MEAN);
  if (kb) {
    kept = (int64_t *)dm_scratch(kb);
    ce_kept_k<<<1, DM_SCAN_THREADS, 0, dm_cuda_stream()>>>(kept, dm_data(targets), targets->dtype, Lt, rows,
                                                           ignore_index);
    DM_CU_LAUNCHED();
  }
  dm_dispatch_float(logits->dtype, "cross_entropy_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    ce_bwd_k<DT><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
        (S_<DT> *)dm_data(gx), (const C_<DT> *)dm_data(g), Lg, (const S_<DT> *)dm_data(logits), Lx,
        logits->strides[logits->ndim - 1], dm_data(targets), targets->dtype, Lt, (const C_<DT> *)dm_data(lse), rows,
        V, ignore_index, reduction, kept, dm_cuda_device_error(), ce_name());
    DM_CU_LAUNCHED();
  });
  if (kept) dm_scratch_free(kept, kb);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(cross_entropy_check, cuda_ce_check),
  DM_KERNEL_ENTRY(cross_entropy, cuda_ce),
  DM_KERNEL_ENTRY(cross_entropy_bwd, cuda_ce_bwd),
};
DM_CUDA_KERNELS(kernels)
