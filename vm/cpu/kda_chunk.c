/*
** cpu/kda_chunk.c — the chunked WY/UT form of the KDA recurrence on the
** CPU (docs/kda.md §2, forward and backward), in double for f64 q and
** float otherwise: the CUDA chunked kernels' algorithm written as plain
** loops, so its maths is checked against the step-by-step oracle
** (vm/cpu/kda.c) without a GPU.
**
** Per (batch, head), chunks of C = DM_KDA_CHUNK rows, the last one
** possibly partial; in a chunk of c rows, with G the in-chunk inclusive
** cumsum of g (row c-1 is G_last) and S the state entering the chunk:
**
**   M_ij = sum_ch k_i k_j e^(G_i - G_j)  (i > j),  P_ij = the same with q_i  (i >= j)
**   A    = (I + StrictLower(Diag(beta) M))^-1
**   w    = A Diag(beta) (k . e^G),   u = A Diag(beta) v
**   vn   = u - w S                   (row i: beta_i times the step's delta error)
**   o    = (q . e^G) S + P vn
**   S'   = Diag(e^G_last) S + (k . e^(G_last - G))^T vn
**
** No exponent is ever positive (docs/kda.md, "No positive exponent"): e^(G_i - G_j) for rows of one
** sub-chunk of DM_KDA_SUBCHUNK rows is taken as it is, and across
** sub-chunks as e^(G_i - G_r) e^(G_r - G_j) with r the first row of i's
** sub-chunk (j < r <= i), the factorisation that lets the GPU turn those
** blocks into matrix products. factor() is that one rule for forward and
** backward alike.
**
** The backward keeps the state entering every chunk (one forward pass),
** then walks the chunks last first, recomputing each chunk's M, P, A, w,
** u and vn from its state and carrying dS (docs/kda.md §2, "Its backward": B2 for dS and dvn, B3
** for the inter-chunk and WY terms, B4 for the intra-chunk terms, B5 the
** reverse cumsum of dG into dg).
*/
#ifndef KDA_CHUNK_R

#include <tgmath.h>
#include <string.h>
#include "ops/kda.h"
#include "core/alloc.h"

#define FN(name) FN_(name, KDA_SFX)
#define FN_(name, sfx) FN__(name, sfx)
#define FN__(name, sfx) name##_##sfx

#define KDA_CHUNK_R float
#define KDA_SFX f
#define KDA_DT DM_F32
#include "kda_chunk.c"
#undef KDA_CHUNK_R
#undef KDA_SFX
#undef KDA_DT

#define KDA_CHUNK_R double
#define KDA_SFX d
#define KDA_DT DM_F64
#include "kda_chunk.c"
#undef KDA_CHUNK_R
#undef KDA_SFX
#undef KDA_DT

static void cpu_kda_chunk_fwd(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                              const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0) {
  (q->dtype == DM_F64 ? run_d : run_f)(o, s_final, NULL, NULL, NULL, NULL, NULL, NULL, q, k, v, g, beta, s0, NULL,
                                       NULL);
}

static void cpu_kda_chunk_bwd(dm_tensor *dq, dm_tensor *dk, dm_tensor *dv, dm_tensor *dg, dm_tensor *dbeta,
                              dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                              const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                              const dm_tensor *ds_final, int64_t chunk) {
  if (chunk != DM_KDA_CHUNK) dm_error("kda_chunk_bwd: the chunk size must be %d, got %lld", DM_KDA_CHUNK, (long long)chunk);
  (q->dtype == DM_F64 ? run_d : run_f)(NULL, NULL, dq, dk, dv, dg, dbeta, ds0, q, k, v, g, beta, s0, dout,
                                       ds_final);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(kda_chunk_fwd, cpu_kda_chunk_fwd),
  DM_KERNEL_ENTRY(kda_chunk_bwd, cpu_kda_chunk_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)

#else /* ---- the body, for R = KDA_CHUNK_R ------------------------------------------------- */

#define R KDA_CHUNK_R
#define CH DM_KDA_CHUNK
#define SUB DM_KDA_SUBCHUNK
#define CH_MAXD DM_KDA_CHUNK_MAXD

/* rows r = 0..n-1 of d values at element base + r * stride of a contiguous tensor (NULL: zeros) */
static void FN(gather)(R *dst, const dm_tensor *t, int64_t base, int64_t n, int64_t stride, int64_t d) {
  const char *p = t ? dm_data(t) : NULL;
  const size_t es = t ? dm_dtype_size(t->dtype) : 0;
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < d; i++)
      dst[r * d + i] = p ? (R)dm_load(t->dtype, p + (size_t)(base + r * stride + i) * es) : 0;
}

