/*
** blocks.cu — the building blocks on CUDA (blocks.h has the contracts):
** rownorm (rmsnorm, l2norm), cross-entropy, the causal depthwise
** convolution and silu_mul, forward and backward.
**
** Row kernels (rownorm, cross-entropy) give each row one warp: its lanes
** stride through the row (any strides; a row's first element is found
** through its leading dims) and combine by a butterfly, in the compute type
** (float for f32, bf16 and f16; double for f64). Sums over rows (the gain's
** and the convolution weight's gradients, cross-entropy's mean) go through
** partial sums in a fixed order (model.cuh), never atomics: every run gives
** the same bits.
**
** Targets out of range follow index_check's convention (index.cu): by
** default cross_entropy_check does nothing, the kernels skip a bad target
** (its loss is NaN) and record it, and the error is raised at the next
** synchronisation; with DM_DEBUG >= 1 the check runs at the op and raises
** the CPU's message.
*/
#include "model.cuh"
extern "C" {
#include "ops/conv.h"
#include "ops/elementwise.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

/* 16 bytes of elements: V of them a load or a store (the vector kernels of rownorm and the conv) */
template <int DT> struct vec16 { enum { V = 16 / (int)sizeof(S_<DT>) }; };

template <int DT, int V> __device__ __forceinline__ void vload16(C_<DT> *v, const S_<DT> *p) {
  uint4 raw = *(const uint4 *)p;
  const S_<DT> *e = (const S_<DT> *)&raw;
#pragma unroll
  for (int i = 0; i < V; i++) v[i] = dt<DT>::load(e[i]);
}

template <int DT, int V> __device__ __forceinline__ void vstore16(S_<DT> *p, const C_<DT> *v) {
  uint4 raw;
  S_<DT> *e = (S_<DT> *)&raw;
#pragma unroll
  for (int i = 0; i < V; i++) e[i] = dt<DT>::store(v[i]);
  *(uint4 *)p = raw;
}

static int64_t n_rows(const dm_tensor *t) {
  int64_t d = t->shape[t->ndim - 1];
  return d ? dm_numel(t) / d : 0;
}

/* warps a launch of rows needs: 8 rows a block of 256 */
static unsigned row_blocks(int64_t rows) {
  int64_t b = (rows + 7) / 8, cap = (int64_t)dm_cuda_sm_count() * 32;
  return (unsigned)(b < 1 ? 1 : b < cap ? b : cap);
}

#define WARP_LOOP(r, rows)                                                                           \
  for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (rows);              \
       r += ((int64_t)gridDim.x * blockDim.x) >> 5)

/* ---- rownorm ---------------------------------------------------------------------------------- */

template <int DT>
__global__ void rownorm_k(S_<DT> *y, C_<DT> *rstd, const S_<DT> *x, dm_lead Lx, int64_t xs, const S_<DT> *gain,
                          int64_t gs, int64_t rows, int64_t D, double div, double eps) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + dm_lead_off(Lx, r);
    C ss = 0;
    for (int64_t j = lane; j < D; j += 32) {
      C v = dt<DT>::load(xr[j * xs]);
      ss += v * v;
    }
    ss = dm_warp_sum(ss);
    C rs = (C)(1 / sqrt((double)ss / div + eps));
    for (int64_t j = lane; j < D; j += 32) {
      C g = gain ? dt<DT>::load(gain[j * gs]) : (C)1;
      y[r * D + j] = dt<DT>::store(dt<DT>::load(xr[j * xs]) * rs * g);
    }
    if (rstd && lane == 0) rstd[r] = rs;
  }
}

static double norm_div(int kind, int64_t D) { return kind == DM_NORM_RMS ? (double)D : 1.0; }

/* ---- rownorm on rows of 16-byte vectors: each lane takes V neighbouring elements a load --------
** For contiguous, aligned rows of D >= 32 V (the model's d-wide norms): a warp reads 512
** contiguous bytes a load instead of 64. Each lane sums its own elements, then the warp. */
template <int DT, int V>
__global__ void rownorm_vk(S_<DT> *y, C_<DT> *rstd, const S_<DT> *x, int64_t ld, const S_<DT> *gain, int64_t rows,
                           int64_t D, double div, double eps) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + r * ld;
    C ss = 0, v[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      vload16<DT, V>(v, xr + j);
#pragma unroll
      for (int i = 0; i < V; i++) ss += v[i] * v[i];
    }
    ss = dm_warp_sum(ss);
    C rs = (C)(1 / sqrt((double)ss / div + eps)), g[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      vload16<DT, V>(v, xr + j);
      if (gain) vload16<DT, V>(g, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) v[i] = v[i] * rs * (gain ? g[i] : (C)1);
      vstore16<DT, V>(y + r * D + j, v);
    }
    if (rstd && lane == 0) rstd[r] = rs;
  }
}

/* gx of rownorm_bwd_k on vector rows: g and x rows at ld apart, gain contiguous */
template <int DT, int V>
__global__ void rownorm_bwd_vk(S_<DT> *gx, const S_<DT> *g, int64_t lg, const S_<DT> *x, int64_t lx,
                               const S_<DT> *gain, const C_<DT> *rstd, int64_t rows, int64_t D, double div) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + r * lx, *gr = g + r * lg;
    C dot = 0, gv[V], xv[V], gn[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      vload16<DT, V>(gv, gr + j);
      vload16<DT, V>(xv, xr + j);
      if (gain) vload16<DT, V>(gn, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) dot += gv[i] * (gain ? gn[i] : (C)1) * xv[i];
    }
    dot = dm_warp_sum(dot);
    double rd = (double)rstd[r];
    C rs = (C)rd, c = (C)(rd * rd * (double)dot / div);
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      vload16<DT, V>(gv, gr + j);
      vload16<DT, V>(xv, xr + j);
      if (gain) vload16<DT, V>(gn, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) gv[i] = rs * (gv[i] * (gain ? gn[i] : (C)1) - xv[i] * c);
      vstore16<DT, V>(gx + r * D + j, gv);
    }
  }
}

