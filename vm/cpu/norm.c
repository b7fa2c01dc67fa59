/*
** cpu/norm.c — the kernels of the row norms (norm.h): rownorm (rmsnorm,
** l2norm), forward and backward, and add_rownorm (the residual add before one).
**
** Every kernel takes operands of any strides: a row's first element is
** found through its leading dims (rows.h) and the row walked with its
** last-dim stride; rows of f32 with unit stride take four-lane loops (GCC
** vector extensions), the others a generic loop through ld/st. Sums are
** taken in double (the f32 lanes in float over blocks of 64, then in
** double). The gain's gradient goes in row order into double accumulators:
** deterministic, no atomics.
*/
#include <tgmath.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"
#include "rows.h"
#include "core/alloc.h"
#include "ops/norm.h"

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

/* ---- rownorm: rmsnorm and l2norm --------------------------------------------------------- */

/* what a row needs: data, byte strides along rows, dtype */
typedef struct rown {
  int kind;
  dm_dtype dt;
  int64_t d;                    /* row length */
  double div;                   /* D (rms) or 1 (l2) */
  const char *gain;             /* scale_v (a double) with stride 0 when there is no gain */
  dm_dtype gdt;
  int64_t gs;
  bool fast;                    /* f32, unit stride everywhere */
  double *acc;                  /* the gain's gradient, when asked for (backward) */
  void *scratch;                /* one block for acc and the fast path's row of scale */
  double scale_v;               /* what stands in for the gain when there is none */
} rown;

/* one allocation for the scratch, so that running out of memory leaks nothing */
static void rown_init(rown *u, int kind, const dm_tensor *x, const dm_tensor *gain, double scale, bool with_acc) {
  memset(u, 0, sizeof *u);
  u->scale_v = scale;
  u->kind = kind;
  u->dt = x->dtype;
  u->d = row_len(x);
  u->div = kind == DM_NORM_RMS ? (double)u->d : 1.0;
  if (gain) { u->gain = dm_data(gain); u->gdt = gain->dtype; u->gs = row_step(gain); }
  else { u->gain = (const char *)&u->scale_v; u->gdt = DM_F64; u->gs = 0; }
  u->fast = x->dtype == DM_F32 && row_step(x) == 4 && (!gain || u->gs == 4);
  bool ones = u->fast && !gain;                  /* the fast path's gain when there is none: scale's */
  size_t nacc = with_acc ? (size_t)u->d : 0, nones = ones ? (size_t)u->d : 0;
  if (with_acc || ones) u->scratch = dm_xcalloc(nacc * sizeof(double) + nones * sizeof(float), 1);
  u->acc = with_acc ? u->scratch : NULL;
  if (ones) {
    float *g = (float *)((double *)u->scratch + nacc);
    for (int64_t j = 0; j < u->d; j++) g[j] = (float)scale;
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
                        double eps, double scale) {
  rown u;
  rown_init(&u, kind, x, gain, scale, false);
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
                            const dm_tensor *gain, const dm_tensor *rstd, double scale) {
  rown u;
  rown_init(&u, kind, x, gain, scale, ggain != NULL);
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

/* ---- add_rownorm: the add, the cast and rownorm of the ops it stands for, in turn ------------ */

/* s = h + y as the binary add computes it after y's cast to h's dtype (cpu/elementwise.c: f32,
** bf16 and f16 in float, f64 in double; casts as the copy's, dm_load and dm_store) */
static void add_into(dm_tensor *s, const dm_tensor *h, const dm_tensor *y) {
  dm_dtype hd = h->dtype, yd = y->dtype;
  bool in_float = hd != DM_F64;
  const char *ph = dm_data(h), *py = dm_data(y);
  char *ps = dm_data(s), yh[8];
  size_t hs = dm_dtype_size(hd), ys = dm_dtype_size(yd);
  for (int64_t i = 0, n = dm_numel(s); i < n; i++) {
    dm_store(hd, yh, dm_load(yd, py + i * ys));                 /* y's element in h's dtype */
    double a = dm_load(hd, ph + i * hs), b = dm_load(hd, yh);
    dm_store(hd, ps + i * hs, in_float ? (double)((float)a + (float)b) : a + b);
  }
}

static void cpu_add_rownorm(dm_tensor *s, dm_tensor *x, dm_tensor *u, dm_tensor *rstd, const dm_tensor *h,
                            const dm_tensor *y, const dm_tensor *gain, double eps) {
  add_into(s, h, y);
  dm_tensor *held = x;
  if (!held) held = h->dtype == y->dtype ? s : dm_tensor_new(DM_CPU, y->dtype, s->ndim, s->shape);
  if (held != s) {
    size_t hs = dm_dtype_size(s->dtype), xs = dm_dtype_size(held->dtype);
    const char *ps = dm_data(s);
    char *px = dm_data(held);
    for (int64_t i = 0, n = dm_numel(s); i < n; i++) dm_store(held->dtype, px + i * xs, dm_load(s->dtype, ps + i * hs));
  }
  cpu_rownorm(DM_NORM_RMS, u, rstd, held, gain, eps, 1.0);
  if (!x && held != s) dm_release(held);
}

static void cpu_add_rownorm_bwd(dm_tensor *gs, dm_tensor *gy, const dm_tensor *g, const dm_tensor *gu,
                                const dm_tensor *x, const dm_tensor *gain, const dm_tensor *rstd) {
  dm_tensor *gx = dm_tensor_new(DM_CPU, x->dtype, x->ndim, x->shape);
  cpu_rownorm_bwd(DM_NORM_RMS, gx, NULL, gu, x, gain, rstd, 1.0);
  add_into(gs, g, gx);
  dm_release(gx);
  if (gy) {
    size_t ss = dm_dtype_size(gs->dtype), ys = dm_dtype_size(gy->dtype);
    const char *ps = dm_data(gs);
    char *py = dm_data(gy);
    for (int64_t i = 0, n = dm_numel(gs); i < n; i++) dm_store(gy->dtype, py + i * ys, dm_load(gs->dtype, ps + i * ss));
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(rownorm, cpu_rownorm),
  DM_KERNEL_ENTRY(rownorm_bwd, cpu_rownorm_bwd),
  DM_KERNEL_ENTRY(add_rownorm, cpu_add_rownorm),
  DM_KERNEL_ENTRY(add_rownorm_bwd, cpu_add_rownorm_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
