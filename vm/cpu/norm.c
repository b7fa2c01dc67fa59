/*
** cpu/blocks.c — the kernels of the building blocks (blocks.h): rownorm
** (rmsnorm, l2norm), cross-entropy, the causal depthwise convolution and
** silu_mul, forward and backward.
**
** Every kernel takes operands of any strides. The row kernels (rownorm,
** cross-entropy) find each row's first element through its leading dims
** and walk the row with its last-dim stride; rows of f32 with unit stride
** take four-lane loops (GCC vector extensions), the others a generic loop
** through ld/st. Sums are taken in double (the f32 lanes in float over
** blocks of 64, then in double). Reductions over rows (the gain's and the
** convolution weight's gradients) go in row order into double accumulators:
** deterministic, no atomics.
*/
#include <tgmath.h>
#include <stdlib.h>
#include <string.h>
#include "iter.h"
#include "vec.h"
#include "ops/conv.h"
#include "ops/elementwise.h"

/* the address of element r of t's first nd dims, counted row-major (later dims at 0) */
static char *addr(const dm_tensor *t, int nd, int64_t r) {
  int64_t off = 0;
  for (int d = nd - 1; d >= 0; d--) {
    off += (r % t->shape[d]) * t->strides[d];
    r /= t->shape[d];
  }
  return (char *)dm_data(t) + off * (int64_t)dm_dtype_size(t->dtype);
}

/* the first element of row r (rows: the last dim), element r of the whole tensor */
static char *row_at(const dm_tensor *t, int64_t r) { return addr(t, t->ndim - 1, r); }
static char *elem_at(const dm_tensor *t, int64_t r) { return addr(t, t->ndim, r); }

static int64_t row_len(const dm_tensor *t) { return t->shape[t->ndim - 1]; }
static int64_t n_rows(const dm_tensor *t) { return row_len(t) ? dm_numel(t) / row_len(t) : 0; }
/* byte stride along a row */
static int64_t row_step(const dm_tensor *t) { return t->strides[t->ndim - 1] * (int64_t)dm_dtype_size(t->dtype); }

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) dm_error("out of host memory for a kernel's scratch (%zu bytes)", n * size);
  return p;
}

/* ---- f32 rows four lanes at a time ---------------------------------------------------- */

typedef double v2d __attribute__((vector_size(16)));

/* sum of a[j] * b[j] (b NULL: of a[j]^2); float lanes over blocks of 64, then double */
static double dot_f32(const float *a, const float *b, int64_t n) {
  double total = 0;
  int64_t j = 0;
  while (j + 8 <= n) {
    v4f s0 = {0, 0, 0, 0}, s1 = s0;
    int64_t end = j + 64 < n ? j + 64 : n;
    for (; j + 8 <= end; j += 8) {
      v4f a0 = load4(a + j), a1 = load4(a + j + 4);
      s0 += a0 * (b ? load4(b + j) : a0);
      s1 += a1 * (b ? load4(b + j + 4) : a1);
    }
    total += hsum4(s0 + s1);
  }
  for (; j < n; j++) total += (double)a[j] * (b ? b[j] : a[j]);
  return total;
}

