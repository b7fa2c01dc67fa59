/*
** norm.cu — the row norms on CUDA (vm/ops/norm.h has the contracts):
** rownorm (rmsnorm, l2norm; a number in the gain's place when there is
** none, l2norm's scale), forward and backward, and add_rownorm (the
** residual add before one).
**
** Each row gets one warp: its lanes stride through the row (any strides; a
** row's first element is found through its leading dims) and combine by a
** butterfly, in the compute type (float for f32, bf16 and f16; double for
** f64); contiguous, aligned rows go by 16-byte vectors. The gain's gradient,
** a sum over rows, goes through partial sums in a fixed order (model.cuh),
** never atomics: every run gives the same bits.
*/
#include "model.cuh"
extern "C" {
#include "ops/norm.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

template <int DT>
__global__ void rownorm_k(S_<DT> *y, C_<DT> *rstd, const S_<DT> *x, dm_lead Lx, int64_t xs, const S_<DT> *gain,
                          int64_t gs, int64_t rows, int64_t D, double div, double eps, double scale) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + dm_lead_off(Lx, r);
    C ss = 0;
    for (int64_t j = lane; j < D; j += 32) {
      C v = dt<DT>::load(xr[j * xs]);
      ss += v * v;
    }
    ss = dm_warp_sum(ss);
    C rs = (C)(1 / sqrt((double)ss / div + eps));
    for (int64_t j = lane; j < D; j += 32) {
      C g = gain ? dt<DT>::load(gain[j * gs]) : (C)scale;
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
                           int64_t D, double div, double eps, double scale) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + r * ld;
    C ss = 0, v[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      dm_vload16<DT, V>(v, xr + j);
#pragma unroll
      for (int i = 0; i < V; i++) ss += v[i] * v[i];
    }
    ss = dm_warp_sum(ss);
    C rs = (C)(1 / sqrt((double)ss / div + eps)), g[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      dm_vload16<DT, V>(v, xr + j);
      if (gain) dm_vload16<DT, V>(g, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) v[i] = v[i] * rs * (gain ? g[i] : (C)scale);
      dm_vstore16<DT, V>(y + r * D + j, v);
    }
    if (rstd && lane == 0) rstd[r] = rs;
  }
}

/* gx of rownorm_bwd_k on vector rows: g and x rows at ld apart, gain contiguous */
template <int DT, int V>
__global__ void rownorm_bwd_vk(S_<DT> *gx, const S_<DT> *g, int64_t lg, const S_<DT> *x, int64_t lx,
                               const S_<DT> *gain, const C_<DT> *rstd, int64_t rows, int64_t D, double div,
                               double scale) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + r * lx, *gr = g + r * lg;
    C dot = 0, gv[V], xv[V], gn[V];
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      dm_vload16<DT, V>(gv, gr + j);
      dm_vload16<DT, V>(xv, xr + j);
      if (gain) dm_vload16<DT, V>(gn, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) dot += gv[i] * (gain ? gn[i] : (C)scale) * xv[i];
    }
    dot = dm_warp_sum(dot);
    double rd = (double)rstd[r];
    C rs = (C)rd, c = (C)(rd * rd * (double)dot / div);
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      dm_vload16<DT, V>(gv, gr + j);
      dm_vload16<DT, V>(xv, xr + j);
      if (gain) dm_vload16<DT, V>(gn, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) gv[i] = rs * (gv[i] * (gain ? gn[i] : (C)scale) - xv[i] * c);
      dm_vstore16<DT, V>(gx + r * D + j, gv);
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
                         double eps, double scale) {
  int64_t rows = dm_row_count(x), D = x->shape[x->ndim - 1];
  if (rows == 0) return;
  dm_lead Lx = dm_lead_of(x, x->ndim - 1);
  dm_dispatch_float(x->dtype, "rownorm", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    int64_t ld = row_vec_ld(x, sizeof(S_<DT>));
    if (ld && (!gain || (gain->strides[0] == 1 && ((uintptr_t)dm_data(gain) & 15) == 0))) {
      rownorm_vk<DT, dm_vec16<DT>::V><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(y), rstd ? (C_<DT> *)dm_data(rstd) : NULL, (const S_<DT> *)dm_data(x), ld,
          gain ? (const S_<DT> *)dm_data(gain) : NULL, rows, D, norm_div(kind, D), eps, scale);
      DM_CU_LAUNCHED();
      return;
    }
    rownorm_k<DT><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
        (S_<DT> *)dm_data(y), rstd ? (C_<DT> *)dm_data(rstd) : NULL, (const S_<DT> *)dm_data(x), Lx,
        x->strides[x->ndim - 1], gain ? (const S_<DT> *)dm_data(gain) : NULL, gain ? gain->strides[0] : 0, rows, D,
        norm_div(kind, D), eps, scale);
    DM_CU_LAUNCHED();
  });
}

