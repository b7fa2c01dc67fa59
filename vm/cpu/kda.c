/*
** cpu/kda.c — the KDA recurrence and its gate on the CPU: the float64
** oracle when run in f64, the float32 path otherwise.
**
** Each (batch, head) pair runs the recurrence step by step, one pair after
** the other: the pairs write disjoint outputs, so running them in parallel
** would change the time and nothing else. A pair's inputs are gathered into
** contiguous rows of the compute type R (double for f64 q, else float) and
** its results scattered back in the outputs' dtypes. The state S is dk x dv
** in row-major order: row i belongs to key channel i.
**
** The backward follows docs/kda.md §1 ("The backward step") with the state recomputed from
** checkpoints (see kda.h): one forward pass keeps S at every chunk start,
** then each chunk, last first, recomputes its states and delta errors and
** runs the reverse steps. Forward and recompute share one step function,
** so the recomputed states are the forward's bit for bit.
**
** The body is written once for R: this file includes itself twice, with
** R = float and R = double, then registers the dispatchers.
*/
#ifndef KDA_R

#include <tgmath.h>
#include <string.h>
#include "ops/kda.h"
#include "core/alloc.h"

#define FN(name) FN_(name, KDA_SFX)
#define FN_(name, sfx) FN__(name, sfx)
#define FN__(name, sfx) name##_##sfx

#define KDA_R float
#define KDA_SFX f
#define KDA_DT DM_F32
#include "kda.c"
#undef KDA_R
#undef KDA_SFX
#undef KDA_DT

#define KDA_R double
#define KDA_SFX d
#define KDA_DT DM_F64
#include "kda.c"
#undef KDA_R
#undef KDA_SFX
#undef KDA_DT

static void cpu_kda_fwd(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                        const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0) {
  (q->dtype == DM_F64 ? forward_d : forward_f)(o, s_final, q, k, v, g, beta, s0);
}

static void cpu_kda_bwd(dm_tensor *dq, dm_tensor *dk, dm_tensor *dv, dm_tensor *dg, dm_tensor *dbeta,
                        dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                        const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                        const dm_tensor *ds_final, int64_t chunk) {
  (q->dtype == DM_F64 ? backward_d : backward_f)(dq, dk, dv, dg, dbeta, ds0, q, k, v, g, beta, s0, dout,
                                                 ds_final, chunk);
}

static void cpu_kda_gate(dm_tensor *g, const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias,
                         int64_t heads, int kind, double lb) {
  (f->dtype == DM_F64 ? gate_d : gate_f)(g, NULL, NULL, NULL, NULL, f, a_log, dt_bias, heads, kind, lb);
}

static void cpu_kda_gate_bwd(dm_tensor *df, dm_tensor *da_log, dm_tensor *ddt_bias, const dm_tensor *dg,
                             const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias, int64_t heads,
                             int kind, double lb) {
  (f->dtype == DM_F64 ? gate_d : gate_f)(NULL, df, da_log, ddt_bias, dg, f, a_log, dt_bias, heads, kind, lb);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(kda_fwd, cpu_kda_fwd),
  DM_KERNEL_ENTRY(kda_bwd, cpu_kda_bwd),
  DM_KERNEL_ENTRY(kda_gate, cpu_kda_gate),
  DM_KERNEL_ENTRY(kda_gate_bwd, cpu_kda_gate_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)

#else /* ---- the body, for R = KDA_R ------------------------------------------------------- */

#define R KDA_R

/* rows r = 0..n-1 of d values at element base + r * stride of a contiguous tensor, into dst */
static void FN(gather)(R *dst, const dm_tensor *t, int64_t base, int64_t n, int64_t stride, int64_t d) {
  if (t->dtype == KDA_DT) {                            /* no conversion */
    const R *p = dm_data(t);
    for (int64_t r = 0; r < n; r++)
      for (int64_t i = 0; i < d; i++) dst[r * d + i] = p[base + r * stride + i];
    return;
  }
  const char *p = dm_data(t);
  const size_t es = dm_dtype_size(t->dtype);
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < d; i++) dst[r * d + i] = (R)dm_load(t->dtype, p + (size_t)(base + r * stride + i) * es);
}

