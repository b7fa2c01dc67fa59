/*
** kda.cu — the KDA recurrence and its gate on CUDA (kda.h has the
** contract): the fused recurrent kernel, the decode path and the second
** reference beside the CPU's loops. (The chunked WY/UT algorithm is a
** separate, later kernel.)
**
** One block of 256 threads runs one (batch, head) pair through time, its
** dk x dv state in the compute type R (float, or double for f64 q) in
** shared memory (in device scratch when it does not fit). Warp w owns the
** state's rows i = w, w + 8, ...; lane l its columns j = l, l + 32, ...
** A step (kda.h): S' = Diag(a) S; e = v - S'^T k; S = S' + beta k e^T;
** o = S^T q. Sums over rows go through per-warp partials added in warp
** order, sums over columns through a warp's butterfly: every run gives the
** same bits, and the step is one function (products and fmas written out,
** so no contraction differs between its uses), so the backward's
** recomputed states are the forward's bit for bit.
**
** The backward follows vm/cpu/kda.c: one pass keeps the state at every
** chunk start (device scratch), then each chunk, last first, recomputes
** its states and delta errors (scratch) and runs the reverse-time steps of
** docs/kda.md §1 (the backward step), with dS in shared memory.
**
** Inputs of any float dtype are read element by element through their
** dtype (a step reads 3 dk + dv + 1 values; the state work dominates).
*/
#include "model.cuh"
extern "C" {
#include "ops/kda.h"
}

#define KDA_THREADS (DM_KDA_WARPS * 32)
#define KDA_WARPS DM_KDA_WARPS      /* vm/ops/kda.h: its scratch follows it */

/* what a pair's kernel reads and writes; dtypes at run time */
struct kda_io {
  int64_t B, T, H, dk, dv, chunk;
  const void *q, *k, *v, *g, *beta, *s0, *dout, *dsf;
  int qdt, gdt, bdt, sdt, odt, fdt;        /* q/k/v, g, beta, s0, dout, ds_final */
  void *o, *sfin;                          /* forward outputs (sfin in R) */
  void *dq, *dk_, *dv_, *dg, *dbeta, *ds0; /* backward outputs, each in its input's dtype */
  int dqdt, dkdt, dvdt, dgdt, dbdt, ds0dt;
  bool smem_state;                         /* S (and dS) in shared memory, else in scratch */
};

/* element offset of row (b, t, h) of a [B, T, H, d] tensor */
__device__ __forceinline__ int64_t kda_row(const kda_io &A, int64_t b, int64_t t, int64_t h, int64_t d) {
  return ((b * A.T + t) * A.H + h) * d;
}

/* the per-step vectors in shared memory */
template <typename R> struct kda_vecs {
  R *q, *k, *a, *v, *beta;     /* v holds do in the backward */
};

/* the step's inputs into shared memory (the caller syncs) */
template <typename R>
__device__ void kda_load(const kda_io &A, const kda_vecs<R> &s, int64_t b, int64_t t, int64_t h, bool with_v) {
  const int64_t rk = kda_row(A, b, t, h, A.dk), rv = kda_row(A, b, t, h, A.dv);
  for (int64_t i = threadIdx.x; i < A.dk; i += blockDim.x) {
    s.q[i] = (R)dm_ld(A.qdt, A.q, rk + i);
    s.k[i] = (R)dm_ld(A.qdt, A.k, rk + i);
    s.a[i] = exp((R)dm_ld(A.gdt, A.g, rk + i));
  }
  if (with_v)
    for (int64_t j = threadIdx.x; j < A.dv; j += blockDim.x) s.v[j] = (R)dm_ld(A.qdt, A.v, rv + j);
  if (threadIdx.x == 0) s.beta[0] = (R)dm_ld(A.bdt, A.beta, (b * A.T + t) * A.H + h);
}

__device__ __forceinline__ float kda_mul(float x, float y) { return __fmul_rn(x, y); }
__device__ __forceinline__ double kda_mul(double x, double y) { return __dmul_rn(x, y); }

