/*
** cpu/engram.c — the Engram kernels: n-gram rows, unique rows, the
** per-row gradient sums, sparse Adam, and the gate alpha with its backward.
**
** The ops hand every kernel contiguous tensors. Float kernels are written
** once as a template over the storage type T and the compute type A (float
** for f32, bf16 and f16, double for f64), as the elementwise family does.
*/
#include <stdlib.h>
#include <string.h>
#include <tgmath.h>
#include "core/alloc.h"
#include "ops/engram.h"

/* ---- unique rows: a stable LSD radix sort of (value, position) pairs ------------------------- */

#define DIGIT 12                       /* bits per pass: 4096 buckets, two passes up to 2^24 */

int64_t dm_engram_unique_host(const int64_t *idx, int64_t n, int64_t *rows, int64_t *inverse,
                              int64_t *counts, int64_t *scratch) {
  uint64_t *key = (uint64_t *)scratch, *key2 = key + n;
  int64_t *pos = scratch + 2 * n, *pos2 = scratch + 3 * n;
  uint64_t top = 0;
  for (int64_t i = 0; i < n; i++) {
    key[i] = (uint64_t)idx[i];
    pos[i] = i;
    if (key[i] > top) top = key[i];
  }
  /* one pass per digit of the largest value; stability keeps equal values in position order */
  int64_t at[(1 << DIGIT) + 1];         /* 32 KB of stack */
  for (int shift = 0; shift < 64 && (top >> shift) != 0; shift += DIGIT) {
    const uint64_t mask = (1u << DIGIT) - 1;
    memset(at, 0, sizeof at);
    for (int64_t i = 0; i < n; i++) at[((key[i] >> shift) & mask) + 1]++;
    for (int d = 0; d < 1 << DIGIT; d++) at[d + 1] += at[d];
    for (int64_t i = 0; i < n; i++) {
      int64_t to = at[(key[i] >> shift) & mask]++;
      key2[to] = key[i];
      pos2[to] = pos[i];
    }
    uint64_t *tk = key; key = key2; key2 = tk;
    int64_t *tp = pos; pos = pos2; pos2 = tp;
  }
  int64_t u = -1;
  for (int64_t i = 0; i < n; i++) {
    int64_t v = (int64_t)key[i];
    if (u < 0 || v != rows[u]) { rows[++u] = v; counts[u] = 0; }
    counts[u]++;
    inverse[pos[i]] = u;
  }
  return u + 1;
}

static void cpu_engram_unique(dm_tensor *rows, dm_tensor *inverse, dm_tensor *counts, dm_tensor *n_unique,
                              const dm_tensor *idx) {
  int64_t n = dm_numel(idx);
  int64_t *scratch = dm_xmalloc(sizeof(int64_t) * 4 * (size_t)n);
  int64_t u = dm_engram_unique_host(dm_data(idx), n, dm_data(rows), dm_data(inverse), dm_data(counts), scratch);
  free(scratch);
  *(int64_t *)dm_data(n_unique) = u;
}

/* ---- n-gram rows ------------------------------------------------------------------------------ */

static uint8_t byte_at(const dm_tensor *t, const char *base, int64_t i) {
  switch (t->dtype) {
  case DM_U8: return ((const uint8_t *)base)[i];
  case DM_I32: return (uint8_t)((const int32_t *)base)[i];
  default: return (uint8_t)((const int64_t *)base)[i];
  }
}

static void cpu_engram_index(dm_tensor *idx, const dm_tensor *x, const dm_tensor *prefix,
                             const dm_engram_layout *L) {
  int64_t B = x->shape[0], T = x->shape[1], P = prefix ? prefix->shape[1] : 0;
  int64_t K = L->max_order - 1, S = L->nsub;
  const char *px = dm_data(x), *pp = prefix ? dm_data(prefix) : NULL;
  int64_t *out = dm_data(idx);
  /* one row's bytes behind the K bytes before it, so every n-gram reads a contiguous run */
  uint8_t *buf = dm_xmalloc((size_t)(K + T));
  for (int64_t b = 0; b < B; b++) {
    for (int64_t i = 0; i < K; i++) {
      int64_t at = P - K + i;                   /* the prefix's last K bytes, pad 0 before them */
      buf[i] = at >= 0 ? byte_at(prefix, pp, b * P + at) : 0;
    }
    for (int64_t t = 0; t < T; t++) buf[K + t] = byte_at(x, px, b * T + t);
    for (int64_t t = 0; t < T; t++)
      for (int s = 0; s < S; s++) out[(b * T + t) * S + s] = dm_engram_row(L, s, buf + K + t);
  }
  free(buf);
}