/* the reverse of gather; a NULL t wants nothing */
static void FN(scatter)(dm_tensor *t, const R *src, int64_t base, int64_t n, int64_t stride, int64_t d) {
  if (!t) return;
  if (t->dtype == KDA_DT) {
    R *p = dm_data(t);
    for (int64_t r = 0; r < n; r++)
      for (int64_t i = 0; i < d; i++) p[base + r * stride + i] = src[r * d + i];
    return;
  }
  char *p = dm_data(t);
  const size_t es = dm_dtype_size(t->dtype);
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < d; i++) dm_store(t->dtype, p + (size_t)(base + r * stride + i) * es, src[r * d + i]);
}

/* one (b, h) pair: T rows each; a = exp(g), the per-step decay */
typedef struct {
  int64_t T, H, dk, dv;
  R *q, *k, *v, *a, *beta;
} FN(pair_t);

/* R values from scratch memory, advancing the cursor */
static R *FN(take)(R **cur, int64_t n) {
  R *p = *cur;
  *cur += n;
  return p;
}

static void FN(pair_init)(FN(pair_t) *p, const dm_tensor *q, const dm_tensor *v, R **cur) {
  p->T = q->shape[1];
  p->H = q->shape[2];
  p->dk = q->shape[3];
  p->dv = v->shape[3];
  p->q = FN(take)(cur, p->T * p->dk);
  p->k = FN(take)(cur, p->T * p->dk);
  p->a = FN(take)(cur, p->T * p->dk);
  p->v = FN(take)(cur, p->T * p->dv);
  p->beta = FN(take)(cur, p->T);
}

static int64_t FN(pair_size)(const dm_tensor *q, const dm_tensor *v) {
  return q->shape[1] * (3 * q->shape[3] + v->shape[3] + 1);
}

/* element offset of row (b, t = 0, h) of a [B, T, H, d] tensor */
static int64_t FN(row0)(const FN(pair_t) *p, int64_t b, int64_t h, int64_t d) {
  return (b * p->T * p->H + h) * d;
}

static void FN(pair_load)(FN(pair_t) *p, int64_t b, int64_t h, const dm_tensor *q, const dm_tensor *k,
                          const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta) {
  const int64_t T = p->T, H = p->H, dk = p->dk, dv = p->dv;
  FN(gather)(p->q, q, FN(row0)(p, b, h, dk), T, H * dk, dk);
  FN(gather)(p->k, k, FN(row0)(p, b, h, dk), T, H * dk, dk);
  FN(gather)(p->a, g, FN(row0)(p, b, h, dk), T, H * dk, dk);
  for (int64_t i = 0; i < T * dk; i++) p->a[i] = exp(p->a[i]);
  FN(gather)(p->v, v, FN(row0)(p, b, h, dv), T, H * dv, dv);
  FN(gather)(p->beta, beta, FN(row0)(p, b, h, 1), T, H, 1);
}

/* the state of pair (b, h) from a [B, H, dk, dv] tensor, or zeros */
static void FN(state_load)(R *S, const dm_tensor *s, int64_t b, int64_t h, const FN(pair_t) *p) {
  const int64_t n = p->dk * p->dv;
  if (s) FN(gather)(S, s, (b * p->H + h) * n, 1, 0, n);
  else memset(S, 0, sizeof(R) * (size_t)n);
}

/* Step t on S: S' = Diag(a) S; e = v - S'^T k; S = S' + beta k e^T; and
** o = S^T q when o is not NULL. */
static void FN(step)(const FN(pair_t) *p, int64_t t, R *S, R *e, R *o) {
  const int64_t dk = p->dk, dv = p->dv;
  const R *q = p->q + t * dk, *k = p->k + t * dk, *a = p->a + t * dk, *v = p->v + t * dv, beta = p->beta[t];
  for (int64_t j = 0; j < dv; j++) e[j] = v[j];
  for (int64_t i = 0; i < dk; i++) {
    R *s = S + i * dv, ai = a[i], ki = k[i];
    for (int64_t j = 0; j < dv; j++) {
      s[j] *= ai;
      e[j] -= s[j] * ki;
    }
  }
  if (o) for (int64_t j = 0; j < dv; j++) o[j] = 0;
  for (int64_t i = 0; i < dk; i++) {
    R *s = S + i * dv, bk = beta * k[i], qi = q[i];
    for (int64_t j = 0; j < dv; j++) s[j] += bk * e[j];
    if (o) for (int64_t j = 0; j < dv; j++) o[j] += s[j] * qi;
  }
}

