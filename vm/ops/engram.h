/*
** engram.h — the Engram family: byte n-gram rows, unique rows, sparse
** gradients, sparse Adam, and the gate alpha (docs/model.md, "Engram").
**
** The table layout. For each order n of a list and each of K hash heads
** there is one sub-table; all of them live in ONE physical table
** [total_rows, de] at increasing offsets, order by order in the order of
** the list, head by head within an order (sub-table s = i*K + k for the
** i-th order and head k). The key of order n at position t reads the
** bytes b_j = x[t - j], j = 0 .. n-1 (b_0 is the byte at t; bytes before
** the row come from the prefix, else the pad byte 0):
**   direct (256^n <= R): row = b_{n-1}*256^{n-1} + ... + b_1*256 + b_0,
**       the n bytes as a base-256 number (oldest byte most significant);
**       the sub-table has exactly 256^n rows and no collisions. Its K
**       heads are K separate tables with the same index (e_t keeps its
**       width |orders|*K*de).
**   hashed: mix = (b_0*r_0) ^ (b_1*r_1) ^ ... ^ (b_{n-1}*r_{n-1}) in
**       uint64 arithmetic (multiplication wraps modulo 2^64), r_j the odd
**       multipliers below (the same for every order), and row = mix % p
**       (unsigned) with p a prime. Every hashed sub-table has its own
**       prime: walking the orders in list order and the heads within each,
**       each takes the largest prime <= R not yet taken (so the first is
**       the largest prime <= R, and the K heads of one order reduce the
**       same mix modulo K distinct primes).
** The index of a lookup is offset(s) + row. Everything is integer
** arithmetic with explicit wrap-around, so every backend computes the same
** indices bit for bit; the inline helpers below are that arithmetic, and a
** CUDA kernel includes this header and calls them (DM_HD marks them
** __host__ __device__ there).
**
** Sparse rows. engram_unique sorts the lookups' rows (stable, by value)
** and gives the distinct rows in increasing order, the inverse map (the
** position of each lookup's row in that list) and the count of each row.
** engram_sparse_grad reduces per-lookup gradients [M, de] to the unique
** rows [n_unique, de]: each unique row's sum runs over its lookups in
** increasing lookup position, starting from 0, in the gradient's compute
** type (float for f32, bf16, f16; double for f64). That order is part of
** the contract: a backend that follows it (one thread per row segment
** after a stable sort, no atomics) gives the same bits as the CPU.
**
** Sparse Adam. dm_engram_adam updates only the rows named (distinct,
** increasing: engram_unique's list): w, m and v of every other row are
** neither read nor written (lazy Adam: untouched rows' moments do not
** decay). The per-row update is dm_engram_adam_row_* below, the one
** formula every backend and the host tables (hostable.c) use:
**   m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
**   w = w - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
** with t the 1-based step; no weight decay.
*/
#ifndef DM_ENGRAM_H
#define DM_ENGRAM_H

#include <math.h>
#include "core/ops.h"
#include "ops/prims.h"      /* the column sums' and the bucket sort's scratch */
#include "core/code8.h"
#include "core/sround.h"

#include "core/hd.h"

#define DM_ENGRAM_MAXORDER 8     /* longest n-gram: bytes the hash reads */
#define DM_ENGRAM_MAXSUB 64      /* sub-tables (orders x heads) */

/* the multipliers r_0 .. r_7 (odd; splitmix64 outputs from the seed "engram") */
#define DM_ENGRAM_MULTIPLIERS {                                            \
    0x74e8fb843f592e6full, 0x825378ce0093be8bull, 0x6ca405719a226ffbull,  \
    0xcaa448f6511ef753ull, 0xdfcf88a394411261ull, 0xb2b26dccb55d2289ull,  \
    0x6b31e4863e3ce9e1ull, 0x7d62f1b4540cc507ull }

typedef struct dm_engram_sub {
  int32_t order;        /* n */
  int32_t head;         /* 0 .. K-1 */
  int32_t direct;       /* 1: the n bytes in base 256; 0: the mix modulo size */
  int32_t pad_;
  int64_t offset;       /* first row in the physical table */
  int64_t size;         /* rows: 256^n when direct, else a prime <= R */
} dm_engram_sub;

