/*
** engram.cu — the Engram kernels on CUDA (engram.h has the layout and the
** arithmetic): n-gram rows, unique rows, per-row gradient sums, the gate
** alpha with its backward, and sparse Adam.
**
** engram_index calls engram.h's dm_engram_row, so its indices are the
** CPU's bit for bit. engram_unique and engram_sparse_grad sort
** (value, position) pairs with model.cuh's stable LSD radix sort (8 bits a
** pass, on its bucket sort); the sort is stable, so equal
** values keep their positions in order and a row's sum runs over its
** lookups in increasing position, from 0, in the compute type: the CPU's
** order, the CPU's bits. engram_unique reads its largest value on the
** device and skips the passes above it: no host sync. Sparse Adam updates
** each named row with engram.h's row formula.
**
** Bad indices (a byte outside 0..255, an inverse entry outside 0..U-1, a
** row outside the table or out of order for Adam) are recorded and raised
** at the next synchronisation, as index.cu does; Adam then changes nothing.
*/
#include "model.cuh"
extern "C" {
#include "ops/engram.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

/* ---- n-gram rows ----------------------------------------------------------------------------------- */

__device__ __forceinline__ int64_t byte_at(int t, const void *p, int64_t i) {
  return t == DM_U8 ? ((const uint8_t *)p)[i] : t == DM_I32 ? ((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

/* one thread per (b, t, sub-table): the bytes at t, t-1, ... (prefix, then pad 0, before the row) */
__global__ void index_k(int64_t *idx, const void *x, int xdt, const void *prefix, int pdt, int64_t B, int64_t T,
                        int64_t P, const __grid_constant__ dm_engram_layout L, dm_device_error *err, int what) {
  const int64_t S = L.nsub;
  DM_GRID_LOOP(i, B * T * S) {
    int64_t s = i % S, t = (i / S) % T, b = i / (S * T);
    uint8_t buf[DM_ENGRAM_MAXORDER];
    const int n = L.sub[s].order;
    for (int j = 0; j < n; j++) {
      int64_t pos = t - j, v = 0;
      if (pos >= 0) v = byte_at(xdt, x, b * T + pos);
      else if (P + pos >= 0) v = byte_at(pdt, prefix, b * P + P + pos);
      if (v < 0 || v > 255) dm_report(err, what, v, 256, 0);
      buf[DM_ENGRAM_MAXORDER - 1 - j] = (uint8_t)v;
    }
    idx[i] = dm_engram_row(&L, (int)s, buf + DM_ENGRAM_MAXORDER - 1);
  }
}

static void cuda_engram_index(dm_tensor *idx, const dm_tensor *x, const dm_tensor *prefix, const dm_engram_layout *L) {
  int64_t B = x->shape[0], T = x->shape[1], P = prefix ? prefix->shape[1] : 0, n = B * T * L->nsub;
  if (n == 0) return;
  DM_LAUNCH(index_k, n, (int64_t *)dm_data(idx), dm_data(x), x->dtype, prefix ? dm_data(prefix) : NULL,
            prefix ? prefix->dtype : DM_U8, B, T, P, *L, dm_cuda_device_error(), dm_cuda_name_id("engram_index"));
}

/* ---- the radix sort of (value, position) pairs -------------------------------------------------------- */

/* the largest of n values >= 0 (one block) */
__global__ void max_k(int64_t *out, const int64_t *v, int64_t n) {
  int64_t m = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = v[i] > m ? v[i] : m;
  m = dm_block_reduce(m, dm_op_max());
  if (threadIdx.x == 0) out[0] = m;
}

/* ---- unique rows ---------------------------------------------------------------------------------------- */

/* flags[i] = 1 where sorted value i starts a new run */
__global__ void run_starts_k(int64_t *flags, const int64_t *sk, int64_t n) {
  DM_GRID_LOOP(i, n) flags[i] = i == 0 || sk[i] != sk[i - 1];
}

/* u = the run of i (ex: the exclusive prefix of the flags): rows, inverse, each run's start */
__global__ void unique_k(int64_t *rows, int64_t *inverse, int64_t *start, const int64_t *sk, const int64_t *sp,
                         const int64_t *ex, int64_t n) {
  DM_GRID_LOOP(i, n) {
    bool first = i == 0 || sk[i] != sk[i - 1];
    int64_t u = ex[i] + first - 1;
    inverse[sp[i]] = u;
    if (first) {
      rows[u] = sk[i];
      start[u] = i;
    }
  }
}

/* counts[u] = the run's length, written at its last element */
__global__ void unique_counts_k(int64_t *counts, const int64_t *start, const int64_t *sk, const int64_t *ex,
                                int64_t n) {
  DM_GRID_LOOP(i, n) {
    if (i + 1 < n && sk[i + 1] == sk[i]) continue;
    bool first = i == 0 || sk[i] != sk[i - 1];
    int64_t u = ex[i] + first - 1;
    counts[u] = i + 1 - start[u];
  }
}

static void cuda_engram_unique(dm_tensor *rows, dm_tensor *inverse, dm_tensor *counts, dm_tensor *n_unique,
                               const dm_tensor *idx) {
  int64_t n = dm_numel(idx);
  cudaStream_t st = dm_cuda_stream();
  if (n == 0) {
    DM_CU(cudaMemsetAsync(dm_data(n_unique), 0, sizeof(int64_t), st));
    return;
  }
  /* sk sp tk tp, the flags' prefix (n + 1), the run starts, the largest value */
  size_t nb = (size_t)dm_engram_unique_arrays(n);
  int64_t *mem = (int64_t *)dm_scratch(nb);
  int64_t *sk = mem, *sp = sk + n, *tk = sp + n, *tp = tk + n, *ex = tp + n, *start = ex + n + 1, *mx = start + n;
  const int64_t *key = (const int64_t *)dm_data(idx);
  max_k<<<1, DM_SCAN_THREADS, 0, st>>>(mx, key, n);
  DM_CU_LAUNCHED();
  {
    int64_t *const k[2] = {tk, sk}, *const v[2] = {tp, sp};    /* the passes end in (sk, sp) when even */
    const int r = dm_radix_sort(n, key, NULL, k, v, 64, mx);
    sk = k[r];
    sp = v[r];
  }
  DM_LAUNCH(run_starts_k, n, ex, sk, n);
  dm_scan(ex, ex, n);
  DM_LAUNCH(unique_k, n, (int64_t *)dm_data(rows), (int64_t *)dm_data(inverse), start, sk, sp, ex, n);
  DM_LAUNCH(unique_counts_k, n, (int64_t *)dm_data(counts), start, sk, ex, n);
  DM_CU(cudaMemcpyAsync(dm_data(n_unique), ex + n, sizeof(int64_t), cudaMemcpyDeviceToDevice, st));
  dm_scratch_free(mem, nb);
}

/* ---- per-row gradient sums ------------------------------------------------------------------------------- */

/* keys: the inverse, with a value outside 0..U-1 recorded and sent past the last row (U) */
__global__ void grad_keys_k(int64_t *key, const int64_t *inv, int64_t m, int64_t U, dm_device_error *err, int what) {
  DM_GRID_LOOP(i, m) {
    int64_t v = inv[i];
    if (v < 0 || v >= U) {
      dm_report(err, what, v, U, 0);
      v = U;
    }
    key[i] = v;
  }
}

/* start[u] = the first sorted position holding a value >= u (u = 0..U) */
__global__ void seg_start_k(int64_t *start, const int64_t *sk, int64_t m, int64_t U) {
  DM_GRID_LOOP(u, U + 1) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (sk[mid] < u) lo = mid + 1; else hi = mid;
    }
    start[u] = lo;
  }
}

/* out[u, c] = the sum of g[sp[i], c] over u's run, in increasing position, from 0 */
template <int DT>
__global__ void seg_sum_k(S_<DT> *out, const S_<DT> *g, const int64_t *sp, const int64_t *start, int64_t U,
                          int64_t de) {
  DM_GRID_LOOP(i, U * de) {
    int64_t u = i / de, c = i - u * de;
    C_<DT> acc = 0;
    for (int64_t q = start[u]; q < start[u + 1]; q++) acc += dt<DT>::load(g[sp[q] * de + c]);
    out[i] = dt<DT>::store(acc);
  }
}

static void cuda_engram_sparse_grad(dm_tensor *out, const dm_tensor *g, const dm_tensor *inverse) {
  int64_t U = out->shape[0], m = g->shape[0], de = g->shape[1];
  if (U * de == 0) return;
  size_t nb = (size_t)dm_engram_sparse_grad_arrays(m, U);
  int64_t *mem = (int64_t *)dm_scratch(nb);
  int64_t *key = mem, *sk = key + m, *sp = sk + m, *tk = sp + m, *tp = tk + m, *start = tp + m;
  if (m > 0) {
    DM_LAUNCH(grad_keys_k, m, key, (const int64_t *)dm_data(inverse), m, U, dm_cuda_device_error(),
              dm_cuda_name_id("engram_sparse_grad"));
    int64_t *const k[2] = {tk, sk}, *const v[2] = {tp, sp};
    const int r = dm_radix_sort(m, key, NULL, k, v, 64 - __builtin_clzll((unsigned long long)U), NULL);
    sk = k[r];
    sp = v[r];
  }
  DM_LAUNCH(seg_start_k, U + 1, start, sk, m, U);
  dm_dispatch_float(g->dtype, "engram_sparse_grad", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_LAUNCH(seg_sum_k<DT>, U * de, (S_<DT> *)dm_data(out), (const S_<DT> *)dm_data(g), sp, start, U, de);
  });
  dm_scratch_free(mem, nb);
}

/* ---- the gate alpha --------------------------------------------------------------------------------------- */

/* a token's 1/rms(u), 1/rms(k) and s = ru rk (w . u k) / sqrt(d), over a warp */
template <int DT>
__device__ __forceinline__ void alpha_token(const S_<DT> *u, const S_<DT> *k, const S_<DT> *w, int64_t d, double eps,
                                            C_<DT> *ru, C_<DT> *rk, C_<DT> *s) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  C su = 0, sk = 0, dot = 0;
  for (int64_t i = lane; i < d; i += 32) {
    C a = dt<DT>::load(u[i]), b = dt<DT>::load(k[i]), wi = w ? dt<DT>::load(w[i]) : (C)1;
    su += a * a;
    sk += b * b;
    dot += wi * a * b;
  }
  su = dm_warp_sum(su);
  sk = dm_warp_sum(sk);
  dot = dm_warp_sum(dot);
  *ru = 1 / sqrt(su / (C)d + (C)eps);
  *rk = 1 / sqrt(sk / (C)d + (C)eps);
  *s = *ru * *rk * dot / sqrt((C)d);
}

