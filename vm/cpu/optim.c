/*
** cpu/optim.c — the optimisers' element loops (signatures in optim.h).
**
** Every tensor here is contiguous (the core checked). Parameters, moments
** and momentum buffers are f32; gradients and the Newton–Schulz stack may
** be bf16, which is read and written in spans of CHUNK elements through a
** small f32 buffer, so each loop body is plain f32 arithmetic. Sums of
** squares accumulate in double.
*/
#include <math.h>
#include <string.h>
#include "ops/optim.h"
#include "core/ops.h"
#include "core/sround.h"
#include "core/code8.h"

#define CHUNK 2048

static inline float bf16_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* elements [i0, i0 + len) of t as f32: t's own memory when it is f32, else
** converted into tmp */
static float *span(const dm_tensor *t, int64_t i0, int64_t len, float *tmp) {
  if (t->dtype == DM_F32) return (float *)dm_data(t) + i0;
  const uint16_t *h = (const uint16_t *)dm_data(t) + i0;
  for (int64_t j = 0; j < len; j++) tmp[j] = bf16_f32(h[j]);
  return tmp;
}

/* write a span back when it was a converted copy */
static void commit(dm_tensor *t, int64_t i0, int64_t len, const float *s) {
  if (t->dtype == DM_F32) return;
  uint16_t *h = (uint16_t *)dm_data(t) + i0;
  for (int64_t j = 0; j < len; j++) h[j] = dm_f32_to_bf16(s[j]);
}

static inline int64_t span_len(int64_t n, int64_t i0) { return n - i0 < CHUNK ? n - i0 : CHUNK; }

/* ---- AdamW ------------------------------------------------------------------------------------ */

static void cpu_adamw(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m,
                      dm_tensor *const *v, const dm_adamw_hp *hp) {
  double bc1 = 1 - pow(hp->beta1, (double)hp->step), bc2 = 1 - pow(hp->beta2, (double)hp->step);
  const float b1 = (float)hp->beta1, b2 = (float)hp->beta2, eps = (float)hp->eps;
  const float step_size = (float)(hp->lr / bc1), rbc2 = (float)(1 / sqrt(bc2));
  const float decay = (float)(1 - hp->lr * hp->weight_decay);
  float tmp[CHUNK];
  for (int i = 0; i < n; i++) {
    if (!g[i]) continue;
    float *pp = dm_data(p[i]), *mm = dm_data(m[i]), *vv = dm_data(v[i]);
    int64_t total = dm_numel(p[i]);
    for (int64_t i0 = 0; i0 < total; i0 += CHUNK) {
      int64_t len = span_len(total, i0);
      const float *gg = span(g[i], i0, len, tmp);
      for (int64_t j = 0; j < len; j++) {
        int64_t e = i0 + j;
        float gj = gg[j];
        float mj = b1 * mm[e] + (1 - b1) * gj;
        float vj = b2 * vv[e] + (1 - b2) * gj * gj;
        mm[e] = mj;
        vv[e] = vj;
        pp[e] = pp[e] * decay - step_size * mj / (sqrtf(vj) * rbc2 + eps);
      }
    }
  }
}

/* ---- AdamW with 8-bit moments (code8.h) ---------------------------------------------------------- */

