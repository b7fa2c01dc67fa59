/*
** kda_chunk.cu — the chunked WY/UT form of KDA on CUDA (kda.h has the
** contract, vm/cpu/kda_chunk.c the same algorithm as plain loops and its
** equations; docs/kda.md §2 and its backward). Chunks of KC = 64 rows, sub-chunks
** of KS = 16, dk, dv <= 64, everything in float32: the inputs are widened
** on load, the gates' cumsum G, the state and every intermediate are
** float32.
**
** Kernels (one block of 256 threads each; "chunk" = one (b, h, chunk)),
** every 64 x 64 x 64 product on the tensor cores: in "3xTF32" (near float32;
** see "the backward per chunk on tensor cores") for f32 inputs, in one TF32
** pass for 16-bit ones (kc_passes):
**   prep     per chunk: G, M, P, A = (I + StrictLower(beta M))^-1, w, u, kg,
**            qg, e^G_last into device scratch.
**   state    per (b, h, 32 value columns), serial over chunks: vn = u - w S,
**            o = qg S + P vn, S = e^G_last S + kg^T vn; the backward's
**            recompute keeps S (h) and vn per chunk instead of o.
**   bstate   per (b, h, 32 value columns), last chunk first: dh = dS,
**            dvn = P^T do + kg dS, dS = e^G_last dS + qg^T do - w^T dvn.
**   bwy      per chunk: the inter-chunk and WY terms (docs/kda.md §2, B3), dv and
**            dbeta final, dq, dk, dG partial, dM = beta dL and dP saved
**            (M and A read from prep's scratch, not computed again).
**   bintra   per chunk: the intra-chunk terms through M and P (B4), then
**            dq, dk and dg = the reverse cumsum of dG (B5).
**
** No exponent is positive (docs/kda.md, "No positive exponent"): across sub-chunks e^(G_i - G_j) is
** e^(G_i - G_r) e^(G_r - G_j), r the first row of i's sub-chunk, which
** turns those blocks into products of KE = k e^(G - G_r) (QE with q) with
** KB_a = k e^(G_r(a) - G) (EB_a without k); inside a sub-chunk the
** exponentials are taken pair by pair. Rows past the end of a partial
** chunk are zeros (g = 0, beta = 0), which keeps them out of every sum.
**
** Tiles sit in shared memory with padded rows (no bank conflicts down a
** column); what is not a product (the loads, the anchored exponentials,
** the inverse) is split among the threads so that row group r is the
** sub-chunk. Every sum runs in a fixed order and nothing is added with
** atomics: two runs give the same bits. (The same kernels with fp32 FMA
** products, 1.7x slower end to end, are in the history before the
** tensor cores: docs/performance.md.)
*/
#include "model.cuh"
#include "ptx.cuh"
extern "C" {
#include "ops/kda.h"
}

#define KC DM_KDA_CHUNK            /* vm/ops/kda.h */
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
  float *Mg, *Ag;                /* the backward: prep keeps M and A for bwy */
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

/* Rows i < c, columns x < d of chunk rows of a [B, T, H, d] tensor of dtype DT into registers (zeros
** elsewhere), then into a tile (rows of L). Every load of a tile, and of all the tiles kc_load_all
** takes, is in flight before the first store. */
#define KC_NR (KC * KC / KC_THREADS)
template <int DT>
__device__ __forceinline__ void kc_rows_ld(float (&r)[KC_NR], const void *src, int64_t row0, int64_t rstride, int c,
                                           int d) {
#pragma unroll
  for (int it = 0; it < KC_NR; it++) {
    const int idx = threadIdx.x + KC_THREADS * it, i = idx / KC, x = idx % KC;
    r[it] = i < c && x < d ? ldt<DT>(src, row0 + i * rstride + x) : 0.f;
  }
}
template <int L> __device__ __forceinline__ void kc_rows_st(float *dst, const float (&r)[KC_NR]) {
#pragma unroll
  for (int it = 0; it < KC_NR; it++) {
    const int idx = threadIdx.x + KC_THREADS * it, i = idx / KC, x = idx % KC;
    dst[i * L + x] = r[it];
  }
}

/* rows i < c, columns x < d of chunk rows of a [B, T, H, d] tensor into a tile (zeros elsewhere) */
template <int L = LD>
__device__ __forceinline__ void rows_in(float *dst, const void *src, int t, int64_t row0, int64_t rstride, int c,
                                        int d) {
  float r[KC_NR];
  with_dtype(t, [&](auto D) { kc_rows_ld<decltype(D)::value>(r, src, row0, rstride, c, d); });
  kc_rows_st<L>(dst, r);
}

/* q, k, v, do (each may be NULL), G = the in-chunk cumsum of g, beta (may be NULL) into tiles in rows of
** L; rows >= c and columns >= dk/dv zero. Then waits for the cp.async loads issued before, if any. */
template <int L>
__device__ void kc_load_all(const kc_io &A, int64_t pair, int64_t n, int c, float *q, float *k, float *v, float *dO,
                            float *G, float *beta) {
  const int64_t b = pair / A.H, hh = pair % A.H, t0 = n * KC;
  const int64_t rk = ((b * A.T + t0) * A.H + hh) * A.dk, rv = ((b * A.T + t0) * A.H + hh) * A.dv;
  const int dk = (int)A.dk, dv = (int)A.dv;
  float rq[KC_NR], rkk[KC_NR], rvv[KC_NR], ro[KC_NR], rg[KC_NR];
  with_dtype(A.qdt, [&](auto D) {
    constexpr int DT = decltype(D)::value;
    if (q) kc_rows_ld<DT>(rq, A.q, rk, A.H * A.dk, c, dk);
    if (k) kc_rows_ld<DT>(rkk, A.k, rk, A.H * A.dk, c, dk);
    if (v) kc_rows_ld<DT>(rvv, A.v, rv, A.H * A.dv, c, dv);
  });
  if (dO) with_dtype(A.odt, [&](auto D) { kc_rows_ld<decltype(D)::value>(ro, A.dout, rv, A.H * A.dv, c, dv); });
  with_dtype(A.gdt, [&](auto D) { kc_rows_ld<decltype(D)::value>(rg, A.g, rk, A.H * A.dk, c, dk); });
  if (beta && threadIdx.x < KC) {
    const int i = threadIdx.x;
    beta[i] = i < c ? (float)dm_ld(A.bdt, A.beta, (b * A.T + t0 + i) * A.H + hh) : 0.f;
  }
  if (q) kc_rows_st<L>(q, rq);
  if (k) kc_rows_st<L>(k, rkk);
  if (v) kc_rows_st<L>(v, rvv);
  if (dO) kc_rows_st<L>(dO, ro);
  kc_rows_st<L>(G, rg);
  __syncthreads();
  if (threadIdx.x < KC) {          /* G: one thread per column, the rows summed in order (as vm/cpu/kda_chunk.c) */
    const int x = threadIdx.x;
    float s = 0;
#pragma unroll 16
    for (int r = 0; r < KC; r++) {
      s += G[r * L + x];
      G[r * L + x] = s;
    }
  }
  dm_cp_wait_all();
  __syncthreads();
}

/* q, k, v (each may be NULL), G = the in-chunk cumsum of g, beta; rows >= c and columns >= dk/dv zero */
__device__ __forceinline__ void kc_load(const kc_io &A, int64_t pair, int64_t n, int c, float *q, float *k, float *v,
                                        float *G, float *beta) {
  kc_load_all<LD>(A, pair, n, c, q, k, v, NULL, G, beta);
}