/* gx = r (gh - xh sum(gh xh) / div), xh = x r, gh = g gain */
template <int DT>
__global__ void rownorm_bwd_k(S_<DT> *gx, const S_<DT> *g, dm_lead Lg, int64_t gst, const S_<DT> *x, dm_lead Lx,
                              int64_t xs, const S_<DT> *gain, int64_t gns, const C_<DT> *rstd, int64_t rows,
                              int64_t D, double div, double scale) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  DM_WARP_LOOP(r, rows) {
    const S_<DT> *xr = x + dm_lead_off(Lx, r), *gr = g + dm_lead_off(Lg, r);
    C dot = 0;
    for (int64_t j = lane; j < D; j += 32) {
      C gn = gain ? dt<DT>::load(gain[j * gns]) : (C)scale;
      dot += dt<DT>::load(gr[j * gst]) * gn * dt<DT>::load(xr[j * xs]);
    }
    dot = dm_warp_sum(dot);
    double rd = (double)rstd[r];
    C rs = (C)rd, c = (C)(rd * rd * (double)dot / div);
    for (int64_t j = lane; j < D; j += 32) {
      C gn = gain ? dt<DT>::load(gain[j * gns]) : (C)scale;
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
                             const dm_tensor *gain, const dm_tensor *rstd, double scale) {
  int64_t rows = dm_row_count(x), D = x->shape[x->ndim - 1];
  dm_lead Lx = dm_lead_of(x, x->ndim - 1), Lg = dm_lead_of(g, g->ndim - 1);
  int64_t xs = x->strides[x->ndim - 1], gst = g->strides[g->ndim - 1];
  dm_dispatch_float(x->dtype, "rownorm_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *pg = (const S_<DT> *)dm_data(g), *px = (const S_<DT> *)dm_data(x);
    const C_<DT> *pr = (const C_<DT> *)dm_data(rstd);
    int64_t lx = row_vec_ld(x, sizeof(S_<DT>)), lg = row_vec_ld(g, sizeof(S_<DT>));
    bool vec = lx && lg && (!gain || (gain->strides[0] == 1 && ((uintptr_t)dm_data(gain) & 15) == 0));
    if (gx && rows > 0 && vec) {
      rownorm_bwd_vk<DT, dm_vec16<DT>::V><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(gx), pg, lg, px, lx, gain ? (const S_<DT> *)dm_data(gain) : NULL, pr, rows, D,
          norm_div(kind, D), scale);
      DM_CU_LAUNCHED();
    } else if (gx && rows > 0) {
      rownorm_bwd_k<DT><<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
          (S_<DT> *)dm_data(gx), pg, Lg, gst, px, Lx, xs, gain ? (const S_<DT> *)dm_data(gain) : NULL,
          gain ? gain->strides[0] : 0, pr, rows, D, norm_div(kind, D), scale);
      DM_CU_LAUNCHED();
    }
    if (ggain) {
      gain_term<DT> f = {pg, px, Lg, Lx, gst, xs, pr};
      put_strided<DT> put = {(S_<DT> *)dm_data(ggain), ggain->strides[0]};
      dm_colsum(rows, D, f, put);
    }
  });
}