/* One step on S with the inputs in shared memory (synced). E (when not
** NULL) receives the delta error e; with partO, each warp's part of
** S^T q (the caller sums the warps after the closing sync). */
template <typename R>
__device__ void kda_step(R *S, const kda_vecs<R> &s, int dk, int dv, R *partE, R *partO, R *E) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int j = lane; j < dv; j += 32) {
    R acc = 0;
    for (int i = w; i < dk; i += KDA_WARPS) {
      R x = kda_mul(S[i * dv + j], s.a[i]);
      S[i * dv + j] = x;
      acc = fma(x, s.k[i], acc);
    }
    partE[w * dv + j] = acc;
  }
  __syncthreads();
  const R beta = s.beta[0];
  for (int j = lane; j < dv; j += 32) {
    R sk = 0;
    for (int u = 0; u < KDA_WARPS; u++) sk += partE[u * dv + j];
    R e = s.v[j] - sk, acc = 0;
    if (E && w == 0) E[j] = e;
    for (int i = w; i < dk; i += KDA_WARPS) {
      R x = fma(kda_mul(beta, s.k[i]), e, S[i * dv + j]);
      S[i * dv + j] = x;
      acc = fma(x, s.q[i], acc);
    }
    if (partO) partO[w * dv + j] = acc;
  }
  __syncthreads();
}

/* dst = src over the elements this thread owns in kda_step (no sync needed around it) */
template <typename R> __device__ void kda_copy_own(R *dst, const R *src, int dk, int dv) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = w; i < dk; i += KDA_WARPS)
    for (int j = lane; j < dv; j += 32) dst[i * dv + j] = src[i * dv + j];
}

/* a state from a [B, H, dk, dv] tensor of dtype t (NULL: zeros), own elements */
template <typename R>
__device__ void kda_state_load(R *S, const void *src, int t, int64_t base, int dk, int dv) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = w; i < dk; i += KDA_WARPS)
    for (int j = lane; j < dv; j += 32) S[i * dv + j] = src ? (R)dm_ld(t, src, base + i * dv + j) : (R)0;
}

template <typename R>
__device__ void kda_state_store(void *dst, int t, int64_t base, const R *S, int dk, int dv) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = w; i < dk; i += KDA_WARPS)
    for (int j = lane; j < dv; j += 32) dm_st(t, dst, base + i * dv + j, (double)S[i * dv + j]);
}

/* ---- shared memory ---------------------------------------------------------------------------- */

/* R values of a pair's shared memory: [S dS] q k a u v(do) e gv beta partE partO */

template <typename R> struct kda_shared {
  R *S, *dS, *u, *e, *gv, *partE, *partO;
  kda_vecs<R> s;
};

/* the layout over raw shared memory; S and dS point into scratch + the pair's slice when not shared */
template <typename R>
__device__ kda_shared<R> kda_carve(R *sm, const kda_io &A, bool bwd, R *scratch) {
  kda_shared<R> L;
  const int64_t n = A.dk * A.dv;
  R *p = sm;
  if (A.smem_state) {
    L.S = p; p += n;
    L.dS = bwd ? p : NULL; p += bwd ? n : 0;
  } else {
    R *mine = scratch + (int64_t)blockIdx.x * (bwd ? 2 : 1) * n;
    L.S = mine;
    L.dS = bwd ? mine + n : NULL;
  }
  L.s.q = p; p += A.dk;
  L.s.k = p; p += A.dk;
  L.s.a = p; p += A.dk;
  L.u = p; p += A.dk;
  L.s.v = p; p += A.dv;
  L.e = p; p += A.dv;
  L.gv = p; p += A.dv;
  L.s.beta = p; p += 1;
  L.partE = p; p += KDA_WARPS * A.dv;
  L.partO = p;
  return L;
}

/* ---- forward ----------------------------------------------------------------------------------- */