/* the leading stride of t's rows when they are contiguous, 16-byte aligned vector rows of
** D >= 32 V that follow one another at one stride (a single lead dim); else 0 */
static int64_t row_vec_ld(const dm_tensor *t, size_t esize) {
  if (!t) return 0;
  const int64_t D = t->shape[t->ndim - 1], V = 16 / (int64_t)esize;
  if (t->strides[t->ndim - 1] != 1 || D % V != 0 || D < 32 * V || ((uintptr_t)dm_data(t) & 15) != 0) return 0;
  dm_lead L = dm_lead_of(t, t->ndim - 1);
  if (L.nd > 1 || (L.nd == 1 && L.st[0] % V != 0)) return 0;
  return L.nd == 1 ? L.st[0] : D;
}

static void cuda_rownorm(int kind, dm_tensor *y, dm_tensor *rstd, const dm_tensor *x, const dm_tensor *gain,
                         double eps) {
  int64_t rows = n_rows(x), D = x->shape[x->ndim - 1];
  if (rows == 0) return;
  dm_lead Lx = dm_lead_of(x, x->ndim - 1);
  dm_dispatch_float(x->dtype, "rownorm", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    int64_t ld = row_vec_ld(x, sizeof(S_<DT>));
    if (ld && (!gain || (gain->strides[0] == 1 && ((uintptr_t)dm_data(gain) & 15) == 0))) {
      rownorm_vk<DT, vec16<DT>::V><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(y), rstd ? (C_<DT> *)dm_data(rstd) : NULL, (const S_<DT> *)dm_data(x), ld,
          gain ? (const S_<DT> *)dm_data(gain) : NULL, rows, D, norm_div(kind, D), eps);
      DM_CU_LAUNCHED();
      return;
    }
    rownorm_k<DT><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
        (S_<DT> *)dm_data(y), rstd ? (C_<DT> *)dm_data(rstd) : NULL, (const S_<DT> *)dm_data(x), Lx,
        x->strides[x->ndim - 1], gain ? (const S_<DT> *)dm_data(gain) : NULL, gain ? gain->strides[0] : 0, rows, D,
        norm_div(kind, D), eps);
    DM_CU_LAUNCHED();
  });
}

/* gx = r (gh - xh sum(gh xh) / div), xh = x r, gh = g gain */
template <int DT>
__global__ void rownorm_bwd_k(S_<DT> *gx, const S_<DT> *g, dm_lead Lg, int64_t gst, const S_<DT> *x, dm_lead Lx,
                              int64_t xs, const S_<DT> *gain, int64_t gns, const C_<DT> *rstd, int64_t rows,
                              int64_t D, double div) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + dm_lead_off(Lx, r), *gr = g + dm_lead_off(Lg, r);
    C dot = 0;
    for (int64_t j = lane; j < D; j += 32) {
      C gn = gain ? dt<DT>::load(gain[j * gns]) : (C)1;
      dot += dt<DT>::load(gr[j * gst]) * gn * dt<DT>::load(xr[j * xs]);
    }
    dot = dm_warp_sum(dot);
    double rd = (double)rstd[r];
    C rs = (C)rd, c = (C)(rd * rd * (double)dot / div);
    for (int64_t j = lane; j < D; j += 32) {
      C gn = gain ? dt<DT>::load(gain[j * gns]) : (C)1;
      gx[r * D + j] = dt<DT>::store(rs * (dt<DT>::load(gr[j * gst]) * gn - dt<DT>::load(xr[j * xs]) * c));
    }
  }
}

/* the gain's gradient: column j of row r is g x rstd */
template <int DT> struct gain_term {
  const S_<DT> *g, *x;
  dm_lead Lg, Lx;
  int64_t gst, xs;
  const C_<DT> *rstd;
  __device__ C_<DT> operator()(int64_t r, int64_t j) const {
    return dt<DT>::load(g[dm_lead_off(Lg, r) + j * gst]) * dt<DT>::load(x[dm_lead_off(Lx, r) + j * xs]) * rstd[r];
  }
};

template <int DT> struct put_strided {
  S_<DT> *out;
  int64_t st;
  __device__ void operator()(int64_t j, double v) const { out[j * st] = dt<DT>::store(v); }
};

static void cuda_rownorm_bwd(int kind, dm_tensor *gx, dm_tensor *ggain, const dm_tensor *g, const dm_tensor *x,
                             const dm_tensor *gain, const dm_tensor *rstd) {
  int64_t rows = n_rows(x), D = x->shape[x->ndim - 1];
  dm_lead Lx = dm_lead_of(x, x->ndim - 1), Lg = dm_lead_of(g, g->ndim - 1);
  int64_t xs = x->strides[x->ndim - 1], gst = g->strides[g->ndim - 1];
  dm_dispatch_float(x->dtype, "rownorm_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *pg = (const S_<DT> *)dm_data(g), *px = (const S_<DT> *)dm_data(x);
    const C_<DT> *pr = (const C_<DT> *)dm_data(rstd);
    int64_t lx = row_vec_ld(x, sizeof(S_<DT>)), lg = row_vec_ld(g, sizeof(S_<DT>));
    bool vec = lx && lg && (!gain || (gain->strides[0] == 1 && ((uintptr_t)dm_data(gain) & 15) == 0));
    if (gx && rows > 0 && vec) {
      rownorm_bwd_vk<DT, vec16<DT>::V><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(gx), pg, lg, px, lx, gain ? (const S_<DT> *)dm_data(gain) : NULL, pr, rows, D,
          norm_div(kind, D));
      DM_CU_LAUNCHED();
    } else if (gx && rows > 0) {
      rownorm_bwd_k<DT><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(gx), pg, Lg, gst, px, Lx, xs, gain ? (const S_<DT> *)dm_data(gain) : NULL,
          gain ? gain->strides[0] : 0, pr, rows, D, norm_div(kind, D));
      DM_CU_LAUNCHED();
    }
    if (ggain) {
      gain_term<DT> f = {pg, px, Lg, Lx, gst, xs, pr};
      put_strided<DT> put = {(S_<DT> *)dm_data(ggain), ggain->strides[0]};
      dm_colsum(rows, D, f, put);
    }
  });
}