/* ---- add_rownorm: s = h + y, x = s in y's dtype, u = rmsnorm(x) * gain --------------------------
** One warp a row of contiguous rows. The bits are those of the ops it stands for: y cast to h's
** dtype and added in h's compute type (the copy and binary kernels), s cast to y's dtype, and the
** sum of squares taken over x's elements in the order rownorm's kernel would take them (V
** neighbouring elements a lane where rownorm_vk would run on x, else one), so u and rstd are
** rmsnorm's. The second pass reads s back (the lane wrote it). scale (1) stands in for a missing gain
** read at run time, as rownorm's kernels read theirs: the products then contract alike. With VL
** (every row 16-byte aligned) a lane's V elements move as whole 16-byte words: the same elements in
** the same order, so the same bits. The loads stay 16-byte loads; in the unrolled main loop the
** compiler splits some of the stores (f32 rows among them) into narrower ones. */

/* N neighbouring storage elements from src to dst (registers or memory) through 16-byte words
** (both 16-byte aligned), or one by one */
template <bool VL, typename S, int N> __device__ __forceinline__ void raw_copy(S *dst, const S *src) {
  static_assert(!VL || N * sizeof(S) % 16 == 0, "raw_copy: whole 16-byte words only");
  if (VL) {
#pragma unroll
    for (int k = 0; k < (int)(N * sizeof(S) / 16); k++) ((uint4 *)dst)[k] = ((const uint4 *)src)[k];
  } else {
#pragma unroll
    for (int i = 0; i < N; i++) dst[i] = src[i];
  }
}

template <int DH, int DY, int V, bool VL>
__global__ void add_rownorm_k(S_<DH> *s, S_<DY> *x, S_<DY> *u, C_<DY> *rstd, const S_<DH> *h, const S_<DY> *y,
                              const S_<DY> *gain, int64_t gs, int64_t rows, int64_t D, double eps, double scale) {
  typedef C_<DY> C;
  const int lane = threadIdx.x & 31;
  alignas(16) S_<DH> hv[V], sv[V];
  alignas(16) S_<DY> yv[V], xv[V], gv[V];
  DM_WARP_LOOP(r, rows) {
    const int64_t o = r * D;
    C ss = 0;
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      raw_copy<VL, S_<DH>, V>(hv, h + o + j);
      raw_copy<VL, S_<DY>, V>(yv, y + o + j);
#pragma unroll
      for (int i = 0; i < V; i++) {
        sv[i] = dt<DH>::store(dt<DH>::load(hv[i]) + dt<DH>::load(dt<DH>::store(dt<DY>::load(yv[i]))));
        xv[i] = dt<DY>::store(dt<DH>::load(sv[i]));
        C v = dt<DY>::load(xv[i]);
        ss += v * v;
      }
      raw_copy<VL, S_<DH>, V>(s + o + j, sv);
      if (x) raw_copy<VL, S_<DY>, V>(x + o + j, xv);
    }
    ss = dm_warp_sum(ss);
    C rs = (C)(1 / sqrt((double)ss / (double)D + eps));
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      raw_copy<VL, S_<DH>, V>(sv, s + o + j);
      if (gain && VL) raw_copy<VL, S_<DY>, V>(gv, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) {
        C v = dt<DY>::load(dt<DY>::store(dt<DH>::load(sv[i])));
        C g = gain ? dt<DY>::load(VL ? gv[i] : gain[(j + i) * gs]) : (C)scale;
        xv[i] = dt<DY>::store(v * rs * g);
      }
      raw_copy<VL, S_<DY>, V>(u + o + j, xv);
    }
    if (rstd && lane == 0) rstd[r] = rs;
  }
}

static bool aligned16(const dm_tensor *t) { return !t || ((uintptr_t)dm_data(t) & 15) == 0; }