#define TOKEN_LOOP(n, N)                                                                              \
  for (int64_t n = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; n < (N);                   \
       n += ((int64_t)gridDim.x * blockDim.x) >> 5)

template <int DT>
__global__ void alpha_k(S_<DT> *alpha, const S_<DT> *u, const S_<DT> *k, const S_<DT> *w, int64_t N, int64_t d,
                        double eps) {
  TOKEN_LOOP(n, N) {
    C_<DT> ru, rk, s;
    alpha_token<DT>(u + n * d, k + n * d, w, d, eps, &ru, &rk, &s);
    if ((threadIdx.x & 31) == 0) alpha[n] = dt<DT>::store(1 / (1 + exp(-s)));
  }
}

static unsigned token_blocks(int64_t n) {
  int64_t b = (n + 7) / 8, cap = (int64_t)dm_cuda_sm_count() * 32;
  return (unsigned)(b < 1 ? 1 : b < cap ? b : cap);
}

static void cuda_engram_alpha(dm_tensor *alpha, const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w,
                              double eps) {
  int64_t d = u->shape[u->ndim - 1], N = dm_numel(alpha);
  if (N == 0) return;
  dm_dispatch_float(u->dtype, "engram_alpha", [&](auto dd) {
    constexpr int DT = decltype(dd)::value;
    alpha_k<DT><<<token_blocks(N), DM_THREADS, 0, dm_cuda_stream()>>>(
        (S_<DT> *)dm_data(alpha), (const S_<DT> *)dm_data(u), (const S_<DT> *)dm_data(kx),
        w ? (const S_<DT> *)dm_data(w) : NULL, N, d, eps);
    DM_CU_LAUNCHED();
  });
}