/* ---- cross-entropy -------------------------------------------------------------------------- */

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
  WARP_LOOP(r, rows) {
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
  int64_t rows = n_rows(logits), V = logits->shape[logits->ndim - 1];
  dm_lead Lx = dm_lead_of(logits, logits->ndim - 1), Lt = dm_lead_of(targets, targets->ndim);
  int64_t xs = logits->strides[logits->ndim - 1];
  dm_dispatch_float(logits->dtype, "cross_entropy", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef C_<DT> C;
    bool none = reduction == DM_CE_NONE;
    size_t nb = (size_t)dm_ce_scratch(rows, !none);
    double *part = none ? NULL : (double *)dm_scratch(nb);
    if (rows > 0) {
      ce_k<DT><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
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
  WARP_LOOP(r, rows) {
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
  int64_t rows = n_rows(logits), V = logits->shape[logits->ndim - 1];
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
    ce_bwd_k<DT><<<row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
        (S_<DT> *)dm_data(gx), (const C_<DT> *)dm_data(g), Lg, (const S_<DT> *)dm_data(logits), Lx,
        logits->strides[logits->ndim - 1], dm_data(targets), targets->dtype, Lt, (const C_<DT> *)dm_data(lse), rows,
        V, ignore_index, reduction, kept, dm_cuda_device_error(), ce_name());
    DM_CU_LAUNCHED();
  });
  if (kept) dm_scratch_free(kept, kb);
}

/* ---- causal_conv1d ----------------------------------------------------------------------------- */

/* i = (b n + q) C + c → c, q, b; in 32 bits when i fits (a 64-bit division per
** element costs more than the kernel's memory traffic) */
__device__ __forceinline__ void conv_split(int64_t i, int64_t C, int64_t n, int64_t *c, int64_t *q, int64_t *b) {
  if (i < 0x7fffffff && C * n < 0x7fffffff) {
    uint32_t u = (uint32_t)i, cc = (uint32_t)C, nn = (uint32_t)n, r = u / cc;
    *c = u - r * cc;
    *b = r / nn;
    *q = r - (uint32_t)*b * nn;
    return;
  }
  int64_t r = i / C;
  *c = i - r * C;
  *b = r / n;
  *q = r - *b * n;
}

/* x [B, T, C] with the cache [B, P, C] before it (positions -P..T-1), any strides */
template <int DT> struct conv_in {
  const S_<DT> *x, *cache;
  int64_t xs[3], cs[3], T, P;
  __device__ C_<DT> operator()(int64_t b, int64_t pos, int64_t c) const {
    if (pos >= 0) return dt<DT>::load(x[b * xs[0] + pos * xs[1] + c * xs[2]]);
    if (!cache || pos < -P) return 0;
    return dt<DT>::load(cache[b * cs[0] + (P + pos) * cs[1] + c * cs[2]]);
  }
};

template <int DT> static conv_in<DT> conv_in_of(const dm_tensor *x, const dm_tensor *cache, int64_t P) {
  conv_in<DT> in;
  in.x = (const S_<DT> *)dm_data(x);
  in.cache = cache ? (const S_<DT> *)dm_data(cache) : NULL;
  for (int d = 0; d < 3; d++) {
    in.xs[d] = x->strides[d];
    in.cs[d] = cache ? cache->strides[d] : 0;
  }
  in.T = x->shape[1];
  in.P = P;
  return in;
}

/* y [B, T, C] (contiguous) and the new cache [B, P, C]: xin's last P positions */
template <int DT>
__global__ void conv_k(S_<DT> *y, S_<DT> *cout, conv_in<DT> in, const S_<DT> *w, int64_t ws0, int64_t ws1,
                       int64_t B, int64_t C, int64_t K, int64_t dil) {
  typedef C_<DT> CT;
  const int64_t T = in.T, P = in.P, ny = B * T * C;
  DM_GRID_LOOP(i, ny + B * P * C) {
    if (i < ny) {
      int64_t c, t, b;
      conv_split(i, C, T, &c, &t, &b);
      CT acc = 0;
      for (int64_t k = 0; k < K; k++) acc += dt<DT>::load(w[c * ws0 + k * ws1]) * in(b, t - (K - 1 - k) * dil, c);
      y[i] = dt<DT>::store(acc);
    } else {
      int64_t j = i - ny, c, p, b;
      conv_split(j, C, P, &c, &p, &b);
      cout[j] = dt<DT>::store(in(b, T - P + p, c));
    }
  }
}

/* The run kernels: a thread owns one channel c of one batch row b and slides
** over CONV_TL positions, the channel's K weights in registers, warps along
** channels (coalesced). Each output is the same sum in the same order as in
** conv_k and conv_bwd_k; the weight gradient sums each run's products in
** double, then the runs in order. Used when K <= CONV_MAXK and the grid fits. */
#define CONV_TL DM_CONV_RUN         /* vm/ops/blocks.h */
#define CONV_MAXK DM_CONV_MAXK       /* vm/ops/blocks.h */
#define CONV_CH 128                       /* channels a block */

static bool conv_runs_fit(int64_t B, int64_t span, int64_t K) { return dm_conv_runs_fit(B, span, K); }

static dim3 conv_run_grid(int64_t B, int64_t span, int64_t C) {
  return dim3((unsigned)((C + CONV_CH - 1) / CONV_CH), (unsigned)((span + CONV_TL - 1) / CONV_TL), (unsigned)B);
}

template <int DT>
__device__ __forceinline__ void conv_weights(C_<DT> *wk, const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t c,
                                             int64_t K) {
#pragma unroll
  for (int k = 0; k < CONV_MAXK; k++) wk[k] = k < K ? dt<DT>::load(w[c * ws0 + k * ws1]) : (C_<DT>)0;
}

/* the SiLU of the fused op, in the formula of the elementwise table (vm/ops/elementwise.h) */
template <typename T> __device__ __forceinline__ T conv_silu(T z) { return z * (T)DM_SIGMOID(z); }
template <typename T> __device__ __forceinline__ T conv_dsilu(T z) { return (T)DM_DSILU(z); }