/* the reverse of gather; a NULL t wants nothing */
static void FN(scatter)(dm_tensor *t, const R *src, int64_t base, int64_t n, int64_t stride, int64_t d) {
  if (!t) return;
  char *p = dm_data(t);
  const size_t es = dm_dtype_size(t->dtype);
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < d; i++) dm_store(t->dtype, p + (size_t)(base + r * stride + i) * es, src[r * d + i]);
}

/* one chunk's recomputable quantities, for c <= CH rows */
typedef struct {
  int64_t c, dk, dv;
  const R *q, *k, *v, *beta;   /* the chunk's rows of the pair's inputs */
  R G[CH * CH_MAXD], M[CH * CH], P[CH * CH], A[CH * CH];
  R w[CH * CH_MAXD], u[CH * CH_MAXD], vn[CH * CH_MAXD], eG[CH * CH_MAXD], kg[CH * CH_MAXD];
} FN(chunk_t);

/* e^(G_i - G_j) in channel x for rows j <= i of the chunk, never with a positive exponent */
static inline R FN(factor)(const FN(chunk_t) *C, int64_t i, int64_t j, int64_t x) {
  const int64_t dk = C->dk, r = i / SUB * SUB;
  const R *G = C->G;
  if (j >= r) return exp(G[i * dk + x] - G[j * dk + x]);
  return exp(G[i * dk + x] - G[r * dk + x]) * exp(G[r * dk + x] - G[j * dk + x]);
}

/* G, M, P, A, w, u, e^G and kg of the chunk whose rows start at q, k, v, beta, g */
static void FN(prep)(FN(chunk_t) *C, const R *g) {
  const int64_t c = C->c, dk = C->dk, dv = C->dv;
  for (int64_t x = 0; x < dk; x++) {
    R s = 0;
    for (int64_t i = 0; i < c; i++) C->G[i * dk + x] = s += g[i * dk + x];
  }
  for (int64_t i = 0; i < c; i++)
    for (int64_t j = 0; j <= i; j++) {
      R m = 0, p = 0;
      for (int64_t x = 0; x < dk; x++) {
        R kf = C->k[j * dk + x] * FN(factor)(C, i, j, x);
        m += C->k[i * dk + x] * kf;
        p += C->q[i * dk + x] * kf;
      }
      C->M[i * CH + j] = j < i ? m : 0;
      C->P[i * CH + j] = p;
    }
  /* A = (I + L)^-1 by forward substitution: A_i = e_i - sum_{j<i} L_ij A_j */
  for (int64_t i = 0; i < c; i++)
    for (int64_t m = 0; m <= i; m++) {
      R s = m == i;
      for (int64_t j = m; j < i; j++) s -= C->beta[i] * C->M[i * CH + j] * C->A[j * CH + m];
      C->A[i * CH + m] = s;
    }
  const R *Gl = C->G + (c - 1) * dk;
  for (int64_t i = 0; i < c; i++)
    for (int64_t x = 0; x < dk; x++) {
      C->eG[i * dk + x] = exp(C->G[i * dk + x]);
      C->kg[i * dk + x] = C->k[i * dk + x] * exp(Gl[x] - C->G[i * dk + x]);
    }
  for (int64_t i = 0; i < c; i++) {
    for (int64_t x = 0; x < dk; x++) {
      R s = 0;
      for (int64_t j = 0; j <= i; j++) s += C->A[i * CH + j] * C->beta[j] * C->k[j * dk + x] * C->eG[j * dk + x];
      C->w[i * dk + x] = s;
    }
    for (int64_t y = 0; y < dv; y++) {
      R s = 0;
      for (int64_t j = 0; j <= i; j++) s += C->A[i * CH + j] * C->beta[j] * C->v[j * dv + y];
      C->u[i * dv + y] = s;
    }
  }
}

