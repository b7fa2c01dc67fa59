/*
** kda_chunk.cu — the chunked WY/UT form of KDA on CUDA (kda.h has the
** contract, vm/cpu/kda_chunk.c the same algorithm as plain loops and its
** equations; research-kda.md §2, §3.2). Chunks of KC = 64 rows, sub-chunks
** of KS = 16, dk, dv <= 64, everything in float32: the inputs are widened
** on load, the gates' cumsum G, the state and every intermediate are
** float32.
**
** Kernels (one block of 256 threads each; "chunk" = one (b, h, chunk)):
**   prep     per chunk: G, M, P, A = (I + StrictLower(beta M))^-1, w, u, kg,
**            qg, e^G_last into device scratch.
**   state    per (b, h, 32 value columns), serial over chunks: vn = u - w S,
**            o = qg S + P vn, S = e^G_last S + kg^T vn; the backward's
**            recompute keeps S (h) and vn per chunk instead of o.
**   bstate   per (b, h, 32 value columns), last chunk first: dh = dS,
**            dvn = P^T do + kg dS, dS = e^G_last dS + qg^T do - w^T dvn.
**   bwy      per chunk: the inter-chunk and WY terms (§3.2 B3), dv and
**            dbeta final, dq, dk, dG partial, dM = beta dL and dP saved.
**   bintra   per chunk: the intra-chunk terms through M and P (B4), then
**            dq, dk and dg = the reverse cumsum of dG (B5).
**
** No exponent is positive (§2.3): across sub-chunks e^(G_i - G_j) is
** e^(G_i - G_r) e^(G_r - G_j), r the first row of i's sub-chunk, which
** turns those blocks into products of KE = k e^(G - G_r) (QE with q) with
** KB_a = k e^(G_r(a) - G) (EB_a without k); inside a sub-chunk the
** exponentials are taken pair by pair. Rows past the end of a partial
** chunk are zeros (g = 0, beta = 0), which keeps them out of every sum.
**
** Products run over 64 x 64 tiles in shared memory (row stride 65, no
** bank conflicts down a column): thread (ty, tx) = (tid / 16, tid % 16)
** owns rows ty + 16 r and columns tx + 16 c, so row group r is the
** sub-chunk. Every sum runs in a fixed order and nothing is added with
** atomics: two runs give the same bits.
*/
#include "model.cuh"
extern "C" {
#include "kda.h"
}

#define KC 64
#define KS 16
#define LD 65                    /* row stride of a 64-column tile */
#define LDV 33                   /* row stride of a 32-column tile */
#define TILE (KC * LD)
#define VT 32                    /* value columns per state block */
#define KC_THREADS 256
#define KB_ROWS 96               /* the anchored rows: 16 + 32 + 48 for anchors 1, 2, 3 */

/* the row of KB_a / EB_a holding column j (j < 16 a) */
__device__ __forceinline__ int kb_row(int a, int j) { return 8 * a * (a - 1) + j; }

struct kc_io {
  int64_t B, T, H, dk, dv, NT;
  const void *q, *k, *v, *g, *beta, *s0, *dout, *dsf;
  int qdt, gdt, bdt, sdt, odt, fdt;
  void *o;
  float *sfin;
  void *dq, *dk_, *dv_, *dg, *dbeta, *ds0;
  int dqdt, dkdt, dvdt, dgdt, dbdt, ds0dt;
  /* scratch, KC x KC floats per chunk (decay: KC) */
  float *w, *u, *kg, *qg, *P, *decay;
  float *h, *vn, *dh, *dvn, *dM, *dP, *pq, *pk, *pG;
};

__device__ __forceinline__ float *chunk_tile(float *base, int64_t chunk) { return base + chunk * (KC * KC); }

/* rows in chunk n of a sequence of T */
__device__ __forceinline__ int chunk_rows(const kc_io &A, int64_t n) {
  int64_t c = A.T - n * KC;
  return (int)(c < KC ? c : KC);
}

/* ---- loading ------------------------------------------------------------------------------------ */

/* element i of a float tensor of dtype DT, as float */
template <int DT> __device__ __forceinline__ float ldt(const void *p, int64_t i) {
  return (float)dt<DT>::load(((const typename dt<DT>::S *)p)[i]);
}

/* f(std::integral_constant<int, DT>) for a float dtype t: the loops inside f are
** compiled per dtype, so their loads are independent and all in flight at once */
template <typename F> __device__ __forceinline__ void with_dtype(int t, F f) {
  switch (t) {
  case DM_BF16: f(std::integral_constant<int, DM_BF16>()); break;
  case DM_F16: f(std::integral_constant<int, DM_F16>()); break;
  case DM_F64: f(std::integral_constant<int, DM_F64>()); break;
  default: f(std::integral_constant<int, DM_F32>()); break;
  }
}

/* rows i < c, columns x < d of chunk rows of a [B, T, H, d] tensor into a tile (zeros elsewhere) */
__device__ __forceinline__ void rows_in(float *dst, const void *src, int t, int64_t row0, int64_t rstride, int c,
                                        int d) {
  with_dtype(t, [&](auto D) {
#pragma unroll
    for (int it = 0; it < KC * KC / KC_THREADS; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / KC, x = idx % KC;
      dst[i * LD + x] = i < c && x < d ? ldt<decltype(D)::value>(src, row0 + i * rstride + x) : 0.f;
    }
  });
}

/* q, k, v (each may be NULL), G = the in-chunk cumsum of g, beta; rows >= c and columns >= dk/dv zero */
__device__ void kc_load(const kc_io &A, int64_t pair, int64_t n, int c, float *q, float *k, float *v, float *G,
                        float *beta) {
  const int64_t b = pair / A.H, hh = pair % A.H, t0 = n * KC;
  const int64_t rk = ((b * A.T + t0) * A.H + hh) * A.dk, rv = ((b * A.T + t0) * A.H + hh) * A.dv;
  const int dk = (int)A.dk, dv = (int)A.dv;
  if (q) rows_in(q, A.q, A.qdt, rk, A.H * A.dk, c, dk);
  if (k) rows_in(k, A.k, A.qdt, rk, A.H * A.dk, c, dk);
  if (v) rows_in(v, A.v, A.qdt, rv, A.H * A.dv, c, dv);
  /* G: one thread per column, the rows summed in order (as vm/cpu/kda_chunk.c: the same bits) */
  if (threadIdx.x < KC) {
    const int x = threadIdx.x, i = threadIdx.x;
    with_dtype(A.gdt, [&](auto D) {
      float s = 0;
#pragma unroll 16
      for (int r = 0; r < KC; r++) {
        s += r < c && x < dk ? ldt<decltype(D)::value>(A.g, rk + r * A.H * A.dk + x) : 0.f;
        G[r * LD + x] = s;
      }
    });
    beta[i] = i < c ? (float)dm_ld(A.bdt, A.beta, (b * A.T + t0 + i) * A.H + hh) : 0.f;
  }
  __syncthreads();
}