template <typename R>
__global__ void __launch_bounds__(KDA_THREADS) kda_fwd_k(kda_io A, R *scratch) {
  extern __shared__ __align__(16) unsigned char kda_smem_raw[];
  kda_shared<R> L = kda_carve<R>((R *)kda_smem_raw, A, false, scratch);
  const int64_t b = blockIdx.x / A.H, h = blockIdx.x % A.H;
  const int dk = (int)A.dk, dv = (int)A.dv;
  const int64_t sbase = (b * A.H + h) * A.dk * A.dv;
  kda_state_load<R>(L.S, A.s0, A.sdt, sbase, dk, dv);
  for (int64_t t = 0; t < A.T; t++) {
    kda_load<R>(A, L.s, b, t, h, true);
    __syncthreads();
    kda_step<R>(L.S, L.s, dk, dv, L.partE, L.partO, NULL);
    const int64_t ro = kda_row(A, b, t, h, A.dv);
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
      R o = 0;
      for (int u = 0; u < KDA_WARPS; u++) o += L.partO[u * dv + j];
      dm_st(A.odt, A.o, ro + j, (double)o);
    }
  }
  kda_state_store<R>(A.sfin, sizeof(R) == 8 ? DM_F64 : DM_F32, sbase, L.S, dk, dv);
}

/* ---- backward ----------------------------------------------------------------------------------- */

/* Step t backwards (docs/kda.md §1, as vm/cpu/kda.c's back_step): Sh the
** state before the step, Sn after it, the step's error in L.e, do in L.s.v. */
template <typename R>
__device__ void kda_back_step(const kda_io &A, const kda_shared<R> &L, int64_t b, int64_t t, int64_t h,
                              const R *Sh, const R *Sn) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, dk = (int)A.dk, dv = (int)A.dv;
  const kda_vecs<R> &s = L.s;
  R *dS = L.dS;
  const R beta = s.beta[0];
  const int64_t rk = kda_row(A, b, t, h, A.dk), rv = kda_row(A, b, t, h, A.dv);
  /* dS += q do^T; w = dS^T k (warp partials) */
  for (int j = lane; j < dv; j += 32) {
    R acc = 0;
    for (int i = w; i < dk; i += KDA_WARPS) {
      R x = dS[i * dv + j] + s.q[i] * s.v[j];
      dS[i * dv + j] = x;
      acc += x * s.k[i];
    }
    L.partE[w * dv + j] = acc;
  }
  /* dq = S_t do; u = dS e */
  for (int i = w; i < dk; i += KDA_WARPS) {
    R dq = 0, u = 0;
    for (int j = lane; j < dv; j += 32) {
      dq += Sn[i * dv + j] * s.v[j];
      u += dS[i * dv + j] * L.e[j];
    }
    dq = dm_warp_sum(dq);
    u = dm_warp_sum(u);
    if (lane == 0) {
      L.u[i] = u;
      if (A.dq) dm_st(A.dqdt, A.dq, rk + i, (double)dq);
    }
  }
  __syncthreads();
  /* dv = beta dS^T k (the error's gradient); dbeta = k^T dS e */
  for (int j = threadIdx.x; j < dv; j += blockDim.x) {
    R x = 0;
    for (int u = 0; u < KDA_WARPS; u++) x += L.partE[u * dv + j];
    L.gv[j] = beta * x;
    if (A.dv_) dm_st(A.dvdt, A.dv_, rv + j, (double)(beta * x));
  }
  if (w == 0) {
    R db = 0;
    for (int i = lane; i < dk; i += 32) db += s.k[i] * L.u[i];
    db = dm_warp_sum(db);
    if (lane == 0 && A.dbeta) dm_st(A.dbdt, A.dbeta, (b * A.T + t) * A.H + h, (double)db);
  }
  __syncthreads();
  /* dk = beta u - S' dv; dS' = dS - k dv^T; dg = rowsum(S' . dS'); dS_{t-1} = Diag(a) dS' */
  for (int i = w; i < dk; i += KDA_WARPS) {
    const R ai = s.a[i], ki = s.k[i];
    R sde = 0, dg = 0;
    for (int j = lane; j < dv; j += 32) {
      R sp = ai * Sh[i * dv + j], dsp = dS[i * dv + j] - ki * L.gv[j];
      sde += sp * L.gv[j];
      dg += sp * dsp;
      dS[i * dv + j] = ai * dsp;
    }
    sde = dm_warp_sum(sde);
    dg = dm_warp_sum(dg);
    if (lane == 0) {
      if (A.dk_) dm_st(A.dkdt, A.dk_, rk + i, (double)(beta * L.u[i] - sde));
      if (A.dg) dm_st(A.dgdt, A.dg, rk + i, (double)dg);
    }
  }
  __syncthreads();
}