/* ds = g a (1 - a); with a_i = w_i k^_i / sqrt(d): du_i = ds ru (a_i - u^_i s / d), and so on.
** tok[n] keeps {ds, ru, rk} for the gain's sums. */
template <int DT>
__global__ void alpha_bwd_k(S_<DT> *gu, S_<DT> *gk, C_<DT> *tok, const S_<DT> *g, const S_<DT> *u, const S_<DT> *k,
                            const S_<DT> *w, int64_t N, int64_t d, double eps) {
  typedef C_<DT> C;
  const int lane = threadIdx.x & 31;
  const C isd = 1 / sqrt((C)d), rd = 1 / (C)d;
  TOKEN_LOOP(n, N) {
    const S_<DT> *un = u + n * d, *kn = k + n * d;
    C ru, rk, s;
    alpha_token<DT>(un, kn, w, d, eps, &ru, &rk, &s);
    C a = 1 / (1 + exp(-s)), ds = dt<DT>::load(g[n]) * a * (1 - a);
    if (tok && lane == 0) { tok[3 * n] = ds; tok[3 * n + 1] = ru; tok[3 * n + 2] = rk; }
    for (int64_t i = lane; i < d; i += 32) {
      C uh = dt<DT>::load(un[i]) * ru, kh = dt<DT>::load(kn[i]) * rk, wi = w ? dt<DT>::load(w[i]) : (C)1;
      if (gu) gu[n * d + i] = dt<DT>::store(ds * ru * (wi * kh * isd - uh * s * rd));
      if (gk) gk[n * d + i] = dt<DT>::store(ds * rk * (wi * uh * isd - kh * s * rd));
    }
  }
}