/* KE = k e^(G - G_r), QE = q e^(G - G_r) (r: the row's sub-chunk start); KB_a, EB_a (NULL: not wanted) */
__device__ void kc_anchor(const float *q, const float *k, const float *G, float *KE, float *QE, float *KB, float *EB) {
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC, r = i / KS * KS;
    const float e = __expf(G[i * LD + x] - G[r * LD + x]);
    if (KE) KE[i * LD + x] = k[i * LD + x] * e;
    if (QE) QE[i * LD + x] = q[i * LD + x] * e;
  }
  for (int idx = threadIdx.x; idx < KB_ROWS * KC; idx += KC_THREADS) {
    const int row = idx / KC, x = idx % KC;
    const int a = row < 16 ? 1 : row < 48 ? 2 : 3, j = row - 8 * a * (a - 1);
    const float e = __expf(G[KS * a * LD + x] - G[j * LD + x]);
    if (EB) EB[row * LD + x] = e;
    if (KB) KB[row * LD + x] = k[j * LD + x] * e;
  }
  __syncthreads();
}

/* M (strictly lower, into Ms, which may lie over KB) and, with Pg, P (lower, to global) */
__device__ void kc_mp(const float *q, const float *k, const float *G, const float *KE, const float *QE,
                      const float *KB, float *Ms, float *Pg) {
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  float m[4][4], p[4][4];
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) m[r][cc] = p[r][cc] = 0;
  /* across sub-chunks: (k|q e^(G - G_r)) . (k e^(G_r - G)) */
  for (int x = 0; x < KC; x++) {
    float ke[4], qe[4];
#pragma unroll
    for (int r = 1; r < 4; r++) {
      ke[r] = KE[(ty + KS * r) * LD + x];
      if (Pg) qe[r] = QE[(ty + KS * r) * LD + x];
    }
#pragma unroll
    for (int r = 1; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < r; cc++) {
        const float kb = KB[kb_row(r, tx + KS * cc) * LD + x];
        m[r][cc] = fmaf(ke[r], kb, m[r][cc]);
        if (Pg) p[r][cc] = fmaf(qe[r], kb, p[r][cc]);
      }
  }
  /* inside a sub-chunk, pair by pair */
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int i = ty + KS * r, j = tx + KS * r;
    if (j > i) continue;
    float mm = 0, pp = 0;
    for (int x = 0; x < KC; x++) {
      const float kf = k[j * LD + x] * __expf(G[i * LD + x] - G[j * LD + x]);
      mm = fmaf(k[i * LD + x], kf, mm);
      pp = fmaf(q[i * LD + x], kf, pp);
    }
    m[r][r] = j < i ? mm : 0.f;
    p[r][r] = pp;
  }
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++)
      if (Pg) Pg[(ty + KS * r) * KC + tx + KS * cc] = cc <= r ? p[r][cc] : 0.f;
  __syncthreads();                                 /* Ms may lie over KB */
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) Ms[(ty + KS * r) * LD + tx + KS * cc] = cc <= r ? m[r][cc] : 0.f;
  __syncthreads();
}

/* A = (I + L)^-1, L = StrictLower(Diag(beta) M): forward substitution in the
** 16 x 16 diagonal blocks, then the blocks below them, nearest first:
** A_ab = -A_aa sum_{m = b}^{a-1} L_am A_mb. X: 256 floats of scratch. */
__device__ void kc_inverse(const float *Ms, const float *beta, float *As, float *X) {
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) As[(idx / KC) * LD + idx % KC] = 0;
  __syncthreads();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (w < 4 && lane < KS) {                       /* lane m: column m of block w, its own column only */
    const int o = KS * w, m = lane;
    for (int ii = 0; ii < KS; ii++) {
      float s = ii == m ? 1.f : 0.f;
      if (ii > m) {
        float acc = 0;
        for (int jj = m; jj < ii; jj++) acc = fmaf(Ms[(o + ii) * LD + o + jj], As[(o + jj) * LD + o + m], acc);
        s = -beta[o + ii] * acc;
      }
      As[(o + ii) * LD + o + m] = s;
    }
  }
  __syncthreads();
  const int ii = threadIdx.x >> 4, mm = threadIdx.x & 15;
  for (int d = 1; d < 4; d++)
    for (int a = d; a < 4; a++) {
      const int bb = a - d;
      float s = 0;
      for (int m = KS * bb; m < KS * a; m++) s = fmaf(Ms[(KS * a + ii) * LD + m], As[m * LD + KS * bb + mm], s);
      X[ii * KS + mm] = beta[KS * a + ii] * s;
      __syncthreads();
      float t = 0;
      for (int jj = 0; jj < KS; jj++) t = fmaf(As[(KS * a + ii) * LD + KS * a + jj], X[jj * KS + mm], t);
      As[(KS * a + ii) * LD + KS * bb + mm] = -t;
      __syncthreads();
    }
}

/* ---- prep -------------------------------------------------------------------------------------- */

/* shared floats: q k G KE QE (5 tiles), KB, beta, X: under 113 KB, two blocks a multiprocessor.
** After M and P, M lies over KB, X = beta k e^G over KE, Y = beta v over QE, A over q. */
#define PREP_SMEM (5 * TILE + KB_ROWS * LD + KC + KS * KS)