/* scratch per pair: nc checkpoints, len recomputed states, len error rows */
template <typename R>
__global__ void __launch_bounds__(KDA_THREADS) kda_bwd_k(kda_io A, R *scratch, R *work) {
  extern __shared__ __align__(16) unsigned char kda_smem_raw[];
  kda_shared<R> L = kda_carve<R>((R *)kda_smem_raw, A, true, scratch);
  const int64_t b = blockIdx.x / A.H, h = blockIdx.x % A.H, T = A.T, chunk = A.chunk;
  const int dk = (int)A.dk, dv = (int)A.dv;
  const int64_t n = A.dk * A.dv, nc = (T + chunk - 1) / chunk, len_max = chunk < T ? chunk : T;
  R *ckpt = work + (int64_t)blockIdx.x * (nc * n + len_max * n + len_max * A.dv);
  R *hist = ckpt + nc * n, *E = hist + len_max * n;
  const int64_t sbase = (b * A.H + h) * n;
  /* checkpoints: ckpt[c] is the state before step c * chunk */
  kda_state_load<R>(L.S, A.s0, A.sdt, sbase, dk, dv);
  if (nc > 0) kda_copy_own<R>(ckpt, L.S, dk, dv);
  for (int64_t c = 1; c < nc; c++) {
    for (int64_t t = (c - 1) * chunk; t < c * chunk; t++) {
      kda_load<R>(A, L.s, b, t, h, true);
      __syncthreads();
      kda_step<R>(L.S, L.s, dk, dv, L.partE, NULL, NULL);
    }
    kda_copy_own<R>(ckpt + c * n, L.S, dk, dv);
  }
  kda_state_load<R>(L.dS, A.dsf, A.fdt, sbase, dk, dv);
  for (int64_t c = nc - 1; c >= 0; c--) {
    const int64_t t0 = c * chunk, len = T - t0 < chunk ? T - t0 : chunk;
    /* hist[j]: the state after step t0 + j; E row j: that step's error */
    kda_copy_own<R>(L.S, ckpt + c * n, dk, dv);
    for (int64_t j = 0; j < len; j++) {
      kda_load<R>(A, L.s, b, t0 + j, h, true);
      __syncthreads();
      kda_step<R>(L.S, L.s, dk, dv, L.partE, NULL, E + j * A.dv);
      kda_copy_own<R>(hist + j * n, L.S, dk, dv);
    }
    for (int64_t j = len - 1; j >= 0; j--) {
      const int64_t t = t0 + j, rv = kda_row(A, b, t, h, A.dv);
      kda_load<R>(A, L.s, b, t, h, false);
      for (int64_t x = threadIdx.x; x < A.dv; x += blockDim.x) {
        L.s.v[x] = (R)dm_ld(A.odt, A.dout, rv + x);
        L.e[x] = E[j * A.dv + x];
      }
      __syncthreads();
      kda_back_step<R>(A, L, b, t, h, j > 0 ? hist + (j - 1) * n : ckpt + c * n, hist + j * n);
    }
  }
  if (A.ds0) kda_state_store<R>(A.ds0, A.ds0dt, sbase, L.dS, dk, dv);
}

/* ---- launching ------------------------------------------------------------------------------------ */

static kda_io kda_io_of(const dm_tensor *q, const dm_tensor *k, const dm_tensor *v, const dm_tensor *g,
                        const dm_tensor *beta, const dm_tensor *s0) {
  kda_io A;
  memset(&A, 0, sizeof A);
  A.B = q->shape[0]; A.T = q->shape[1]; A.H = q->shape[2]; A.dk = q->shape[3]; A.dv = v->shape[3];
  A.q = dm_data(q); A.k = dm_data(k); A.v = dm_data(v); A.g = dm_data(g); A.beta = dm_data(beta);
  A.s0 = s0 ? dm_data(s0) : NULL;
  A.qdt = q->dtype; A.gdt = g->dtype; A.bdt = beta->dtype; A.sdt = s0 ? s0->dtype : DM_F32;
  return A;
}