template <int DH, int DY>
static void launch_add_rownorm(dm_tensor *s, dm_tensor *x, dm_tensor *u, dm_tensor *rstd, const dm_tensor *h,
                               const dm_tensor *y, const dm_tensor *gain, int64_t rows, int64_t D, double eps) {
  constexpr int V = dm_vec16<DY>::V;
  /* where rmsnorm of a fresh x would take its vector kernel (cuda_rownorm, row_vec_ld) */
  bool vec = D % V == 0 && D >= 32 * V && (!gain || (gain->strides[0] == 1 && aligned16(gain)));
  bool vl = vec && aligned16(s) && aligned16(x) && aligned16(u) && aligned16(h) && aligned16(y);
  auto k = vl ? add_rownorm_k<DH, DY, V, true> : vec ? add_rownorm_k<DH, DY, V, false> : add_rownorm_k<DH, DY, 1, false>;
  k<<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
      (S_<DH> *)dm_data(s), x ? (S_<DY> *)dm_data(x) : NULL, (S_<DY> *)dm_data(u),
      rstd ? (C_<DY> *)dm_data(rstd) : NULL, (const S_<DH> *)dm_data(h), (const S_<DY> *)dm_data(y),
      gain ? (const S_<DY> *)dm_data(gain) : NULL, gain ? gain->strides[0] : 0, rows, D, eps, 1.0);
  DM_CU_LAUNCHED();
}

static void cuda_add_rownorm(dm_tensor *s, dm_tensor *x, dm_tensor *u, dm_tensor *rstd, const dm_tensor *h,
                             const dm_tensor *y, const dm_tensor *gain, double eps) {
  int64_t rows = dm_row_count(u), D = u->shape[u->ndim - 1];
  if (rows == 0 || D == 0) return;
  if (h->dtype == y->dtype) {
    dm_dispatch_float(y->dtype, "add_rownorm", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      launch_add_rownorm<DT, DT>(s, x, u, rstd, h, y, gain, rows, D, eps);
    });
  } else if (h->dtype == DM_F32 && y->dtype == DM_BF16) {
    launch_add_rownorm<DM_F32, DM_BF16>(s, x, u, rstd, h, y, gain, rows, D, eps);
  } else if (h->dtype == DM_F32 && y->dtype == DM_F16) {
    launch_add_rownorm<DM_F32, DM_F16>(s, x, u, rstd, h, y, gain, rows, D, eps);
  } else {
    dm_error("add_rmsnorm: on CUDA h and y share a dtype, or h is f32 and y bf16 or f16; got h %s and y %s",
             dm_dtype_name(h->dtype), dm_dtype_name(y->dtype));
  }
}

/* a + b rounded once, never contracted with the product that made b */
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

/* ---- add_rownorm_bwd: gs = g + gx, gy = gs in y's dtype -------------------------------------------
** One warp a row of contiguous rows. gx is rownorm_bwd's, bit for bit: its row sum in the order of
** rownorm_bwd_vk (V neighbouring elements a lane) where that kernel would run on x and gu, else of
** rownorm_bwd_k, and the same expressions; it is rounded to x's dtype, widened and added to g as the
** cast and the add would, and gs rounded to y's dtype as the cast would. VL: as add_rownorm_k's. */
template <int DH, int DY, int V, bool VL>
__global__ void add_rownorm_bwd_k(S_<DH> *gs, S_<DY> *gy, const S_<DH> *g, const S_<DY> *gu, const S_<DY> *x,
                                  const S_<DY> *gain, int64_t gst, const C_<DY> *rstd, int64_t rows, int64_t D,
                                  double scale) {
  typedef C_<DY> C;
  const int lane = threadIdx.x & 31;
  const double div = (double)D;
  alignas(16) S_<DH> hv[V];
  alignas(16) S_<DY> uv[V], xv[V], nv[V];
  DM_WARP_LOOP(r, rows) {
    const int64_t o = r * D;
    C dot = 0;
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      raw_copy<VL, S_<DY>, V>(uv, gu + o + j);
      raw_copy<VL, S_<DY>, V>(xv, x + o + j);
      if (gain && VL) raw_copy<VL, S_<DY>, V>(nv, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) {
        C gn = gain ? dt<DY>::load(VL ? nv[i] : gain[(j + i) * gst]) : (C)scale;
        dot += dt<DY>::load(uv[i]) * gn * dt<DY>::load(xv[i]);
      }
    }
    dot = dm_warp_sum(dot);
    double rd = (double)rstd[r];
    C rs = (C)rd, c = (C)(rd * rd * (double)dot / div);
    for (int64_t j = lane * V; j < D; j += 32 * V) {
      raw_copy<VL, S_<DY>, V>(uv, gu + o + j);
      raw_copy<VL, S_<DY>, V>(xv, x + o + j);
      raw_copy<VL, S_<DH>, V>(hv, g + o + j);
      if (gain && VL) raw_copy<VL, S_<DY>, V>(nv, gain + j);
#pragma unroll
      for (int i = 0; i < V; i++) {
        C gn = gain ? dt<DY>::load(VL ? nv[i] : gain[(j + i) * gst]) : (C)scale;
        S_<DY> gx = dt<DY>::store(rs * (dt<DY>::load(uv[i]) * gn - dt<DY>::load(xv[i]) * c));
        /* rounded apart, as two kernels round it: no contraction of the product into the add */
        hv[i] = dt<DH>::store(add_rn(dt<DH>::load(hv[i]), dt<DH>::load(dt<DH>::store(dt<DY>::load(gx)))));
        uv[i] = dt<DY>::store(dt<DH>::load(hv[i]));
      }
      raw_copy<VL, S_<DH>, V>(gs + o + j, hv);
      if (gy) raw_copy<VL, S_<DY>, V>(gy + o + j, uv);
    }
  }
}