/* KE = k e^(G - G_r), QE = q e^(G - G_r) (r: the row's sub-chunk start); KB_a, EB_a (NULL: not wanted);
** every tile in rows of L */
template <int L = LD>
__device__ void kc_anchor(const float *q, const float *k, const float *G, float *KE, float *QE, float *KB, float *EB) {
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC, r = i / KS * KS;
    const float e = __expf(G[i * L + x] - G[r * L + x]);
    if (KE) KE[i * L + x] = k[i * L + x] * e;
    if (QE) QE[i * L + x] = q[i * L + x] * e;
  }
  for (int idx = threadIdx.x; idx < KB_ROWS * KC; idx += KC_THREADS) {
    const int row = idx / KC, x = idx % KC;
    const int a = row < 16 ? 1 : row < 48 ? 2 : 3, j = row - 8 * a * (a - 1);
    const float e = __expf(G[KS * a * L + x] - G[j * L + x]);
    if (EB) EB[row * L + x] = e;
    if (KB) KB[row * L + x] = k[j * L + x] * e;
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
template <int L = LD> __device__ void kc_inverse(const float *Ms, const float *beta, float *As, float *X) {
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) As[(idx / KC) * L + idx % KC] = 0;
  __syncthreads();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (w < 4 && lane < KS) {                       /* lane m: column m of block w, its own column only */
    const int o = KS * w, m = lane;
    for (int ii = 0; ii < KS; ii++) {
      float s = ii == m ? 1.f : 0.f;
      if (ii > m) {
        float acc = 0;
        for (int jj = m; jj < ii; jj++) acc = fmaf(Ms[(o + ii) * L + o + jj], As[(o + jj) * L + o + m], acc);
        s = -beta[o + ii] * acc;
      }
      As[(o + ii) * L + o + m] = s;
    }
  }
  __syncthreads();
  const int ii = threadIdx.x >> 4, mm = threadIdx.x & 15;
  for (int d = 1; d < 4; d++)
    for (int a = d; a < 4; a++) {
      const int bb = a - d;
      float s = 0;
      for (int m = KS * bb; m < KS * a; m++) s = fmaf(Ms[(KS * a + ii) * L + m], As[m * L + KS * bb + mm], s);
      X[ii * KS + mm] = beta[KS * a + ii] * s;
      __syncthreads();
      float t = 0;
      for (int jj = 0; jj < KS; jj++) t = fmaf(As[(KS * a + ii) * L + KS * a + jj], X[jj * KS + mm], t);
      As[(KS * a + ii) * L + KS * bb + mm] = -t;
      __syncthreads();
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

template <int N, int L = LD> __device__ __forceinline__ void tiles_store(float *const (&dst)[N], const tiles_reg<N> &R) {
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int it = 0; it < TILE_V4; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / (KC / 4), x = 4 * (idx % (KC / 4));
      const float4 v = R.v[t][it];
      dst[t][i * L + x] = v.x; dst[t][i * L + x + 1] = v.y; dst[t][i * L + x + 2] = v.z; dst[t][i * L + x + 3] = v.w;
    }
}

/* N scratch tiles into shared memory (stride LD), all loads in flight together */
template <int N> __device__ __forceinline__ void tiles_in(float *const (&dst)[N], const float *const (&src)[N]) {
  tiles_reg<N> R;
  tiles_load<N>(R, src);
  tiles_store<N>(dst, R);
}


/* ---- the backward per chunk on tensor cores ------------------------------------------------------------
**
** kc_bwy_tc_k and kc_bintra_tc_k compute the B3 and B4-B5 terms with their 64 x 64 x 64 products on mma.sync
** m16n8k8 in "3xTF32": every float32 operand is split as x = hi + lo, both rounded to tf32, and a b is
** taken as lo(a) hi(b) + hi(a) lo(b) + hi(a) hi(b), f32 accumulation; what is left out, lo lo and the
** rounding of lo, is under 2^-21 relative, near float32. 16-bit inputs take hi(a) hi(b) alone: each
** operand, the f32 intermediates (state, inverse, decayed keys) among them, rounded to tf32 (2^-11
** relative; kc_passes). bwy reads M and A from prep's scratch instead
** of computing them again.
**
** Tiles have rows of LT = 68 floats: a fragment's 32 lanes, (row g, column q) for g < 8, q < 4, fall in
** 32 different banks. Warp w of 8 owns the 16 x 32 block at rows m0 = 16 (w / 2), columns n0 =
** 32 (w % 2) of every 64 x 64 result: four m16n8 tiles t, element e of tile t at row m0 + g + 8 (e / 2),
** column n0 + 8 t + 2 q + e % 2 (g = lane / 4, q = lane % 4). Row sums go across the four lanes of a
** row with shuffles, then across the warp pair through shared memory, in a fixed order: two runs give
** the same bits.
*/
#define LT 68                    /* row stride of the tensor-core kernels' tiles */
#define TT (KC * LT)

/* a KC x KC scratch tile (rows of KC) into shared rows of LT, asynchronously */
__device__ __forceinline__ void kc_tile_async(float *dst, const float *src) {
#pragma unroll
  for (int it = 0; it < KC * KC / 4 / KC_THREADS; it++) {
    const int idx = threadIdx.x + KC_THREADS * it, i = idx >> 4, x = (idx & 15) << 2;
    dm_cp_async16(dst + i * LT + x, src + i * KC + x);
  }
}

__device__ __forceinline__ void kc_split(float x, uint32_t &hi, uint32_t &lo) {
  hi = dm_tf32(x);          /* ptx.cuh */
  lo = __float_as_uint(x - __uint_as_float(hi));   /* exact; the tensor core reads its top 19 bits */
}

struct kc_fa { uint32_t h[4], l[4]; };           /* an A fragment, hi and lo */
struct kc_fb { uint32_t h[2], l[2]; };           /* a B fragment */

/* the A fragment 16 x 8 at (m0, k0) of a matrix whose element (m, k) is a[m sm + k sk] */
__device__ __forceinline__ void kc_lda(kc_fa &f, const float *a, int sm, int sk, int m0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
  const float *p = a + (m0 + g) * sm + (k0 + q) * sk;
  kc_split(p[0], f.h[0], f.l[0]);
  kc_split(p[8 * sm], f.h[1], f.l[1]);
  kc_split(p[4 * sk], f.h[2], f.l[2]);
  kc_split(p[8 * sm + 4 * sk], f.h[3], f.l[3]);
}
/* the B fragment 8 x 8 at (k0, n0) of a matrix whose element (k, n) is b[k sk + n sn] */
__device__ __forceinline__ void kc_ldb(kc_fb &f, const float *b, int sk, int sn, int k0, int n0) {
  const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
  const float *p = b + (k0 + q) * sk + (n0 + g) * sn;
  kc_split(p[0], f.h[0], f.l[0]);
  kc_split(p[4 * sk], f.h[1], f.l[1]);
}
/* the same, each element times s (s for column n0 + g: this lane's column) */
__device__ __forceinline__ void kc_ldbs(kc_fb &f, const float *b, int sk, int sn, int k0, int n0, float s) {
  const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
  const float *p = b + (k0 + q) * sk + (n0 + g) * sn;
  kc_split(s * p[0], f.h[0], f.l[0]);
  kc_split(s * p[4 * sk], f.h[1], f.l[1]);
}
/* c += a b in NP passes: 3 (3xTF32, the small terms first: near float32) or 1 (the rounded
** operands alone: a 10-bit mantissa, for 16-bit inputs; kc_passes) */
template <int NP> __device__ __forceinline__ void kc_mma(float (&c)[4], const kc_fa &a, const kc_fb &b) {
  static_assert(NP == 1 || NP == 3, "kc_mma takes 1 or 3 passes");
  if constexpr (NP == 3) {
    dm_mma1688_tf32(c, a.l, b.h);
    dm_mma1688_tf32(c, a.h, b.l);
  }
  dm_mma1688_tf32(c, a.h, b.h);
}

/* ---- the tile products ------------------------------------------------------------------------------------
**
** A product here is a 16-row block of A (rows m0) times NT m16n8 tiles of B (columns n0 + 8 t), stepped
** through k by 8: kc_step is one step, kc_tile the loop. The operands are tiles as the product reads them,
** element (r, c) of tile i at p[i][r SR + c SC], (m, k) for an A and (k, n) for a B, in braces:
** kc_mat<LT, 2>{KE, QE}. These functions are compiled before they are inlined: the strides are constants,
** the operands braces (not a function's result) and kc_step's loads written out (not a loop over the
** operands), as otherwise the same loops come out unrolled or addressed otherwise than written in place
** (the SASS compared).
**
** Not through them: bwy's first products (three A fragments, four products, dP only on and below the
** diagonal), dA and bstate's dS (two products into one accumulator, a B scaled as it is loaded: kc_ldbs)
** and dL (the tiles above the diagonal skipped).
*/
template <int SR_, int SC_, int N_> struct kc_op {
  static constexpr int SR = SR_, SC = SC_, N = N_;
  const float *p[N];
};
template <int L, int N = 1> using kc_mat = kc_op<L, 1, N>;    /* N tiles in rows of L */
template <int L, int N = 1> using kc_matT = kc_op<1, L, N>;   /* the same, transposed */

/* One step, at k0: c0[t] += A0 B0 and c1[t] += A1 B1, one A or one B (N = 1) shared by both; with one of
** each, c0[t] += A B alone. The A fragments are loaded once, then per tile the B fragments, then the
** products. */
template <int NP, int NT, class OA, class OB>
__device__ __forceinline__ void kc_step(float (&c0)[NT][4], float (&c1)[NT][4], OA a, int m0, OB b, int n0, int k0) {
  static_assert(OA::N <= 2 && OB::N <= 2, "kc_step: at most two products");
  kc_fa a0, a1;
  kc_lda(a0, a.p[0], OA::SR, OA::SC, m0, k0);
  if constexpr (OA::N == 2) kc_lda(a1, a.p[1], OA::SR, OA::SC, m0, k0);
#pragma unroll
  for (int t = 0; t < NT; t++) {
    kc_fb b0, b1;
    kc_ldb(b0, b.p[0], OB::SR, OB::SC, k0, n0 + 8 * t);
    if constexpr (OB::N == 2) kc_ldb(b1, b.p[1], OB::SR, OB::SC, k0, n0 + 8 * t);
    kc_mma<NP>(c0[t], a0, b0);
    if constexpr (OA::N == 2 || OB::N == 2) kc_mma<NP>(c1[t], OA::N == 2 ? a1 : a0, OB::N == 2 ? b1 : b0);
  }
}

/* The steps for k0 <= k < k1 (k0, k1 multiples of 8): c0 += A0 B0 and c1 += A1 B1, or c += A B. UNR = 1
** keeps the loop rolled, 0 leaves it to the compiler (for runtime bounds it unrolls by 2 or 4, which no
** count reproduces). A loop unrolled by a count of its own (prep's M and P, bintra's Cc and Kc) is written
** at its call site around kc_step: in here its bounds are not known when it is unrolled. */
template <int NP, int UNR = 0, int NT, class OA, class OB>
__device__ __forceinline__ void kc_tile(float (&c0)[NT][4], float (&c1)[NT][4], OA a, int m0, OB b, int n0, int k0,
                                        int k1) {
  static_assert(UNR == 0 || UNR == 1, "kc_tile: a count of its own goes around kc_step");
  if constexpr (UNR == 1) {
#pragma unroll 1
    for (int kk = k0; kk < k1; kk += 8) kc_step<NP>(c0, c1, a, m0, b, n0, kk);
  } else {
    for (int kk = k0; kk < k1; kk += 8) kc_step<NP>(c0, c1, a, m0, b, n0, kk);
  }
}
template <int NP, int UNR = 0, int NT, class OA, class OB>
__device__ __forceinline__ void kc_tile(float (&c)[NT][4], OA a, int m0, OB b, int n0, int k0, int k1) {
  static_assert(OA::N == 1 && OB::N == 1, "kc_tile: one accumulator, one product");
  kc_tile<NP, UNR>(c, c, a, m0, b, n0, k0, k1);
}

/* the row and column of element e of accumulator tile t (in a kernel that defines m0, n0, gq, qq) */
#define KC_ROW(e) (m0 + gq + 8 * ((e) >> 1))
#define KC_COL(t, e) (n0 + 8 * (t) + 2 * qq + ((e) & 1))
#define KC_OWN(...)                                                                                             \
  _Pragma("unroll") for (int t = 0; t < 4; t++) _Pragma("unroll") for (int e = 0; e < 4; e++) {                  \
    const int i = KC_ROW(e), x = KC_COL(t, e);                                                                  \
    (void)i; (void)x;                                                                                           \
    __VA_ARGS__                                                                                                 \
  }

/* rows i < c, columns x < d of a tile (rows of LT) out to chunk rows (row0, rstride) of a tensor of dtype t,
** one dtype dispatch for the tile (dst NULL: not wanted) */
__device__ __forceinline__ void kc_rows_out(void *dst, int t, const float *src, int64_t row0, int64_t rstride, int c,
                                            int d) {
  if (!dst) return;
  with_dtype(t, [&](auto D) {
    constexpr int DT = decltype(D)::value;
#pragma unroll
    for (int it = 0; it < KC_NR; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / KC, x = idx % KC;
      if (i < c && x < d) ((typename dt<DT>::S *)dst)[row0 + i * rstride + x] = dt<DT>::store(src[i * LT + x]);
    }
  });
}

/* ---- prep on tensor cores ---------------------------------------------------------------------------------
**
** kc_prep_tc_k works in tiles of LT: M and P across
** sub-chunks and w = A X, u = A Y in 3xTF32; M and P inside the sub-chunks pair by pair, each pair's
** sum over the 64 channels split among four lanes (16 channels each, in order) and added by a butterfly.
*/

/* M (strictly lower, into Ms, which lies over KB) and P (lower, to global) */
template <int NP> __device__ void kc_mp_tc(const float *q, const float *k, const float *G, const float *KE, const float *QE,
                         const float *KB, float *Ms, float *Pg) {
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq = lane >> 2, qq = lane & 3;
  /* across sub-chunks: 12 m16n8 jobs (block row r >= 1, columns 8 nt < 16 r), jobs wp and wp + 8 */
  float cm[2][1][4] = {}, cp[2][1][4] = {};
  int jr[2], jn[2];
#pragma unroll
  for (int s = 0; s < 2; s++) {
    const int job = wp + 8 * s;                    /* r = 1: jobs 0-1, r = 2: 2-5, r = 3: 6-11 */
    jr[s] = job < 2 ? 1 : job < 6 ? 2 : 3;
    jn[s] = job - (jr[s] == 1 ? 0 : jr[s] == 2 ? 2 : 6);
    if (job >= 12) continue;
    const float *kb = KB + kb_row(jr[s], 0) * LT;
#pragma unroll 2
    for (int kk = 0; kk < KC; kk += 8)             /* (x, j) = KB_r[j][x] */
      kc_step<NP>(cm[s], cp[s], kc_mat<LT, 2>{KE, QE}, KS * jr[s], kc_matT<LT>{kb}, 8 * jn[s], kk);
  }
  __syncthreads();                                 /* KB read: M goes over it */
  /* zeros above the diagonal (M: on it too), the values across sub-chunks */
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, j = idx % KC;
    if (j >= i) Ms[i * LT + j] = 0.f;
    if (j > i) Pg[idx] = 0.f;
  }
#pragma unroll
  for (int s = 0; s < 2; s++) {
    if (wp + 8 * s >= 12) continue;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int i = KS * jr[s] + gq + 8 * (e >> 1), j = 8 * jn[s] + 2 * qq + (e & 1);
      Ms[i * LT + j] = cm[s][0][e];
      Pg[i * KC + j] = cp[s][0][e];
    }
  }
  /* inside a sub-chunk: 4 x 136 pairs i >= j, a pair's channels in four quarters of four lanes */
  constexpr int NPAIR = 4 * (KS * (KS + 1) / 2);