/* the most dynamic shared memory a block may opt in to on this device */
static int64_t kda_smem_optin(void) {
  static int limit = -1;
  if (limit < 0) {
    int dev = 0;
    DM_CU(cudaGetDevice(&dev));
    DM_CU(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  return limit;
}

/* shared bytes of one block, deciding whether the state fits there */
template <typename R> static size_t kda_smem_bytes(kda_io *A, bool bwd, const void *kernel) {
  const int64_t limit = kda_smem_optin();
  A->smem_state = dm_kda_state_in_smem(A->dk, A->dv, bwd, sizeof(R), limit);
  size_t bytes = sizeof(R) * (size_t)dm_kda_smem_values(A->dk, A->dv, bwd, A->smem_state);
  if (bytes > (size_t)limit)
    dm_error("kda: dv = %lld is too large for the CUDA recurrent kernel's shared memory", (long long)A->dv);
  if (bytes > 48 * 1024) DM_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return bytes;
}

static void kda_check_dims(const kda_io *A) {
  if (A->dk > INT_MAX / 2 || A->dv > INT_MAX / 2) dm_error("kda: dk and dv must fit an int on CUDA");
}

template <typename R> static void kda_forward(dm_tensor *o, dm_tensor *s_final, kda_io A) {
  A.o = dm_data(o);
  A.odt = o->dtype;
  A.sfin = dm_data(s_final);
  int64_t pairs = A.B * A.H;
  if (pairs == 0) return;
  size_t bytes = kda_smem_bytes<R>(&A, false, (const void *)kda_fwd_k<R>);
  size_t sb = (size_t)dm_kda_fwd_scratch(pairs, A.dk, A.dv, sizeof(R), kda_smem_optin());
  R *scratch = sb ? (R *)dm_scratch(sb) : NULL;
  kda_fwd_k<R><<<(unsigned)pairs, KDA_THREADS, bytes, dm_cuda_stream()>>>(A, scratch);
  DM_CU_LAUNCHED();
  if (scratch) dm_scratch_free(scratch, sb);
}

static void cuda_kda_fwd(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                         const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0) {
  kda_io A = kda_io_of(q, k, v, g, beta, s0);
  kda_check_dims(&A);
  if (q->dtype == DM_F64) kda_forward<double>(o, s_final, A);
  else kda_forward<float>(o, s_final, A);
}

template <typename R> static void kda_backward(kda_io A) {
  int64_t pairs = A.B * A.H;
  if (pairs == 0) return;
  size_t bytes = kda_smem_bytes<R>(&A, true, (const void *)kda_bwd_k<R>);
  size_t sb = (size_t)dm_kda_bwd_states(pairs, A.dk, A.dv, sizeof(R), kda_smem_optin());
  size_t wb = (size_t)dm_kda_bwd_work(pairs, A.T, A.dk, A.dv, A.chunk, sizeof(R));
  R *scratch = sb ? (R *)dm_scratch(sb) : NULL, *work = (R *)dm_scratch(wb);
  kda_bwd_k<R><<<(unsigned)pairs, KDA_THREADS, bytes, dm_cuda_stream()>>>(A, scratch, work);
  DM_CU_LAUNCHED();
  dm_scratch_free(work, wb);
  if (scratch) dm_scratch_free(scratch, sb);
}

static void cuda_kda_bwd(dm_tensor *dq, dm_tensor *dk, dm_tensor *dv, dm_tensor *dg, dm_tensor *dbeta,
                         dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                         const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                         const dm_tensor *ds_final, int64_t chunk) {
  if (chunk < 1) dm_error("kda_bwd: the checkpoint interval must be >= 1, got %lld", (long long)chunk);
  kda_io A = kda_io_of(q, k, v, g, beta, s0);
  kda_check_dims(&A);
  A.chunk = chunk;
  dm_tensor *outs[6] = {dq, dk, dv, dg, dbeta, ds0};
  kda_bind_backward(A, dout, ds_final, outs);
  if (q->dtype == DM_F64) kda_backward<double>(A);
  else kda_backward<float>(A);
}

/* ---- the gate -------------------------------------------------------------------------------------- */

template <typename R> __device__ __forceinline__ R kda_sigmoid(R x) {
  return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x));
}
template <typename R> __device__ __forceinline__ R kda_softplus(R x) {
  return (x > 0 ? x : 0) + log1p(exp(-fabs(x)));
}