__global__ void __launch_bounds__(KC_THREADS, 2) kc_prep_k(kc_io A) {
  extern __shared__ float sm[];
  float *q = sm, *k = q + TILE, *G = k + TILE, *KE = G + TILE, *QE = KE + TILE, *KB = QE + TILE;
  float *beta = KB + KB_ROWS * LD, *X = beta + KC, *Ms = KB, *As = q;
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT;
  const int c = chunk_rows(A, n);
  kc_load(A, pair, n, c, q, k, NULL, G, beta);
  kc_anchor(q, k, G, KE, QE, KB, NULL);
  kc_mp(q, k, G, KE, QE, KB, Ms, chunk_tile(A.P, chunk));
  /* X = beta k e^G into KE, v into QE; kg, qg, e^G_last out */
  float *gk = chunk_tile(A.kg, chunk), *gq = chunk_tile(A.qg, chunk);
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC;
    const float G_i = G[i * LD + x], eg = __expf(G_i);
    KE[i * LD + x] = beta[i] * k[i * LD + x] * eg;
    gk[idx] = k[i * LD + x] * __expf(G[(KC - 1) * LD + x] - G_i);
    gq[idx] = q[i * LD + x] * eg;
  }
  if (threadIdx.x < KC) A.decay[chunk * KC + threadIdx.x] = __expf(G[(KC - 1) * LD + threadIdx.x]);
  {
    const int64_t b = pair / A.H, hh = pair % A.H;
    rows_in(QE, A.v, A.qdt, ((b * A.T + n * KC) * A.H + hh) * A.dv, A.H * A.dv, c, (int)A.dv);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) QE[(idx / KC) * LD + idx % KC] *= beta[idx / KC];
  kc_inverse(Ms, beta, As, X);                     /* syncs before and after */
  /* w = A X, u = A Y */
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  float w[4][4] = {}, u[4][4] = {};
  for (int j = 0; j < KC; j++) {
    float a[4], xs[4], ys[4];
#pragma unroll
    for (int r = 0; r < 4; r++) a[r] = As[(ty + KS * r) * LD + j];
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      xs[cc] = KE[j * LD + tx + KS * cc];
      ys[cc] = QE[j * LD + tx + KS * cc];
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        w[r][cc] = fmaf(a[r], xs[cc], w[r][cc]);
        u[r][cc] = fmaf(a[r], ys[cc], u[r][cc]);
      }
  }
  float *gw = chunk_tile(A.w, chunk), *gu = chunk_tile(A.u, chunk);
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      gw[i * KC + x] = w[r][cc];
      gu[i * KC + x] = u[r][cc];
    }
}

/* ---- the state pass ------------------------------------------------------------------------------- */

/* N KC x KC scratch tiles, in registers (each thread its KC * KC / 4 / KC_THREADS float4 of each) */
#define TILE_V4 (KC * KC / 4 / KC_THREADS)
template <int N> struct tiles_reg { float4 v[N][TILE_V4]; };

template <int N> __device__ __forceinline__ void tiles_load(tiles_reg<N> &R, const float *const (&src)[N]) {
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int it = 0; it < TILE_V4; it++) R.v[t][it] = reinterpret_cast<const float4 *>(src[t])[threadIdx.x + KC_THREADS * it];
}

template <int N> __device__ __forceinline__ void tiles_store(float *const (&dst)[N], const tiles_reg<N> &R) {
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int it = 0; it < TILE_V4; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / (KC / 4), x = 4 * (idx % (KC / 4));
      const float4 v = R.v[t][it];
      dst[t][i * LD + x] = v.x; dst[t][i * LD + x + 1] = v.y; dst[t][i * LD + x + 2] = v.z; dst[t][i * LD + x + 3] = v.w;
    }
}

/* N scratch tiles into shared memory (stride LD), all loads in flight together */
template <int N> __device__ __forceinline__ void tiles_in(float *const (&dst)[N], const float *const (&src)[N]) {
  tiles_reg<N> R;
  tiles_load<N>(R, src);
  tiles_store<N>(dst, R);
}


/* shared floats: w kg qg P (4 tiles), S u vn (64 x 33 each), decay */
#define STATE_SMEM (4 * TILE + 3 * KC * LDV + KC)