/* the max of a row (NaN is passed over: the sum of exps then carries it) */
static float max_f32(const float *x, int64_t n) {
  v4f m0 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, m1 = m0;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v4f a = load4(x + j), b = load4(x + j + 4);
    m0 = sel(a > m0, a, m0);
    m1 = sel(b > m1, b, m1);
  }
  m0 = sel(m1 > m0, m1, m0);
  float m = fmaxf(fmaxf(m0[0], m0[1]), fmaxf(m0[2], m0[3]));
  for (; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

/* sum of exp(x[j] - shift); with y, also y[j] = scale * exp(x[j] - shift) */
static double expsum_f32(float *y, const float *x, int64_t n, float shift, float scale) {
  double total = 0;
  int64_t j = 0;
  while (j + 8 <= n) {
    v4f acc = {0, 0, 0, 0};
    int64_t end = j + 64 < n ? j + 64 : n;
    for (; j + 8 <= end; j += 8) {             /* two at once: the polynomial is a long chain */
      v4f e0 = exp4(load4(x + j) - shift), e1 = exp4(load4(x + j + 4) - shift);
      if (y) { store4(y + j, e0 * scale); store4(y + j + 4, e1 * scale); }
      acc += e0 + e1;
    }
    total += hsum4(acc);
  }
  for (; j < n; j++) {
    float e = exp1(x[j] - shift);
    if (y) y[j] = e * scale;
    total += e;
  }
  return total;
}

/* ---- rownorm: rmsnorm and l2norm --------------------------------------------------------- */

/* what a row needs: data, byte strides along rows, dtype */
typedef struct rown {
  int kind;
  dm_dtype dt;
  int64_t d;                    /* row length */
  double div;                   /* D (rms) or 1 (l2) */
  const char *gain;             /* a double 1.0 with stride 0 when there is no gain */
  dm_dtype gdt;
  int64_t gs;
  bool fast;                    /* f32, unit stride everywhere */
  double *acc;                  /* the gain's gradient, when asked for (backward) */
  void *scratch;                /* one block for acc and the fast path's ones */
} rown;

static const double one = 1.0;

/* one allocation for the scratch, so that running out of memory leaks nothing */
static void rown_init(rown *u, int kind, const dm_tensor *x, const dm_tensor *gain, bool with_acc) {
  memset(u, 0, sizeof *u);
  u->kind = kind;
  u->dt = x->dtype;
  u->d = row_len(x);
  u->div = kind == DM_NORM_RMS ? (double)u->d : 1.0;
  if (gain) { u->gain = dm_data(gain); u->gdt = gain->dtype; u->gs = row_step(gain); }
  else { u->gain = (const char *)&one; u->gdt = DM_F64; u->gs = 0; }
  u->fast = x->dtype == DM_F32 && row_step(x) == 4 && (!gain || u->gs == 4);
  bool ones = u->fast && !gain;                  /* the fast path's gain when there is none */
  size_t nacc = with_acc ? (size_t)u->d : 0, nones = ones ? (size_t)u->d : 0;
  if (with_acc || ones) u->scratch = xcalloc(nacc * sizeof(double) + nones * sizeof(float), 1);
  u->acc = with_acc ? u->scratch : NULL;
  if (ones) {
    float *g = (float *)((double *)u->scratch + nacc);
    for (int64_t j = 0; j < u->d; j++) g[j] = 1;
    u->gain = (const char *)g;
  }
}

static double row_rstd(const rown *u, double ss, double eps) { return 1 / sqrt(ss / u->div + eps); }

static void rownorm_row_fast(const rown *u, float *y, const float *x, double eps, double *rstd) {
  const float *g = (const float *)u->gain;
  int64_t n = u->d, j = 0;
  double r = row_rstd(u, dot_f32(x, NULL, n), eps);
  float rf = (float)r;
  for (; j + 4 <= n; j += 4) store4(y + j, load4(x + j) * rf * load4(g + j));
  for (; j < n; j++) y[j] = x[j] * rf * g[j];
  *rstd = r;
}

static void rownorm_row(const rown *u, char *y, int64_t ys, const char *x, int64_t xs, double eps, double *rstd) {
  double ss = 0;
  for (int64_t j = 0; j < u->d; j++) { double v = ld(u->dt, x + j * xs); ss += v * v; }
  double r = row_rstd(u, ss, eps);
  for (int64_t j = 0; j < u->d; j++)
    st(u->dt, y + j * ys, ld(u->dt, x + j * xs) * r * ld(u->gdt, u->gain + j * u->gs));
  *rstd = r;
}

static void cpu_rownorm(int kind, dm_tensor *y, dm_tensor *rstd, const dm_tensor *x, const dm_tensor *gain,
                        double eps) {
  rown u;
  rown_init(&u, kind, x, gain, false);
  int64_t rows = n_rows(x), xs = row_step(x), ys = row_step(y);
  for (int64_t r = 0; r < rows; r++) {
    double rs;
    char *yr = row_at(y, r);
    const char *xr = row_at(x, r);
    if (u.fast && ys == 4) rownorm_row_fast(&u, (float *)yr, (const float *)xr, eps, &rs);
    else rownorm_row(&u, yr, ys, xr, xs, eps, &rs);
    if (rstd) st(rstd->dtype, elem_at(rstd, r), rs);
  }
  free(u.scratch);
}

/* One row of the backward, xh = x * r, gh = g * gain:
**   gx = r (gh - xh * sum(gh * xh) / div),   acc (the gain's gradient) += g * xh */
static void rownorm_bwd_row_fast(const rown *u, float *gx, double *acc, const float *g, const float *x,
                                 double r) {
  const float *gn = (const float *)u->gain;
  int64_t n = u->d, j = 0;
  if (gx) {
    double dot = 0;                             /* sum(g gain x), in float lanes over blocks of 64 */
    while (j + 4 <= n) {
      v4f s = {0, 0, 0, 0};
      int64_t end = j + 64 < n ? j + 64 : n;
      for (; j + 4 <= end; j += 4) s += load4(g + j) * load4(gn + j) * load4(x + j);
      dot += hsum4(s);
    }
    for (; j < n; j++) dot += (double)g[j] * gn[j] * x[j];
    float rf = (float)r, c = (float)(r * r * dot / u->div);
    for (j = 0; j + 4 <= n; j += 4)
      store4(gx + j, rf * (load4(g + j) * load4(gn + j) - load4(x + j) * c));
    for (; j < n; j++) gx[j] = rf * (g[j] * gn[j] - x[j] * c);
  }
  if (acc) {                                    /* float products, double sums, two lanes at a time */
    float rf = (float)r;
    for (j = 0; j + 4 <= n; j += 4) {
      v4f p = load4(g + j) * load4(x + j) * rf;
      v2d lo, hi;
      memcpy(&lo, acc + j, sizeof lo);
      memcpy(&hi, acc + j + 2, sizeof hi);
      lo += (v2d){p[0], p[1]};
      hi += (v2d){p[2], p[3]};
      memcpy(acc + j, &lo, sizeof lo);
      memcpy(acc + j + 2, &hi, sizeof hi);
    }
    for (; j < n; j++) acc[j] += g[j] * x[j] * rf;
  }
}

static void rownorm_bwd_row(const rown *u, char *gx, int64_t gxs, double *acc, const char *g, int64_t gs,
                            const char *x, int64_t xs, double r) {
  dm_dtype dt = u->dt;
  if (gx) {
    double dot = 0;
    for (int64_t j = 0; j < u->d; j++)
      dot += ld(dt, g + j * gs) * ld(u->gdt, u->gain + j * u->gs) * ld(dt, x + j * xs);
    double c = r * r * dot / u->div;
    for (int64_t j = 0; j < u->d; j++)
      st(dt, gx + j * gxs, r * (ld(dt, g + j * gs) * ld(u->gdt, u->gain + j * u->gs) - ld(dt, x + j * xs) * c));
  }
  if (acc) for (int64_t j = 0; j < u->d; j++) acc[j] += ld(dt, g + j * gs) * ld(dt, x + j * xs) * r;
}

static void cpu_rownorm_bwd(int kind, dm_tensor *gx, dm_tensor *ggain, const dm_tensor *g, const dm_tensor *x,
                            const dm_tensor *gain, const dm_tensor *rstd) {
  rown u;
  rown_init(&u, kind, x, gain, ggain != NULL);
  int64_t rows = n_rows(x), xs = row_step(x), gs = row_step(g), gxs = gx ? row_step(gx) : 0;
  bool fast = u.fast && gs == 4 && (!gx || gxs == 4);
  double *acc = u.acc;
  for (int64_t r = 0; r < rows; r++) {
    double rs = ld(rstd->dtype, elem_at(rstd, r));
    char *gxr = gx ? row_at(gx, r) : NULL;
    if (fast) rownorm_bwd_row_fast(&u, (float *)gxr, acc, (const float *)row_at(g, r), (const float *)row_at(x, r), rs);
    else rownorm_bwd_row(&u, gxr, gxs, acc, row_at(g, r), gs, row_at(x, r), xs, rs);
  }
  if (ggain) for (int64_t j = 0; j < u.d; j++) st(ggain->dtype, elem_at(ggain, j), acc[j]);
  free(u.scratch);
}

/* ---- cross-entropy ------------------------------------------------------------------------ */

static int64_t target_at(const dm_tensor *t, int64_t r) {
  const char *p = elem_at(t, r);
  return t->dtype == DM_I64 ? *(const int64_t *)p : t->dtype == DM_I32 ? *(const int32_t *)p : *(const uint8_t *)p;
}

static bool ignored(int64_t target, int64_t ignore_index) { return ignore_index != -1 && target == ignore_index; }

static void cpu_ce_check(const dm_tensor *targets, int64_t classes, int64_t ignore_index) {
  int64_t rows = dm_numel(targets);
  for (int64_t r = 0; r < rows; r++) {
    int64_t t = target_at(targets, r);
    if (!ignored(t, ignore_index) && (t < 0 || t >= classes))
      dm_error("cross_entropy: target %lld at row %lld of %lld is out of range for %lld classes "
               "(class ids 0..%lld%s)", (long long)t, (long long)r + 1, (long long)rows, (long long)classes,
               (long long)classes - 1, ignore_index == -1 ? "" : ", or ignore_index");
  }
}

/* the logsumexp of a row */
static double row_lse(const dm_tensor *x, const char *row, int64_t n) {
  int64_t s = row_step(x);
  if (x->dtype == DM_F32 && s == 4) {
    float m = max_f32((const float *)row, n);
    if (isinf(m)) return m;                     /* every entry -inf (or one +inf): no shift works */
    return m + log(expsum_f32(NULL, (const float *)row, n, m, 1));
  }
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j < n; j++) { double v = ld(x->dtype, row + j * s); m = v > m ? v : m; }
  if (isinf(m)) return m;
  for (int64_t j = 0; j < n; j++) sum += exp(ld(x->dtype, row + j * s) - m);
  return m + log(sum);
}