/* g at z with scale ea = e^A; with dz set, also dg/dz and dg/dA (as vm/cpu/kda.c's gate_at) */
template <typename R> __device__ __forceinline__ R kda_gate_at(int kind, R lb, R ea, R z, R *dz, R *dA) {
  if (kind == DM_KDA_GATE_BOUNDED) {
    R y = z == 0 ? 0 : ea * z, s = kda_sigmoid(y), ds = s * kda_sigmoid(-y);
    if (dz) {
      *dz = ds == 0 ? 0 : lb * ds * ea;
      *dA = ds == 0 ? 0 : lb * ds * y;
    }
    return lb * s;
  }
  R sp = kda_softplus(z), g = sp == 0 ? 0 : -(ea * sp);
  if (dz) {
    R s = kda_sigmoid(z);
    *dz = s == 0 ? 0 : -(ea * s);
    *dA = g;
  }
  return g;
}

/* f seen as [N, D]; channel c belongs to head c / per */
struct gate_io {
  const void *f, *a_log, *bias, *dg;
  int fdt, adt, bdt, gdt;
  int64_t N, D, per;
  int kind;
  double lb;
};

template <typename R> __device__ __forceinline__ R gate_scale(const gate_io &G, int64_t c) {
  return G.a_log ? exp((R)dm_ld(G.adt, G.a_log, c / G.per)) : (R)1;
}

struct gate_put {
  void *dbias;
  int bdt;
  double *chan;
  int64_t D;
  __device__ void operator()(int64_t j, double v) const {
    if (j < D) { if (dbias) dm_st(bdt, dbias, j, v); }
    else chan[j - D] = v;
  }
};

/* da_log[h] = the sum of its channels' terms, in channel order */
__global__ void gate_heads_k(void *da, int dadt, const double *chan, int64_t heads, int64_t per) {
  DM_GRID_LOOP(h, heads) {
    double s = 0;
    for (int64_t c = h * per; c < (h + 1) * per; c++) s += chan[c];
    dm_st(dadt, da, h, s);
  }
}

/* The gate by channel runs: a thread takes channel c (coalesced across the warp) over GATE_ROWS
** rows, with its scale and bias read once; no index division an element. The backward writes df
** and sums each run's bias and scale terms in double (part[run][2D]: the bias's D, then the
** scale's), joined in run order by dm_colsum_join_k. */
#define GATE_ROWS DM_KDA_GATE_ROWS   /* vm/ops/kda.h */
#define GATE_CH 256

static int64_t gate_rows_per(int64_t N) { return dm_kda_gate_rows_per(N); }

template <typename R> __global__ void gate_rows_k(R *g, gate_io G, int64_t per) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= G.D) return;
  const R ea = gate_scale<R>(G, c), bias = (R)dm_ld(G.bdt, G.bias, c), lb = (R)G.lb;
  const int64_t n0 = (int64_t)blockIdx.y * per, n1 = n0 + per < G.N ? n0 + per : G.N;
  for (int64_t n = n0; n < n1; n++)
    g[n * G.D + c] = kda_gate_at<R>(G.kind, lb, ea, (R)dm_ld(G.fdt, G.f, n * G.D + c) + bias, NULL, NULL);
}

template <typename R> __global__ void gate_rows_bwd_k(void *df, int dfdt, gate_io G, int64_t per, double *part) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= G.D) return;
  const R ea = gate_scale<R>(G, c), bias = (R)dm_ld(G.bdt, G.bias, c), lb = (R)G.lb;
  const int64_t n0 = (int64_t)blockIdx.y * per, n1 = n0 + per < G.N ? n0 + per : G.N;
  double sb = 0, sa = 0;
  for (int64_t n = n0; n < n1; n++) {
    const int64_t i = n * G.D + c;
    R gr = (R)dm_ld(G.gdt, G.dg, i), tz = 0, ta = 0;
    if (gr != 0) {
      R dz = 0, dA = 0;
      kda_gate_at<R>(G.kind, lb, ea, (R)dm_ld(G.fdt, G.f, i) + bias, &dz, &dA);
      tz = gr * dz;
      ta = gr * dA;
    }
    if (df) dm_st(dfdt, df, i, (double)tz);
    sb += (double)tz;
    sa += (double)ta;
  }
  if (part) {
    part[(int64_t)blockIdx.y * 2 * G.D + c] = sb;
    part[(int64_t)blockIdx.y * 2 * G.D + G.D + c] = sa;
  }
}

