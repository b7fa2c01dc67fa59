/*
** cpu/xent.c — the kernels of cross-entropy (xent.h): the targets' check,
** the loss with its log-softmax, and the backward.
**
** Every kernel takes operands of any strides: a row's first element is
** found through its leading dims (rows.h) and the row walked with its
** last-dim stride; rows of f32 with unit stride take four-lane loops (GCC
** vector extensions), the others a generic loop through ld/st. Sums are
** taken in double (the f32 lanes in float over blocks of 64, then in
** double); the loss's sum over rows goes in row order: deterministic.
*/
#include <tgmath.h>
#include "vec.h"
#include "rows.h"
#include "ops/xent.h"

/* ---- f32 rows four lanes at a time ---------------------------------------------------- */

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

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(cross_entropy_check, cpu_ce_check),
  DM_KERNEL_ENTRY(cross_entropy, cpu_ce),
  DM_KERNEL_ENTRY(cross_entropy_bwd, cpu_ce_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