/* grid: pairs x (64 / VT); bwd: keep h and vn, no o */
template <bool BWD> __global__ void __launch_bounds__(KC_THREADS, 2) kc_state_k(kc_io A) {
  extern __shared__ float sm[];
  float *w = sm, *kg = w + TILE, *qg = kg + TILE, *P = qg + TILE, *S = P + TILE, *u = S + KC * LDV;
  float *vn = u + KC * LDV, *decay = vn + KC * LDV;
  const int64_t pair = blockIdx.x / (KC / VT), b = pair / A.H, hh = pair % A.H;
  const int y0 = VT * (int)(blockIdx.x % (KC / VT)), dk = (int)A.dk, dv = (int)A.dv;
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const int64_t sbase = pair * A.dk * A.dv;
  constexpr int NTL = BWD ? 2 : 4, NU = KC * VT / KC_THREADS;
  float *dst[NTL];
  dst[0] = w;
  dst[1] = kg;
  if (!BWD) { dst[NTL - 2] = qg; dst[NTL - 1] = P; }
  /* the next chunk's tiles, u columns and decays, loaded while this one computes */
  tiles_reg<NTL> R;
  float ur[NU], dr = 0;
  auto prefetch = [&](int64_t chunk) {
    const float *src[NTL];
    src[0] = chunk_tile(A.w, chunk); src[1] = chunk_tile(A.kg, chunk);
    if (!BWD) { src[NTL - 2] = chunk_tile(A.qg, chunk); src[NTL - 1] = chunk_tile(A.P, chunk); }
#pragma unroll
    for (int t = 0; t < NTL; t++)
#pragma unroll
      for (int it = 0; it < TILE_V4; it++) R.v[t][it] = reinterpret_cast<const float4 *>(src[t])[threadIdx.x + KC_THREADS * it];
    const float *gu = chunk_tile(A.u, chunk);
#pragma unroll
    for (int it = 0; it < NU; it++) {
      const int idx = threadIdx.x + KC_THREADS * it;
      ur[it] = gu[(idx / VT) * KC + y0 + idx % VT];
    }
    if (threadIdx.x < KC) dr = A.decay[chunk * KC + threadIdx.x];
  };
  for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
    const int x = idx / VT, y = idx % VT;
    S[x * LDV + y] = A.s0 && x < dk && y0 + y < dv ? (float)dm_ld(A.sdt, A.s0, sbase + x * A.dv + y0 + y) : 0.f;
  }
  if (A.NT > 0) prefetch(pair * A.NT);
  for (int64_t n = 0; n < A.NT; n++) {
    const int64_t chunk = pair * A.NT + n;
    tiles_store<NTL>(dst, R);
#pragma unroll
    for (int it = 0; it < NU; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / VT, y = idx % VT;
      u[i * LDV + y] = ur[it];
      if (BWD) chunk_tile(A.h, chunk)[i * KC + y0 + y] = S[i * LDV + y];
    }
    if (threadIdx.x < KC) decay[threadIdx.x] = dr;
    __syncthreads();
    if (n + 1 < A.NT) prefetch(chunk + 1);
    /* vn = u - w S; o so far = qg S */
    float nv[4][2] = {}, ov[4][2] = {};
    for (int x = 0; x < KC; x++) {
      float s[2] = {S[x * LDV + tx], S[x * LDV + tx + KS]};
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const float a = w[(ty + KS * r) * LD + x], e = BWD ? 0.f : qg[(ty + KS * r) * LD + x];
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
          nv[r][cc] = fmaf(a, s[cc], nv[r][cc]);
          if (!BWD) ov[r][cc] = fmaf(e, s[cc], ov[r][cc]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) {
        const int i = ty + KS * r, y = tx + KS * cc;
        const float x = u[i * LDV + y] - nv[r][cc];
        vn[i * LDV + y] = x;
        if (BWD) chunk_tile(A.vn, chunk)[i * KC + y0 + y] = x;
      }
    __syncthreads();
    if (!BWD) {                                    /* o = qg S + P vn */
      const int c = chunk_rows(A, n);
      for (int j = 0; j < KC; j++) {
        float s[2] = {vn[j * LDV + tx], vn[j * LDV + tx + KS]};
#pragma unroll
        for (int r = 0; r < 4; r++) {
          const float p = P[(ty + KS * r) * LD + j];
#pragma unroll
          for (int cc = 0; cc < 2; cc++) ov[r][cc] = fmaf(p, s[cc], ov[r][cc]);
        }
      }
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
          const int i = ty + KS * r, y = y0 + tx + KS * cc;
          if (i < c && y < dv) dm_st(A.odt, A.o, ((b * A.T + n * KC + i) * A.H + hh) * A.dv + y, (double)ov[r][cc]);
        }
    }
    /* S = Diag(e^G_last) S + kg^T vn, each thread its own elements */
    float sn[4][2];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) sn[r][cc] = decay[ty + KS * r] * S[(ty + KS * r) * LDV + tx + KS * cc];
    for (int i = 0; i < KC; i++) {
      float s[2] = {vn[i * LDV + tx], vn[i * LDV + tx + KS]};
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const float a = kg[i * LD + ty + KS * r];
#pragma unroll
        for (int cc = 0; cc < 2; cc++) sn[r][cc] = fmaf(a, s[cc], sn[r][cc]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) S[(ty + KS * r) * LDV + tx + KS * cc] = sn[r][cc];
    __syncthreads();
  }
  if (!BWD)
    for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
      const int x = idx / VT, y = idx % VT;
      if (x < dk && y0 + y < dv) A.sfin[sbase + x * A.dv + y0 + y] = S[x * LDV + y];
    }
}

/* ---- the backward's state pass ----------------------------------------------------------------------- */

/* shared floats: P kg qg w (4 tiles), dS do dvn (64 x 33 each), decay */
__global__ void __launch_bounds__(KC_THREADS, 2) kc_bstate_k(kc_io A) {
  extern __shared__ float sm[];
  float *P = sm, *kg = P + TILE, *qg = kg + TILE, *w = qg + TILE, *dS = w + TILE, *dO = dS + KC * LDV;
  float *dvn = dO + KC * LDV, *decay = dvn + KC * LDV;
  const int64_t pair = blockIdx.x / (KC / VT), b = pair / A.H, hh = pair % A.H;
  const int y0 = VT * (int)(blockIdx.x % (KC / VT)), dk = (int)A.dk, dv = (int)A.dv;
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const int64_t sbase = pair * A.dk * A.dv;
  constexpr int NU = KC * VT / KC_THREADS;
  float *const dst[4] = {P, kg, qg, w};
  tiles_reg<4> R;
  float orow[NU], dr = 0;
  auto prefetch = [&](int64_t n) {
    const int64_t chunk = pair * A.NT + n;
    const float *const src[4] = {chunk_tile(A.P, chunk), chunk_tile(A.kg, chunk), chunk_tile(A.qg, chunk),
                                 chunk_tile(A.w, chunk)};
    tiles_load<4>(R, src);
    const int c = chunk_rows(A, n);
    const int64_t r0 = ((b * A.T + n * KC) * A.H + hh) * A.dv + y0;
    with_dtype(A.odt, [&](auto D) {
#pragma unroll
      for (int it = 0; it < NU; it++) {
        const int idx = threadIdx.x + KC_THREADS * it, i = idx / VT, y = idx % VT;
        orow[it] = i < c && y0 + y < dv ? ldt<decltype(D)::value>(A.dout, r0 + i * A.H * A.dv + y) : 0.f;
      }
    });
    if (threadIdx.x < KC) dr = A.decay[chunk * KC + threadIdx.x];
  };
  for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
    const int x = idx / VT, y = idx % VT;
    dS[x * LDV + y] = A.dsf && x < dk && y0 + y < dv ? (float)dm_ld(A.fdt, A.dsf, sbase + x * A.dv + y0 + y) : 0.f;
  }
  if (A.NT > 0) prefetch(A.NT - 1);
  for (int64_t n = A.NT - 1; n >= 0; n--) {
    const int64_t chunk = pair * A.NT + n;
    tiles_store<4>(dst, R);
#pragma unroll
    for (int it = 0; it < NU; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / VT, y = idx % VT;
      dO[i * LDV + y] = orow[it];
      chunk_tile(A.dh, chunk)[i * KC + y0 + y] = dS[i * LDV + y];
    }
    if (threadIdx.x < KC) decay[threadIdx.x] = dr;
    __syncthreads();
    if (n > 0) prefetch(n - 1);
    /* dvn = P^T do + kg dS */
    float d[4][2] = {};
    for (int i = 0; i < KC; i++) {
      float o2[2] = {dO[i * LDV + tx], dO[i * LDV + tx + KS]}, s2[2] = {dS[i * LDV + tx], dS[i * LDV + tx + KS]};
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const float p = P[i * LD + ty + KS * r], g = kg[(ty + KS * r) * LD + i];
#pragma unroll
        for (int cc = 0; cc < 2; cc++) d[r][cc] = fmaf(p, o2[cc], fmaf(g, s2[cc], d[r][cc]));
      }
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) {
        const int j = ty + KS * r, y = tx + KS * cc;
        dvn[j * LDV + y] = d[r][cc];
        chunk_tile(A.dvn, chunk)[j * KC + y0 + y] = d[r][cc];
      }
    __syncthreads();
    /* dS = Diag(e^G_last) dS + qg^T do - w^T dvn, own elements */
    float s[4][2];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) s[r][cc] = decay[ty + KS * r] * dS[(ty + KS * r) * LDV + tx + KS * cc];
    for (int i = 0; i < KC; i++) {
      float o2[2] = {dO[i * LDV + tx], dO[i * LDV + tx + KS]}, v2[2] = {dvn[i * LDV + tx], dvn[i * LDV + tx + KS]};
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const float a = qg[i * LD + ty + KS * r], ww = w[i * LD + ty + KS * r];
#pragma unroll
        for (int cc = 0; cc < 2; cc++) s[r][cc] = fmaf(a, o2[cc], fmaf(-ww, v2[cc], s[r][cc]));
      }
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 2; cc++) dS[(ty + KS * r) * LDV + tx + KS * cc] = s[r][cc];
    __syncthreads();
  }
  if (A.ds0)
    for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
      const int x = idx / VT, y = idx % VT;
      if (x < dk && y0 + y < dv) dm_st(A.ds0dt, A.ds0, sbase + x * A.dv + y0 + y, (double)dS[x * LDV + y]);
    }
}
/* ---- the backward per chunk: inter-chunk and WY terms --------------------------------------------------- */