/* plain data (no pointers): a kernel on any device takes it by value */
typedef struct dm_engram_layout {
  int32_t norders, heads, nsub, max_order;
  int32_t orders[DM_ENGRAM_MAXORDER];
  int64_t rows;                          /* R as asked */
  int64_t total_rows;                    /* rows of the physical table */
  uint64_t mult[DM_ENGRAM_MAXORDER];     /* DM_ENGRAM_MULTIPLIERS */
  dm_engram_sub sub[DM_ENGRAM_MAXSUB];
} dm_engram_layout;

/* Builds the layout of the comment above. orders: 1..8 values, strictly
** increasing, each 1..8; heads >= 1 with norders*heads <= DM_ENGRAM_MAXSUB;
** rows >= 2, with enough primes <= rows for the hashed sub-tables. Raises
** naming the bad value. Deterministic; costs microseconds. */
void dm_engram_layout_make(dm_engram_layout *L, int norders, const int64_t *orders, int64_t heads,
                           int64_t rows);
/* the largest prime <= n, or 0 if there is none (n < 2); exact for every n < 2^63 */
int64_t dm_engram_prev_prime(int64_t n);

/* ---- the index arithmetic (every backend) ------------------------------------------------- */

/* The row of sub-table s for the n-gram ending at *at: at[-j] is the byte
** j positions back (b_j above), readable for j < the sub-table's order. */
DM_HD int64_t dm_engram_row(const dm_engram_layout *L, int s, const uint8_t *at) {
  const dm_engram_sub *u = &L->sub[s];
  uint64_t key = 0;
  if (u->direct) {
    for (int j = u->order - 1; j >= 0; j--) key = (key << 8) | at[-j];
  } else {
    for (int j = 0; j < u->order; j++) key ^= (uint64_t)at[-j] * L->mult[j];
    key %= (uint64_t)u->size;
  }
  return u->offset + (int64_t)key;
}

/* ---- the Adam row update (every backend, and the host tables) ------------------------------ */

typedef struct dm_engram_adam_hp {
  double lr, beta1, beta2, eps;
  double step_size;       /* lr / (1 - beta1^t) */
  double rbc2;            /* 1 / sqrt(1 - beta2^t) */
} dm_engram_adam_hp;

/* "engram_adam", "engram_adam_at" of n rows: the first bad row's flag, and the constants on the device */
static inline int64_t dm_engram_adam_scratch(int64_t n) {
  return n > 0 ? (int64_t)(sizeof(unsigned long long) + sizeof(dm_engram_adam_hp)) : 0;
}

/* the constants of step t >= 1 (raises on a bad step or beta) */
dm_engram_adam_hp dm_engram_adam_prepare(double lr, double beta1, double beta2, double eps, int64_t step);

#define DM_ENGRAM_ADAM_ROW(T, sfx, SQRT)                                                            \
  DM_HD void dm_engram_adam_row_##sfx(T *w, T *m, T *v, const T *g, int64_t de,                    \
                                      const dm_engram_adam_hp *hp) {                                \
    const T b1 = (T)hp->beta1, b2 = (T)hp->beta2, c1 = (T)(1 - hp->beta1), c2 = (T)(1 - hp->beta2); \
    const T step = (T)hp->step_size, rbc2 = (T)hp->rbc2, eps = (T)hp->eps;                          \
    for (int64_t i = 0; i < de; i++) {                                                              \
      T gi = g[i], mi = b1 * m[i] + c1 * gi, vi = b2 * v[i] + c2 * gi * gi;                         \
      m[i] = mi;                                                                                    \
      v[i] = vi;                                                                                    \
      w[i] -= step * mi / (SQRT(vi) * rbc2 + eps);                                                  \
    }                                                                                               \
  }
DM_ENGRAM_ADAM_ROW(float, f32, sqrtf)
DM_ENGRAM_ADAM_ROW(double, f64, sqrt)