#pragma unroll 1
  for (int item0 = 0; item0 < 4 * NPAIR; item0 += KC_THREADS) {
    const int item = item0 + threadIdx.x, p = item >> 2, x0 = KS * (item & 3);
    if (item0 + (threadIdx.x & ~31) >= 4 * NPAIR) continue;   /* whole warps */
    const int r = p / 136, l = p % 136;
    int a = 0;
    while ((a + 1) * (a + 2) / 2 <= l) a++;
    const int i = KS * r + a, j = KS * r + l - a * (a + 1) / 2;
    float mm = 0, pp = 0;
#pragma unroll
    for (int x = x0; x < x0 + KS; x++) {
      const float kf = k[j * LT + x] * __expf(G[i * LT + x] - G[j * LT + x]);
      mm = fmaf(k[i * LT + x], kf, mm);
      pp = fmaf(q[i * LT + x], kf, pp);
    }
    mm += __shfl_xor_sync(DM_FULL_MASK, mm, 1);
    pp += __shfl_xor_sync(DM_FULL_MASK, pp, 1);
    mm += __shfl_xor_sync(DM_FULL_MASK, mm, 2);
    pp += __shfl_xor_sync(DM_FULL_MASK, pp, 2);
    if (!(item & 3)) {
      if (i > j) Ms[i * LT + j] = mm;
      Pg[i * KC + j] = pp;
    }
  }
  __syncthreads();
}