/* shared floats: q k v G M A (6 tiles), KE + KB (then h dh), vn dvn do (3 tiles), beta, X, hdh, gl, dbeta */
#define BWY_SMEM (9 * TILE + TILE + KB_ROWS * LD + 4 * KC + KS * KS)

/* the sum over the 16 threads of a row (lanes tx of one half warp), in a fixed order */
__device__ __forceinline__ float row16_sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(DM_FULL_MASK, v, o);
  return v;
}

__global__ void __launch_bounds__(KC_THREADS) kc_bwy_k(kc_io A) {
  extern __shared__ float sm[];
  float *q = sm, *k = q + TILE, *v = k + TILE, *G = v + TILE, *Ms = G + TILE, *As = Ms + TILE;
  float *vn = As + TILE, *dvn = vn + TILE, *dO = dvn + TILE, *KE = dO + TILE, *KB = KE + TILE;
  float *h = KE, *dh = KE + TILE;                  /* after A: over KE and KB */
  float *beta = KB + KB_ROWS * LD, *hdh = beta + KC, *gl = hdh + KC, *db = gl + KC, *X = db + KC;
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT, b = pair / A.H, hh = pair % A.H;
  const int c = chunk_rows(A, n), dv = (int)A.dv;
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  kc_load(A, pair, n, c, q, k, v, G, beta);
  kc_anchor(q, k, G, KE, NULL, KB, NULL);
  kc_mp(q, k, G, KE, NULL, KB, Ms, NULL);
  kc_inverse(Ms, beta, As, X);
  {
    float *const d[4] = {h, dh, vn, dvn};
    const float *const s[4] = {chunk_tile(A.h, chunk), chunk_tile(A.dh, chunk), chunk_tile(A.vn, chunk),
                               chunk_tile(A.dvn, chunk)};
    tiles_in<4>(d, s);
  }
  rows_in(dO, A.dout, A.odt, ((b * A.T + n * KC) * A.H + hh) * A.dv, A.H * A.dv, c, dv);
  __syncthreads();
  if (threadIdx.x < KC) {                          /* e^G_last sum_y h dh per channel */
    const int x = threadIdx.x;
    float s = 0;
    for (int y = 0; y < KC; y++) s = fmaf(h[x * LD + y], dh[x * LD + y], s);
    hdh[x] = s * __expf(G[(c - 1) * LD + x]);
  }
  /* dq = (do h^T) e^G, dk = (vn dh^T) e^(G_last - G), dw = -dvn h^T, dP = do vn^T (lower) */
  float dq[4][4] = {}, dkk[4][4] = {}, dw[4][4] = {}, dP[4][4] = {};
  for (int y = 0; y < KC; y++) {
    float o4[4], n4[4], d4[4], h4[4], e4[4], v4[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int i = ty + KS * r;
      o4[r] = dO[i * LD + y]; n4[r] = vn[i * LD + y]; d4[r] = dvn[i * LD + y];
    }
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int x = tx + KS * cc;
      h4[cc] = h[x * LD + y]; e4[cc] = dh[x * LD + y]; v4[cc] = vn[x * LD + y];
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        dq[r][cc] = fmaf(o4[r], h4[cc], dq[r][cc]);
        dkk[r][cc] = fmaf(n4[r], e4[cc], dkk[r][cc]);
        dw[r][cc] = fmaf(d4[r], h4[cc], dw[r][cc]);
        dP[r][cc] = fmaf(o4[r], v4[cc], dP[r][cc]);
      }
  }
  float dG[4][4];
  float *gdP = chunk_tile(A.dP, chunk);
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      const float Gi = G[i * LD + x];
      dq[r][cc] *= __expf(Gi);
      dkk[r][cc] *= __expf(G[(c - 1) * LD + x] - Gi);
      /* the last row's -k dk cancels its own term of gl: both left out */
      dG[r][cc] = q[i * LD + x] * dq[r][cc] - (i < c - 1 ? k[i * LD + x] * dkk[r][cc] : 0.f);
      gdP[i * KC + x] = x <= i ? dP[r][cc] : 0.f;
    }
  __syncthreads();                                 /* h, dh, do, vn are free */
  /* dw into h, X = beta k e^G into dh, k dk (rows < c - 1) into do */
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      h[i * LD + x] = -dw[r][cc];
      dO[i * LD + x] = i < c - 1 ? k[i * LD + x] * dkk[r][cc] : 0.f;
    }
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC;
    dh[i * LD + x] = beta[i] * k[i * LD + x] * __expf(G[i * LD + x]);
  }
  __syncthreads();
  if (threadIdx.x < KC) {                          /* gl = the extra gradient of G_last */
    const int x = threadIdx.x;
    float s = hdh[x];
    for (int i = 0; i < KC; i++) s += dO[i * LD + x];
    gl[x] = s;
  }
  float *dwt = h, *Xt = dh, *dA = vn;
  /* dA = dw X^T + dvn (beta v)^T, strictly lower */
  {
    float a4[4][4] = {};
    for (int x = 0; x < KC; x++) {
      float l[4], rr[4], lv[4], rv[4];
#pragma unroll
      for (int r = 0; r < 4; r++) { l[r] = dwt[(ty + KS * r) * LD + x]; lv[r] = dvn[(ty + KS * r) * LD + x]; }
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const int j = tx + KS * cc;
        rr[cc] = Xt[j * LD + x]; rv[cc] = beta[j] * v[j * LD + x];
      }
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) a4[r][cc] = fmaf(l[r], rr[cc], fmaf(lv[r], rv[cc], a4[r][cc]));
    }
    __syncthreads();                               /* everyone is done with vn (and gl's sum with do) */
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const int i = ty + KS * r, j = tx + KS * cc;
        dA[i * LD + j] = j < i ? a4[r][cc] : 0.f;
      }
  }
  /* dX = A^T dw, dY = A^T dvn: dk += beta e^G dX, dbeta += sum dX k e^G + sum dY v,
  ** dG += dX X, dv = beta dY */
  {
    float dX[4][4] = {}, dY[4][4] = {};
    for (int i = 0; i < KC; i++) {
      float a[4], w4[4], n4[4];
#pragma unroll
      for (int r = 0; r < 4; r++) a[r] = As[i * LD + ty + KS * r];
#pragma unroll
      for (int cc = 0; cc < 4; cc++) { w4[cc] = dwt[i * LD + tx + KS * cc]; n4[cc] = dvn[i * LD + tx + KS * cc]; }
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) {
          dX[r][cc] = fmaf(a[r], w4[cc], dX[r][cc]);
          dY[r][cc] = fmaf(a[r], n4[cc], dY[r][cc]);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int j = ty + KS * r;
      float sb = 0;
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const int x = tx + KS * cc;
        const float X = Xt[j * LD + x], eg = __expf(G[j * LD + x]);
        dkk[r][cc] = fmaf(beta[j] * eg, dX[r][cc], dkk[r][cc]);
        sb = fmaf(dX[r][cc], k[j * LD + x] * eg, sb);
        dG[r][cc] = fmaf(dX[r][cc], X, dG[r][cc]);
        sb = fmaf(dY[r][cc], v[j * LD + x], sb);
        if (j < c && x < dv)
          dm_st(A.dvdt, A.dv_, ((b * A.T + n * KC + j) * A.H + hh) * A.dv + x, (double)(beta[j] * dY[r][cc]));
      }
      sb = row16_sum(sb);
      if (tx == 0) db[j] = sb;
    }
  }
  __syncthreads();                                 /* dA written; X no longer read */
  /* T = A^T dA into X's tile, then dL = -T A^T (strictly lower): dM = beta dL, dbeta += sum dL M */
  float *Tt = Xt;
  {
    float t4[4][4] = {};
    for (int m = 0; m < KC; m++) {
      float a[4], d4[4];
#pragma unroll
      for (int r = 0; r < 4; r++) a[r] = As[m * LD + ty + KS * r];
#pragma unroll
      for (int cc = 0; cc < 4; cc++) d4[cc] = dA[m * LD + tx + KS * cc];
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) t4[r][cc] = fmaf(a[r], d4[cc], t4[r][cc]);
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int cc = 0; cc < 4; cc++) Tt[(ty + KS * r) * LD + tx + KS * cc] = t4[r][cc];
  }
  __syncthreads();
  {
    float l4[4][4] = {};
    for (int m = 0; m < KC; m++) {
      float t[4], a[4];
#pragma unroll
      for (int r = 0; r < 4; r++) t[r] = Tt[(ty + KS * r) * LD + m];
#pragma unroll
      for (int cc = 0; cc < 4; cc++) a[cc] = As[(tx + KS * cc) * LD + m];
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int cc = 0; cc < 4; cc++) l4[r][cc] = fmaf(t[r], a[cc], l4[r][cc]);
    }
    float *gdM = chunk_tile(A.dM, chunk);
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int i = ty + KS * r;
      float sb = 0;
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const int j = tx + KS * cc;
        const float dL = j < i ? -l4[r][cc] : 0.f;
        sb = fmaf(dL, Ms[i * LD + j], sb);
        gdM[i * KC + j] = beta[i] * dL;
      }
      sb = row16_sum(sb);
      if (tx == 0 && i < c) dm_st(A.dbdt, A.dbeta, (b * A.T + n * KC + i) * A.H + hh, (double)(db[i] + sb));
    }
  }
  /* the partial dq, dk, dG (gl on row c - 1) */
  float *pq = chunk_tile(A.pq, chunk), *pk = chunk_tile(A.pk, chunk), *pG = chunk_tile(A.pG, chunk);
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      pq[i * KC + x] = dq[r][cc];
      pk[i * KC + x] = dkk[r][cc];
      pG[i * KC + x] = dG[r][cc] + (i == c - 1 ? gl[x] : 0.f);
    }
}