static void FN(forward)(dm_tensor *o, dm_tensor *s_final, const dm_tensor *q, const dm_tensor *k,
                        const dm_tensor *v, const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0) {
  const int64_t B = q->shape[0], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  const int64_t n = FN(pair_size)(q, v) + dk * dv + 2 * dv;
  R *mem = dm_alloc(DM_CPU, sizeof(R) * (size_t)(n > 0 ? n : 1)), *cur = mem;
  FN(pair_t) p;
  FN(pair_init)(&p, q, v, &cur);
  R *S = FN(take)(&cur, dk * dv), *e = FN(take)(&cur, dv), *orow = FN(take)(&cur, dv);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      FN(pair_load)(&p, b, h, q, k, v, g, beta);
      FN(state_load)(S, s0, b, h, &p);
      for (int64_t t = 0; t < p.T; t++) {
        FN(step)(&p, t, S, e, orow);
        FN(scatter)(o, orow, FN(row0)(&p, b, h, dv) + t * H * dv, 1, 0, dv);
      }
      FN(scatter)(s_final, S, (b * H + h) * dk * dv, 1, 0, dk * dv);
    }
  dm_free(DM_CPU, mem, sizeof(R) * (size_t)(n > 0 ? n : 1));
}

/* Step t backwards (docs/kda.md §1). Sh is the state
** before the step, Sn after it, e the step's delta error, dout the output's
** gradient. dS holds dL/dS_t on entry and dL/dS_{t-1} on return; the
** step's gradients go to the rows t of the g* arrays; w is dv scratch. */
static void FN(back_step)(const FN(pair_t) *p, int64_t t, R *dS, const R *Sh, const R *Sn, const R *e,
                          const R *dout, R *gq, R *gk, R *gv, R *ga, R *gbeta, R *w) {
  const int64_t dk = p->dk, dv = p->dv;
  const R *q = p->q + t * dk, *k = p->k + t * dk, *a = p->a + t * dk, beta = p->beta[t];
  gq += t * dk; gk += t * dk; ga += t * dk; gv += t * dv;
  /* dS += q do^T; dq = S_t do; u = dS e (kept in gk); w = dS^T k */
  R db = 0;
  for (int64_t j = 0; j < dv; j++) w[j] = 0;
  for (int64_t i = 0; i < dk; i++) {
    R *ds = dS + i * dv, qi = q[i], ki = k[i], dq = 0, u = 0;
    const R *sn = Sn + i * dv;
    for (int64_t j = 0; j < dv; j++) {
      ds[j] += qi * dout[j];
      dq += sn[j] * dout[j];
      u += ds[j] * e[j];
      w[j] += ds[j] * ki;
    }
    gq[i] = dq;
    gk[i] = u;
    db += ki * u;
  }
  gbeta[t] = db;                                       /* dbeta = k^T dS e */
  for (int64_t j = 0; j < dv; j++) gv[j] = beta * w[j];   /* de = dv = beta dS^T k */
  /* dk = beta u - S' de; dS' = dS - k de^T; dg = rowsum(S' . dS'); dS_{t-1} = Diag(a) dS' */
  for (int64_t i = 0; i < dk; i++) {
    R *ds = dS + i * dv, ai = a[i], ki = k[i], sde = 0, dg = 0;
    const R *sh = Sh + i * dv;
    for (int64_t j = 0; j < dv; j++) {
      R sp = ai * sh[j], dsp = ds[j] - ki * gv[j];
      sde += sp * gv[j];
      dg += sp * dsp;
      ds[j] = ai * dsp;
    }
    gk[i] = beta * gk[i] - sde;
    ga[i] = dg;
  }
}