/* block [lo, hi) of member i: decode, AdamW's step in f32, encode */
static void adamw_8bit_block(float *p, const float *g, uint8_t *mc, float *ms, uint8_t *rc, float *rs, int64_t lo,
                           int64_t hi, int i, const dm_adamw_hp *hp, float step_size, float rbc2, float decay,
                           uint32_t salt) {
  const float b1 = (float)hp->beta1, b2 = (float)hp->beta2, eps = (float)hp->eps;
  const int64_t b = lo / DM_CODE8_BLOCK;
  float m[DM_CODE8_BLOCK], r[DM_CODE8_BLOCK], mmax = 0, rmax = 0;
  for (int64_t e = lo; e < hi; e++) {
    float gj = g[e - lo], mo = dm_code8_signed(mc[e]) * ms[b], ro = dm_code8_unsigned(rc[e]) * rs[b];
    float mj = b1 * mo + (1 - b1) * gj;
    float vj = b2 * (ro * ro) + (1 - b2) * gj * gj;
    float rj = sqrtf(vj);
    p[e] = p[e] * decay - step_size * mj / (rj * rbc2 + eps);
    m[e - lo] = mj;
    r[e - lo] = rj;
    mmax = fmaxf(mmax, fabsf(mj));
    rmax = fmaxf(rmax, rj);
  }
  ms[b] = mmax;
  rs[b] = rmax;
  float mi = dm_code8_inverse(mmax), ri = dm_code8_inverse(rmax);
  for (int64_t e = lo; e < hi; e++) {
    mc[e] = dm_code8_encode_signed(m[e - lo] * mi, dm_sround_bits(salt, 2u * (uint32_t)i, hp->step, e));
    rc[e] = dm_code8_encode_unsigned(r[e - lo] * ri, dm_sround_bits(salt, 2u * (uint32_t)i + 1u, hp->step, e));
  }
}

static void cpu_adamw_8bit(int n, dm_tensor *const *p, dm_tensor *const *g, dm_tensor *const *m,
                         dm_tensor *const *m_scale, dm_tensor *const *r, dm_tensor *const *r_scale,
                         const dm_adamw_hp *hp, uint32_t salt) {
  double bc1 = 1 - pow(hp->beta1, (double)hp->step), bc2 = 1 - pow(hp->beta2, (double)hp->step);
  const float step_size = (float)(hp->lr / bc1), rbc2 = (float)(1 / sqrt(bc2));
  const float decay = (float)(1 - hp->lr * hp->weight_decay);
  float tmp[DM_CODE8_BLOCK];
  for (int i = 0; i < n; i++) {
    if (!g[i]) continue;
    int64_t total = dm_numel(p[i]);
    for (int64_t lo = 0; lo < total; lo += DM_CODE8_BLOCK) {
      int64_t len = total - lo < DM_CODE8_BLOCK ? total - lo : DM_CODE8_BLOCK;
      const float *gg = span(g[i], lo, len, tmp);
      adamw_8bit_block(dm_data(p[i]), gg, dm_data(m[i]), dm_data(m_scale[i]), dm_data(r[i]), dm_data(r_scale[i]),
                     lo, lo + len, i, hp, step_size, rbc2, decay, salt);
    }
  }
}

/* ---- clipping ------------------------------------------------------------------------------- */

static double sumsq_f32(const float *x, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; k++) s[k] += (double)x[i + k] * x[i + k];
  for (; i < n; i++) s[0] += (double)x[i] * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

static double sumsq_any(const dm_tensor *t) {
  int64_t n = dm_numel(t);
  const char *d = dm_data(t);
  if (t->dtype == DM_F32) return sumsq_f32((const float *)d, n);
  size_t es = dm_dtype_size(t->dtype);
  double s = 0;
  for (int64_t i = 0; i < n; i++) {
    double x = dm_load(t->dtype, d + (size_t)i * es);
    s += x * x;
  }
  return s;
}

static void cpu_sumsq(int n, dm_tensor *const *x, dm_tensor *out) {
  double s = 0;
  for (int i = 0; i < n; i++) if (x[i]) s += sumsq_any(x[i]);
  *(double *)dm_data(out) = s;
}

/* each element becomes (its value · s) rounded once to its dtype */
static void scale_any(dm_tensor *t, double s) {
  int64_t n = dm_numel(t);
  char *d = dm_data(t);
  if (t->dtype == DM_F32) {
    float *f = (float *)d;
    for (int64_t i = 0; i < n; i++) f[i] = (float)(f[i] * s);
    return;
  }
  size_t es = dm_dtype_size(t->dtype);
  for (int64_t i = 0; i < n; i++) dm_store(t->dtype, d + (size_t)i * es, dm_load(t->dtype, d + (size_t)i * es) * s);
}