/* the convolution's sum at (b, t, c), taps from the registers wk */
template <int DT>
__device__ __forceinline__ C_<DT> conv_sum(const C_<DT> *wk, const conv_in<DT> &in, int64_t b, int64_t t, int64_t c,
                                          int64_t K, int64_t dil) {
  C_<DT> acc = 0;
#pragma unroll
  for (int k = 0; k < CONV_MAXK; k++)
    if (k < K) acc += wk[k] * in(b, t - (K - 1 - k) * dil, c);
  return acc;
}

/* What a channel run writes at element i from its sum z: y = z, or silu(z) */
template <int DT, bool SILU> struct conv_to_y {
  S_<DT> *y;
  __device__ void operator()(int64_t i, C_<DT> z) const { y[i] = dt<DT>::store(SILU ? conv_silu(z) : z); }
};
/* gz = gy · silu'(z): the fused op's backward, the convolution run again */
template <int DT> struct conv_to_dz {
  S_<DT> *gz;
  const S_<DT> *gy;
  dm_lead Lgy;
  __device__ void operator()(int64_t i, C_<DT> z) const {
    gz[i] = dt<DT>::store(dt<DT>::load(gy[dm_lead_off(Lgy, i)]) * conv_dsilu(z));
  }
};

/* out(i, the sum) for each element i of [B, T, C] */
template <int DT, typename Out>
__global__ void conv_run_k(Out out, conv_in<DT> in, const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t C, int64_t K,
                           int64_t dil) {
  typedef C_<DT> CT;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.z;
  if (c >= C) return;
  CT wk[CONV_MAXK];
  conv_weights<DT>(wk, w, ws0, ws1, c, K);
  const int64_t t0 = (int64_t)blockIdx.y * CONV_TL, t1 = t0 + CONV_TL < in.T ? t0 + CONV_TL : in.T;
  for (int64_t t = t0; t < t1; t++) out((b * in.T + t) * C + c, conv_sum<DT>(wk, in, b, t, c, K, dil));
}

/* out(i, z[i]) over a convolution already in z (where the run kernels do not fit); out may write z[i] */
template <int DT, typename Out> __global__ void conv_apply_k(Out out, const S_<DT> *z, int64_t n) {
  DM_GRID_LOOP(i, n) out(i, (C_<DT>)dt<DT>::load(z[i]));
}

/* the new cache [B, P, C]: xin's last P positions */
template <int DT>
__global__ void conv_cache_k(S_<DT> *cout, conv_in<DT> in, int64_t B, int64_t C) {
  DM_GRID_LOOP(j, B * in.P * C) {
    int64_t c, p, b;
    conv_split(j, C, in.P, &c, &p, &b);
    cout[j] = dt<DT>::store(in(b, in.T - in.P + p, c));
  }
}

/* ---- channel vectors: V channels a thread in 16-byte loads and stores ------------------------
** Where x, its cache, gy and the cache's gradient are contiguous with C a multiple of V and
** 16-byte aligned rows (the model's case), each thread takes V neighbouring channels: a warp
** moves 512 contiguous bytes a position instead of 64. The sums are those of the run kernels,
** term by term and in the same order, so the results are the same bit for bit. */
#define CONV_VEC_TL 8                     /* positions a thread for y, gz and gx */

/* xin at (b, pos), channels c .. c+V-1: x, the cache before it, or zeros */
template <int DT, int V>
__device__ __forceinline__ void conv_vin(C_<DT> *v, const conv_in<DT> &in, int64_t b, int64_t pos, int64_t c) {
  if (pos >= 0) { vload16<DT, V>(v, in.x + b * in.xs[0] + pos * in.xs[1] + c); return; }
  if (in.cache && pos >= -in.P) { vload16<DT, V>(v, in.cache + b * in.cs[0] + (in.P + pos) * in.cs[1] + c); return; }
#pragma unroll
  for (int i = 0; i < V; i++) v[i] = 0;
}

template <int DT, int V, int KM>
__device__ __forceinline__ void conv_vweights(C_<DT> (*wk)[V], const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t c,
                                              int K) {
#pragma unroll
  for (int k = 0; k < KM; k++)
#pragma unroll
    for (int i = 0; i < V; i++) wk[k][i] = k < K ? dt<DT>::load(w[(c + i) * ws0 + k * ws1]) : (C_<DT>)0;
}

/* the epilogues of conv_to_y and conv_to_dz, V elements from i on */
template <int DT, int V, bool SILU> struct conv_vto_y {
  S_<DT> *y;
  __device__ void operator()(int64_t i, C_<DT> *z) const {
#pragma unroll
    for (int j = 0; j < V; j++) z[j] = SILU ? conv_silu(z[j]) : z[j];
    vstore16<DT, V>(y + i, z);
  }
};
template <int DT, int V> struct conv_vto_dz {
  S_<DT> *gz;
  const S_<DT> *gy;
  __device__ void operator()(int64_t i, C_<DT> *z) const {
    C_<DT> g[V];
    vload16<DT, V>(g, gy + i);
#pragma unroll
    for (int j = 0; j < V; j++) z[j] = g[j] * conv_dsilu(z[j]);
    vstore16<DT, V>(gz + i, z);
  }
};

/* out(i, the sums at i .. i+V-1) over [B, T, C], CONV_VEC_TL positions a thread */
template <int DT, int V, int KM, typename Out>
__global__ void conv_vrun_k(Out out, conv_in<DT> in, const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t C, int K,
                            int64_t dil) {
  typedef C_<DT> CT;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V, b = blockIdx.z;
  if (c >= C) return;
  CT wk[KM][V];
  conv_vweights<DT, V, KM>(wk, w, ws0, ws1, c, K);
  const int64_t t0 = (int64_t)blockIdx.y * CONV_VEC_TL, t1 = t0 + CONV_VEC_TL < in.T ? t0 + CONV_VEC_TL : in.T;
  for (int64_t t = t0; t < t1; t++) {
    CT acc[V], xv[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0;
#pragma unroll
    for (int k = 0; k < KM; k++)
      if (k < K) {
        conv_vin<DT, V>(xv, in, b, t - (K - 1 - k) * dil, c);
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] += wk[k][i] * xv[i];
      }
    out((b * in.T + t) * C + c, acc);
  }
}