/* shared floats: q k G KE QE (5 tiles of LT), KB, beta, X: two blocks a multiprocessor.
** After M and P, M lies over KB, X = beta k e^G over KE, Y = beta v over QE, A over q. */
#define PREPT_SMEM (5 * TT + KB_ROWS * LT + KC + KS * KS)

template <int NP> __global__ void __launch_bounds__(KC_THREADS, 2) kc_prep_tc_k(kc_io A) {
  extern __shared__ __align__(16) float smt[];
  float *q = smt, *k = q + TT, *G = k + TT, *KE = G + TT, *QE = KE + TT, *KB = QE + TT;
  float *beta = KB + KB_ROWS * LT, *X = beta + KC, *Ms = KB, *As = q;
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT;
  const int c = chunk_rows(A, n);
  kc_load_all<LT>(A, pair, n, c, q, k, NULL, NULL, G, beta);
  kc_anchor<LT>(q, k, G, KE, QE, KB, NULL);
  kc_mp_tc<NP>(q, k, G, KE, QE, KB, Ms, chunk_tile(A.P, chunk));
  /* X = beta k e^G into KE, v into QE; kg, qg, e^G_last out */
  float *gk = chunk_tile(A.kg, chunk), *gq = chunk_tile(A.qg, chunk);
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC;
    const float G_i = G[i * LT + x], eg = __expf(G_i);
    KE[i * LT + x] = beta[i] * k[i * LT + x] * eg;
    gk[idx] = k[i * LT + x] * __expf(G[(KC - 1) * LT + x] - G_i);
    gq[idx] = q[i * LT + x] * eg;
  }
  if (threadIdx.x < KC) A.decay[chunk * KC + threadIdx.x] = __expf(G[(KC - 1) * LT + threadIdx.x]);
  {
    const int64_t b = pair / A.H, hh = pair % A.H;
    rows_in<LT>(QE, A.v, A.qdt, ((b * A.T + n * KC) * A.H + hh) * A.dv, A.H * A.dv, c, (int)A.dv);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) QE[(idx / KC) * LT + idx % KC] *= beta[idx / KC];
  kc_inverse<LT>(Ms, beta, As, X);                 /* syncs before and after */
  if (A.Mg) {                                      /* the backward: M and A for bwy */
    float *gM = chunk_tile(A.Mg, chunk), *gA = chunk_tile(A.Ag, chunk);
    for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
      const int i = idx / KC, x = idx % KC;
      gM[idx] = Ms[i * LT + x];
      gA[idx] = As[i * LT + x];
    }
  }
  /* w = A X, u = A Y (A[i][j] = 0 for j > i) */
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq4 = lane >> 2, qq = lane & 3;
  const int m0 = 16 * (wp >> 1), n0 = 32 * (wp & 1);
  float w4[4][4] = {}, u4[4][4] = {};
  kc_tile<NP>(w4, u4, kc_mat<LT>{As}, m0, kc_mat<LT, 2>{KE, QE}, n0, 0, m0 + 16);
  float *gw = chunk_tile(A.w, chunk), *gu = chunk_tile(A.u, chunk);
#pragma unroll
  for (int t = 0; t < 4; t++)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = m0 + gq4 + 8 * (e >> 1), x = n0 + 8 * t + 2 * qq;
      *reinterpret_cast<float2 *>(gw + i * KC + x) = make_float2(w4[t][e], w4[t][e + 1]);
      *reinterpret_cast<float2 *>(gu + i * KC + x) = make_float2(u4[t][e], u4[t][e + 1]);
    }
}

/* the sum over the four lanes of a row of accumulators (lanes q of one g), the same bits in all four */
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(DM_FULL_MASK, v, 1);
  return v + __shfl_xor_sync(DM_FULL_MASK, v, 2);
}

/* shared floats: q k v G M A h dh vn dvn do (11 tiles); beta, hdh, gl, 4 x KC column sums, 2 x KC db, 2 x KC sb */
#define BWYT_SMEM (11 * TT + 11 * KC)