static void FN(backward)(dm_tensor *dq, dm_tensor *dk_, dm_tensor *dv_, dm_tensor *dg, dm_tensor *dbeta,
                         dm_tensor *ds0, const dm_tensor *q, const dm_tensor *k, const dm_tensor *v,
                         const dm_tensor *g, const dm_tensor *beta, const dm_tensor *s0, const dm_tensor *dout,
                         const dm_tensor *ds_final, int64_t chunk) {
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  const int64_t nc = (T + chunk - 1) / chunk, L = chunk < T ? chunk : T, nS = dk * dv;
  /* the pair's inputs, do, its five gradients, checkpoints, a chunk's
  ** states and errors, dS and w */
  const int64_t n = FN(pair_size)(q, v) + T * dv + T * (3 * dk + dv + 1) + nc * nS + (L + 1) * nS + L * dv
                    + nS + dv;
  R *mem = dm_alloc(DM_CPU, sizeof(R) * (size_t)(n > 0 ? n : 1)), *cur = mem;
  FN(pair_t) p;
  FN(pair_init)(&p, q, v, &cur);
  R *d_o = FN(take)(&cur, T * dv);
  R *gq = FN(take)(&cur, T * dk), *gk = FN(take)(&cur, T * dk), *ga = FN(take)(&cur, T * dk);
  R *gv = FN(take)(&cur, T * dv), *gb = FN(take)(&cur, T);
  R *ckpt = FN(take)(&cur, nc * nS), *hist = FN(take)(&cur, (L + 1) * nS), *E = FN(take)(&cur, L * dv);
  R *dS = FN(take)(&cur, nS), *w = FN(take)(&cur, dv);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      FN(pair_load)(&p, b, h, q, k, v, g, beta);
      FN(gather)(d_o, dout, FN(row0)(&p, b, h, dv), T, H * dv, dv);
      FN(state_load)(dS, ds_final, b, h, &p);
      /* checkpoints: ckpt[c] is the state before step c * chunk */
      if (nc > 0) FN(state_load)(ckpt, s0, b, h, &p);
      for (int64_t c = 1; c < nc; c++) {
        R *S = ckpt + c * nS;
        memcpy(S, S - nS, sizeof(R) * (size_t)nS);
        for (int64_t t = (c - 1) * chunk; t < c * chunk; t++) FN(step)(&p, t, S, w, NULL);
      }
      for (int64_t c = nc - 1; c >= 0; c--) {
        const int64_t t0 = c * chunk, len = T - t0 < chunk ? T - t0 : chunk;
        /* hist[j] is the state before step t0 + j, E row j that step's delta error */
        memcpy(hist, ckpt + c * nS, sizeof(R) * (size_t)nS);
        for (int64_t j = 0; j < len; j++) {
          memcpy(hist + (j + 1) * nS, hist + j * nS, sizeof(R) * (size_t)nS);
          FN(step)(&p, t0 + j, hist + (j + 1) * nS, E + j * dv, NULL);
        }
        for (int64_t j = len - 1; j >= 0; j--)
          FN(back_step)(&p, t0 + j, dS, hist + j * nS, hist + (j + 1) * nS, E + j * dv, d_o + (t0 + j) * dv,
                        gq, gk, gv, ga, gb, w);
      }
      FN(scatter)(dq, gq, FN(row0)(&p, b, h, dk), T, H * dk, dk);
      FN(scatter)(dk_, gk, FN(row0)(&p, b, h, dk), T, H * dk, dk);
      FN(scatter)(dg, ga, FN(row0)(&p, b, h, dk), T, H * dk, dk);
      FN(scatter)(dv_, gv, FN(row0)(&p, b, h, dv), T, H * dv, dv);
      FN(scatter)(dbeta, gb, FN(row0)(&p, b, h, 1), T, H, 1);
      FN(scatter)(ds0, dS, (b * H + h) * nS, 1, 0, nS);
    }
  dm_free(DM_CPU, mem, sizeof(R) * (size_t)(n > 0 ? n : 1));
}

/* ---- the gate ------------------------------------------------------------------------------- */