/* With 8-bit moments (optim.engram_moments = "8bit", vm/core/code8.h): m and sqrt(v) as u8 codes, each
** row one block with its scale in m_scale[r], v_scale[r]. Element i of a row: the row formula
** above from the decoded moments, the parameter stepped, the new m and sqrt(v) returned. */
DM_HD void dm_engram_adam_8bit_elem(float *w, uint8_t mc, float ms, uint8_t vc, float vs, float g,
                                  const dm_engram_adam_hp *hp, float *m_new, float *r_new) {
  const float b1 = (float)hp->beta1, b2 = (float)hp->beta2, c1 = (float)(1 - hp->beta1), c2 = (float)(1 - hp->beta2);
  const float step = (float)hp->step_size, rbc2 = (float)hp->rbc2, eps = (float)hp->eps;
  float mo = dm_code8_signed(mc) * ms, ro = dm_code8_unsigned(vc) * vs;
  float mi = b1 * mo + c1 * g, vi = b2 * (ro * ro) + c2 * g * g, ri = sqrtf(vi);
  *w -= step * mi / (ri * rbc2 + eps);
  *m_new = mi;
  *r_new = ri;
}

/* A whole row of de values on one thread (the CPU): the new moments' largest magnitudes first,
** then every element again (the same arithmetic) encoded under them; row index r keys the bits
** (element r * de + i, at step `step`, under salt) */
DM_HD void dm_engram_adam_row_8bit(float *w, uint8_t *mc, float *ms, uint8_t *vc, float *vs, const float *g,
                                 int64_t de, int64_t r, const dm_engram_adam_hp *hp, int64_t step, uint32_t salt) {
  const float ms0 = *ms, vs0 = *vs;
  float mmax = 0, rmax = 0, mi, ri;
  for (int64_t i = 0; i < de; i++) {
    dm_engram_adam_8bit_elem(&w[i], mc[i], ms0, vc[i], vs0, g[i], hp, &mi, &ri);
    mmax = fmaxf(mmax, fabsf(mi));
    rmax = fmaxf(rmax, ri);
  }
  const float minv = dm_code8_inverse(mmax), rinv = dm_code8_inverse(rmax);
  for (int64_t i = 0; i < de; i++) {
    float scratch = 0;                              /* the parameter was stepped above */
    dm_engram_adam_8bit_elem(&scratch, mc[i], ms0, vc[i], vs0, g[i], hp, &mi, &ri);
    mc[i] = dm_code8_encode_signed(mi * minv, dm_sround_bits(salt, 0, step, r * de + i));
    vc[i] = dm_code8_encode_unsigned(ri * rinv, dm_sround_bits(salt, 1, step, r * de + i));
  }
  *ms = mmax;
  *vs = rmax;
}

/* ---- host helpers (vm/cpu/engram.c): plain arrays, thread-safe, never raise ----------------- */

/* The Adam update of rows[lo..hi-1] of w, m, v [R, de] with the gradient rows g[lo..hi-1]
** (g row i is rows[i]'s), prefetching the rows ahead: random rows of a large table are bound
** by memory latency. The CPU kernel and the host tables' threads run it. */
void dm_engram_adam_rows_f32(float *w, float *m, float *v, int64_t de, const int64_t *rows, const float *g,
                             int64_t lo, int64_t hi, const dm_engram_adam_hp *hp);
void dm_engram_adam_rows_f64(double *w, double *m, double *v, int64_t de, const int64_t *rows,
                             const double *g, int64_t lo, int64_t hi, const dm_engram_adam_hp *hp);

/* The distinct values of idx[0..n-1] (all >= 0, < 2^62) in increasing
** order into rows, their counts into counts, and inverse[i] = the position
** of idx[i] in rows; returns how many. scratch holds 4*n values. */
int64_t dm_engram_unique_host(const int64_t *idx, int64_t n, int64_t *rows, int64_t *inverse,
                              int64_t *counts, int64_t *scratch);

/* ---- kernels: registered as "engram_index", ... for each device ----------------------------
** Every tensor a kernel is given is contiguous; the ops make it so. */

/* idx [B, T, nsub] i64 from x [B, T] and prefix [B, P] (NULL: none), each u8, i32 or i64
** with values 0..255 (the op checks) */
typedef void (*dm_engram_index_k)(dm_tensor *idx, const dm_tensor *x, const dm_tensor *prefix,
                                  const dm_engram_layout *L);