/* ---- the backward per chunk: intra-chunk terms ----------------------------------------------------------- */

/* shared floats: q k G KE QE dM dP (7 tiles), KB EB */
#define BINTRA_SMEM (7 * TILE + 2 * KB_ROWS * LD)

__global__ void __launch_bounds__(KC_THREADS) kc_bintra_k(kc_io A) {
  extern __shared__ float sm[];
  float *q = sm, *k = q + TILE, *G = k + TILE, *KE = G + TILE, *QE = KE + TILE, *dM = QE + TILE, *dP = dM + TILE;
  float *KB = dP + TILE, *EB = KB + KB_ROWS * LD;
  __shared__ float beta_unused[KC];
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT, b = pair / A.H, hh = pair % A.H;
  const int c = chunk_rows(A, n), dk = (int)A.dk;
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  kc_load(A, pair, n, c, q, k, NULL, G, beta_unused);
  kc_anchor(q, k, G, KE, QE, KB, EB);
  {
    float *const d[2] = {dM, dP};
    const float *const s[2] = {chunk_tile(A.dM, chunk), chunk_tile(A.dP, chunk)};
    tiles_in<2>(d, s);
  }
  __syncthreads();
  float R[4][4] = {}, Qr[4][4] = {}, Cc[4][4] = {}, Kc[4][4] = {}, gd[4][4] = {};
  /* row type across sub-chunks: R_i = E_i sum_j dM_ij KB_r(j), Qr the same with dP */
  for (int j = 0; j < 3 * KS; j++) {
#pragma unroll
    for (int r = 1; r < 4; r++) {
      if (j >= KS * r) continue;
      const float m = dM[(ty + KS * r) * LD + j], p = dP[(ty + KS * r) * LD + j];
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const float kb = KB[kb_row(r, j) * LD + tx + KS * cc];
        R[r][cc] = fmaf(m, kb, R[r][cc]);
        Qr[r][cc] = fmaf(p, kb, Qr[r][cc]);
      }
    }
  }