/* gx (gcache below position 0) at positions lo .. hi-1, as conv_run_bwd_k; gy, gco contiguous */
template <int DT, int V, int KM>
__global__ void conv_vrun_bwd_k(S_<DT> *gx, S_<DT> *gc, const S_<DT> *gy, const S_<DT> *gco, const S_<DT> *w,
                                int64_t ws0, int64_t ws1, int64_t T, int64_t C, int K, int64_t P, int64_t dil,
                                int64_t lo, int64_t hi) {
  typedef C_<DT> CT;
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V, b = blockIdx.z;
  if (c >= C) return;
  CT wk[KM][V];
  conv_vweights<DT, V, KM>(wk, w, ws0, ws1, c, K);
  const int64_t p0 = lo + (int64_t)blockIdx.y * CONV_VEC_TL, p1 = p0 + CONV_VEC_TL < hi ? p0 + CONV_VEC_TL : hi;
  for (int64_t pos = p0; pos < p1; pos++) {
    CT acc[V], g[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0;
    if (gy)
#pragma unroll
      for (int k = 0; k < KM; k++) {
        int64_t t = pos + (K - 1 - k) * dil;
        if (k < K && t >= 0 && t < T) {
          vload16<DT, V>(g, gy + (b * T + t) * C + c);
#pragma unroll
          for (int i = 0; i < V; i++) acc[i] += wk[k][i] * g[i];
        }
      }
    int64_t q = pos - (T - P);
    if (gco && q >= 0 && q < P) {
      vload16<DT, V>(g, gco + (b * P + q) * C + c);
#pragma unroll
      for (int i = 0; i < V; i++) acc[i] += g[i];
    }
    if (pos >= 0) vstore16<DT, V>(gx + (b * T + pos) * C + c, acc);
    else vstore16<DT, V>(gc + (b * P + P + pos) * C + c, acc);
  }
}

/* the weights' partial sums of conv_gw_run_k (CONV_TL positions a run, in double), V channels a thread */
template <int DT, int V, int KM>
__global__ void conv_vgw_run_k(double *part, const S_<DT> *gy, conv_in<DT> in, int64_t C, int K, int64_t dil) {
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V, b = blockIdx.z, run = blockIdx.y;
  if (c >= C) return;
  double acc[KM][V];
#pragma unroll
  for (int k = 0; k < KM; k++)
#pragma unroll
    for (int i = 0; i < V; i++) acc[k][i] = 0;
  const int64_t t0 = run * CONV_TL, t1 = t0 + CONV_TL < in.T ? t0 + CONV_TL : in.T;
#pragma unroll 2
  for (int64_t t = t0; t < t1; t++) {
    C_<DT> g[V], xv[V];
    vload16<DT, V>(g, gy + (b * in.T + t) * C + c);
#pragma unroll
    for (int k = 0; k < KM; k++)
      if (k < K) {
        conv_vin<DT, V>(xv, in, b, t - (K - 1 - k) * dil, c);
#pragma unroll
        for (int i = 0; i < V; i++) acc[k][i] += (double)(g[i] * xv[i]);
      }
  }
  double *out = part + ((b * gridDim.y + run) * K) * C + c;
#pragma unroll
  for (int k = 0; k < KM; k++)
    if (k < K)
#pragma unroll
      for (int i = 0; i < V; i++) out[k * C + i] = acc[k][i];
}

/* may the channel-vector kernels take these tensors (each NULL or contiguous [.., .., C], aligned)? */
static bool conv_vec_fits(int64_t C, int64_t span, size_t esize, const dm_tensor *const *ts, int n) {
  const int64_t V = 16 / (int64_t)esize;
  if (C % V != 0 || (span + CONV_VEC_TL - 1) / CONV_VEC_TL > 65535) return false;
  for (int i = 0; i < n; i++) {
    const dm_tensor *t = ts[i];
    if (t && (!dm_is_contiguous(t) || ((uintptr_t)dm_data(t) & 15) != 0)) return false;
  }
  return true;
}

static dim3 conv_vec_grid(int64_t B, int64_t span, int64_t C, int64_t V, int64_t tl) {
  return dim3((unsigned)((C / V + CONV_CH - 1) / CONV_CH), (unsigned)((span + tl - 1) / tl), (unsigned)B);
}

/* f(std::integral_constant<int, KM>) for the taps' bound KM >= K: 4 (the model's) or CONV_MAXK */
template <typename F> static void conv_dispatch_k(int64_t K, F f) {
  if (K <= 4) f(std::integral_constant<int, 4>());
  else f(std::integral_constant<int, CONV_MAXK>());
}

/* out over [B, T, C] by the channel-vector kernel: false where it does not fit */
template <int DT, typename MakeOut>
static bool conv_vec_run(MakeOut make, const dm_tensor *x, const dm_tensor *w, const dm_tensor *cache,
                         const dm_tensor *gy, int64_t dil) {
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  const dm_tensor *ts[3] = {x, cache, gy};
  constexpr int V = vec16<DT>::V;
  if (!conv_runs_fit(B, T, K) || !conv_vec_fits(C, T, sizeof(S_<DT>), ts, 3) || B * T * C == 0) return false;
  conv_dispatch_k(K, [&](auto km) {
    constexpr int KM = decltype(km)::value;
    conv_vrun_k<DT, V, KM><<<conv_vec_grid(B, T, C, V, CONV_VEC_TL), CONV_CH, 0, dm_cuda_stream()>>>(
        make(std::integral_constant<int, V>()), conv_in_of<DT>(x, cache, P), (const S_<DT> *)dm_data(w),
        w->strides[0], w->strides[1], C, (int)K, dil);
    DM_CU_LAUNCHED();
  });
  return true;
}

static void cuda_conv(dm_tensor *y, dm_tensor *cache_out, const dm_tensor *x, const dm_tensor *w,
                      const dm_tensor *cache, int64_t dil) {
  int64_t B0 = x->shape[0], T0 = x->shape[1], C0 = x->shape[2], K0 = w->shape[1], P0 = (K0 - 1) * dil;
  if (conv_runs_fit(B0, T0, K0) && B0 * T0 * C0 > 0) {
    dm_dispatch_float(x->dtype, "causal_conv1d", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      conv_in<DT> in = conv_in_of<DT>(x, cache, P0);
      auto vy = [&](auto v) { return conv_vto_y<DT, decltype(v)::value, false>{(S_<DT> *)dm_data(y)}; };
      if (!conv_vec_run<DT>(vy, x, w, cache, NULL, dil)) {
        conv_to_y<DT, false> out = {(S_<DT> *)dm_data(y)};
        conv_run_k<DT><<<conv_run_grid(B0, T0, C0), CONV_CH, 0, dm_cuda_stream()>>>(
            out, in, (const S_<DT> *)dm_data(w), w->strides[0], w->strides[1], C0, K0, dil);
        DM_CU_LAUNCHED();
      }
      if (B0 * P0 * C0 > 0) DM_LAUNCH(conv_cache_k<DT>, B0 * P0 * C0, (S_<DT> *)dm_data(cache_out), in, B0, C0);
    });
    return;
  }
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  int64_t n = B * T * C + B * P * C;
  if (n == 0) return;
  dm_dispatch_float(x->dtype, "causal_conv1d", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(conv_k<DT>, n, (S_<DT> *)dm_data(y), (S_<DT> *)dm_data(cache_out), conv_in_of<DT>(x, cache, P),
              (const S_<DT> *)dm_data(w), w->strides[0], w->strides[1], B, C, K, dil);
  });
}