/* vn = u - w S; with o, o = (q . e^G) S + P vn; then S = Diag(e^G_last) S + kg^T vn */
static void FN(advance)(FN(chunk_t) *C, R *S, R *o) {
  const int64_t c = C->c, dk = C->dk, dv = C->dv;
  for (int64_t i = 0; i < c; i++)
    for (int64_t y = 0; y < dv; y++) {
      R s = C->u[i * dv + y];
      for (int64_t x = 0; x < dk; x++) s -= C->w[i * dk + x] * S[x * dv + y];
      C->vn[i * dv + y] = s;
    }
  if (o)
    for (int64_t i = 0; i < c; i++)
      for (int64_t y = 0; y < dv; y++) {
        R s = 0;
        for (int64_t x = 0; x < dk; x++) s += C->q[i * dk + x] * C->eG[i * dk + x] * S[x * dv + y];
        for (int64_t j = 0; j <= i; j++) s += C->P[i * CH + j] * C->vn[j * dv + y];
        o[i * dv + y] = s;
      }
  const R *eGl = C->eG + (c - 1) * dk;
  for (int64_t x = 0; x < dk; x++)
    for (int64_t y = 0; y < dv; y++) {
      R s = eGl[x] * S[x * dv + y];
      for (int64_t i = 0; i < c; i++) s += C->kg[i * dk + x] * C->vn[i * dv + y];
      S[x * dv + y] = s;
    }
}