/* ---- float kernels ------------------------------------------------------------------------------ */

#define LD_SAME(x) (x)
#define ST_SAME(x) (x)

#define FLOAT_KERNELS(T, A, LD, ST, sfx)                                                                 \
  /* out[u] = the sum of g's rows with inverse == u, in increasing position (a stable counting sort) */  \
  static void sparse_grad_##sfx(dm_tensor *out, const dm_tensor *g, const dm_tensor *inverse) {          \
    int64_t U = out->shape[0], M = g->shape[0], de = g->shape[1];                                        \
    const int64_t *inv = dm_data(inverse);                                                               \
    const T *G = dm_data(g);                                                                             \
    T *O = dm_data(out);                                                                                 \
    /* one block, so that running out of memory leaks nothing */                                         \
    int64_t *at = dm_xmalloc(sizeof(int64_t) * (size_t)(U + 1 + M) + sizeof(A) * (size_t)de);            \
    int64_t *order = at + U + 1;                                                                         \
    A *acc = (A *)(order + M);                                                                           \
    memset(at, 0, sizeof(int64_t) * (size_t)(U + 1));                                                    \
    for (int64_t p = 0; p < M; p++) at[inv[p] + 1]++;                                                    \
    for (int64_t u = 0; u < U; u++) at[u + 1] += at[u];                                                  \
    for (int64_t p = 0; p < M; p++) order[at[inv[p]]++] = p;                                             \
    for (int64_t u = 0, lo = 0; u < U; u++) {      /* at[u] is now the end of segment u */               \
      for (int64_t c = 0; c < de; c++) acc[c] = 0;                                                       \
      for (; lo < at[u]; lo++)                                                                           \
        for (int64_t c = 0; c < de; c++) acc[c] += LD(G[order[lo] * de + c]);                            \
      for (int64_t c = 0; c < de; c++) O[u * de + c] = ST(acc[c]);                                       \
    }                                                                                                    \
    free(at);                                                                                            \
  }                                                                                                      \
                                                                                                         \
  /* sum u^2, sum k^2 and sum w u k of one token → 1/rms(u), 1/rms(k), s */                              \
  static inline void alpha_token_##sfx(const T *u, const T *k, const T *w, int64_t d, A eps,             \
                                       A *ru, A *rk, A *s) {                                             \
    A su = 0, sk = 0, dot = 0;                                                                           \
    for (int64_t i = 0; i < d; i++) {                                                                    \
      A a = LD(u[i]), b = LD(k[i]), wi = w ? LD(w[i]) : 1;                                               \
      su += a * a;                                                                                       \
      sk += b * b;                                                                                       \
      dot += wi * a * b;                                                                                 \
    }                                                                                                    \
    *ru = 1 / sqrt(su / (A)d + eps);                                                                     \
    *rk = 1 / sqrt(sk / (A)d + eps);                                                                     \
    *s = *ru * *rk * dot / sqrt((A)d);                                                                   \
  }                                                                                                      \
                                                                                                         \
  static void alpha_##sfx(dm_tensor *alpha, const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w, \
                          double eps) {                                                                  \
    int64_t d = u->shape[u->ndim - 1], N = dm_numel(alpha);                                              \
    const T *U = dm_data(u), *K = dm_data(kx), *W = w ? dm_data(w) : NULL;                               \
    T *O = dm_data(alpha);                                                                               \
    for (int64_t n = 0; n < N; n++) {                                                                    \
      A ru, rk, s;                                                                                       \
      alpha_token_##sfx(U + n * d, K + n * d, W, d, (A)eps, &ru, &rk, &s);                               \
      O[n] = ST(1 / (1 + exp(-s)));                                                                      \
    }                                                                                                    \
  }                                                                                                      \
                                                                                                         \
  /* ds = g a (1 - a); with a_i = w_i k^_i / sqrt(d): du_i = ds ru (a_i - u^_i s / d), and so on */      \
  static void alpha_bwd_##sfx(dm_tensor *gu, dm_tensor *gk, dm_tensor *gw, const dm_tensor *g,           \
                              const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w, double eps) { \
    int64_t d = u->shape[u->ndim - 1], N = dm_numel(g);                                                  \
    const T *U = dm_data(u), *K = dm_data(kx), *W = w ? dm_data(w) : NULL, *G = dm_data(g);              \
    T *GU = gu ? dm_data(gu) : NULL, *GK = gk ? dm_data(gk) : NULL;                                      \
    double *gw_acc = gw ? dm_xmalloc(sizeof(double) * (size_t)d) : NULL;                                 \
    if (gw_acc) for (int64_t i = 0; i < d; i++) gw_acc[i] = 0;                                           \
    const A isd = 1 / sqrt((A)d), rd = 1 / (A)d;                                                         \
    for (int64_t n = 0; n < N; n++) {                                                                    \
      const T *un = U + n * d, *kn = K + n * d;                                                          \
      A ru, rk, s;                                                                                       \
      alpha_token_##sfx(un, kn, W, d, (A)eps, &ru, &rk, &s);                                             \
      A a = 1 / (1 + exp(-s)), ds = LD(G[n]) * a * (1 - a);                                              \
      for (int64_t i = 0; i < d; i++) {                                                                  \
        A uh = LD(un[i]) * ru, kh = LD(kn[i]) * rk, wi = W ? LD(W[i]) : 1;                               \
        if (GU) GU[n * d + i] = ST(ds * ru * (wi * kh * isd - uh * s * rd));                             \
        if (GK) GK[n * d + i] = ST(ds * rk * (wi * uh * isd - kh * s * rd));                             \
        if (gw_acc) gw_acc[i] += (double)(ds * uh * kh * isd);                                           \
      }                                                                                                  \
    }                                                                                                    \
    if (gw_acc) {                                                                                        \
      T *GW = dm_data(gw);                                                                               \
      for (int64_t i = 0; i < d; i++) GW[i] = ST((A)gw_acc[i]);                                          \
      free(gw_acc);                                                                                      \
    }                                                                                                    \
  }

