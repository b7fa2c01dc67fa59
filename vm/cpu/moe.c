/*
** cpu/moe.c — the routed-expert kernels on the CPU (moe.h has the layout).
**
** The ops hand over contiguous f32 or f64 tensors and i64 indices. The
** expert products go through BLAS one expert at a time: gather the expert's
** rows (its tokens' u) into a scratch matrix, multiply, and write its
** outputs straight into its slice of the sorted rows. Elementwise work
** (gates, the activation and its derivative) is computed in double and
** rounded on store. Loops run in a fixed order and every output is written
** once, so results repeat bit for bit (OpenBLAS splits products over
** threads along rows and columns, never along the summed dim).
*/
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/alloc.h"
#include "ops/moe.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static inline double ld(dm_dtype dt, const void *p, int64_t i) {
  return dt == DM_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
static inline void st(dm_dtype dt, void *p, int64_t i, double v) {
  if (dt == DM_F64) ((double *)p)[i] = v;
  else ((float *)p)[i] = (float)v;
}
/* v as the dtype holds it: the f32 kernels pick experts on f32 values, as a float backend does */
static inline double rnd(dm_dtype dt, double v) { return dt == DM_F64 ? v : (double)(float)v; }

static inline void *at(const void *p, int64_t i, size_t es) { return (char *)p + i * (int64_t)es; }
static inline double sigmoid(double x) { return 1 / (1 + exp(-x)); }

static const int64_t *ix(const dm_tensor *t) { return dm_data(t); }