/* the gain's gradient: column i of token n is ds u^_i k^_i / sqrt(d) */
template <int DT> struct gw_term {
  const S_<DT> *u, *k;
  const C_<DT> *tok;
  int64_t d;
  C_<DT> isd;
  __device__ C_<DT> operator()(int64_t n, int64_t i) const {
    const C_<DT> *t = tok + 3 * n;
    return t[0] * (dt<DT>::load(u[n * d + i]) * t[1]) * (dt<DT>::load(k[n * d + i]) * t[2]) * isd;
  }
};

template <int DT> struct put_flat {
  S_<DT> *out;
  __device__ void operator()(int64_t j, double v) const { out[j] = dt<DT>::store(v); }
};

static void cuda_engram_alpha_bwd(dm_tensor *gu, dm_tensor *gk, dm_tensor *gw, const dm_tensor *g, const dm_tensor *u,
                                  const dm_tensor *kx, const dm_tensor *w, double eps) {
  int64_t d = u->shape[u->ndim - 1], N = dm_numel(g);
  dm_dispatch_float(u->dtype, "engram_alpha_bwd", [&](auto dd) {
    constexpr int DT = decltype(dd)::value;
    typedef C_<DT> C;
    size_t tb = gw ? (size_t)dm_engram_alpha_tokens(N, (int64_t)sizeof(C)) : 0;   /* then the sums' */
    C *tok = gw ? (C *)dm_scratch(tb) : NULL;
    const S_<DT> *pu = (const S_<DT> *)dm_data(u), *pk = (const S_<DT> *)dm_data(kx);
    if (N > 0) {
      alpha_bwd_k<DT><<<token_blocks(N), DM_THREADS, 0, dm_cuda_stream()>>>(
          gu ? (S_<DT> *)dm_data(gu) : NULL, gk ? (S_<DT> *)dm_data(gk) : NULL, tok, (const S_<DT> *)dm_data(g), pu,
          pk, w ? (const S_<DT> *)dm_data(w) : NULL, N, d, eps);
      DM_CU_LAUNCHED();
    }
    if (gw) {
      gw_term<DT> f = {pu, pk, tok, d, (C)(1 / sqrt((double)d))};
      put_flat<DT> put = {(S_<DT> *)dm_data(gw)};
      dm_colsum(N, d, f, put);
      dm_scratch_free(tok, tb);
    }
  });
}

/* ---- sparse Adam ----------------------------------------------------------------------------------------------- */

/* the first bad position of the row list (out of the table, or not above the row before), into *bad */
__global__ void adam_check_k(unsigned long long *bad, const int64_t *rows, int64_t n, int64_t R, dm_device_error *err,
                             int what, bool report, const int64_t *n_at) {
  if (n_at && *n_at < n) n = *n_at;                 /* the padded list's real rows */
  DM_GRID_LOOP(i, n) {
    int64_t r = rows[i];
    bool range = r < 0 || r >= R, order = i > 0 && r <= rows[i - 1];
    if (!range && !order) continue;
    atomicMin(bad, (unsigned long long)i);
    if (report) dm_report(err, what, r, R, 0);
  }
}