FLOAT_KERNELS(float, float, LD_SAME, ST_SAME, f32)
FLOAT_KERNELS(double, double, LD_SAME, ST_SAME, f64)
FLOAT_KERNELS(uint16_t, float, dm_bf16_to_f32, dm_f32_to_bf16, bf16)
FLOAT_KERNELS(uint16_t, float, dm_f16_to_f32, dm_f32_to_f16, f16)

#define BY_DTYPE(dt, fn, ...) do {                                              \
    switch (dt) {                                                               \
    case DM_F32: fn##_f32(__VA_ARGS__); break;                                  \
    case DM_F64: fn##_f64(__VA_ARGS__); break;                                  \
    case DM_BF16: fn##_bf16(__VA_ARGS__); break;                                \
    case DM_F16: fn##_f16(__VA_ARGS__); break;                                  \
    default: dm_error("engram: no CPU kernel for dtype %s", dm_dtype_name(dt)); \
    }                                                                           \
  } while (0)

static void cpu_engram_sparse_grad(dm_tensor *out, const dm_tensor *g, const dm_tensor *inverse) {
  BY_DTYPE(g->dtype, sparse_grad, out, g, inverse);
}

static void cpu_engram_alpha(dm_tensor *alpha, const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w,
                             double eps) {
  BY_DTYPE(u->dtype, alpha, alpha, u, kx, w, eps);
}