static gate_io gate_io_of(const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias, int64_t heads,
                          int kind, double lb) {
  gate_io G;
  memset(&G, 0, sizeof G);
  G.f = dm_data(f); G.fdt = f->dtype;
  G.a_log = a_log ? dm_data(a_log) : NULL; G.adt = a_log ? a_log->dtype : DM_F32;
  G.bias = dm_data(dt_bias); G.bdt = dt_bias->dtype;
  G.D = dm_numel(dt_bias);
  G.N = G.D ? dm_numel(f) / G.D : 0;
  G.per = heads > 0 ? G.D / heads : 1;
  if (G.per < 1) G.per = 1;
  G.kind = kind;
  G.lb = lb;
  return G;
}

static void cuda_kda_gate(dm_tensor *g, const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias,
                          int64_t heads, int kind, double lb) {
  gate_io G = gate_io_of(f, a_log, dt_bias, heads, kind, lb);
  if (G.N * G.D == 0) return;
  const int64_t per = gate_rows_per(G.N);
  dim3 grid((unsigned)((G.D + GATE_CH - 1) / GATE_CH), (unsigned)((G.N + per - 1) / per));
  if (f->dtype == DM_F64) gate_rows_k<double><<<grid, GATE_CH, 0, dm_cuda_stream()>>>((double *)dm_data(g), G, per);
  else gate_rows_k<float><<<grid, GATE_CH, 0, dm_cuda_stream()>>>((float *)dm_data(g), G, per);
  DM_CU_LAUNCHED();
}

template <typename R>
static void gate_backward(dm_tensor *df, dm_tensor *da_log, dm_tensor *ddt_bias, gate_io G, int64_t heads) {
  const bool sums = da_log || ddt_bias;
  if (G.D == 0 || (!df && !sums)) return;
  const int64_t per = gate_rows_per(G.N), runs = G.N > 0 ? (G.N + per - 1) / per : 0;
  size_t nb = (size_t)dm_kda_gate_bwd_channels(G.D), np = (size_t)dm_kda_gate_bwd_partials(G.N, G.D);
  double *part = sums && runs > 0 ? (double *)dm_scratch(np) : NULL;
  if (runs > 0) {
    dim3 grid((unsigned)((G.D + GATE_CH - 1) / GATE_CH), (unsigned)runs);
    gate_rows_bwd_k<R><<<grid, GATE_CH, 0, dm_cuda_stream()>>>(df ? dm_data(df) : NULL, df ? df->dtype : DM_F32, G,
                                                               per, part);
    DM_CU_LAUNCHED();
  }
  if (!sums) return;
  double *chan = (double *)dm_scratch(nb);
  gate_put put = {ddt_bias ? dm_data(ddt_bias) : NULL, ddt_bias ? ddt_bias->dtype : DM_F32, chan, G.D};
  DM_LAUNCH(dm_colsum_join_k<gate_put>, 2 * G.D, put, part, runs, 2 * G.D);
  if (da_log && heads > 0) DM_LAUNCH(gate_heads_k, heads, dm_data(da_log), da_log->dtype, chan, heads, G.per);
  dm_scratch_free(chan, nb);
  if (part) dm_scratch_free(part, np);
}

static void cuda_kda_gate_bwd(dm_tensor *df, dm_tensor *da_log, dm_tensor *ddt_bias, const dm_tensor *dg,
                              const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias, int64_t heads,
                              int kind, double lb) {
  gate_io G = gate_io_of(f, a_log, dt_bias, heads, kind, lb);
  G.dg = dm_data(dg);
  G.gdt = dg->dtype;
  if (f->dtype == DM_F64) gate_backward<double>(df, da_log, ddt_bias, G, heads);
  else gate_backward<float>(df, da_log, ddt_bias, G, heads);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(kda_fwd, cuda_kda_fwd),
  DM_KERNEL_ENTRY(kda_bwd, cuda_kda_bwd),
  DM_KERNEL_ENTRY(kda_gate, cuda_kda_gate),
  DM_KERNEL_ENTRY(kda_gate_bwd, cuda_kda_gate_bwd),
};
DM_CUDA_KERNELS(kernels)