/* each element of each named row, with engram.h's row formula; nothing when the list is bad.
** The constants: hp_at's (device memory, made from device scalars) when set, else hp's;
** n_at (or NULL): how many of the n rows are real */
template <typename T>
__global__ void adam_k(T *w, T *m, T *v, const int64_t *rows, const T *g, int64_t n, int64_t de,
                       const unsigned long long *bad, dm_engram_adam_hp hp, const dm_engram_adam_hp *hp_at,
                       const int64_t *n_at) {
  if (*bad != ~0ull) return;
  const dm_engram_adam_hp h = hp_at ? *hp_at : hp;
  const int64_t real = n_at && *n_at < n ? *n_at : n;
  DM_GRID_LOOP(i, real * de) {
    int64_t q = i / de, c = i - q * de, at = rows[q] * de + c;
    if constexpr (sizeof(T) == 4) dm_engram_adam_row_f32(w + at, m + at, v + at, g + i, 1, &h);
    else dm_engram_adam_row_f64(w + at, m + at, v + at, g + i, 1, &h);
  }
}

/* rows with 8-bit moments (engram.h's dm_engram_adam_row_8bit): a warp a row, each lane its elements
** c = lane, lane + 32, ...; the row's largest new moments by shuffles (a max: the same in any order);
** then each lane encodes its elements again from the old codes, which no lane has written yet */
__global__ void adam_8bit_k(float *w, uint8_t *mc, float *ms, uint8_t *vc, float *vs, const int64_t *rows,
                          const float *g, int64_t n, int64_t de, const unsigned long long *bad, dm_engram_adam_hp hp,
                          const dm_engram_adam_hp *hp_at, const int64_t *n_at, int64_t step, const int64_t *step_at,
                          uint32_t salt) {
  if (*bad != ~0ull) return;
  const dm_engram_adam_hp h = hp_at ? *hp_at : hp;
  const int64_t real = n_at && *n_at < n ? *n_at : n, k = step_at ? *step_at : step;
  const int lane = threadIdx.x & 31;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t q = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < real; q += warps) {
    const int64_t r = rows[q], base = r * de;
    const float ms0 = ms[r], vs0 = vs[r];
    float mmax = 0, rmax = 0, mi, ri;
    for (int64_t c = lane; c < de; c += 32) {
      dm_engram_adam_8bit_elem(&w[base + c], mc[base + c], ms0, vc[base + c], vs0, g[q * de + c], &h, &mi, &ri);
      mmax = fmaxf(mmax, fabsf(mi));
      rmax = fmaxf(rmax, ri);
    }
    for (int o = 16; o > 0; o /= 2) {
      mmax = fmaxf(mmax, __shfl_xor_sync(DM_FULL_MASK, mmax, o));
      rmax = fmaxf(rmax, __shfl_xor_sync(DM_FULL_MASK, rmax, o));
    }
    const float minv = dm_code8_inverse(mmax), rinv = dm_code8_inverse(rmax);
    for (int64_t c = lane; c < de; c += 32) {
      float stepped = 0;                             /* the parameter moved in the first pass */
      dm_engram_adam_8bit_elem(&stepped, mc[base + c], ms0, vc[base + c], vs0, g[q * de + c], &h, &mi, &ri);
      mc[base + c] = dm_code8_encode_signed(mi * minv, dm_sround_bits(salt, 0, k, base + c));
      vc[base + c] = dm_code8_encode_unsigned(ri * rinv, dm_sround_bits(salt, 1, k, base + c));
    }
    if (lane == 0) { ms[r] = mmax; vs[r] = rmax; }   /* every lane read the old scales before the shuffles */
  }
}

/* the step's constants from the device scalars (engram.h's dm_engram_adam_prepare, on the
** device); a non-finite gradient norm marks the list bad, which skips the update */
__global__ void adam_at_consts_k(dm_engram_adam_hp *hp, dm_engram_adam_hp base, dm_engram_adam_scalars at,
                                 unsigned long long *bad) {
  double lr = *at.lr, t = (double)*at.step;
  base.lr = lr;
  base.step_size = lr / (1 - pow(base.beta1, t));
  base.rbc2 = 1 / sqrt(1 - pow(base.beta2, t));
  *hp = base;
  if (at.sumsq && !isfinite(*at.sumsq)) *bad = 0;
}