static void cpu_engram_alpha_bwd(dm_tensor *gu, dm_tensor *gk, dm_tensor *gw, const dm_tensor *g,
                                 const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w, double eps) {
  BY_DTYPE(u->dtype, alpha_bwd, gu, gk, gw, g, u, kx, w, eps);
}

/* ---- sparse Adam -------------------------------------------------------------------------------- */

#define AHEAD 8          /* rows prefetched ahead of the update */

#define ADAM_ROWS(T, sfx)                                                                       \
  void dm_engram_adam_rows_##sfx(T *w, T *m, T *v, int64_t de, const int64_t *rows, const T *g, \
                                 int64_t lo, int64_t hi, const dm_engram_adam_hp *hp) {         \
    const int64_t line = 64 / (int64_t)sizeof(T);                                               \
    for (int64_t i = lo; i < hi; i++) {                                                         \
      if (i + AHEAD < hi) {                                                                     \
        int64_t r = rows[i + AHEAD] * de;                                                       \
        for (int64_t c = 0; c < de; c += line) {                                                \
          __builtin_prefetch(w + r + c, 1);                                                     \
          __builtin_prefetch(m + r + c, 1);                                                     \
          __builtin_prefetch(v + r + c, 1);                                                     \
        }                                                                                       \
      }                                                                                         \
      int64_t r = rows[i] * de;                                                                 \
      dm_engram_adam_row_##sfx(w + r, m + r, v + r, g + i * de, de, hp);                        \
    }                                                                                           \
  }
ADAM_ROWS(float, f32)
ADAM_ROWS(double, f64)

/* the row list of an update: every row checked before any is written, so a bad list changes nothing */
static void check_rows(const int64_t *r, int64_t n, int64_t R) {
  for (int64_t i = 0; i < n; i++) {
    if (r[i] < 0 || r[i] >= R)
      dm_error("engram_adam: row %lld is out of range for a table of %lld rows", (long long)r[i], (long long)R);
    if (i > 0 && r[i] <= r[i - 1])
      dm_error("engram_adam: rows must be distinct and increasing (engram_unique's list); "
               "row %lld follows row %lld", (long long)r[i], (long long)r[i - 1]);
  }
}

static void cpu_engram_adam(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                            const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp) {
  const int64_t *r = dm_data(rows);
  int64_t R = table->shape[0], de = table->shape[1];
  check_rows(r, n, R);
  if (table->dtype == DM_F32)
    dm_engram_adam_rows_f32(dm_data(table), dm_data(m), dm_data(v), de, r, dm_data(grads), 0, n, hp);
  else
    dm_engram_adam_rows_f64(dm_data(table), dm_data(m), dm_data(v), de, r, dm_data(grads), 0, n, hp);
}

static void cpu_engram_adam_8bit(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows,
                               const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp, int64_t step,
                               const dm_engram_adam_scalars *at) {
  (void)at;                                       /* the core reads the scalars on the CPU */
  const int64_t *r = dm_data(rows);
  int64_t R = table->shape[0], de = table->shape[1];
  check_rows(r, n, R);
  float *w = dm_data(table), *ms = dm_data(m8->m_scale), *vs = dm_data(m8->v_scale);
  uint8_t *mc = dm_data(m8->m), *vc = dm_data(m8->v);
  const float *g = dm_data(grads);
  for (int64_t i = 0; i < n; i++) {
    int64_t at_row = r[i] * de;
    dm_engram_adam_row_8bit(w + at_row, mc + at_row, ms + r[i], vc + at_row, vs + r[i], g + i * de, de, r[i], hp,
                          step, m8->salt);
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(engram_adam_8bit, cpu_engram_adam_8bit),
  DM_KERNEL_ENTRY(engram_index, cpu_engram_index),
  DM_KERNEL_ENTRY(engram_unique, cpu_engram_unique),
  DM_KERNEL_ENTRY(engram_sparse_grad, cpu_engram_sparse_grad),
  DM_KERNEL_ENTRY(engram_alpha, cpu_engram_alpha),
  DM_KERNEL_ENTRY(engram_alpha_bwd, cpu_engram_alpha_bwd),
  DM_KERNEL_ENTRY(engram_adam, cpu_engram_adam),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