template <int NP> __global__ void __launch_bounds__(KC_THREADS, 1) kc_bwy_tc_k(kc_io A) {
  extern __shared__ __align__(16) float smt[];
  float *q = smt, *k = q + TT, *v = k + TT, *G = v + TT, *Ms = G + TT, *As = Ms + TT, *h = As + TT, *dh = h + TT;
  float *vn = dh + TT, *dvn = vn + TT, *dO = dvn + TT;
  float *beta = dO + TT, *hdh = beta + KC, *gl = hdh + KC, *csum = gl + KC, *dbp = csum + 4 * KC, *sbp = dbp + 2 * KC;
  float *dwt = h, *Xt = dh, *kdk = dO, *dA = vn, *Tt = dO, *dvs = q;   /* later tenants */
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT, b = pair / A.H, hh = pair % A.H;
  const int c = chunk_rows(A, n), dv = (int)A.dv;
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq = lane >> 2, qq = lane & 3, half = wp & 1;
  const int m0 = 16 * (wp >> 1), n0 = 32 * half;
  kc_tile_async(Ms, chunk_tile(A.Mg, chunk));
  kc_tile_async(As, chunk_tile(A.Ag, chunk));
  kc_tile_async(h, chunk_tile(A.h, chunk));
  kc_tile_async(dh, chunk_tile(A.dh, chunk));
  kc_tile_async(vn, chunk_tile(A.vn, chunk));
  kc_tile_async(dvn, chunk_tile(A.dvn, chunk));
  dm_cp_commit();
  kc_load_all<LT>(A, pair, n, c, q, k, v, dO, G, beta);
  const float *Gl = G + (c - 1) * LT;
  {                                                /* hdh = e^G_last sum_y h dh: four lanes a channel */
    const int x = threadIdx.x >> 2, p = threadIdx.x & 3;
    float s = 0;
#pragma unroll
    for (int y = 0; y < 16; y++) s = fmaf(h[x * LT + 16 * p + y], dh[x * LT + 16 * p + y], s);
    s = quad_sum(s);
    if (p == 0) hdh[x] = s * __expf(Gl[x]);
  }
  /* dq = (do h^T) e^G, dk = (vn dh^T) e^(G_last - G), dw = -dvn h^T, dP = do vn^T (lower) */
  float dq[4][4] = {}, dkk[4][4] = {}, dw[4][4] = {}, dP[4][4] = {};
#pragma unroll 2
  for (int kk = 0; kk < KC; kk += 8) {
    kc_fa ao, an, ad;
    kc_lda(ao, dO, LT, 1, m0, kk);
    kc_lda(an, vn, LT, 1, m0, kk);
    kc_lda(ad, dvn, LT, 1, m0, kk);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      const int nt = n0 + 8 * t;
      kc_fb bh, bd;
      kc_ldb(bh, h, 1, LT, kk, nt);
      kc_ldb(bd, dh, 1, LT, kk, nt);
      kc_mma<NP>(dq[t], ao, bh);
      kc_mma<NP>(dkk[t], an, bd);
      kc_mma<NP>(dw[t], ad, bh);
      if (nt <= m0 + 15) {
        kc_fb bv;
        kc_ldb(bv, vn, 1, LT, kk, nt);
        kc_mma<NP>(dP[t], ao, bv);
      }
    }
  }
  float dG[4][4];
  KC_OWN({
    const float Gi = G[i * LT + x];
    dq[t][e] *= __expf(Gi);
    dkk[t][e] *= __expf(Gl[x] - Gi);
    /* the last row's -k dk cancels its own term of gl: both left out */
    dG[t][e] = q[i * LT + x] * dq[t][e] - (i < c - 1 ? k[i * LT + x] * dkk[t][e] : 0.f);
  })
  {
    float *gdP = chunk_tile(A.dP, chunk);
    KC_OWN(if (!(e & 1)) *reinterpret_cast<float2 *>(gdP + i * KC + x) =
               make_float2(x <= i ? dP[t][e] : 0.f, x + 1 <= i ? dP[t][e + 1] : 0.f);)
  }
  __syncthreads();                                 /* h, dh, vn, do are free */
  /* -dw over h, X = beta k e^G over dh, k dk (rows < c - 1) over do */
  KC_OWN({
    dwt[i * LT + x] = -dw[t][e];
    kdk[i * LT + x] = i < c - 1 ? k[i * LT + x] * dkk[t][e] : 0.f;
  })
  for (int idx = threadIdx.x; idx < KC * KC; idx += KC_THREADS) {
    const int i = idx / KC, x = idx % KC;
    Xt[i * LT + x] = beta[i] * k[i * LT + x] * __expf(G[i * LT + x]);
  }
  __syncthreads();
  {                                                /* column sums of k dk, 16 rows a thread (gl below) */
    const int x = threadIdx.x & (KC - 1), p = threadIdx.x / KC;
    float s = 0;
#pragma unroll
    for (int i = 0; i < KS; i++) s += kdk[(KS * p + i) * LT + x];
    csum[p * KC + x] = s;
  }
  /* dA = dw X^T + dvn (beta v)^T, strictly lower, over vn */
  {
    float a4[4][4] = {};
#pragma unroll 2
    for (int kk = 0; kk < KC; kk += 8) {
      kc_fa aw, av;
      kc_lda(aw, dwt, LT, 1, m0, kk);
      kc_lda(av, dvn, LT, 1, m0, kk);
#pragma unroll
      for (int t = 0; t < 4; t++) {
        const int nt = n0 + 8 * t;
        if (nt > m0 + 15) continue;
        kc_fb bx, bv;
        kc_ldb(bx, Xt, 1, LT, kk, nt);
        kc_ldbs(bv, v, 1, LT, kk, nt, beta[nt + gq]);
        kc_mma<NP>(a4[t], aw, bx);
        kc_mma<NP>(a4[t], av, bv);
      }
    }
    KC_OWN(dA[i * LT + x] = x < i ? a4[t][e] : 0.f;)
  }
  /* dX = A^T dw, dY = A^T dvn: dk += beta e^G dX, dbeta += sum dX k e^G + sum dY v, dG += dX X, dv = beta dY */
  {
    float dX[4][4] = {}, dY[4][4] = {};          /* A[i][j] = 0 for i < j: k from m0 */
    kc_tile<NP>(dX, dY, kc_matT<LT>{As}, m0, kc_mat<LT, 2>{dwt, dvn}, n0, m0, KC);
    float sb[2] = {0.f, 0.f};
    KC_OWN({
      const float X = Xt[i * LT + x], eg = __expf(G[i * LT + x]), bj = beta[i];
      dkk[t][e] = fmaf(bj * eg, dX[t][e], dkk[t][e]);
      sb[e >> 1] = fmaf(dX[t][e], k[i * LT + x] * eg, sb[e >> 1]);
      dG[t][e] = fmaf(dX[t][e], X, dG[t][e]);
      sb[e >> 1] = fmaf(dY[t][e], v[i * LT + x], sb[e >> 1]);
      dvs[i * LT + x] = bj * dY[t][e];
    })
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float s = quad_sum(sb[r]);
      if (qq == 0) dbp[half * KC + m0 + gq + 8 * r] = s;
    }
  }
  __syncthreads();                                 /* dA, dv written; the column sums done with do */
  if (threadIdx.x < KC) {                          /* gl = the extra gradient of G_last */
    const int x = threadIdx.x;
    gl[x] = hdh[x] + csum[x] + csum[KC + x] + csum[2 * KC + x] + csum[3 * KC + x];
  }
  kc_rows_out(A.dv_, A.dvdt, dvs, ((b * A.T + n * KC) * A.H + hh) * A.dv, A.H * A.dv, c, dv);
  /* T = A^T dA over do, then dL = -T A^T (strictly lower): dM = beta dL, dbeta += sum dL M */
  {
    float t4[4][4] = {};
    kc_tile<NP>(t4, kc_matT<LT>{As}, m0, kc_mat<LT>{dA}, n0, m0, KC);
    KC_OWN(Tt[i * LT + x] = t4[t][e];)
  }
  __syncthreads();
  {
    float l4[4][4] = {};
    for (int kk = 0; kk < n0 + 32; kk += 8) {      /* A[j][m] = 0 for m > j */
      kc_fa at;
      kc_lda(at, Tt, LT, 1, m0, kk);
#pragma unroll
      for (int t = 0; t < 4; t++) {
        const int nt = n0 + 8 * t;
        if (nt > m0 + 15) continue;
        kc_fb ba;
        kc_ldb(ba, As, 1, LT, kk, nt);
        kc_mma<NP>(l4[t], at, ba);
      }
    }
    float *gdM = chunk_tile(A.dM, chunk);
    float sl[2] = {0.f, 0.f};
    KC_OWN({
      const float dL = x < i ? -l4[t][e] : 0.f;
      l4[t][e] = dL;
      sl[e >> 1] = fmaf(dL, Ms[i * LT + x], sl[e >> 1]);
    })
    KC_OWN(if (!(e & 1)) *reinterpret_cast<float2 *>(gdM + i * KC + x) =
               make_float2(beta[i] * l4[t][e], beta[i] * l4[t][e + 1]);)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float s = quad_sum(sl[r]);
      if (qq == 0) sbp[half * KC + m0 + gq + 8 * r] = s;
    }
  }
  /* the partial dq, dk, dG (gl on row c - 1) */
  {
    float *pq = chunk_tile(A.pq, chunk), *pk = chunk_tile(A.pk, chunk), *pG = chunk_tile(A.pG, chunk);
    KC_OWN(if (!(e & 1)) {
      *reinterpret_cast<float2 *>(pq + i * KC + x) = make_float2(dq[t][e], dq[t][e + 1]);
      *reinterpret_cast<float2 *>(pk + i * KC + x) = make_float2(dkk[t][e], dkk[t][e + 1]);
      const bool last = i == c - 1;
      *reinterpret_cast<float2 *>(pG + i * KC + x) =
          make_float2(dG[t][e] + (last ? gl[x] : 0.f), dG[t][e + 1] + (last ? gl[x + 1] : 0.f));
    })
  }
  __syncthreads();
  if (threadIdx.x < c)
    dm_st(A.dbdt, A.dbeta, (b * A.T + n * KC + threadIdx.x) * A.H + hh,
          (double)((dbp[threadIdx.x] + dbp[KC + threadIdx.x]) + (sbp[threadIdx.x] + sbp[KC + threadIdx.x])));
}