/* the update of rows[0..n-1] (or of the first *at->n of them); at NULL: hp's constants and step;
** m8 (or NULL): the 8-bit moments, m and v unused */
static void engram_adam_run(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_engram_8bit *m8,
                            const dm_tensor *rows, const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp,
                            int64_t step, const dm_engram_adam_scalars *at) {
  int64_t R = table->shape[0], de = table->shape[1];
  if (n <= 0) return;
  const int64_t *pr = (const int64_t *)dm_data(rows), *n_at = at ? at->n : NULL;
  bool now = dm_debug_level() >= 1 && !at;           /* the debug read waits: never with device scalars */
  size_t nb = (size_t)dm_engram_adam_scratch(n);
  unsigned long long *bad = (unsigned long long *)dm_scratch(nb);
  dm_engram_adam_hp *hpd = (dm_engram_adam_hp *)(bad + 1);
  cudaStream_t st = dm_cuda_stream();
  DM_CU(cudaMemsetAsync(bad, 0xff, sizeof *bad, st));
  DM_LAUNCH(adam_check_k, n, bad, pr, n, R, dm_cuda_device_error(), dm_cuda_name_id("engram_adam"), !now, n_at);
  if (now) {
    unsigned long long got;
    DM_CU(cudaMemcpyAsync(&got, bad, sizeof got, cudaMemcpyDeviceToHost, st));
    DM_CU(cudaStreamSynchronize(st));
    if (got != ~0ull) {
      int64_t i = (int64_t)got, pair[2] = {0, 0};
      DM_CU(cudaMemcpyAsync(pair, pr + (i > 0 ? i - 1 : 0), sizeof(int64_t) * (i > 0 ? 2 : 1), cudaMemcpyDeviceToHost, st));
      DM_CU(cudaStreamSynchronize(st));
      dm_scratch_free(bad, nb);
      int64_t r = i > 0 ? pair[1] : pair[0];
      if (r < 0 || r >= R)
        dm_error("engram_adam: row %lld is out of range for a table of %lld rows", (long long)r, (long long)R);
      dm_error("engram_adam: rows must be distinct and increasing (engram_unique's list); row %lld follows row %lld",
               (long long)r, (long long)pair[0]);
    }
  }
  if (at) {
    adam_at_consts_k<<<1, 1, 0, st>>>(hpd, *hp, *at, bad);
    DM_CU_LAUNCHED();
  }
  const dm_engram_adam_hp *hp_at = at ? hpd : NULL;
  if (m8)
    DM_LAUNCH(adam_8bit_k, n * 32, (float *)dm_data(table), (uint8_t *)dm_data(m8->m), (float *)dm_data(m8->m_scale),
              (uint8_t *)dm_data(m8->v), (float *)dm_data(m8->v_scale), pr, (const float *)dm_data(grads), n,
              de, bad, *hp, hp_at, n_at, step, at ? at->step : NULL, m8->salt);
  else if (table->dtype == DM_F32)
    DM_LAUNCH(adam_k<float>, n * de, (float *)dm_data(table), (float *)dm_data(m), (float *)dm_data(v), pr,
              (const float *)dm_data(grads), n, de, bad, *hp, hp_at, n_at);
  else
    DM_LAUNCH(adam_k<double>, n * de, (double *)dm_data(table), (double *)dm_data(m), (double *)dm_data(v), pr,
              (const double *)dm_data(grads), n, de, bad, *hp, hp_at, n_at);
  dm_scratch_free(bad, nb);
}

static void cuda_engram_adam(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                             const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp) {
  engram_adam_run(table, m, v, NULL, rows, grads, n, hp, 0, NULL);
}

static void cuda_engram_adam_at(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                                const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp,
                                const dm_engram_adam_scalars *at) {
  engram_adam_run(table, m, v, NULL, rows, grads, n, hp, 0, at);
}

static void cuda_engram_adam_8bit(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows,
                                const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp, int64_t step,
                                const dm_engram_adam_scalars *at) {
  engram_adam_run(table, NULL, NULL, m8, rows, grads, n, hp, step, at);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(engram_index, cuda_engram_index),
  DM_KERNEL_ENTRY(engram_unique, cuda_engram_unique),
  DM_KERNEL_ENTRY(engram_sparse_grad, cuda_engram_sparse_grad),
  DM_KERNEL_ENTRY(engram_alpha, cuda_engram_alpha),
  DM_KERNEL_ENTRY(engram_alpha_bwd, cuda_engram_alpha_bwd),
  DM_KERNEL_ENTRY(engram_adam, cuda_engram_adam),
  DM_KERNEL_ENTRY(engram_adam_at, cuda_engram_adam_at),
  DM_KERNEL_ENTRY(engram_adam_8bit, cuda_engram_adam_8bit),
};
DM_CUDA_KERNELS(kernels)