static void cpu_ce(dm_tensor *loss, dm_tensor *lse, const dm_tensor *logits, const dm_tensor *targets,
                   int64_t ignore_index, int reduction) {
  int64_t rows = n_rows(logits), n = row_len(logits), s = row_step(logits), kept = 0;
  double total = 0;
  for (int64_t r = 0; r < rows; r++) {
    const char *row = row_at(logits, r);
    int64_t t = target_at(targets, r);
    double l = row_lse(logits, row, n), v = 0;
    if (lse) st(lse->dtype, elem_at(lse, r), l);
    if (!ignored(t, ignore_index)) {
      v = l - ld(logits->dtype, row + t * s);
      total += v;
      kept++;
    }
    if (reduction == DM_CE_NONE) st(loss->dtype, elem_at(loss, r), v);
  }
  if (reduction == DM_CE_MEAN) st(loss->dtype, dm_data(loss), total / (double)kept);   /* 0/0: NaN */
  else if (reduction == DM_CE_SUM) st(loss->dtype, dm_data(loss), total);
}

/* gx = c * (softmax - onehot) on every row, c the row's share of the loss's gradient */
static void cpu_ce_bwd(dm_tensor *gx, const dm_tensor *g, const dm_tensor *logits, const dm_tensor *targets,
                       const dm_tensor *lse, int64_t ignore_index, int reduction) {
  int64_t rows = n_rows(logits), n = row_len(logits), xs = row_step(logits), gs = row_step(gx), kept = 0;
  for (int64_t r = 0; r < rows; r++) kept += !ignored(target_at(targets, r), ignore_index);
  double g0 = reduction == DM_CE_NONE ? 0 : ld(g->dtype, dm_data(g));
  if (reduction == DM_CE_MEAN) g0 /= (double)kept;
  dm_dtype dt = gx->dtype;
  bool fast = dt == DM_F32 && logits->dtype == DM_F32 && xs == 4 && gs == 4;
  for (int64_t r = 0; r < rows; r++) {
    int64_t t = target_at(targets, r);
    char *gr = row_at(gx, r);
    const char *xr = row_at(logits, r);
    double c = ignored(t, ignore_index) ? 0 : reduction == DM_CE_NONE ? ld(g->dtype, elem_at(g, r)) : g0;
    double l = ld(lse->dtype, elem_at(lse, r));
    if (c == 0) { for (int64_t j = 0; j < n; j++) st(dt, gr + j * gs, 0); continue; }
    if (fast) expsum_f32((float *)gr, (const float *)xr, n, (float)l, (float)c);
    else for (int64_t j = 0; j < n; j++) st(dt, gr + j * gs, c * exp(ld(logits->dtype, xr + j * xs) - l));
    st(dt, gr + t * gs, ld(dt, gr + t * gs) - c);
  }
}