/* shared floats: q k G KE QE dM dP (7 tiles), the partial dq dk dG (3 tiles, summed into), KB EB, block totals */
#define BINTT_SMEM (10 * TT + 2 * KB_ROWS * LT + 4 * KC)

template <int NP> __global__ void __launch_bounds__(KC_THREADS, 1) kc_bintra_tc_k(kc_io A) {
  extern __shared__ __align__(16) float smt[];
  float *q = smt, *k = q + TT, *G = k + TT, *KE = G + TT, *QE = KE + TT, *dM = QE + TT, *dP = dM + TT;
  float *sq = dP + TT, *sk = sq + TT, *sg = sk + TT, *KB = sg + TT, *EB = KB + KB_ROWS * LT, *tot = EB + KB_ROWS * LT;
  const int64_t chunk = blockIdx.x, pair = chunk / A.NT, n = chunk % A.NT, b = pair / A.H, hh = pair % A.H;
  const int c = chunk_rows(A, n), dk = (int)A.dk;
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq = lane >> 2, qq = lane & 3, mt = wp >> 1;
  const int m0 = 16 * mt, n0 = 32 * (wp & 1);
  kc_tile_async(dM, chunk_tile(A.dM, chunk));
  kc_tile_async(dP, chunk_tile(A.dP, chunk));
  kc_tile_async(sq, chunk_tile(A.pq, chunk));
  kc_tile_async(sk, chunk_tile(A.pk, chunk));
  kc_tile_async(sg, chunk_tile(A.pG, chunk));
  dm_cp_commit();
  kc_load_all<LT>(A, pair, n, c, q, k, NULL, NULL, G, NULL);
  kc_anchor<LT>(q, k, G, KE, QE, KB, EB);          /* ends with a barrier */
  /* across sub-chunks. Rows of block mt: R_i = E_i sum_j dM_ij KB_mt(j), Qr the same with dP. Columns of
  ** block mt: Cc_j = sum_{a > mt} EB_a(j) sum_{i in a} dM_ij KE_i, Kc with dP and QE. */
  {
    float R[4][4] = {}, Qr[4][4] = {}, Cc[4][4] = {}, Kc[4][4] = {};
    if (mt > 0) {
      const float *kb = KB + kb_row(mt, 0) * LT;
      kc_tile<NP>(R, Qr, kc_mat<LT, 2>{dM, dP}, m0, kc_mat<LT>{kb}, n0, 0, m0);
      KC_OWN({
        const float ex = __expf(G[i * LT + x] - G[m0 * LT + x]);
        R[t][e] *= ex;
        Qr[t][e] *= ex;
      })
    }
    for (int a = mt + 1; a < 4; a++) {
      float zc[4][4] = {}, zk[4][4] = {};          /* (j, i) = dM[i][j], dP[i][j] */
#pragma unroll
      for (int kk = 0; kk < KS; kk += 8)
        kc_step<NP>(zc, zk, kc_matT<LT, 2>{dM, dP}, m0, kc_mat<LT, 2>{KE, QE}, n0, KS * a + kk);
      const float *eb = EB + kb_row(a, 0) * LT;
      KC_OWN({
        const float ev = eb[i * LT + x];
        Cc[t][e] = fmaf(ev, zc[t][e], Cc[t][e]);
        Kc[t][e] = fmaf(ev, zk[t][e], Kc[t][e]);
      })
    }
    /* into the partials: dq += Qr, dk += R + Cc + Kc, dG += k (R - Cc - Kc) + q Qr */
    KC_OWN({
      const int o = i * LT + x;
      sg[o] += k[o] * (R[t][e] - Cc[t][e] - Kc[t][e]) + q[o] * Qr[t][e];
      sq[o] += Qr[t][e];
      sk[o] += R[t][e] + Cc[t][e] + Kc[t][e];
    })
  }
  __syncthreads();
  /* inside a sub-chunk, pair by pair: thread (r, x) takes column x of sub-chunk r, each pair's
  ** exponential once for both its row's and its column's terms */
  {
    const int r = threadIdx.x / KC, x = threadIdx.x & (KC - 1), i0 = KS * r;
    float Gv[KS], kv[KS], qv[KS], DK[KS], DQ[KS], GD[KS];
#pragma unroll
    for (int a = 0; a < KS; a++) {
      Gv[a] = G[(i0 + a) * LT + x];
      kv[a] = k[(i0 + a) * LT + x];
      qv[a] = q[(i0 + a) * LT + x];
      DK[a] = DQ[a] = GD[a] = 0.f;
    }
    const float *dMr = dM + i0 * LT + i0, *dPr = dP + i0 * LT + i0;
#pragma unroll
    for (int a = 0; a < KS; a++) {
#pragma unroll
      for (int j = 0; j < a; j++) {
        const float ex = __expf(Gv[a] - Gv[j]);
        const float tm = dMr[a * LT + j] * ex, tp = dPr[a * LT + j] * ex;
        const float u = fmaf(tm, kv[a], tp * qv[a]); /* row a's share of column j's dk */
        DK[j] += u;
        DK[a] = fmaf(tm, kv[j], DK[a]);
        DQ[a] = fmaf(tp, kv[j], DQ[a]);
        const float s = kv[j] * u;
        GD[a] += s;
        GD[j] -= s;
      }
      const float pd = dPr[a * LT + a];
      DQ[a] = fmaf(pd, kv[a], DQ[a]);
      DK[a] = fmaf(pd, qv[a], DK[a]);
    }
    /* dq, dk into their partials; dG = the partial + GD, summed from the chunk's end (dg = the reverse cumsum) */
    float s = 0;
#pragma unroll
    for (int a = KS - 1; a >= 0; a--) {
      const int o = (i0 + a) * LT + x;
      sq[o] += DQ[a];
      sk[o] += DK[a];
      s += sg[o] + GD[a];
      GD[a] = s;
    }
    tot[r * KC + x] = s;
    __syncthreads();
    float later = 0;
    for (int r2 = 3; r2 > r; r2--) later += tot[r2 * KC + x];
#pragma unroll
    for (int a = 0; a < KS; a++) sg[(i0 + a) * LT + x] = GD[a] + later;
  }
  __syncthreads();
  const int64_t row0 = ((b * A.T + n * KC) * A.H + hh) * A.dk, rs = A.H * A.dk;
  kc_rows_out(A.dq, A.dqdt, sq, row0, rs, c, dk);
  kc_rows_out(A.dk_, A.dkdt, sk, row0, rs, c, dk);
  kc_rows_out(A.dg, A.dgdt, sg, row0, rs, c, dk);
}