#pragma unroll
  for (int r = 1; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      const float e = __expf(G[i * LD + x] - G[KS * r * LD + x]);
      R[r][cc] *= e;
      Qr[r][cc] *= e;
    }
  /* column type across sub-chunks: Cc_j = sum_{a > s(j)} EB_a(j) sum_{i in a} dM_ij KE_i, Kc with dP, QE */
  for (int a = 1; a < 4; a++) {
    float zc[4][4] = {}, zk[4][4] = {};
    for (int ii = 0; ii < KS; ii++) {
      const int i = KS * a + ii;
      float ke[4], qe[4];
#pragma unroll
      for (int cc = 0; cc < 4; cc++) { ke[cc] = KE[i * LD + tx + KS * cc]; qe[cc] = QE[i * LD + tx + KS * cc]; }
#pragma unroll
      for (int r = 0; r < 3; r++) {
        if (r >= a) continue;
        const float m = dM[i * LD + ty + KS * r], p = dP[i * LD + ty + KS * r];
#pragma unroll
        for (int cc = 0; cc < 4; cc++) {
          zc[r][cc] = fmaf(m, ke[cc], zc[r][cc]);
          zk[r][cc] = fmaf(p, qe[cc], zk[r][cc]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 3; r++) {
      if (r >= a) continue;
#pragma unroll
      for (int cc = 0; cc < 4; cc++) {
        const float e = EB[kb_row(a, ty + KS * r) * LD + tx + KS * cc];
        Cc[r][cc] = fmaf(e, zc[r][cc], Cc[r][cc]);
        Kc[r][cc] = fmaf(e, zk[r][cc], Kc[r][cc]);
      }
    }
  }
  /* their share of dG: k R + q Qr - k Cc - k Kc */
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      gd[r][cc] = k[i * LD + x] * (R[r][cc] - Cc[r][cc] - Kc[r][cc]) + q[i * LD + x] * Qr[r][cc];
    }
  /* inside a sub-chunk, pair by pair: row i over j <= i, then column j over i >= j */
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int i = ty + KS * r;
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int x = tx + KS * cc;
      const float Gi = G[i * LD + x], ki = k[i * LD + x], qi = q[i * LD + x];
      float rr = 0, qq = 0, g = 0;
      for (int j = KS * r; j < i; j++) {
        const float f = __expf(Gi - G[j * LD + x]) * k[j * LD + x], m = dM[i * LD + j], p = dP[i * LD + j];
        rr = fmaf(m, f, rr);
        qq = fmaf(p, f, qq);
        g = fmaf(f, fmaf(m, ki, p * qi), g);
      }
      qq = fmaf(dP[i * LD + i], ki, qq);
      float cm = 0, kp = 0, gm = 0;
      for (int ii = i + 1; ii < KS * (r + 1); ii++) {
        const float f = __expf(G[ii * LD + x] - Gi), m = dM[ii * LD + i], p = dP[ii * LD + i];
        const float kk = k[ii * LD + x], qv = q[ii * LD + x];
        cm = fmaf(m * kk, f, cm);
        kp = fmaf(p * qv, f, kp);
      }
      gm = ki * (cm + kp);
      kp = fmaf(dP[i * LD + i], qi, kp);
      R[r][cc] += rr;
      Qr[r][cc] += qq;
      Cc[r][cc] += cm;
      Kc[r][cc] += kp;
      gd[r][cc] += g - gm;
    }
  }
  __syncthreads();                                 /* dM is free: dG goes there */
  const float *pq = chunk_tile(A.pq, chunk), *pk = chunk_tile(A.pk, chunk), *pG = chunk_tile(A.pG, chunk);
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int cc = 0; cc < 4; cc++) {
      const int i = ty + KS * r, x = tx + KS * cc;
      const float dqv = pq[i * KC + x] + Qr[r][cc], dkv = pk[i * KC + x] + R[r][cc] + Cc[r][cc] + Kc[r][cc];
      dM[i * LD + x] = pG[i * KC + x] + gd[r][cc];
      if (i < c && x < dk) {
        const int64_t at = ((b * A.T + n * KC + i) * A.H + hh) * A.dk + x;
        if (A.dq) dm_st(A.dqdt, A.dq, at, (double)dqv);
        if (A.dk_) dm_st(A.dkdt, A.dk_, at, (double)dkv);
      }
    }
  __syncthreads();
  if (threadIdx.x < KC && A.dg) {                  /* dg = the reverse cumsum of dG */
    const int x = threadIdx.x;
    float s = 0;
    for (int i = c - 1; i >= 0; i--) {
      s += dM[i * LD + x];
      if (x < dk) dm_st(A.dgdt, A.dg, ((b * A.T + n * KC + i) * A.H + hh) * A.dk + x, (double)s);
    }
  }
}

/* ---- launching ------------------------------------------------------------------------------------------ */