/* idx: M values i64 >= 0. rows and counts [M]: the first n_unique are written; inverse: idx's
** shape; n_unique: [1] i64 on the same device (so a device never has to sync to run it) */
typedef void (*dm_engram_unique_k)(dm_tensor *rows, dm_tensor *inverse, dm_tensor *counts,
                                   dm_tensor *n_unique, const dm_tensor *idx);
/* out [U, de] = the per-row sums of g [M, de] through inverse (M values in 0..U-1), in the order above */
typedef void (*dm_engram_sparse_grad_k)(dm_tensor *out, const dm_tensor *g, const dm_tensor *inverse);
/* alpha [N] from u, kx [N, d] and w [d] (NULL: all ones) */
typedef void (*dm_engram_alpha_k)(dm_tensor *alpha, const dm_tensor *u, const dm_tensor *kx,
                                  const dm_tensor *w, double eps);
/* gu, gk [N, d] and gw [d] (each NULL when not wanted) from g [N] in one pass */
typedef void (*dm_engram_alpha_bwd_k)(dm_tensor *gu, dm_tensor *gk, dm_tensor *gw, const dm_tensor *g,
                                      const dm_tensor *u, const dm_tensor *kx, const dm_tensor *w,
                                      double eps);
/* the rows rows[0..n-1] of table, m, v [R, de] (f32 or f64) updated with grads [>= n, de] */
typedef void (*dm_engram_adam_k)(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                                 const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp);

/* The step's scalars in device memory, for a step captured as a CUDA graph:
** the kernel reads them when it runs. n: how many of the rows are real (the
** padded list of engram_unique's static form); lr, step: as in hp (the
** constants are made on the device); sumsq: the step's gradient sum of
** squares, a non-finite one skipping the update. The host arguments n, lr
** and step then only bound and check. */
typedef struct dm_engram_adam_scalars {
  const int64_t *n, *step;
  const double *lr, *sumsq;
} dm_engram_adam_scalars;
/* "engram_adam_at": the same update with the scalars of at (device memory) */
typedef void (*dm_engram_adam_at_k)(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                                    const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp,
                                    const dm_engram_adam_scalars *at);

/* The tables' Adam with 8-bit moments (optim.engram_moments = "8bit"): m and v are the u8 codes
** [R, de] of m and sqrt(v), m_scale and v_scale their f32 scales [R] (a row a block; code8.h), salt
** the key of their rounding with the step and the element (row r's i: r * de + i). */
typedef struct dm_engram_8bit {
  dm_tensor *m, *m_scale, *v, *v_scale;
  uint32_t salt;
} dm_engram_8bit;
/* "engram_adam_8bit": rows[0..n-1] of an f32 table, hp's constants and step (at NULL), or at's
** scalars (device memory, read when it runs: then n is the bound and *at->n the count) */
typedef void (*dm_engram_adam_8bit_k)(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows,
                                    const dm_tensor *grads, int64_t n, const dm_engram_adam_hp *hp, int64_t step,
                                    const dm_engram_adam_scalars *at);

/* ---- the C API (vm/ops/engram.c): owned references, recorded when grad mode is on ---------- */

/* [B, T, nsub] i64 rows of the physical table; prefix may be NULL */
dm_tensor *dm_engram_index(dm_tensor *x, dm_tensor *prefix, const dm_engram_layout *L);
/* rows [U] i64 increasing, inverse (idx's shape) i64, counts [U] i64 */
void dm_engram_unique(dm_tensor *idx, dm_tensor **rows, dm_tensor **inverse, dm_tensor **counts);
/* The static form (nothing waits for the device): rows and counts [M], M =
** numel(idx), whose first U entries are those above and the rest row 0 with
** count 0; n_unique [1] i64 = U, on idx's device. */
void dm_engram_unique_padded(dm_tensor *idx, dm_tensor **rows, dm_tensor **inverse, dm_tensor **counts,
                             dm_tensor **n_unique);