/* ---- the state passes on tensor cores -------------------------------------------------------------------
**
** kc_state_tc_k and kc_bstate_tc_k run each step's 64 x 32 x 64 products in 3xTF32 as above. The chunk tiles have rows of LT,
** the 32-column ones (S, u, vn; dS, do, dvn) rows of LVS = 40, so that a fragment read down their
** columns meets 32 banks. Warp w owns rows m0 = 16 (w / 2) and columns n0 = 16 (w % 2) of the block's
** 32: two m16n8 tiles t, element e at row m0 + g + 8 (e / 2), column n0 + 8 t + 2 q + e % 2.
*/
#define LVS 40
#define KC_OWN2(...)                                                                                           \
  _Pragma("unroll") for (int t = 0; t < 2; t++) _Pragma("unroll") for (int e = 0; e < 4; e++) {                  \
    const int i = m0 + gq + 8 * (e >> 1), y = n0 + 8 * t + 2 * qq + (e & 1);                                    \
    (void)i; (void)y;                                                                                           \
    __VA_ARGS__                                                                                                 \
  }

/* shared floats: w kg qg P (4 tiles of LT), S u vn (64 x LVS each), decay */
#define STATT_SMEM (4 * TT + 3 * KC * LVS + KC)

/* grid: pairs x (64 / VT); bwd: keep h and vn, no o */
template <bool BWD, int NP> __global__ void __launch_bounds__(KC_THREADS, 2) kc_state_tc_k(kc_io A) {
  extern __shared__ __align__(16) float smt[];
  float *w = smt, *kg = w + TT, *qg = kg + TT, *P = qg + TT, *S = P + TT, *u = S + KC * LVS;
  float *vn = u + KC * LVS, *decay = vn + KC * LVS;
  const int64_t pair = blockIdx.x / (KC / VT), b = pair / A.H, hh = pair % A.H;
  const int y0 = VT * (int)(blockIdx.x % (KC / VT)), dk = (int)A.dk, dv = (int)A.dv;
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq = lane >> 2, qq = lane & 3;
  const int m0 = 16 * (wp >> 1), n0 = 16 * (wp & 1);
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
    S[x * LVS + y] = A.s0 && x < dk && y0 + y < dv ? (float)dm_ld(A.sdt, A.s0, sbase + x * A.dv + y0 + y) : 0.f;
  }
  if (A.NT > 0) prefetch(pair * A.NT);
  for (int64_t n = 0; n < A.NT; n++) {
    const int64_t chunk = pair * A.NT + n;
    tiles_store<NTL, LT>(dst, R);
#pragma unroll
    for (int it = 0; it < NU; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / VT, y = idx % VT;
      u[i * LVS + y] = ur[it];
      if (BWD) chunk_tile(A.h, chunk)[i * KC + y0 + y] = S[i * LVS + y];
    }
    if (threadIdx.x < KC) decay[threadIdx.x] = dr;
    __syncthreads();
    if (n + 1 < A.NT) prefetch(chunk + 1);
    /* vn = u - w S */
    float nv[2][4] = {};
    kc_tile<NP, 1>(nv, kc_mat<LT>{w}, m0, kc_mat<LVS>{S}, n0, 0, KC);
    KC_OWN2({
      const float x = u[i * LVS + y] - nv[t][e];
      vn[i * LVS + y] = x;
      if (BWD) chunk_tile(A.vn, chunk)[i * KC + y0 + y] = x;
    })
    __syncthreads();
    if (!BWD) {                                    /* o = qg S + P vn (P[i][j] = 0 for j > i) */
      const int c = chunk_rows(A, n);
      float ov[2][4] = {};
      kc_tile<NP, 1>(ov, kc_mat<LT>{qg}, m0, kc_mat<LVS>{S}, n0, 0, KC);
      kc_tile<NP>(ov, kc_mat<LT>{P}, m0, kc_mat<LVS>{vn}, n0, 0, m0 + 16);
      KC_OWN2(if (i < c && y0 + y < dv)
                dm_st(A.odt, A.o, ((b * A.T + n * KC + i) * A.H + hh) * A.dv + y0 + y, (double)ov[t][e]);)
    }
    /* S = Diag(e^G_last) S + kg^T vn, each thread its own elements */
    float sn[2][4];
    KC_OWN2(sn[t][e] = decay[i] * S[i * LVS + y];)
    kc_tile<NP, 1>(sn, kc_matT<LT>{kg}, m0, kc_mat<LVS>{vn}, n0, 0, KC);   /* (x, i) = kg[i][x] */
    KC_OWN2(S[i * LVS + y] = sn[t][e];)
    __syncthreads();
  }
  if (!BWD)
    for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
      const int x = idx / VT, y = idx % VT;
      if (x < dk && y0 + y < dv) A.sfin[sbase + x * A.dv + y0 + y] = S[x * LVS + y];
    }
}