/* "causal_conv1d_silu": y = silu(conv), in one pass where the run kernels fit, else the
** convolution then the SiLU in place */

static void cuda_conv_silu(dm_tensor *y, dm_tensor *cache_out, const dm_tensor *x, const dm_tensor *w,
                           const dm_tensor *cache, int64_t dil) {
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  bool runs = conv_runs_fit(B, T, K) && B * T * C > 0;
  if (!runs) cuda_conv(y, cache_out, x, w, cache, dil);
  dm_dispatch_float(x->dtype, "causal_conv1d_silu", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    conv_to_y<DT, true> out = {(S_<DT> *)dm_data(y)};
    if (!runs) {
      if (B * T * C > 0) DM_LAUNCH(conv_apply_k<DT>, B * T * C, out, (const S_<DT> *)dm_data(y), B * T * C);
      return;
    }
    conv_in<DT> in = conv_in_of<DT>(x, cache, P);
    auto vy = [&](auto v) { return conv_vto_y<DT, decltype(v)::value, true>{(S_<DT> *)dm_data(y)}; };
    if (!conv_vec_run<DT>(vy, x, w, cache, NULL, dil)) {
      conv_run_k<DT><<<conv_run_grid(B, T, C), CONV_CH, 0, dm_cuda_stream()>>>(
          out, in, (const S_<DT> *)dm_data(w), w->strides[0], w->strides[1], C, K, dil);
      DM_CU_LAUNCHED();
    }
    if (B * P * C > 0) DM_LAUNCH(conv_cache_k<DT>, B * P * C, (S_<DT> *)dm_data(cache_out), in, B, C);
  });
}

/* "causal_conv1d_silu_dz": gz = gy · silu'(conv(x)), in one pass where the run kernels fit */
static void cuda_conv_silu_dz(dm_tensor *gz, const dm_tensor *gy, const dm_tensor *x, const dm_tensor *w,
                              const dm_tensor *cache, int64_t dil) {
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  if (B * T * C == 0) return;
  bool runs = conv_runs_fit(B, T, K);
  dm_tensor *scratch_cache = NULL;
  if (!runs) {
    int64_t cs[3] = {B, P, C};
    scratch_cache = dm_tensor_new(DM_CUDA, x->dtype, 3, cs);
    cuda_conv(gz, scratch_cache, x, w, cache, dil);
  }
  dm_lead Lgy = dm_lead_of(gy, 3);
  dm_dispatch_float(x->dtype, "causal_conv1d_silu_dz", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    conv_to_dz<DT> out = {(S_<DT> *)dm_data(gz), (const S_<DT> *)dm_data(gy), Lgy};
    if (!runs) {   /* the convolution is in gz */
      DM_LAUNCH(conv_apply_k<DT>, B * T * C, out, (const S_<DT> *)dm_data(gz), B * T * C);
      return;
    }
    auto vdz = [&](auto v) {
      return conv_vto_dz<DT, decltype(v)::value>{(S_<DT> *)dm_data(gz), (const S_<DT> *)dm_data(gy)};
    };
    if (conv_vec_run<DT>(vdz, x, w, cache, gy, dil)) return;
    conv_run_k<DT><<<conv_run_grid(B, T, C), CONV_CH, 0, dm_cuda_stream()>>>(
        out, conv_in_of<DT>(x, cache, P), (const S_<DT> *)dm_data(w), w->strides[0], w->strides[1], C, K, dil);
    DM_CU_LAUNCHED();
  });
  dm_release(scratch_cache);
}

/* the gradient of xin at every wanted position pos (gx: 0..T-1, gcache: -P..-1): the outputs
** that read it, plus the new cache's row it became */
template <int DT>
__global__ void conv_bwd_k(S_<DT> *gx, S_<DT> *gc, const S_<DT> *gy, dm_lead Lgy, const S_<DT> *gco,
                           dm_lead Lgc, const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t B, int64_t T, int64_t C,
                           int64_t K, int64_t P, int64_t dil, int64_t lo, int64_t hi) {
  typedef C_<DT> CT;
  const int64_t span = hi - lo;
  DM_GRID_LOOP(i, B * span * C) {
    int64_t c, pos, b;
    conv_split(i, C, span, &c, &pos, &b);
    pos += lo;
    CT acc = 0;
    if (gy)
      for (int64_t k = 0; k < K; k++) {
        int64_t t = pos + (K - 1 - k) * dil;
        if (t >= 0 && t < T) acc += dt<DT>::load(w[c * ws0 + k * ws1]) * dt<DT>::load(gy[dm_lead_off(Lgy, (b * T + t) * C + c)]);
      }
    int64_t q = pos - (T - P);
    if (gco && q >= 0 && q < P) acc += dt<DT>::load(gco[dm_lead_off(Lgc, (b * P + q) * C + c)]);
    if (pos >= 0) gx[(b * T + pos) * C + c] = dt<DT>::store(acc);
    else gc[(b * P + P + pos) * C + c] = dt<DT>::store(acc);
  }
}