/* ---- causal_conv1d ------------------------------------------------------------------------- */

typedef struct conv {
  dm_dtype dt;
  int64_t B, T, C, K, P, dil;
  double *wt;                   /* w transposed: wt[k * C + c] = w[c, k] */
  double *scratch;              /* the kernel's accumulators, zeros, after wt in wt's block */
} conv;

/* wt and `extra` doubles of scratch in one allocation, so that running out of memory leaks nothing */
static void conv_init(conv *v, const dm_tensor *x, const dm_tensor *w, int64_t dil, int64_t extra) {
  v->dt = x->dtype;
  v->B = x->shape[0]; v->T = x->shape[1]; v->C = x->shape[2]; v->K = w->shape[1];
  v->dil = dil;
  v->P = (v->K - 1) * dil;
  v->wt = xcalloc((size_t)(v->K * v->C + extra), sizeof(double));
  v->scratch = v->wt + v->K * v->C;
  for (int64_t c = 0; c < v->C; c++)
    for (int64_t k = 0; k < v->K; k++) v->wt[k * v->C + c] = ld(w->dtype, addr(w, 2, c * v->K + k));
}

/* the row [b, t, :] of a [B, *, C] tensor, or NULL outside 0..len-1 or without the tensor */
static char *conv_row(const dm_tensor *t, int64_t b, int64_t pos) {
  if (!t || pos < 0 || pos >= t->shape[1]) return NULL;
  return (char *)dm_data(t) + (b * t->strides[0] + pos * t->strides[1]) * (int64_t)dm_dtype_size(t->dtype);
}