static void cpu_clip_scale(int n, dm_tensor *const *x, const dm_tensor *sumsq, double max_norm) {
  double norm = sqrt(*(const double *)dm_data(sumsq));
  if (!isfinite(norm) || !(norm > max_norm)) return;
  double s = max_norm / norm;
  for (int i = 0; i < n; i++) if (x[i]) scale_any(x[i], s);
}

/* ---- Muon ----------------------------------------------------------------------------------- */

/* (sumsq_at is resolved by the core on the CPU: never set here) */
/* the stack index of element e of a member: rows `pitch` apart (dm_muon_momentum_k) */
static inline int64_t pitched(int64_t e, int64_t cols, int64_t pitch) {
  return pitch == cols ? e : e / cols * pitch + e % cols;
}

/* a span of g's values as scale_any would leave them: each (value · s) rounded once to g's dtype */
static const float *clip_span(const dm_tensor *g, const float *v, int64_t len, double s, float *tmp) {
  for (int64_t j = 0; j < len; j++) {
    if (g->dtype == DM_F32) { tmp[j] = (float)(v[j] * s); continue; }
    char r[8];
    dm_store(g->dtype, r, v[j] * s);
    tmp[j] = (float)dm_load(g->dtype, r);
  }
  return tmp;
}

/* the factor dm_clip_scale would scale by, and whether it would */
static bool clip_factor(const double *clip_at, double clip, double *s) {
  if (!clip_at) return false;
  double norm = sqrt(*clip_at);
  if (!isfinite(norm) || !(norm > clip)) return false;
  *s = clip / norm;
  return true;
}

static void cpu_muon_momentum(int n, dm_tensor *const *buf, dm_tensor *const *g, dm_tensor *const *out,
                              double mu, bool nesterov, const double *sumsq_at, const double *clip_at, double clip,
                              int64_t cols, int64_t pitch, const dm_sround_key *sround) {
  (void)sumsq_at;
  double s = 1;
  bool clipped = clip_factor(clip_at, clip, &s);
  const float m = (float)mu;
  float gt[CHUNK], bt[CHUNK];
  for (int i = 0; i < n; i++) {
    int64_t total = dm_numel(buf[i]);
    bool f32 = out[i]->dtype == DM_F32, stochastic = sround && buf[i]->dtype == DM_BF16;
    for (int64_t i0 = 0; i0 < total; i0 += CHUNK) {
      int64_t len = span_len(total, i0);
      const float *gg = span(g[i], i0, len, gt);
      if (clipped) gg = clip_span(g[i], gg, len, s, gt);
      float *b = span(buf[i], i0, len, bt);       /* a bf16 buffer (momentum_dtype) rounds once a step */
      for (int64_t j = 0; j < len; j++) {
        float bj = m * b[j] + gg[j], o = nesterov ? gg[j] + m * bj : bj;
        b[j] = bj;
        int64_t at = pitched(i0 + j, cols, pitch);
        if (f32) ((float *)dm_data(out[i]))[at] = o;
        else ((uint16_t *)dm_data(out[i]))[at] = dm_f32_to_bf16(o);
      }
      if (stochastic) {
        uint16_t *h = (uint16_t *)dm_data(buf[i]) + i0;
        for (int64_t j = 0; j < len; j++)
          h[j] = dm_bf16_stochastic(b[j], dm_sround_bits(sround->salt, (uint32_t)i, sround->step, i0 + j));
      } else {
        commit(buf[i], i0, len, b);
      }
    }
  }
}