/* gw[c, k] = sum over (b, t) of gy[b, t, c] xin[b, t - (K-1-k) dil, c]: column j = k C + c of row b T + t */
template <int DT> struct conv_gw_term {
  const S_<DT> *gy;
  dm_lead Lgy;
  conv_in<DT> in;
  int64_t C, K, dil;
  __device__ C_<DT> operator()(int64_t r, int64_t j) const {
    if (!gy) return 0;
    int64_t c, k, unused, t, b;
    conv_split(j, C, K, &c, &k, &unused);           /* j = k C + c */
    conv_split(r, 1, in.T, &unused, &t, &b);        /* r = b T + t */
    return dt<DT>::load(gy[dm_lead_off(Lgy, r * C + c)]) * in(b, t - (K - 1 - k) * dil, c);
  }
};

template <int DT> struct conv_gw_put {
  S_<DT> *gw;
  int64_t s0, s1, C;
  __device__ void operator()(int64_t j, double v) const {
    int64_t k = j / C, c = j - k * C;
    gw[c * s0 + k * s1] = dt<DT>::store(v);
  }
};

/* gx at positions lo .. hi-1 of xin (gcache for those below 0), as conv_bwd_k */
template <int DT>
__global__ void conv_run_bwd_k(S_<DT> *gx, S_<DT> *gc, const S_<DT> *gy, dm_lead Lgy, const S_<DT> *gco,
                               dm_lead Lgc, const S_<DT> *w, int64_t ws0, int64_t ws1, int64_t T, int64_t C,
                               int64_t K, int64_t P, int64_t dil, int64_t lo, int64_t hi) {
  typedef C_<DT> CT;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.z;
  if (c >= C) return;
  CT wk[CONV_MAXK];
  conv_weights<DT>(wk, w, ws0, ws1, c, K);
  const int64_t p0 = lo + (int64_t)blockIdx.y * CONV_TL, p1 = p0 + CONV_TL < hi ? p0 + CONV_TL : hi;
  for (int64_t pos = p0; pos < p1; pos++) {
    CT acc = 0;
    if (gy)
#pragma unroll
      for (int k = 0; k < CONV_MAXK; k++) {
        int64_t t = pos + (K - 1 - k) * dil;
        if (k < K && t >= 0 && t < T) acc += wk[k] * dt<DT>::load(gy[dm_lead_off(Lgy, (b * T + t) * C + c)]);
      }
    int64_t q = pos - (T - P);
    if (gco && q >= 0 && q < P) acc += dt<DT>::load(gco[dm_lead_off(Lgc, (b * P + q) * C + c)]);
    if (pos >= 0) gx[(b * T + pos) * C + c] = dt<DT>::store(acc);
    else gc[(b * P + P + pos) * C + c] = dt<DT>::store(acc);
  }
}

/* part[((b runs + run) K + k) C + c] = the run's sum over t of gy[b, t, c] xin[b, t - (K-1-k) dil, c] */
template <int DT>
__global__ void conv_gw_run_k(double *part, const S_<DT> *gy, dm_lead Lgy, conv_in<DT> in, int64_t C, int64_t K,
                              int64_t dil) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.z, run = blockIdx.y;
  if (c >= C) return;
  double acc[CONV_MAXK];
#pragma unroll
  for (int k = 0; k < CONV_MAXK; k++) acc[k] = 0;
  const int64_t t0 = run * CONV_TL, t1 = t0 + CONV_TL < in.T ? t0 + CONV_TL : in.T;
  for (int64_t t = t0; t < t1; t++) {
    C_<DT> g = dt<DT>::load(gy[dm_lead_off(Lgy, (b * in.T + t) * C + c)]);
#pragma unroll
    for (int k = 0; k < CONV_MAXK; k++)
      if (k < K) acc[k] += (double)(g * in(b, t - (K - 1 - k) * dil, c));
  }
  double *out = part + ((b * gridDim.y + run) * K) * C + c;
#pragma unroll
  for (int k = 0; k < CONV_MAXK; k++)
    if (k < K) out[k * C] = acc[k];
}

/* gw[c, k] = the runs' partial sums, added in order */
template <int DT>
__global__ void conv_gw_join_k(S_<DT> *gw, int64_t s0, int64_t s1, const double *part, int64_t nparts, int64_t K,
                               int64_t C) {
  DM_GRID_LOOP(j, K * C) {
    double s = 0;
    for (int64_t p = 0; p < nparts; p++) s += part[p * K * C + j];
    int64_t k = j / C, c = j - k * C;
    gw[c * s0 + k * s1] = dt<DT>::store(s);
  }
}