/* C[m, n] = op(A)[m, kk] op(B)[kk, n] + beta C, row-major */
static void gemm(dm_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t kk, const void *a, int64_t lda,
                 const void *b, int64_t ldb, double beta, void *c, int64_t ldc) {
  enum CBLAS_TRANSPOSE oa = ta ? CblasTrans : CblasNoTrans, ob = tb ? CblasTrans : CblasNoTrans;
  if (dt == DM_F64)
    cblas_dgemm(CblasRowMajor, oa, ob, (int)m, (int)n, (int)kk, 1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
  else
    cblas_sgemm(CblasRowMajor, oa, ob, (int)m, (int)n, (int)kk, 1.0f, a, (int)lda, b, (int)ldb, (float)beta, c,
                (int)ldc);
}

/* y += alpha x over n elements */
static void axpy(dm_dtype dt, int64_t n, double alpha, const void *x, void *y) {
  if (dt == DM_F64) cblas_daxpy((int)n, alpha, x, 1, y, 1);
  else cblas_saxpy((int)n, (float)alpha, x, 1, y, 1);
}

/* y = alpha x over n elements */
static void scale_copy(dm_dtype dt, int64_t n, double alpha, const void *x, void *y) {
  if (dt == DM_F64) {
    const double *a = x;
    double *b = y;
    for (int64_t i = 0; i < n; i++) b[i] = alpha * a[i];
  } else {
    const float *a = x;
    float *b = y, s = (float)alpha;
    for (int64_t i = 0; i < n; i++) b[i] = s * a[i];
  }
}

static double dot(dm_dtype dt, int64_t n, const void *x, const void *y) {
  return dt == DM_F64 ? cblas_ddot((int)n, x, 1, y, 1) : (double)cblas_sdot((int)n, x, 1, y, 1);
}

/* ---- routing ----------------------------------------------------------------------------------- */

/* the gate of logit l among the chosen is route_gate / S, S the sum of route_gate over them: sigmoid(l), or
** exp(l - top) for softmax, top the largest chosen logit */
static double route_gate(int form, double l, double top) {
  return form == DM_MOE_ROUTE_SOFTMAX ? exp(l - top) : sigmoid(l);
}

/* the largest logit of a row's k chosen experts (the row's logits from lg[base]) */
static double chosen_max(dm_dtype dt, const void *lg, int64_t base, const int64_t *row, int64_t k) {
  double top = ld(dt, lg, base + row[0]);
  for (int64_t j = 1; j < k; j++) top = fmax(top, ld(dt, lg, base + row[j]));
  return top;
}

static void cpu_route(dm_tensor *idx, dm_tensor *w, dm_tensor *counts, const dm_tensor *logits,
                      const dm_tensor *bias, int form) {
  dm_dtype dt = logits->dtype;
  int64_t n = logits->shape[0], e = logits->shape[1], k = idx->shape[1];
  const void *lg = dm_data(logits), *b = bias ? dm_data(bias) : NULL;
  int64_t *id = dm_data(idx), *cnt = dm_data(counts);
  void *gate = dm_data(w);
  double *sel = dm_xmalloc((sizeof(double) + sizeof(bool)) * (size_t)e);     /* one block, leak-free */
  bool *taken = (bool *)(sel + e);
  memset(cnt, 0, sizeof(int64_t) * (size_t)e);
  for (int64_t t = 0; t < n; t++) {
    for (int64_t x = 0; x < e; x++) {
      double l = ld(dt, lg, t * e + x), s = form == DM_MOE_ROUTE_SOFTMAX ? l : rnd(dt, sigmoid(l));
      sel[x] = b ? rnd(dt, s + ld(dt, b, x)) : s;
      taken[x] = false;
    }
    /* k passes of a max: strictly greater wins, so ties go to the lower id (NaN never wins) */
    for (int64_t j = 0; j < k; j++) {
      int64_t best = -1;
      for (int64_t x = 0; x < e; x++)
        if (!taken[x] && (best < 0 || sel[x] > sel[best])) best = x;
      taken[best] = true;
      id[t * k + j] = best;
      cnt[best]++;
    }
    double top = chosen_max(dt, lg, t * e, id + t * k, k), sum = 0;
    for (int64_t j = 0; j < k; j++) sum += route_gate(form, ld(dt, lg, t * e + id[t * k + j]), top);
    for (int64_t j = 0; j < k; j++)
      st(dt, gate, t * k + j, route_gate(form, ld(dt, lg, t * e + id[t * k + j]), top) / sum);
  }
  free(sel);
}

/* sigmoid: w_j = s_j / S, dL/ds_i = (gw_i - sum_j gw_j w_j) / S, then ds/dlogit = s (1 - s);
** softmax: dL/dlogit_i = w_i (gw_i - sum_j gw_j w_j) */
static void cpu_route_bwd(dm_tensor *glogits, const dm_tensor *gw, const dm_tensor *logits, const dm_tensor *idx,
                          int form) {
  dm_dtype dt = logits->dtype;
  int64_t n = logits->shape[0], e = logits->shape[1], k = idx->shape[1];
  const void *lg = dm_data(logits), *g = dm_data(gw);
  const int64_t *id = ix(idx);
  void *gl = dm_data(glogits);
  memset(gl, 0, dm_dtype_size(dt) * (size_t)(n * e));
  for (int64_t t = 0; t < n; t++) {
    const int64_t *row = id + t * k;
    double top = chosen_max(dt, lg, t * e, row, k), sum = 0, gdotw = 0;
    for (int64_t j = 0; j < k; j++) sum += route_gate(form, ld(dt, lg, t * e + row[j]), top);
    for (int64_t j = 0; j < k; j++)
      gdotw += ld(dt, g, t * k + j) * route_gate(form, ld(dt, lg, t * e + row[j]), top) / sum;
    for (int64_t j = 0; j < k; j++) {
      double l = ld(dt, lg, t * e + row[j]), wj = route_gate(form, l, top) / sum, gj = ld(dt, g, t * k + j) - gdotw;
      double s = sigmoid(l);
      st(dt, gl, t * e + row[j], form == DM_MOE_ROUTE_SOFTMAX ? wj * gj : gj / sum * s * (1 - s));
    }
  }
}

/* ---- the sort by expert ---------------------------------------------------------------------------- */

/* a stable counting sort: histogram, exclusive scan, then each assignment in order to its expert's next slot */
static void cpu_sort(dm_tensor *perm, dm_tensor *offsets, dm_tensor *inv, const dm_tensor *idx) {
  int64_t rows = dm_numel(idx), e = offsets->shape[0] - 1;
  const int64_t *id = ix(idx);
  int64_t *pm = dm_data(perm), *off = dm_data(offsets), *iv = dm_data(inv);
  int64_t *next = dm_xmalloc(sizeof(int64_t) * (size_t)e);
  memset(off, 0, sizeof(int64_t) * (size_t)(e + 1));
  for (int64_t a = 0; a < rows; a++) off[id[a] + 1]++;
  for (int64_t x = 0; x < e; x++) off[x + 1] += off[x];
  memcpy(next, off, sizeof(int64_t) * (size_t)e);
  for (int64_t a = 0; a < rows; a++) {
    int64_t p = next[id[a]]++;
    pm[p] = a;
    iv[a] = p;
  }
  free(next);
}

/* runs before the op makes anything contiguous: offsets may be a strided view */
static void cpu_check_offsets(const dm_tensor *offsets, int64_t rows, const char *what) {
  int64_t e = offsets->shape[0] - 1, s = offsets->strides[0];
  const int64_t *off = ix(offsets);
  for (int64_t x = 0; x < e; x++)
    if (off[(x + 1) * s] < off[x * s])
      dm_error("%s: offsets decrease at expert %lld (%lld then %lld); they must run from 0 up to N * k = %lld",
               what, (long long)x, (long long)off[x * s], (long long)off[(x + 1) * s], (long long)rows);
  if (off[0] != 0 || off[e * s] != rows)
    dm_error("%s: offsets run from %lld to %lld; they must run from 0 to N * k = %lld", what, (long long)off[0],
             (long long)off[e * s], (long long)rows);
}

static void cpu_invert(dm_tensor *inv, const dm_tensor *perm) {
  int64_t rows = dm_numel(perm);
  const int64_t *pm = ix(perm);
  int64_t *iv = dm_data(inv);
  for (int64_t p = 0; p < rows; p++) iv[pm[p]] = p;
}

/* ---- the experts ------------------------------------------------------------------------------------ */

typedef struct expert_job {
  dm_dtype dt;
  size_t es;
  int64_t k, d, r, f;
  const int64_t *perm, *off;
  const void *u, *ug, *uu, *cg, *cu, *dw;
  double *gc;                     /* scratch in one block: the backward's 2r sums (or none), */
  void *x, *ag, *au, *h;          /* rows [n, d], projections [n, r], activations [n, r] */
} expert_job;

static void job_init(expert_job *j, const dm_tensor *u, const dm_tensor *perm, const dm_tensor *offsets,
                     const dm_moe_bank *bank, int64_t k, bool backward) {
  j->dt = u->dtype;
  j->es = dm_dtype_size(u->dtype);
  j->k = k;
  j->d = u->shape[1];
  j->r = bank->ug->shape[2];
  j->f = bank->d->shape[2];
  j->perm = ix(perm);
  j->off = ix(offsets);
  j->u = dm_data(u);
  j->ug = dm_data(bank->ug);
  j->uu = dm_data(bank->uu);
  j->cg = dm_data(bank->cg);
  j->cu = dm_data(bank->cu);
  j->dw = dm_data(bank->d);
  int64_t e = offsets->shape[0] - 1, most = 0;
  for (int64_t x = 0; x < e; x++) if (j->off[x + 1] - j->off[x] > most) most = j->off[x + 1] - j->off[x];
  int64_t ngc = backward ? 2 * j->r : 0;
  j->gc = dm_xmalloc(sizeof(double) * (size_t)ngc + j->es * (size_t)(most * (j->d + 3 * j->r)));
  j->x = j->gc + ngc;
  j->ag = at(j->x, most * j->d, j->es);
  j->au = at(j->ag, most * j->r, j->es);
  j->h = at(j->au, most * j->r, j->es);
}

static void job_free(expert_job *j) { free(j->gc); }

/* expert e's n rows: gather its tokens' u into x and project: ag = x Ug[e], au = x Uu[e] */
static int64_t expert_project(expert_job *j, int64_t e) {
  int64_t lo = j->off[e], n = j->off[e + 1] - lo, d = j->d, r = j->r;
  if (n == 0) return 0;
  size_t row = j->es * (size_t)d;
  for (int64_t p = 0; p < n; p++) memcpy(at(j->x, p * d, j->es), at(j->u, (j->perm[lo + p] / j->k) * d, j->es), row);
  gemm(j->dt, false, false, n, r, d, j->x, d, at(j->ug, e * d * r, j->es), r, 0, j->ag, r);
  gemm(j->dt, false, false, n, r, d, j->x, d, at(j->uu, e * d * r, j->es), r, 0, j->au, r);
  return n;
}

/* h = silu(ag * cg[e]) * (au * cu[e]) over n rows */
static void expert_activate(expert_job *j, int64_t e, int64_t n) {
  dm_dtype dt = j->dt;
  int64_t r = j->r;
  for (int64_t p = 0; p < n; p++)
    for (int64_t i = 0; i < r; i++) {
      double zg = ld(dt, j->ag, p * r + i) * ld(dt, j->cg, e * r + i);
      double zu = ld(dt, j->au, p * r + i) * ld(dt, j->cu, e * r + i);
      st(dt, j->h, p * r + i, zg * sigmoid(zg) * zu);
    }
}

/* z_rows' rows of expert e (from sorted row lo on): [ag | au] in z's dtype */
static void expert_keep(expert_job *j, dm_tensor *z_rows, int64_t lo, int64_t n) {
  int64_t r = j->r;
  void *z = dm_data(z_rows);
  for (int64_t p = 0; p < n; p++)
    for (int64_t i = 0; i < r; i++) {
      st(z_rows->dtype, z, (lo + p) * 2 * r + i, ld(j->dt, j->ag, p * r + i));
      st(z_rows->dtype, z, (lo + p) * 2 * r + r + i, ld(j->dt, j->au, p * r + i));
    }
}

static void cpu_experts(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                        const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k) {
  expert_job j;
  job_init(&j, u, perm, offsets, bank, k, false);
  int64_t e = offsets->shape[0] - 1, r = j.r, f = j.f;
  for (int64_t x = 0; x < e; x++) {
    int64_t n = expert_project(&j, x);
    if (n == 0) continue;
    if (z_rows) expert_keep(&j, z_rows, j.off[x], n);
    expert_activate(&j, x, n);
    gemm(j.dt, false, false, n, f, r, j.h, r, at(j.dw, x * r * f, j.es), f, 0, at(dm_data(y_rows), j.off[x] * f, j.es),
         f);
  }
  job_free(&j);
}

/* Per expert, with G its rows of gy: dh = G D^T; dD = h^T G; through the
** activation to dzg, dzu; dcg = sum over rows of dzg * ag (and so for u);
** dag = dzg * cg; dUg = x^T dag; dx = dag Ug^T + dau Uu^T. dh is kept in
** h's buffer after dD has used h, dag and dau overwrite ag and au. */
static void cpu_experts_bwd(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows,
                            const dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                            const dm_tensor *offsets, const dm_moe_bank *bank, int64_t k) {
  (void)z_rows;   /* the rows are gathered for dUg and dUu anyway: the projections are recomputed */
  expert_job j;
  job_init(&j, u, perm, offsets, bank, k, true);
  dm_dtype dt = j.dt;
  int64_t e = offsets->shape[0] - 1, d = j.d, r = j.r, f = j.f;
  size_t es = j.es;
  double *gc = j.gc;
  for (int64_t x = 0; x < e; x++) {
    int64_t n = expert_project(&j, x);
    if (n == 0) {         /* no rows: the expert's weight gradients are zero */
      if (g->ug) memset(at(dm_data(g->ug), x * d * r, es), 0, es * (size_t)(d * r));
      if (g->uu) memset(at(dm_data(g->uu), x * d * r, es), 0, es * (size_t)(d * r));
      if (g->cg) memset(at(dm_data(g->cg), x * r, es), 0, es * (size_t)r);
      if (g->cu) memset(at(dm_data(g->cu), x * r, es), 0, es * (size_t)r);
      if (g->d) memset(at(dm_data(g->d), x * r * f, es), 0, es * (size_t)(r * f));
      continue;
    }
    const void *gy = at(dm_data(gy_rows), j.off[x] * f, es), *dx = at(j.dw, x * r * f, es);
    if (g->d) {
      expert_activate(&j, x, n);
      gemm(dt, true, false, r, f, n, j.h, r, gy, f, 0, at(dm_data(g->d), x * r * f, es), f);
    }
    gemm(dt, false, true, n, r, f, gy, f, dx, f, 0, j.h, r);           /* dh */
    for (int64_t i = 0; i < 2 * r; i++) gc[i] = 0;
    for (int64_t p = 0; p < n; p++)
      for (int64_t i = 0; i < r; i++) {
        double cg = ld(dt, j.cg, x * r + i), cu = ld(dt, j.cu, x * r + i);
        double ag = ld(dt, j.ag, p * r + i), au = ld(dt, j.au, p * r + i), dh = ld(dt, j.h, p * r + i);
        double zg = ag * cg, zu = au * cu, s = sigmoid(zg);
        double dzg = dh * zu * s * (1 + zg * (1 - s)), dzu = dh * zg * s;
        gc[i] += dzg * ag;
        gc[r + i] += dzu * au;
        st(dt, j.ag, p * r + i, dzg * cg);
        st(dt, j.au, p * r + i, dzu * cu);
      }
    for (int64_t i = 0; i < r; i++) {
      if (g->cg) st(dt, dm_data(g->cg), x * r + i, gc[i]);
      if (g->cu) st(dt, dm_data(g->cu), x * r + i, gc[r + i]);
    }
    if (g->ug) gemm(dt, true, false, d, r, n, j.x, d, j.ag, r, 0, at(dm_data(g->ug), x * d * r, es), r);
    if (g->uu) gemm(dt, true, false, d, r, n, j.x, d, j.au, r, 0, at(dm_data(g->uu), x * d * r, es), r);
    if (gx_rows) {
      void *gx = at(dm_data(gx_rows), j.off[x] * d, es);
      gemm(dt, false, true, n, d, r, j.ag, r, at(j.ug, x * d * r, es), r, 0, gx, d);
      gemm(dt, false, true, n, d, r, j.au, r, at(j.uu, x * d * r, es), r, 1, gx, d);
    }
  }
  job_free(&j);
}

/* ---- combine ---------------------------------------------------------------------------------------- */

static void cpu_combine(dm_tensor *y, const dm_tensor *rows, const dm_tensor *inv, const dm_tensor *w) {
  dm_dtype dt = y->dtype;
  size_t es = dm_dtype_size(dt);
  int64_t n = y->shape[0], f = y->shape[1], k = n ? dm_numel(inv) / n : 0;
  const int64_t *iv = ix(inv);
  const void *src = dm_data(rows), *gate = w ? dm_data(w) : NULL;
  void *out = dm_data(y);
  if (k == 0) memset(out, 0, es * (size_t)(n * f));
  for (int64_t t = 0; t < n; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t a = t * k + j;
      double s = gate ? ld(dt, gate, a) : 1.0;
      if (j == 0) scale_copy(dt, f, s, at(src, iv[a] * f, es), at(out, t * f, es));
      else axpy(dt, f, s, at(src, iv[a] * f, es), at(out, t * f, es));
    }
}

static void cpu_combine_bwd(dm_tensor *grows, dm_tensor *gw, const dm_tensor *gy, const dm_tensor *rows,
                            const dm_tensor *inv, const dm_tensor *w) {
  dm_dtype dt = gy->dtype;
  size_t es = dm_dtype_size(dt);
  int64_t n = w->shape[0], k = w->shape[1], f = gy->shape[1];
  const int64_t *iv = ix(inv);
  const void *g = dm_data(gy), *src = dm_data(rows), *gate = dm_data(w);
  for (int64_t a = 0; a < n * k; a++) {
    const void *gt = at(g, (a / k) * f, es);
    if (grows) scale_copy(dt, f, ld(dt, gate, a), gt, at(dm_data(grows), iv[a] * f, es));
    if (gw) st(dt, dm_data(gw), a, dot(dt, f, gt, at(src, iv[a] * f, es)));
  }
}

/* ---- capacity, counters, balancing ------------------------------------------------------------------- */

static void cpu_capacity(dm_tensor *out, dm_tensor *drops, const dm_tensor *w, const dm_tensor *idx,
                         const dm_tensor *inv, const dm_tensor *offsets, int64_t capacity) {
  dm_dtype dt = w->dtype;
  int64_t rows = dm_numel(w);
  const int64_t *id = ix(idx), *iv = ix(inv), *off = ix(offsets);
  int64_t *dr = drops ? dm_data(drops) : NULL;
  if (dr) memset(dr, 0, sizeof(int64_t) * (size_t)drops->shape[0]);
  for (int64_t a = 0; a < rows; a++) {
    bool keep = iv[a] - off[id[a]] < capacity;
    st(dt, dm_data(out), a, keep ? ld(dt, dm_data(w), a) : 0.0);
    if (dr && !keep) dr[id[a]]++;
  }
}

static void cpu_counters(dm_tensor *stats, const dm_tensor *counts) {
  int64_t e = counts->shape[0], total = 0, most = 0, dead = 0;
  const int64_t *c = ix(counts);
  for (int64_t x = 0; x < e; x++) {
    total += c[x];
    if (c[x] > most) most = c[x];
    dead += c[x] == 0;
  }
  double h = 0;
  for (int64_t x = 0; x < e && total > 0; x++)
    if (c[x] > 0) {
      double p = (double)c[x] / (double)total;
      h -= p * log(p);
    }
  double *s = dm_data(stats);
  s[0] = total > 0 ? (double)most / (double)total : 0;
  s[1] = h;
  s[2] = (double)dead;
}

static void cpu_balance(dm_tensor *bias, const dm_tensor *counts, double gamma) {
  dm_dtype dt = bias->dtype;
  int64_t e = counts->shape[0], total = 0;
  const int64_t *c = ix(counts);
  void *b = dm_data(bias);
  for (int64_t x = 0; x < e; x++) total += c[x];
  /* compare c * E with the total rather than c with the mean: exact in integers */
  for (int64_t x = 0; x < e; x++) {
    int64_t diff = total - c[x] * e;
    st(dt, b, x, ld(dt, b, x) + gamma * (double)((diff > 0) - (diff < 0)));
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(moe_route, cpu_route),
  DM_KERNEL_ENTRY(moe_route_bwd, cpu_route_bwd),
  DM_KERNEL_ENTRY(moe_sort, cpu_sort),
  DM_KERNEL_ENTRY(moe_check_offsets, cpu_check_offsets),
  DM_KERNEL_ENTRY(moe_invert, cpu_invert),
  DM_KERNEL_ENTRY(moe_experts, cpu_experts),
  DM_KERNEL_ENTRY(moe_experts_bwd, cpu_experts_bwd),
  DM_KERNEL_ENTRY(moe_combine, cpu_combine),
  DM_KERNEL_ENTRY(moe_combine_bwd, cpu_combine_bwd),
  DM_KERNEL_ENTRY(moe_capacity, cpu_capacity),
  DM_KERNEL_ENTRY(moe_counters, cpu_counters),
  DM_KERNEL_ENTRY(moe_balance, cpu_balance),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