/* The chunk's backward (docs/kda.md §2). h is the state entering it; dS holds the
** gradient of the state leaving it and receives that of h; d_o is the
** chunk's rows of do; gq, gk, gg, gv, gb its rows of the gradients (gg
** gets dg); T1..T3 are CH x CH scratch, D1 CH x dv, D2 and D3 CH x dk. */
static void FN(back)(FN(chunk_t) *C, const R *h, R *dS, const R *d_o, R *gq, R *gk, R *gg, R *gv, R *gb,
                     R *T1, R *T2, R *T3, R *D1, R *D2, R *D3, R *dSn) {
  const int64_t c = C->c, dk = C->dk, dv = C->dv;
  const R *q = C->q, *k = C->k, *v = C->v, *beta = C->beta, *A = C->A, *eG = C->eG;
  R *dvn = D1, *dw = D2, *dG = D3;
  /* B1/B2: dvn = P^T do + kg dS; dS_h = Diag(e^G_last) dS + (q . e^G)^T do - w^T dvn */
  for (int64_t j = 0; j < c; j++)
    for (int64_t y = 0; y < dv; y++) {
      R s = 0;
      for (int64_t i = j; i < c; i++) s += C->P[i * CH + j] * d_o[i * dv + y];
      for (int64_t x = 0; x < dk; x++) s += C->kg[j * dk + x] * dS[x * dv + y];
      dvn[j * dv + y] = s;
    }
  const R *eGl = eG + (c - 1) * dk;
  for (int64_t x = 0; x < dk; x++)
    for (int64_t y = 0; y < dv; y++) {
      R s = eGl[x] * dS[x * dv + y];
      for (int64_t i = 0; i < c; i++) s += q[i * dk + x] * eG[i * dk + x] * d_o[i * dv + y] - C->w[i * dk + x] * dvn[i * dv + y];
      dSn[x * dv + y] = s;
    }
  /* B3, inter-chunk: dq = (do h^T) . e^G, dk = (vn dS^T) . kg / k (as e^(G_last - G)),
  ** dG = q . dq - k . dk, plus at G_last; dw = -dvn h^T */
  R *dGl = dG + (c - 1) * dk;
  for (int64_t i = 0; i < c; i++)
    for (int64_t x = 0; x < dk; x++) {
      R a = 0, b = 0, e = 0;
      for (int64_t y = 0; y < dv; y++) {
        a += d_o[i * dv + y] * h[x * dv + y];
        b += C->vn[i * dv + y] * dS[x * dv + y];
        e -= dvn[i * dv + y] * h[x * dv + y];
      }
      R Gl = C->G[(c - 1) * dk + x], Gi = C->G[i * dk + x];
      gq[i * dk + x] = a * eG[i * dk + x];
      gk[i * dk + x] = b * exp(Gl - Gi);
      /* the last row's -k dk cancels its own term of the sum added to dG_last below: both are left out */
      dG[i * dk + x] = q[i * dk + x] * gq[i * dk + x] - (i < c - 1 ? k[i * dk + x] * gk[i * dk + x] : 0);
      dw[i * dk + x] = e;
    }
  for (int64_t x = 0; x < dk; x++) {
    R s = 0;
    for (int64_t y = 0; y < dv; y++) s += h[x * dv + y] * dS[x * dv + y];
    s *= eGl[x];
    for (int64_t i = 0; i < c - 1; i++) s += k[i * dk + x] * gk[i * dk + x];
    dGl[x] += s;
  }
  /* WY: dA = dw X^T + dvn Y^T (strictly lower part), X = beta k e^G, Y = beta v */
  R *dA = T1, *T = T2, *dL = T3;
  for (int64_t i = 0; i < c; i++)
    for (int64_t j = 0; j < i; j++) {
      R s = 0;
      for (int64_t x = 0; x < dk; x++) s += dw[i * dk + x] * beta[j] * k[j * dk + x] * eG[j * dk + x];
      for (int64_t y = 0; y < dv; y++) s += dvn[i * dv + y] * beta[j] * v[j * dv + y];
      dA[i * CH + j] = s;
    }
  /* dX = A^T dw: dk += beta e^G dX, dbeta += sum dX k e^G, dG += dX X;
  ** dY = A^T dvn: dv = beta dY, dbeta += sum dY v */
  for (int64_t j = 0; j < c; j++) {
    R db = 0;
    for (int64_t x = 0; x < dk; x++) {
      R s = 0;
      for (int64_t i = j; i < c; i++) s += A[i * CH + j] * dw[i * dk + x];
      R ke = k[j * dk + x] * eG[j * dk + x];
      gk[j * dk + x] += beta[j] * eG[j * dk + x] * s;
      db += s * ke;
      dG[j * dk + x] += s * beta[j] * ke;
    }
    for (int64_t y = 0; y < dv; y++) {
      R s = 0;
      for (int64_t i = j; i < c; i++) s += A[i * CH + j] * dvn[i * dv + y];
      gv[j * dv + y] = beta[j] * s;
      db += s * v[j * dv + y];
    }
    gb[j] = db;
  }
  /* dL = -StrictLower(A^T dA A^T): T = A^T dA, then dL = -T A^T */
  for (int64_t i = 0; i < c; i++)
    for (int64_t j = 0; j < c; j++) {
      R s = 0;
      for (int64_t m = i > j + 1 ? i : j + 1; m < c; m++) s += A[m * CH + i] * dA[m * CH + j];
      T[i * CH + j] = s;
    }
  for (int64_t i = 0; i < c; i++)
    for (int64_t j = 0; j < i; j++) {
      R s = 0;
      for (int64_t m = 0; m <= j; m++) s += T[i * CH + m] * A[j * CH + m];
      dL[i * CH + j] = -s;
    }
  /* B4: dbeta_i += sum_j dL_ij M_ij; dM = beta_i dL, dP = do vn^T (i >= j), through
  ** M and P to q, k and G */
  for (int64_t i = 0; i < c; i++) {
    R db = 0;
    for (int64_t j = 0; j < i; j++) db += dL[i * CH + j] * C->M[i * CH + j];
    gb[i] += db;
  }
  for (int64_t i = 0; i < c; i++)
    for (int64_t j = 0; j <= i; j++) {
      R dM = j < i ? beta[i] * dL[i * CH + j] : 0, dP = 0;
      for (int64_t y = 0; y < dv; y++) dP += d_o[i * dv + y] * C->vn[j * dv + y];
      for (int64_t x = 0; x < dk; x++) {
        R f = FN(factor)(C, i, j, x), ki = k[i * dk + x], kj = k[j * dk + x], qi = q[i * dk + x];
        R a = (dM * ki + dP * qi) * kj * f;        /* d(G_i - G_j) */
        gk[i * dk + x] += dM * kj * f;
        gk[j * dk + x] += (dM * ki + dP * qi) * f;
        gq[i * dk + x] += dP * kj * f;
        if (j < i) {                              /* on the diagonal the two cancel exactly */
          dG[i * dk + x] += a;
          dG[j * dk + x] -= a;
        }
      }
    }
  /* B5: dg = the reverse cumsum of dG within the chunk */
  for (int64_t x = 0; x < dk; x++) {
    R s = 0;
    for (int64_t i = c - 1; i >= 0; i--) gg[i * dk + x] = s += dG[i * dk + x];
  }
  memcpy(dS, dSn, sizeof(R) * (size_t)(dk * dv));
}