/* xin at position pos (-P..T-1): x's row, the cache's, or NULL (zeros) */
static const char *conv_in(const conv *v, const dm_tensor *x, const dm_tensor *cache, int64_t b, int64_t pos) {
  return pos >= 0 ? conv_row(x, b, pos) : conv_row(cache, b, v->P + pos);
}

/* acc[c] += w * src[c]; the f32 unit-stride case is inlined with its constants */
INLINE void axpy_(dm_dtype dt, int64_t s, double *acc, const double *w, const char *src, int64_t n) {
  for (int64_t c = 0; c < n; c++) acc[c] += w[c] * ld(dt, src + c * s);
}
INLINE void store_row_(dm_dtype dt, int64_t s, char *dst, const double *acc, int64_t n) {
  for (int64_t c = 0; c < n; c++) st(dt, dst + c * s, acc[c]);
}

static int64_t chan_step(const dm_tensor *t) { return t->strides[2] * (int64_t)dm_dtype_size(t->dtype); }

/* a row of xin copied into a row of dst (zeros where xin is) */
static void conv_copy_row(const conv *v, char *dst, int64_t ds, const char *src, int64_t ss) {
  for (int64_t c = 0; c < v->C; c++) st(v->dt, dst + c * ds, src ? ld(v->dt, src + c * ss) : 0);
}

static void cpu_conv(dm_tensor *y, dm_tensor *cache_out, const dm_tensor *x, const dm_tensor *w,
                     const dm_tensor *cache, int64_t dil) {
  conv v;
  conv_init(&v, x, w, dil, x->shape[2]);
  double *acc = v.scratch;
  int64_t ys = chan_step(y), xs = chan_step(x), cs = cache ? chan_step(cache) : 0;
  for (int64_t b = 0; b < v.B; b++) {
    for (int64_t t = 0; t < v.T; t++) {
      memset(acc, 0, sizeof(double) * (size_t)v.C);
      for (int64_t k = 0; k < v.K; k++) {
        int64_t pos = t - (v.K - 1 - k) * dil;
        const char *src = conv_in(&v, x, cache, b, pos);
        if (src) F32_UNIT_DISPATCH(axpy_, v.dt, pos >= 0 ? xs : cs, acc, v.wt + k * v.C, src, v.C);
      }
      F32_UNIT_DISPATCH(store_row_, v.dt, ys, conv_row(y, b, t), acc, v.C);
    }
    for (int64_t j = 0; j < v.P; j++) {          /* the new cache: xin's last P positions */
      int64_t pos = v.T - v.P + j;
      conv_copy_row(&v, conv_row(cache_out, b, j), chan_step(cache_out), conv_in(&v, x, cache, b, pos),
                    pos >= 0 ? xs : cs);
    }
  }
  free(v.wt);
}

