/*
** conv.cu — the causal depthwise convolution on CUDA (vm/ops/conv.h has the
** contracts): forward and backward, and the SiLU of causal_conv1d(...,
** silu = 1) fused into them.
**
** Where the grid fits, a thread owns one channel (or V neighbouring
** channels, in 16-byte loads) of one batch row and slides over a run of
** positions; elsewhere a thread takes one element. The weights' gradient,
** a sum over (b, t), goes through partial sums in a fixed order (the runs',
** or model.cuh's column sums), never atomics: every run gives the same bits.
*/
#include "model.cuh"
extern "C" {
#include "ops/conv.h"
#include "ops/elementwise.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

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
#define CONV_TL DM_CONV_RUN         /* vm/ops/conv.h */
#define CONV_MAXK DM_CONV_MAXK       /* vm/ops/conv.h */
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
  if (pos >= 0) { dm_vload16<DT, V>(v, in.x + b * in.xs[0] + pos * in.xs[1] + c); return; }
  if (in.cache && pos >= -in.P) { dm_vload16<DT, V>(v, in.cache + b * in.cs[0] + (in.P + pos) * in.cs[1] + c); return; }
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
    dm_vstore16<DT, V>(y + i, z);
  }
};
template <int DT, int V> struct conv_vto_dz {
  S_<DT> *gz;
  const S_<DT> *gy;
  __device__ void operator()(int64_t i, C_<DT> *z) const {
    C_<DT> g[V];
    dm_vload16<DT, V>(g, gy + i);
#pragma unroll
    for (int j = 0; j < V; j++) z[j] = g[j] * conv_dsilu(z[j]);
    dm_vstore16<DT, V>(gz + i, z);
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
          dm_vload16<DT, V>(g, gy + (b * T + t) * C + c);
#pragma unroll
          for (int i = 0; i < V; i++) acc[i] += wk[k][i] * g[i];
        }
      }
    int64_t q = pos - (T - P);
    if (gco && q >= 0 && q < P) {
      dm_vload16<DT, V>(g, gco + (b * P + q) * C + c);
#pragma unroll
      for (int i = 0; i < V; i++) acc[i] += g[i];
    }
    if (pos >= 0) dm_vstore16<DT, V>(gx + (b * T + pos) * C + c, acc);
    else dm_vstore16<DT, V>(gc + (b * P + P + pos) * C + c, acc);
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
    dm_vload16<DT, V>(g, gy + (b * in.T + t) * C + c);
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
  constexpr int V = dm_vec16<DT>::V;
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
    constexpr int V = dm_vec16<DT>::V;
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

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(causal_conv1d, cuda_conv),
  DM_KERNEL_ENTRY(causal_conv1d_bwd, cuda_conv_bwd),
  DM_KERNEL_ENTRY(causal_conv1d_silu, cuda_conv_silu),
  DM_KERNEL_ENTRY(causal_conv1d_silu_dz, cuda_conv_silu_dz),
};
DM_CUDA_KERNELS(kernels)