static void cpu_ns_normalize(dm_tensor *x, double mult, double eps) {
  int64_t per = x->shape[1] * x->shape[2];
  float tmp[CHUNK];
  for (int64_t b = 0; b < x->shape[0]; b++) {
    double s = 0;
    for (int64_t i0 = 0; i0 < per; i0 += CHUNK) {
      int64_t len = span_len(per, i0);
      s += sumsq_f32(span(x, b * per + i0, len, tmp), len);
    }
    float r = (float)(1 / (sqrt(s) * mult + eps));
    for (int64_t i0 = 0; i0 < per; i0 += CHUNK) {
      int64_t len = span_len(per, i0);
      float *y = span(x, b * per + i0, len, tmp);
      for (int64_t j = 0; j < len; j++) y[j] *= r;
      commit(x, b * per + i0, len, y);
    }
  }
}

static void cpu_ns_gram_start(dm_tensor *q, const dm_tensor *a, double mult, double eps) {
  int64_t s = a->shape[1];
  const float *pa = dm_data(a);
  float *pq = dm_data(q);
  for (int64_t b = 0; b < a->shape[0]; b++) {
    double tr = 0;
    for (int64_t i = 0; i < s; i++) tr += pa[(b * s + i) * s + i];
    float r = (float)(1 / (sqrt(tr) * mult + eps));
    for (int64_t i = 0; i < s * s; i++) pq[b * s * s + i] = i % (s + 1) == 0 ? r : 0.f;
  }
}

static void cpu_ns_axpby(dm_tensor *y, double alpha, const dm_tensor *x, double beta) {
  const float a = (float)alpha, b = (float)beta;
  float xt[CHUNK], yt[CHUNK];
  int64_t total = dm_numel(y);
  for (int64_t i0 = 0; i0 < total; i0 += CHUNK) {
    int64_t len = span_len(total, i0);
    const float *xs = span(x, i0, len, xt);
    float *ys = span(y, i0, len, yt);
    for (int64_t j = 0; j < len; j++) ys[j] = a * xs[j] + b * ys[j];
    commit(y, i0, len, ys);
  }
}

static void cpu_muon_apply(int n, dm_tensor *const *p, dm_tensor *const *o, dm_tensor *const *s,
                           const dm_muon_hp *hp, double scale, int64_t cols, int64_t pitch) {
  const float decay = (float)(1 - hp->lr * hp->weight_decay), step = (float)(hp->lr * scale);
  for (int i = 0; i < n; i++) {
    float *pp = dm_data(p[i]);
    int64_t total = dm_numel(p[i]), per = p[i]->shape[p[i]->ndim - 2] * cols;
    const float *si = s && s[i] ? dm_data(s[i]) : NULL;   /* matrix e's update times si[e] */
    bool f32 = o[i]->dtype == DM_F32;
    for (int64_t e = 0; e < total; e++) {
      int64_t at = pitched(e, cols, pitch);
      float u = f32 ? ((const float *)dm_data(o[i]))[at] : bf16_f32(((const uint16_t *)dm_data(o[i]))[at]);
      pp[e] = pp[e] * decay - (si ? step * si[e / per] : step) * u;
    }
  }
}

static void cpu_optim_tick(dm_tensor *step, const dm_tensor *sumsq) {
  if (isfinite(*(const double *)dm_data(sumsq))) ++*(int64_t *)dm_data(step);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(adamw, cpu_adamw),
  DM_KERNEL_ENTRY(adamw_8bit, cpu_adamw_8bit),
  DM_KERNEL_ENTRY(optim_tick, cpu_optim_tick),
  DM_KERNEL_ENTRY(sumsq, cpu_sumsq),
  DM_KERNEL_ENTRY(clip_scale, cpu_clip_scale),
  DM_KERNEL_ENTRY(muon_momentum, cpu_muon_momentum),
  DM_KERNEL_ENTRY(ns_normalize, cpu_ns_normalize),
  DM_KERNEL_ENTRY(ns_axpby, cpu_ns_axpby),
  DM_KERNEL_ENTRY(ns_gram_start, cpu_ns_gram_start),
  DM_KERNEL_ENTRY(muon_apply, cpu_muon_apply),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