/* The gradient of xin at every position pos of -P..T-1 (x's rows, then the
** cache's): the outputs that read it, plus the new cache's row it became.
** gw[c, k] sums gy[b, t, c] * xin[b, t - (K-1-k) dil, c] over b and t. */
static void cpu_conv_bwd(dm_tensor *gx, dm_tensor *gw, dm_tensor *gcache, const dm_tensor *gy,
                         const dm_tensor *gcache_out, const dm_tensor *x, const dm_tensor *w,
                         const dm_tensor *cache, int64_t dil) {
  conv v;
  int64_t C = x->shape[2];
  conv_init(&v, x, w, dil, C + (gw ? w->shape[1] * C : 0));
  int64_t gys = chan_step(gy), xs = chan_step(x), cs = cache ? chan_step(cache) : 0;
  double *acc = v.scratch, *accw = gw ? acc + C : NULL;
  int64_t lo = gcache ? -v.P : 0, hi = gx ? v.T : 0;     /* the positions whose gradient is wanted */
  for (int64_t b = 0; b < v.B; b++) {
    for (int64_t pos = lo; pos < hi; pos++) {
      char *dst = pos >= 0 ? conv_row(gx, b, pos) : conv_row(gcache, b, v.P + pos);
      memset(acc, 0, sizeof(double) * (size_t)C);
      for (int64_t k = 0; k < v.K; k++) {
        const char *g = conv_row(gy, b, pos + (v.K - 1 - k) * dil);
        if (g) F32_UNIT_DISPATCH(axpy_, v.dt, gys, acc, v.wt + k * C, g, C);
      }
      const char *gc = conv_row(gcache_out, b, pos - (v.T - v.P));
      if (gc) for (int64_t c = 0; c < C; c++) acc[c] += ld(v.dt, gc + c * chan_step(gcache_out));
      F32_UNIT_DISPATCH(store_row_, v.dt, chan_step(pos >= 0 ? gx : gcache), dst, acc, C);
    }
    if (accw)
      for (int64_t t = 0; t < v.T; t++) {
        const char *g = conv_row(gy, b, t);
        for (int64_t k = 0; k < v.K; k++) {
          int64_t pos = t - (v.K - 1 - k) * dil;
          const char *src = conv_in(&v, x, cache, b, pos);
          int64_t ss = pos >= 0 ? xs : cs;
          if (src) for (int64_t c = 0; c < C; c++) accw[k * C + c] += ld(v.dt, g + c * gys) * ld(v.dt, src + c * ss);
        }
      }
  }
  if (accw)
    for (int64_t c = 0; c < C; c++)
      for (int64_t k = 0; k < v.K; k++) st(gw->dtype, addr(gw, 2, c * v.K + k), accw[k * C + c]);
  free(v.wt);
}

/* ---- silu_mul ------------------------------------------------------------------------------ */

/* the formulas in terms of s = sigmoid(a), for scalars of any float type and for v4f lanes */
#define SM_Y(a, b, s) ((a) * (s) * (b))
#define SM_GA(g, a, b, s) ((g) * (b) * ((s) * (1 + (a) * (1 - (s)))))
#define SM_GB(g, a, s) ((g) * (a) * (s))

INLINE v4f sigmoid4(v4f a) { return 1 / (1 + exp4(-a)); }    /* exp4 clamps: 0 and 1 at the ends */

static void silu_mul_f32(float *y, const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    v4f va = load4(a + i), s = sigmoid4(va);
    store4(y + i, SM_Y(va, load4(b + i), s));
  }
  for (; i < n; i++) { float s = DM_SIGMOID(a[i]); y[i] = SM_Y(a[i], b[i], s); }
}