static kc_io kc_io_of(const dm_tensor *q, const dm_tensor *k, const dm_tensor *v, const dm_tensor *g,
                      const dm_tensor *beta, const dm_tensor *s0) {
  if (q->dtype == DM_F64)
    dm_error("kda: the chunked CUDA kernels compute in float32; f64 takes algo = recurrent");
  kc_io A;
  memset(&A, 0, sizeof A);
  A.B = q->shape[0]; A.T = q->shape[1]; A.H = q->shape[2]; A.dk = q->shape[3]; A.dv = v->shape[3];
  if (A.dk > KC || A.dv > KC)
    dm_error("kda: the chunked CUDA kernels take dk, dv <= %d, got %lld, %lld (algo = recurrent takes any)", KC,
             (long long)A.dk, (long long)A.dv);
  A.NT = (A.T + KC - 1) / KC;
  A.q = dm_data(q); A.k = dm_data(k); A.v = dm_data(v); A.g = dm_data(g); A.beta = dm_data(beta);
  A.s0 = s0 ? dm_data(s0) : NULL;
  A.qdt = q->dtype; A.gdt = g->dtype; A.bdt = beta->dtype; A.sdt = s0 ? s0->dtype : DM_F32;
  return A;
}

/* the dynamic shared memory of a kernel, opted in once */
static size_t kc_smem(const void *kernel, size_t floats) {
  size_t bytes = floats * sizeof(float);
  DM_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return bytes;
}

/* device scratch for n tiles of KC x KC per chunk plus the decays, carved in order */
struct kc_scratch {
  float *base;
  size_t bytes;
};

static float *kc_carve(float **cur, int64_t chunks) {
  float *p = *cur;
  *cur += chunks * KC * KC;
  return p;
}

/* prep, then the state pass (forward: o and the final state; bwd: h and vn kept) */
static kc_scratch kc_front(kc_io *A, bool bwd) {
  const int64_t chunks = A->B * A->H * A->NT;
  const int ntiles = 5 + (bwd ? 9 : 0);
  kc_scratch s;
  s.bytes = sizeof(float) * (size_t)(chunks * (ntiles * KC * KC + KC));
  s.base = (float *)dm_scratch(s.bytes);
  float *cur = s.base;
  A->w = kc_carve(&cur, chunks); A->u = kc_carve(&cur, chunks); A->kg = kc_carve(&cur, chunks);
  A->qg = kc_carve(&cur, chunks); A->P = kc_carve(&cur, chunks);
  if (bwd) {
    A->h = kc_carve(&cur, chunks); A->vn = kc_carve(&cur, chunks); A->dh = kc_carve(&cur, chunks);
    A->dvn = kc_carve(&cur, chunks); A->dM = kc_carve(&cur, chunks); A->dP = kc_carve(&cur, chunks);
    A->pq = kc_carve(&cur, chunks); A->pk = kc_carve(&cur, chunks); A->pG = kc_carve(&cur, chunks);
  }
  A->decay = cur;
  cudaStream_t st = dm_cuda_stream();
  if (chunks > 0) {
    kc_prep_k<<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_prep_k, PREP_SMEM), st>>>(*A);
    DM_CU_LAUNCHED();
  }
  const int64_t blocks = A->B * A->H * (KC / VT);
  if (blocks > 0) {
    if (bwd) kc_state_k<true><<<(unsigned)blocks, KC_THREADS, kc_smem((const void *)kc_state_k<true>, STATE_SMEM), st>>>(*A);
    else kc_state_k<false><<<(unsigned)blocks, KC_THREADS, kc_smem((const void *)kc_state_k<false>, STATE_SMEM), st>>>(*A);
    DM_CU_LAUNCHED();
  }
  return s;
}

static void cuda_kda_chunk_fwd(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                               const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0) {
  kc_io A = kc_io_of(q, k, v, g, beta, s0);
  if (s_final->dtype != DM_F32) dm_error("kda: the chunked CUDA kernels keep the state in f32");
  A.o = dm_data(o);
  A.odt = o->dtype;
  A.sfin = (float *)dm_data(s_final);
  kc_scratch s = kc_front(&A, false);
  dm_scratch_free(s.base, s.bytes);
}

static void cuda_kda_chunk_bwd(dm_tensor *dq, dm_tensor *dk, dm_tensor *dv, dm_tensor *dg, dm_tensor *dbeta,
                               dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                               const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                               const dm_tensor *ds_final, int64_t chunk) {
  if (chunk != KC) dm_error("kda_chunk_bwd: the chunk size must be %d, got %lld", KC, (long long)chunk);
  kc_io A = kc_io_of(q, k, v, g, beta, s0);
  dm_tensor *outs[6] = {dq, dk, dv, dg, dbeta, ds0};
  kda_bind_backward(A, dout, ds_final, outs);
  /* dv and dbeta come out of bwy unconditionally: scratch stands in for an unwanted one */
  const int64_t chunks = A.B * A.H * A.NT, n_tok = A.B * A.T * A.H;
  size_t extra = (A.dv_ ? 0 : sizeof(float) * (size_t)(n_tok * A.dv)) + (A.dbeta ? 0 : sizeof(float) * (size_t)n_tok);
  float *spare = extra ? (float *)dm_scratch(extra) : NULL;
  if (!A.dv_) { A.dv_ = spare; A.dvdt = DM_F32; }
  if (!A.dbeta) { A.dbeta = spare + (A.dv_ == spare ? n_tok * A.dv : 0); A.dbdt = DM_F32; }
  kc_scratch s = kc_front(&A, true);
  cudaStream_t st = dm_cuda_stream();
  const int64_t blocks = A.B * A.H * (KC / VT);
  if (blocks > 0) {
    kc_bstate_k<<<(unsigned)blocks, KC_THREADS, kc_smem((const void *)kc_bstate_k, STATE_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
  if (chunks > 0) {
    kc_bwy_k<<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_bwy_k, BWY_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
    kc_bintra_k<<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_bintra_k, BINTRA_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
  dm_scratch_free(s.base, s.bytes);
  if (spare) dm_scratch_free(spare, extra);
}

static const dm_kernel_entry kernels[] = {
  {"kda_chunk_fwd", (dm_kernel_fn)cuda_kda_chunk_fwd},
  {"kda_chunk_bwd", (dm_kernel_fn)cuda_kda_chunk_bwd},
};
DM_CUDA_KERNELS(kernels)