/* shared floats: P kg qg w (4 tiles of LT), dS do dvn (64 x LVS each), decay */
template <int NP> __global__ void __launch_bounds__(KC_THREADS, 2) kc_bstate_tc_k(kc_io A) {
  extern __shared__ __align__(16) float smt[];
  float *P = smt, *kg = P + TT, *qg = kg + TT, *w = qg + TT, *dS = w + TT, *dO = dS + KC * LVS;
  float *dvn = dO + KC * LVS, *decay = dvn + KC * LVS;
  const int64_t pair = blockIdx.x / (KC / VT), b = pair / A.H, hh = pair % A.H;
  const int y0 = VT * (int)(blockIdx.x % (KC / VT)), dk = (int)A.dk, dv = (int)A.dv;
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, gq = lane >> 2, qq = lane & 3;
  const int m0 = 16 * (wp >> 1), n0 = 16 * (wp & 1);
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
    dS[x * LVS + y] = A.dsf && x < dk && y0 + y < dv ? (float)dm_ld(A.fdt, A.dsf, sbase + x * A.dv + y0 + y) : 0.f;
  }
  if (A.NT > 0) prefetch(A.NT - 1);
  for (int64_t n = A.NT - 1; n >= 0; n--) {
    const int64_t chunk = pair * A.NT + n;
    tiles_store<4, LT>(dst, R);
#pragma unroll
    for (int it = 0; it < NU; it++) {
      const int idx = threadIdx.x + KC_THREADS * it, i = idx / VT, y = idx % VT;
      dO[i * LVS + y] = orow[it];
      chunk_tile(A.dh, chunk)[i * KC + y0 + y] = dS[i * LVS + y];
    }
    if (threadIdx.x < KC) decay[threadIdx.x] = dr;
    __syncthreads();
    if (n > 0) prefetch(n - 1);
    /* dvn = P^T do + kg dS (P[i][j] = 0 for i < j) */
    float d[2][4] = {};
    kc_tile<NP, 1>(d, kc_mat<LT>{kg}, m0, kc_mat<LVS>{dS}, n0, 0, KC);   /* (j, x) = kg[j][x] */
    kc_tile<NP>(d, kc_matT<LT>{P}, m0, kc_mat<LVS>{dO}, n0, m0, KC);      /* (j, i) = P[i][j] */
    KC_OWN2({
      dvn[i * LVS + y] = d[t][e];
      chunk_tile(A.dvn, chunk)[i * KC + y0 + y] = d[t][e];
    })
    __syncthreads();
    /* dS = Diag(e^G_last) dS + qg^T do - w^T dvn, own elements */
    float s[2][4];
    KC_OWN2(s[t][e] = decay[i] * dS[i * LVS + y];)
#pragma unroll 1
    for (int kk = 0; kk < KC; kk += 8) {
      kc_fa aq, aw;
      kc_lda(aq, qg, 1, LT, m0, kk);               /* (x, i) = qg[i][x] */
      kc_lda(aw, w, 1, LT, m0, kk);
#pragma unroll
      for (int t = 0; t < 2; t++) {
        kc_fb bo, bv;
        kc_ldb(bo, dO, LVS, 1, kk, n0 + 8 * t);
        kc_ldbs(bv, dvn, LVS, 1, kk, n0 + 8 * t, -1.f);
        kc_mma<NP>(s[t], aq, bo);
        kc_mma<NP>(s[t], aw, bv);
      }
    }
    KC_OWN2(dS[i * LVS + y] = s[t][e];)
    __syncthreads();
  }
  if (A.ds0)
    for (int idx = threadIdx.x; idx < KC * VT; idx += KC_THREADS) {
      const int x = idx / VT, y = idx % VT;
      if (x < dk && y0 + y < dv) dm_st(A.ds0dt, A.ds0, sbase + x * A.dv + y0 + y, (double)dS[x * LVS + y]);
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

/* The products' passes (kc_mma): 3xTF32 for f32 inputs, near float32; one TF32 pass for 16-bit
** ones, whose outputs are rounded to 16 bits anyway (bf16 keeps 8 bits, f16 11, a tf32 operand 11).
** Each path's error against the float64 recurrence: tests/gpu/check_kda.lua, docs/performance.md. */
static int kc_passes(const kc_io &A) { return A.qdt == DM_F32 ? 3 : 1; }

/* the launch of `run<NP>(args...)` with kc_passes(A) as NP */
#define KC_WITH_PASSES(A, run, ...) \
  (kc_passes(A) == 3 ? run<3>(__VA_ARGS__) : run<1>(__VA_ARGS__))

template <int NP> static void kc_launch_front(kc_io &A, bool bwd, int64_t chunks) {
  cudaStream_t st = dm_cuda_stream();
  if (chunks > 0) {
    kc_prep_tc_k<NP><<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_prep_tc_k<NP>, PREPT_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
  const int64_t blocks = A.B * A.H * (KC / VT);
  if (blocks > 0) {
    const unsigned nb = (unsigned)blocks;
    if (bwd)
      kc_state_tc_k<true, NP><<<nb, KC_THREADS, kc_smem((const void *)kc_state_tc_k<true, NP>, STATT_SMEM), st>>>(A);
    else
      kc_state_tc_k<false, NP><<<nb, KC_THREADS, kc_smem((const void *)kc_state_tc_k<false, NP>, STATT_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
}

/* prep, then the state pass (forward: o and the final state; bwd: h and vn kept) */
static kc_scratch kc_front(kc_io *A, bool bwd) {
  const int64_t chunks = A->B * A->H * A->NT;
  kc_scratch s;
  s.bytes = (size_t)dm_kda_chunk_tiles(A->B * A->H, A->T, bwd);     /* the carving below, 5 or 16 tiles */
  s.base = (float *)dm_scratch(s.bytes);
  float *cur = s.base;
  A->w = kc_carve(&cur, chunks); A->u = kc_carve(&cur, chunks); A->kg = kc_carve(&cur, chunks);
  A->qg = kc_carve(&cur, chunks); A->P = kc_carve(&cur, chunks);
  if (bwd) {
    A->h = kc_carve(&cur, chunks); A->vn = kc_carve(&cur, chunks); A->dh = kc_carve(&cur, chunks);
    A->dvn = kc_carve(&cur, chunks); A->dM = kc_carve(&cur, chunks); A->dP = kc_carve(&cur, chunks);
    A->pq = kc_carve(&cur, chunks); A->pk = kc_carve(&cur, chunks); A->pG = kc_carve(&cur, chunks);
    A->Mg = kc_carve(&cur, chunks); A->Ag = kc_carve(&cur, chunks);
  }
  A->decay = cur;
  KC_WITH_PASSES(*A, kc_launch_front, *A, bwd, chunks);
  return s;
}

/* the backward's kernels after kc_front: bstate, then bwy and bintra per chunk */
template <int NP> static void kc_launch_back(kc_io &A) {
  cudaStream_t st = dm_cuda_stream();
  const int64_t chunks = A.B * A.H * A.NT, blocks = A.B * A.H * (KC / VT);
  if (blocks > 0) {
    kc_bstate_tc_k<NP><<<(unsigned)blocks, KC_THREADS, kc_smem((const void *)kc_bstate_tc_k<NP>, STATT_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
  if (chunks > 0) {
    kc_bwy_tc_k<NP><<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_bwy_tc_k<NP>, BWYT_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
    kc_bintra_tc_k<NP><<<(unsigned)chunks, KC_THREADS, kc_smem((const void *)kc_bintra_tc_k<NP>, BINTT_SMEM), st>>>(A);
    DM_CU_LAUNCHED();
  }
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
  const int64_t n_tok = A.B * A.T * A.H;
  size_t extra = (size_t)dm_kda_chunk_spare(n_tok, A.dv, A.dv_ != NULL, A.dbeta != NULL);
  float *spare = extra ? (float *)dm_scratch(extra) : NULL;
  if (!A.dv_) { A.dv_ = spare; A.dvdt = DM_F32; }
  if (!A.dbeta) { A.dbeta = spare + (A.dv_ == spare ? n_tok * A.dv : 0); A.dbdt = DM_F32; }
  kc_scratch s = kc_front(&A, true);
  KC_WITH_PASSES(A, kc_launch_back, A);
  dm_scratch_free(s.base, s.bytes);
  if (spare) dm_scratch_free(spare, extra);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(kda_chunk_fwd, cuda_kda_chunk_fwd),
  DM_KERNEL_ENTRY(kda_chunk_bwd, cuda_kda_chunk_bwd),
};
DM_CUDA_KERNELS(kernels)