/* p: y, a, b */
static void silu_mul_row(char **p, const int64_t *st_, int64_t n, void *ud) {
  dm_dtype dt = *(const dm_dtype *)ud;
  if (dt == DM_F32 && st_[0] == 4 && st_[1] == 4 && st_[2] == 4) {
    silu_mul_f32((float *)p[0], (const float *)p[1], (const float *)p[2], n);
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *pa = p[1] + i * st_[1], *pb = p[2] + i * st_[2];
    char *py = p[0] + i * st_[0];
    if (dt == DM_F64) {
      double a = *(const double *)pa, s = DM_SIGMOID(a);
      *(double *)py = SM_Y(a, *(const double *)pb, s);
    } else {                                   /* f32, bf16, f16 compute in float */
      float a = (float)ld(dt, pa), s = DM_SIGMOID(a);
      st(dt, py, SM_Y(a, (float)ld(dt, pb), s));
    }
  }
}

static void cpu_silu_mul(dm_tensor *y, const dm_tensor *a, const dm_tensor *b) {
  dm_tensor *in[2] = {(dm_tensor *)a, (dm_tensor *)b};
  dm_dtype dt = y->dtype;
  dm_iter_walk(y, 2, in, silu_mul_row, &dt);
}

typedef struct bwd_args { dm_dtype dt; dm_grad2 g2; } bwd_args;

static void silu_mul_bwd_f32(float *ga, float *gb, const float *g, const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    v4f vg = load4(g + i), va = load4(a + i), vb = load4(b + i), s = sigmoid4(va);
    if (ga) store4(ga + i, SM_GA(vg, va, vb, s));
    if (gb) store4(gb + i, SM_GB(vg, va, s));
  }
  for (; i < n; i++) {
    float s = DM_SIGMOID(a[i]);
    if (ga) ga[i] = SM_GA(g[i], a[i], b[i], s);
    if (gb) gb[i] = SM_GB(g[i], a[i], s);
  }
}

/* p: the lead gradient, g, a, b */
static void silu_mul_bwd_row(char **p, const int64_t *st_, int64_t n, void *ud) {
  const bwd_args *u = ud;
  char *pa, *pb;
  dm_grad2_at(&u->g2, p[0], &pa, &pb);
  dm_dtype dt = u->dt;
  if (dt == DM_F32 && st_[0] == 4 && st_[1] == 4 && st_[2] == 4 && st_[3] == 4) {
    silu_mul_bwd_f32((float *)pa, (float *)pb, (const float *)p[1], (const float *)p[2], (const float *)p[3], n);
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *pg = p[1] + i * st_[1], *px = p[2] + i * st_[2], *py = p[3] + i * st_[3];
    int64_t o = i * st_[0];
    if (dt == DM_F64) {
      double g = *(const double *)pg, a = *(const double *)px, b = *(const double *)py, s = DM_SIGMOID(a);
      if (pa) *(double *)(pa + o) = SM_GA(g, a, b, s);
      if (pb) *(double *)(pb + o) = SM_GB(g, a, s);
    } else {
      float g = (float)ld(dt, pg), a = (float)ld(dt, px), b = (float)ld(dt, py), s = DM_SIGMOID(a);
      if (pa) st(dt, pa + o, SM_GA(g, a, b, s));
      if (pb) st(dt, pb + o, SM_GB(g, a, s));
    }
  }
}

static void cpu_silu_mul_bwd(dm_tensor *ga, dm_tensor *gb, const dm_tensor *g, const dm_tensor *a,
                             const dm_tensor *b) {
  bwd_args u;
  dm_tensor *lead = dm_grad2_init(&u.g2, ga, gb, "silu_mul");
  if (!lead) return;
  u.dt = lead->dtype;
  dm_tensor *in[3] = {(dm_tensor *)g, (dm_tensor *)a, (dm_tensor *)b};
  dm_iter_walk(lead, 3, in, silu_mul_bwd_row, &u);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(rownorm, cpu_rownorm),
  DM_KERNEL_ENTRY(rownorm_bwd, cpu_rownorm_bwd),
  DM_KERNEL_ENTRY(cross_entropy_check, cpu_ce_check),
  DM_KERNEL_ENTRY(cross_entropy, cpu_ce),
  DM_KERNEL_ENTRY(cross_entropy_bwd, cpu_ce_bwd),
  DM_KERNEL_ENTRY(causal_conv1d, cpu_conv),
  DM_KERNEL_ENTRY(causal_conv1d_bwd, cpu_conv_bwd),
  DM_KERNEL_ENTRY(silu_mul, cpu_silu_mul),
  DM_KERNEL_ENTRY(silu_mul_bwd, cpu_silu_mul_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