static bool conv_bwd_runs(dm_tensor *gx, dm_tensor *gw, dm_tensor *gcache, const dm_tensor *gy,
                          const dm_tensor *gcache_out, const dm_tensor *x, const dm_tensor *w,
                          const dm_tensor *cache, int64_t dil) {
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  int64_t lo = gcache ? -P : 0, hi = gx ? T : 0;
  if (!conv_runs_fit(B, hi - lo > T ? hi - lo : T, K) || B * C == 0) return false;
  dm_lead Lgy = gy ? dm_lead_of(gy, 3) : dm_lead{}, Lgc = gcache_out ? dm_lead_of(gcache_out, 3) : dm_lead{};
  const dm_tensor *vts[4] = {x, cache, gy, gcache_out};
  dm_dispatch_float(x->dtype, "causal_conv1d_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    constexpr int V = vec16<DT>::V;
    const S_<DT> *pgy = gy ? (const S_<DT> *)dm_data(gy) : NULL;
    const bool vec = conv_vec_fits(C, hi - lo > T ? hi - lo : T, sizeof(S_<DT>), vts, 4);
    if (vec && hi > lo) {
      conv_dispatch_k(K, [&](auto km) {
        constexpr int KM = decltype(km)::value;
        conv_vrun_bwd_k<DT, V, KM><<<conv_vec_grid(B, hi - lo, C, V, CONV_VEC_TL), CONV_CH, 0, dm_cuda_stream()>>>(
            gx ? (S_<DT> *)dm_data(gx) : NULL, gcache ? (S_<DT> *)dm_data(gcache) : NULL, pgy,
            gcache_out ? (const S_<DT> *)dm_data(gcache_out) : NULL, (const S_<DT> *)dm_data(w), w->strides[0],
            w->strides[1], T, C, (int)K, P, dil, lo, hi);
        DM_CU_LAUNCHED();
      });
    } else if (hi > lo) {
      conv_run_bwd_k<DT><<<conv_run_grid(B, hi - lo, C), CONV_CH, 0, dm_cuda_stream()>>>(
          gx ? (S_<DT> *)dm_data(gx) : NULL, gcache ? (S_<DT> *)dm_data(gcache) : NULL, pgy, Lgy,
          gcache_out ? (const S_<DT> *)dm_data(gcache_out) : NULL, Lgc, (const S_<DT> *)dm_data(w), w->strides[0],
          w->strides[1], T, C, K, P, dil, lo, hi);
      DM_CU_LAUNCHED();
    }
    if (!gw) return;
    int64_t runs = (T + CONV_TL - 1) / CONV_TL, nparts = B * runs;
    if (!pgy || T == 0) {                                 /* no output gradient: the weights' is 0 */
      DM_LAUNCH(conv_gw_join_k<DT>, K * C, (S_<DT> *)dm_data(gw), gw->strides[0], gw->strides[1], (const double *)NULL,
                (int64_t)0, K, C);
      return;
    }
    size_t nb = (size_t)dm_conv_gw_runs_scratch(B, T, C, K);      /* nparts of K x C */
    double *part = (double *)dm_scratch(nb);
    if (vec) {
      conv_dispatch_k(K, [&](auto km) {
        constexpr int KM = decltype(km)::value;
        conv_vgw_run_k<DT, V, KM><<<conv_vec_grid(B, T, C, V, CONV_TL), CONV_CH, 0, dm_cuda_stream()>>>(
            part, pgy, conv_in_of<DT>(x, cache, P), C, (int)K, dil);
      });
    } else {
      conv_gw_run_k<DT><<<conv_run_grid(B, T, C), CONV_CH, 0, dm_cuda_stream()>>>(part, pgy, Lgy,
                                                                                 conv_in_of<DT>(x, cache, P), C, K, dil);
    }
    DM_CU_LAUNCHED();
    DM_LAUNCH(conv_gw_join_k<DT>, K * C, (S_<DT> *)dm_data(gw), gw->strides[0], gw->strides[1],
              (const double *)part, nparts, K, C);
    dm_scratch_free(part, nb);
  });
  return true;
}

static void cuda_conv_bwd(dm_tensor *gx, dm_tensor *gw, dm_tensor *gcache, const dm_tensor *gy,
                          const dm_tensor *gcache_out, const dm_tensor *x, const dm_tensor *w,
                          const dm_tensor *cache, int64_t dil) {
  int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1], P = (K - 1) * dil;
  int64_t lo = gcache ? -P : 0, hi = gx ? T : 0;     /* the positions whose gradient is wanted */
  if (conv_bwd_runs(gx, gw, gcache, gy, gcache_out, x, w, cache, dil)) return;
  dm_lead Lgy = gy ? dm_lead_of(gy, 3) : dm_lead{}, Lgc = gcache_out ? dm_lead_of(gcache_out, 3) : dm_lead{};
  dm_dispatch_float(x->dtype, "causal_conv1d_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *pgy = gy ? (const S_<DT> *)dm_data(gy) : NULL;
    if (hi > lo && B * C > 0)
      DM_LAUNCH(conv_bwd_k<DT>, B * (hi - lo) * C, gx ? (S_<DT> *)dm_data(gx) : NULL,
                gcache ? (S_<DT> *)dm_data(gcache) : NULL, pgy, Lgy,
                gcache_out ? (const S_<DT> *)dm_data(gcache_out) : NULL, Lgc, (const S_<DT> *)dm_data(w),
                w->strides[0], w->strides[1], B, T, C, K, P, dil, lo, hi);
    if (gw) {
      conv_gw_term<DT> f = {pgy, Lgy, conv_in_of<DT>(x, cache, P), C, K, dil};
      conv_gw_put<DT> put = {(S_<DT> *)dm_data(gw), gw->strides[0], gw->strides[1], C};
      dm_colsum(B * T, K * C, f, put);
    }
  });
}

/* ---- silu_mul ----------------------------------------------------------------------------------- */

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
  DM_KERNEL_ENTRY(rownorm, cuda_rownorm),
  DM_KERNEL_ENTRY(rownorm_bwd, cuda_rownorm_bwd),
  DM_KERNEL_ENTRY(cross_entropy_check, cuda_ce_check),
  DM_KERNEL_ENTRY(cross_entropy, cuda_ce),
  DM_KERNEL_ENTRY(cross_entropy_bwd, cuda_ce_bwd),
  DM_KERNEL_ENTRY(causal_conv1d, cuda_conv),
  DM_KERNEL_ENTRY(causal_conv1d_bwd, cuda_conv_bwd),
  DM_KERNEL_ENTRY(causal_conv1d_silu, cuda_conv_silu),
  DM_KERNEL_ENTRY(causal_conv1d_silu_dz, cuda_conv_silu_dz),
  DM_KERNEL_ENTRY(silu_mul, cuda_silu_mul),
  DM_KERNEL_ENTRY(silu_mul_bwd, cuda_silu_mul_bwd),
};
DM_CUDA_KERNELS(kernels)