template <int DH, int DY>
static void launch_add_rownorm_bwd(dm_tensor *gs, dm_tensor *gy, const dm_tensor *g, const dm_tensor *gu,
                                   const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd, int64_t rows,
                                   int64_t D) {
  constexpr int V = dm_vec16<DY>::V;
  /* where rownorm_bwd on x and gu would take its vector kernel (cuda_rownorm_bwd) */
  bool vec = row_vec_ld(x, sizeof(S_<DY>)) && row_vec_ld(gu, sizeof(S_<DY>)) &&
             (!gain || (gain->strides[0] == 1 && aligned16(gain)));
  bool vl = vec && aligned16(gs) && aligned16(gy) && aligned16(g);
  auto k = vl    ? add_rownorm_bwd_k<DH, DY, V, true>
           : vec ? add_rownorm_bwd_k<DH, DY, V, false>
                 : add_rownorm_bwd_k<DH, DY, 1, false>;
  k<<<dm_row_blocks(rows), DM_THREADS, 0, dm_cuda_stream()>>>(
      (S_<DH> *)dm_data(gs), gy ? (S_<DY> *)dm_data(gy) : NULL, (const S_<DH> *)dm_data(g),
      (const S_<DY> *)dm_data(gu), (const S_<DY> *)dm_data(x), gain ? (const S_<DY> *)dm_data(gain) : NULL,
      gain ? gain->strides[0] : 0, (const C_<DY> *)dm_data(rstd), rows, D, 1.0);
  DM_CU_LAUNCHED();
}

static void cuda_add_rownorm_bwd(dm_tensor *gs, dm_tensor *gy, const dm_tensor *g, const dm_tensor *gu,
                                 const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd) {
  int64_t rows = dm_row_count(x), D = x->shape[x->ndim - 1];
  if (rows == 0 || D == 0) return;
  if (gs->dtype == x->dtype) {
    dm_dispatch_float(x->dtype, "add_rownorm_bwd", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      launch_add_rownorm_bwd<DT, DT>(gs, gy, g, gu, x, gain, rstd, rows, D);
    });
  } else if (gs->dtype == DM_F32 && x->dtype == DM_BF16) {
    launch_add_rownorm_bwd<DM_F32, DM_BF16>(gs, gy, g, gu, x, gain, rstd, rows, D);
  } else if (gs->dtype == DM_F32 && x->dtype == DM_F16) {
    launch_add_rownorm_bwd<DM_F32, DM_F16>(gs, gy, g, gu, x, gain, rstd, rows, D);
  } else {
    dm_error("add_rmsnorm's backward: on CUDA h and y share a dtype, or h is f32 and y bf16 or f16; got h %s and y %s",
             dm_dtype_name(gs->dtype), dm_dtype_name(x->dtype));
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(rownorm, cuda_rownorm),
  DM_KERNEL_ENTRY(rownorm_bwd, cuda_rownorm_bwd),
  DM_KERNEL_ENTRY(add_rownorm, cuda_add_rownorm),
  DM_KERNEL_ENTRY(add_rownorm_bwd, cuda_add_rownorm_bwd),
};
DM_CUDA_KERNELS(kernels)