static inline R FN(sigmoid)(R x) { return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x)); }
static inline R FN(softplus)(R x) { return (x > 0 ? x : 0) + log1p(exp(-fabs(x))); }

/* g at z with scale ea = e^A; with dz set, also dg/dz and dg/dA. A
** saturated sigmoid or softplus gives zero derivatives, never inf * 0. */
static inline R FN(gate_at)(int kind, R lb, R ea, R z, R *dz, R *dA) {
  if (kind == DM_KDA_GATE_BOUNDED) {
    R y = z == 0 ? 0 : ea * z, s = FN(sigmoid)(y), ds = s * FN(sigmoid)(-y);
    if (dz) {
      *dz = ds == 0 ? 0 : lb * ds * ea;
      *dA = ds == 0 ? 0 : lb * ds * y;
    }
    return lb * s;
  }
  R sp = FN(softplus)(z), g = sp == 0 ? 0 : -(ea * sp);
  if (dz) {
    R s = FN(sigmoid)(z);
    *dz = s == 0 ? 0 : -(ea * s);
    *dA = g;
  }
  return g;
}

/* Forward (gout NULL: writes g) or backward (writes the wanted df, da_log,
** ddt_bias from gout). f is [N, D] flat; the sums over tokens run in double,
** in a fixed order. */
static void FN(gate)(dm_tensor *g, dm_tensor *df, dm_tensor *da_log, dm_tensor *ddt_bias, const dm_tensor *gout,
                     const dm_tensor *f, const dm_tensor *a_log, const dm_tensor *dt_bias, int64_t heads, int kind,
                     double lb) {
  const int64_t D = dm_numel(dt_bias), N = dm_numel(f) / D, per = D / heads;
  const size_t nbytes = sizeof(R) * (size_t)(2 * D + 2 * D) + sizeof(double) * (size_t)(D + heads);
  R *mem = dm_alloc(DM_CPU, nbytes);
  R *ea = mem, *bias = mem + D, *row = mem + 2 * D, *grow = mem + 3 * D;
  double *acc_b = (double *)(mem + 4 * D), *acc_a = acc_b + D;   /* 4D floats keep doubles aligned */
  FN(gather)(bias, dt_bias, 0, 1, 0, D);
  if (a_log) FN(gather)(row, a_log, 0, 1, 0, heads);
  for (int64_t c = 0; c < D; c++) ea[c] = a_log ? exp(row[c / per]) : 1;
  for (int64_t c = 0; c < D; c++) acc_b[c] = 0;
  for (int64_t hh = 0; hh < heads; hh++) acc_a[hh] = 0;
  const R lbr = (R)lb;
  for (int64_t n = 0; n < N; n++) {
    FN(gather)(row, f, n * D, 1, 0, D);
    if (!gout) {
      for (int64_t c = 0; c < D; c++) row[c] = FN(gate_at)(kind, lbr, ea[c], row[c] + bias[c], NULL, NULL);
      FN(scatter)(g, row, n * D, 1, 0, D);
      continue;
    }
    FN(gather)(grow, gout, n * D, 1, 0, D);
    for (int64_t c = 0; c < D; c++) {
      R dz = 0, dA = 0;
      if (grow[c] != 0) FN(gate_at)(kind, lbr, ea[c], row[c] + bias[c], &dz, &dA);   /* no 0 * inf */
      R gz = grow[c] == 0 ? 0 : grow[c] * dz;
      row[c] = gz;
      acc_b[c] += gz;
      acc_a[c / per] += grow[c] == 0 ? 0 : (double)(grow[c] * dA);
    }
    FN(scatter)(df, row, n * D, 1, 0, D);
  }
  if (gout) {
    for (int64_t c = 0; c < D; c++) row[c] = (R)acc_b[c];
    FN(scatter)(ddt_bias, row, 0, 1, 0, D);
    for (int64_t hh = 0; hh < heads; hh++) row[hh] = (R)acc_a[hh];
    FN(scatter)(da_log, row, 0, 1, 0, heads);
  }
  dm_free(DM_CPU, mem, nbytes);
}

#undef R
#endif