/* The forward (o or s_final given) or the backward (dout given), pair by pair. */
static void FN(run)(dm_tensor *o, dm_tensor *s_final, dm_tensor *dq, dm_tensor *dk_, dm_tensor *dv_, dm_tensor *dg,
                    dm_tensor *dbeta, dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                    const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                    const dm_tensor *ds_final) {
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  if (dk > CH_MAXD || dv > CH_MAXD)
    dm_error("kda: the chunked algorithm takes dk, dv <= %d, got %lld, %lld", CH_MAXD, (long long)dk, (long long)dv);
  const bool bwd = dout != NULL;
  const int64_t nc = (T + CH - 1) / CH, nS = dk * dv;
  /* the pair's rows (q k g, v, beta), o or do, its gradients, the chunk states, dS, dS' and scratch */
  const int64_t n = T * (3 * dk + dv + 1) + T * dv + (bwd ? T * (3 * dk + dv + 1) + (nc + 1) * nS : 0) + 2 * nS
                    + 3 * CH * CH + CH * dv + 2 * CH * dk;
  const size_t bytes = sizeof(R) * (size_t)n + sizeof(FN(chunk_t));
  R *mem = dm_alloc(DM_CPU, bytes), *cur = mem;
  FN(chunk_t) *C = (FN(chunk_t) *)mem;
  cur = (R *)(C + 1);
#define TAKE(m) (cur += (m), cur - (m))
  R *pq = TAKE(T * dk), *pk = TAKE(T * dk), *pg = TAKE(T * dk), *pv = TAKE(T * dv), *pb = TAKE(T);
  R *po = TAKE(T * dv), *S = TAKE(nS), *dSn = TAKE(nS);
  R *T1 = TAKE(CH * CH), *T2 = TAKE(CH * CH), *T3 = TAKE(CH * CH), *D1 = TAKE(CH * dv), *D2 = TAKE(CH * dk),
    *D3 = TAKE(CH * dk);
  R *gq = NULL, *gk = NULL, *gg = NULL, *gv = NULL, *gb = NULL, *hs = NULL;
  if (bwd) {
    gq = TAKE(T * dk); gk = TAKE(T * dk); gg = TAKE(T * dk); gv = TAKE(T * dv); gb = TAKE(T);
    hs = TAKE((nc + 1) * nS);
  }
#undef TAKE
  C->dk = dk;
  C->dv = dv;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t rk = (b * T * H + h) * dk, rv = (b * T * H + h) * dv, rb = b * T * H + h;
      FN(gather)(pq, q, rk, T, H * dk, dk);
      FN(gather)(pk, k, rk, T, H * dk, dk);
      FN(gather)(pg, g, rk, T, H * dk, dk);
      FN(gather)(pv, v, rv, T, H * dv, dv);
      FN(gather)(pb, beta, rb, T, H, 1);
      FN(gather)(S, s0, (b * H + h) * nS, 1, 0, nS);
      for (int64_t ch = 0; ch < nc; ch++) {          /* forward; the backward keeps each chunk's state */
        const int64_t t0 = ch * CH;
        C->c = T - t0 < CH ? T - t0 : CH;
        C->q = pq + t0 * dk; C->k = pk + t0 * dk; C->v = pv + t0 * dv; C->beta = pb + t0;
        if (bwd) memcpy(hs + ch * nS, S, sizeof(R) * (size_t)nS);
        FN(prep)(C, pg + t0 * dk);
        FN(advance)(C, S, bwd ? NULL : po + t0 * dv);
      }
      if (!bwd) {
        FN(scatter)(o, po, rv, T, H * dv, dv);
        FN(scatter)(s_final, S, (b * H + h) * nS, 1, 0, nS);
        continue;
      }
      FN(gather)(po, dout, rv, T, H * dv, dv);
      FN(gather)(S, ds_final, (b * H + h) * nS, 1, 0, nS);     /* S now holds dS */
      for (int64_t ch = nc - 1; ch >= 0; ch--) {
        const int64_t t0 = ch * CH;
        C->c = T - t0 < CH ? T - t0 : CH;
        C->q = pq + t0 * dk; C->k = pk + t0 * dk; C->v = pv + t0 * dv; C->beta = pb + t0;
        FN(prep)(C, pg + t0 * dk);
        memcpy(hs + nc * nS, hs + ch * nS, sizeof(R) * (size_t)nS);
        FN(advance)(C, hs + nc * nS, NULL);            /* vn, from the chunk's state */
        FN(back)(C, hs + ch * nS, S, po + t0 * dv, gq + t0 * dk, gk + t0 * dk, gg + t0 * dk, gv + t0 * dv,
                 gb + t0, T1, T2, T3, D1, D2, D3, dSn);
      }
      FN(scatter)(dq, gq, rk, T, H * dk, dk);
      FN(scatter)(dk_, gk, rk, T, H * dk, dk);
      FN(scatter)(dg, gg, rk, T, H * dk, dk);
      FN(scatter)(dv_, gv, rv, T, H * dv, dv);
      FN(scatter)(dbeta, gb, rb, T, H, 1);
      FN(scatter)(ds0, S, (b * H + h) * nS, 1, 0, nS);
    }
  dm_free(DM_CPU, mem, bytes);
}

#undef R
#undef CH
#undef SUB
#undef CH_MAXD
#endif