/* g [M, de], inverse with M values in 0..n_unique-1 → [n_unique, de] */
dm_tensor *dm_engram_sparse_grad(dm_tensor *g, dm_tensor *inverse, int64_t n_unique);
/* sigmoid(sum_i w_i rmsnorm(u)_i rmsnorm(kx)_i / sqrt(d)) over the last dim; w may be NULL */
dm_tensor *dm_engram_alpha(dm_tensor *u, dm_tensor *kx, dm_tensor *w, double eps);
/* sparse Adam in place on rows[0..n-1] (distinct, increasing, < R); no autograd. table, m, v:
** [R, de] of one dtype (f32, f64) and device, contiguous; grads [>= n, de] of that dtype. */
void dm_engram_adam(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                    const dm_tensor *grads, int64_t n, double lr, double beta1, double beta2, double eps,
                    int64_t step);
/* The same from one-element tensors on the table's device, read when the
** update runs: n_at (i64: rows[0..*n_at-1] are updated, rows has n_at's
** bound of entries; NULL: every row of rows), lr_at (f64), step_at (i64)
** and sumsq_at (f64, may be NULL: a non-finite value skips the update). On
** the CPU they are read at once. */
void dm_engram_adam_at(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                       const dm_tensor *grads, const dm_tensor *n_at, double beta1, double beta2, double eps,
                       const dm_tensor *lr_at, const dm_tensor *step_at, const dm_tensor *sumsq_at);
/* both with 8-bit moments (dm_engram_8bit; an f32 table) */
void dm_engram_adam_8bit(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows, const dm_tensor *grads,
                       int64_t n, double lr, double beta1, double beta2, double eps, int64_t step);
void dm_engram_adam_8bit_at(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows, const dm_tensor *grads,
                          const dm_tensor *n_at, double beta1, double beta2, double eps, const dm_tensor *lr_at,
                          const dm_tensor *step_at, const dm_tensor *sumsq_at);

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): the kernels size
** theirs with these, and the ops hand the same to a plan ---- */

/* "engram_unique" of n rows: four sort arrays, the flags' prefix (n + 1), the run starts and
** the largest value, then the sort's */
static inline int64_t dm_engram_unique_arrays(int64_t n) { return 8 * (6 * n + 2); }
static inline int64_t dm_engram_unique_scratch(int64_t n) {
  return n > 0 ? dm_engram_unique_arrays(n) + dm_radix_sort_scratch(n) : 0;
}

/* "engram_sparse_grad" of m gradient rows into U rows of de: the keys, four sort arrays and
** the U + 1 run starts, then the sort's */
static inline int64_t dm_engram_sparse_grad_arrays(int64_t m, int64_t U) { return 8 * (5 * m + U + 1); }
static inline int64_t dm_engram_sparse_grad_scratch(int64_t m, int64_t U, int64_t de) {
  if (U * de == 0) return 0;
  return dm_engram_sparse_grad_arrays(m, U) + (m > 0 ? dm_radix_sort_scratch(m) : 0);
}

/* "engram_alpha_bwd" with w's gradient: three values a token in the compute type (vb bytes),
** then the column sums over the N tokens of d */
static inline int64_t dm_engram_alpha_tokens(int64_t N, int64_t vb) { return vb * 3 * N; }
static inline int64_t dm_engram_alpha_bwd_scratch(int64_t N, int64_t d, int64_t vb, int64_t sm_count) {
  return dm_engram_alpha_tokens(N, vb) + dm_colsum_scratch(N, d, sm_count);
}

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(engram_adam, dm_engram_adam_k)
DM_KERNEL_TYPE(engram_adam_8bit, dm_engram_adam_8bit_k)
DM_KERNEL_TYPE(engram_adam_at, dm_engram_adam_at_k)
DM_KERNEL_TYPE(engram_alpha, dm_engram_alpha_k)
DM_KERNEL_TYPE(engram_alpha_bwd, dm_engram_alpha_bwd_k)
DM_KERNEL_TYPE(engram_index, dm_engram_index_k)
DM_KERNEL_TYPE(engram_sparse_grad, dm_engram_sparse_grad_k)
DM_KERNEL_TYPE(engram_unique, dm_engram_unique_k)

#endif
