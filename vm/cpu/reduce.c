/*
** cpu/reduce.c — reductions along dims, softmax, and their backwards.
**
** Every kernel here walks the input's ("full") shape split into outer dims,
** which are kept, and inner dims, which are reduced. An operand is either
** full (the input, its gradient) or reduced: it has the full number of dims
** with size 1 on the reduced ones (the forward passes keepdim views), so it
** is read or written once per output position. Dims that every operand
** steps through as one are merged; the last inner dim is a "row", walked
** with one stride, and the output position and row number map to the row's
** first element in each operand through one helper, plan_at(). walk()
** hands the rows to a kernel's piece function, output by output or, in
** column mode (below), a block of outputs at a time.
**
** Accumulation is in double. Rows of f32 with unit stride (the last dim of
** a contiguous tensor: softmax over the classes of a [N, V] matrix) take the
** same code specialised for that case by inlining, and exp, max and argmax
** go four lanes at a time there.
**
** Kernels:
**   reduce(kind, out, idx, x, p, base): out and idx (either may be NULL) in
**     keepdim form; the reduced dims are those where they have size 1 and x
**     has not. idx receives the 0-based flat position within the reduced
**     dims (row-major) plus base. p is the norm's exponent.
**   reduce_bwd(kind, gx, g, y, idx, x, p, base): the input gradient from the
**     output gradient g (keepdim form); y, idx and x as the kind needs them.
**   softmax(y, x, dim, log), softmax_bwd(gx, g, y, dim, log).
*/
#include <math.h>
#include <string.h>
#include "ops/reduce.h"
#include "core/coalesce.h"
#include "vec.h"

#define MAXOPS 5

typedef struct plan {
  int nops, nouter, ninner;                     /* ninner >= 1 */
  int64_t oshape[DM_MAXDIM], ishape[DM_MAXDIM];
  int64_t ostr[MAXOPS][DM_MAXDIM], istr[MAXOPS][DM_MAXDIM];   /* in elements */
  int64_t n_outer, n_rows, rowlen;              /* rows per output position, row length */
  int64_t rs[MAXOPS];                           /* byte stride along a row */
  char *base[MAXOPS];                           /* NULL for an absent operand */
  size_t es[MAXOPS];
} plan;


/* full: the tensor whose shape is walked; mask: its reduced dims */
static void plan_init(plan *p, const dm_tensor *full, unsigned mask, int nops,
                      const dm_tensor *const *t) {
  memset(p, 0, sizeof *p);
  p->nops = nops;
  for (int d = 0; d < full->ndim; d++) {
    bool in = (mask >> d) & 1;
    int slot = in ? p->ninner++ : p->nouter++;
    (in ? p->ishape : p->oshape)[slot] = full->shape[d];
    for (int k = 0; k < nops; k++)
      (in ? p->istr : p->ostr)[k][slot] = (!t[k] || t[k]->shape[d] == 1) ? 0 : t[k]->strides[d];
  }
  p->nouter = dm_coalesce(p->nouter, p->oshape, nops, p->ostr);
  p->ninner = dm_coalesce(p->ninner, p->ishape, nops, p->istr);
  if (p->ninner == 0) { p->ninner = 1; p->ishape[0] = 1; }
  p->n_outer = 1;
  for (int d = 0; d < p->nouter; d++) p->n_outer *= p->oshape[d];
  p->n_rows = 1;
  for (int d = 0; d < p->ninner - 1; d++) p->n_rows *= p->ishape[d];
  p->rowlen = p->ishape[p->ninner - 1];
  for (int k = 0; k < nops; k++) {
    p->base[k] = t[k] ? (char *)dm_data(t[k]) : NULL;
    p->es[k] = t[k] ? dm_dtype_size(t[k]->dtype) : 0;
    p->rs[k] = p->istr[k][p->ninner - 1] * (int64_t)p->es[k];
  }
}

/* The first element of row `row` of output position `pos`, in every operand
** (reduced operands have stride 0 along the rows, so they get their one element). */
static void plan_at(const plan *p, int64_t pos, int64_t row, char **ptr) {
  int64_t off[MAXOPS] = {0};
  for (int d = p->nouter - 1; d >= 0; d--) {
    int64_t i = pos % p->oshape[d];
    pos /= p->oshape[d];
    for (int k = 0; k < p->nops; k++) off[k] += i * p->ostr[k][d];
  }
  for (int d = p->ninner - 2; d >= 0 && row; d--) {
    int64_t i = row % p->ishape[d];
    row /= p->ishape[d];
    for (int k = 0; k < p->nops; k++) off[k] += i * p->istr[k][d];
  }
  for (int k = 0; k < p->nops; k++)
    ptr[k] = p->base[k] ? p->base[k] + off[k] * (int64_t)p->es[k] : NULL;
}

/* the dims where a reduced operand has size 1 and the full one has not */
static unsigned reduced_mask(const dm_tensor *full, const dm_tensor *red) {
  unsigned mask = 0;
  for (int d = 0; d < full->ndim; d++)
    if (red->shape[d] == 1 && full->shape[d] != 1) mask |= 1u << d;
  return mask;
}

/* Column mode. When the last kept dim steps through the input more finely
** than the rows do (a reduction over leading dims: a bias gradient), taking
** one output at a time strides through memory, and power-of-two strides
** thrash the cache. A block of consecutive outputs ("lanes") then goes
** along together, each taking a few row elements (a piece) in turn, so the
** lines of those rows serve every lane before they leave the cache. In row
** mode a block is one output and a piece is a whole row. */
#define LANES 256
#define CHUNK 8

static int64_t lane_block(const plan *p, int64_t pos) {
  if (p->nouter == 0) return 1;
  int64_t ls = p->ostr[0][p->nouter - 1], rs = p->istr[0][p->ninner - 1];
  if ((ls < 0 ? -ls : ls) >= (rs < 0 ? -rs : rs)) return 1;
  int64_t len = p->oshape[p->nouter - 1], left = len - pos % len;
  return left < LANES ? left : LANES;
}

/* byte stride of operand k between lanes */
static int64_t lane_stride(const plan *p, int k) {
  return p->nouter ? p->ostr[k][p->nouter - 1] * (int64_t)p->es[k] : 0;
}

/* the first element of lane b (output pos + b) in every operand */
static void lane_at(const plan *p, int64_t pos, int64_t b, char **q) {
  plan_at(p, pos, 0, q);
  for (int k = 0; k < p->nops; k++) if (q[k]) q[k] += b * lane_stride(p, k);
}

/* fn(ud, lane, q, n, k0): q[k] is operand k's first element of a piece of n
** elements at reduced positions k0.. (reduced operands: the lane's element) */
typedef void (*piece_fn)(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0);

static void walk(const plan *p, int64_t pos, int64_t nb, piece_fn fn, void *ud) {
  int64_t chunk = nb > 1 ? CHUNK : p->rowlen, ls[MAXOPS];
  char *ptr[MAXOPS], *q[MAXOPS];
  for (int k = 0; k < p->nops; k++) ls[k] = lane_stride(p, k);
  for (int64_t row = 0; row < p->n_rows; row++) {
    plan_at(p, pos, row, ptr);
    for (int64_t j0 = 0; j0 < p->rowlen; j0 += chunk)
      for (int64_t b = 0; b < nb; b++) {
        for (int k = 0; k < p->nops; k++) q[k] = ptr[k] ? ptr[k] + b * ls[k] + j0 * p->rs[k] : NULL;
        fn(ud, b, q, p->rowlen - j0 < chunk ? p->rowlen - j0 : chunk, row * p->rowlen + j0);
      }
  }
}

/* ---- f32 rows four lanes at a time ----------------------------------------- */

/* the max of a row; NaN if the row holds one */
static float max_f32(const float *x, int64_t n) {
  v4f m[4] = {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}};
  m[1] = m[2] = m[3] = m[0];
  v4i nan = {0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)                 /* four chains hide the compare latency */
    for (int k = 0; k < 4; k++) {
      v4f v = load4(x + j + 4 * k);
      nan |= v != v;
      m[k] = sel(v > m[k], v, m[k]);
    }
  for (; j + 4 <= n; j += 4) {
    v4f v = load4(x + j);
    nan |= v != v;
    m[0] = sel(v > m[0], v, m[0]);
  }
  for (int k = 1; k < 4; k++) m[0] = sel(m[k] > m[0], m[k], m[0]);
  float r = fmaxf(fmaxf(m[0][0], m[0][1]), fmaxf(m[0][2], m[0][3]));
  for (; j < n; j++) { r = x[j] > r ? x[j] : r; nan[0] |= x[j] != x[j]; }
  return (nan[0] | nan[1] | nan[2] | nan[3]) ? NAN : r;
}

/* y[j] = exp(x[j] - shift) where y is given; returns the sum, in double
** across blocks of 64 (the float partial sums err by at most 16 ulps) */
static double expsum_f32(float *y, const float *x, int64_t n, float shift) {
  double total = 0;
  int64_t j = 0;
  while (j + 4 <= n) {
    v4f acc = {0, 0, 0, 0};
    int64_t end = j + 64 < n ? j + 64 : n;
    for (; j + 8 <= end; j += 8) {               /* two at once: the polynomial is a long chain */
      v4f e0 = exp4(load4(x + j) - shift), e1 = exp4(load4(x + j + 4) - shift);
      if (y) { store4(y + j, e0); store4(y + j + 4, e1); }
      acc += e0 + e1;
    }
    for (; j + 4 <= end; j += 4) {
      v4f e = exp4(load4(x + j) - shift);
      if (y) store4(y + j, e);
      acc += e;
    }
    total += (double)acc[0] + (double)acc[1] + (double)acc[2] + (double)acc[3];
  }
  for (; j < n; j++) {
    float e = exp1(x[j] - shift);
    if (y) y[j] = e;
    total += e;
  }
  return total;
}

/* exp for the other rows, at the element type's precision */
INLINE double ex(dm_dtype dt, double v) { return dt == DM_F32 ? (double)expf((float)v) : exp(v); }

/* ---- forward reductions ------------------------------------------------------ */

typedef struct acc {
  double s, m;            /* running sum (of exp(x - m) for logsumexp), running max */
  int64_t is;             /* integer sums are exact */
  int64_t i;              /* position of the best element so far, -1 before any */
  const char *best;       /* and its address, copied out as is */
} acc;

INLINE double sum_row_(dm_dtype dt, int64_t s, const char *x, int64_t n) {
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;        /* four chains hide the add latency */
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    a0 += ld(dt, x + j * s);
    a1 += ld(dt, x + (j + 1) * s);
    a2 += ld(dt, x + (j + 2) * s);
    a3 += ld(dt, x + (j + 3) * s);
  }
  for (; j < n; j++) a0 += ld(dt, x + j * s);
  return (a0 + a1) + (a2 + a3);
}

static int64_t isum_row(dm_dtype dt, int64_t s, const char *x, int64_t n) {
  int64_t a = 0;
  switch (dt) {
  case DM_I32: for (int64_t j = 0; j < n; j++) a += *(const int32_t *)(x + j * s); break;
  case DM_I64: for (int64_t j = 0; j < n; j++) a += *(const int64_t *)(x + j * s); break;
  case DM_U8: for (int64_t j = 0; j < n; j++) a += *(const uint8_t *)(x + j * s); break;
  default: break;
  }
  return a;
}

/* max (or min) with its first position: v replaces m if it is better; a NaN wins and stays */
INLINE bool better(double v, double m, bool max) { return (max ? v > m : v < m) || (v != v && m == m); }

INLINE void take(acc *a, double v, int64_t k, const char *p, bool max) {
  if (a->i < 0 || better(v, a->m, max)) { a->m = v; a->i = k; a->best = p; }
}

/* f32 rows: each lane keeps its best and position, then the lanes meet in
** position order, so ties still go to the first position */
static int64_t best_f32(acc *a, const float *x, int64_t n, int64_t k0, bool max) {
  if (n < 4) return 0;
  v4f m = load4(x);
  v4i pos = {0, 1, 2, 3}, cur = pos, nan = m != m;
  int64_t j = 4;
  for (; j + 4 <= n; j += 4) {
    v4f v = load4(x + j);
    v4i vnan = v != v;
    v4i win = (max ? v > m : v < m) | (vnan & ~nan);
    cur += 4;
    nan |= vnan;
    m = sel(win, v, m);
    pos = (win & cur) | (~win & pos);
  }
  int b = 0;
  for (int l = 1; l < 4; l++)
    if (better(m[l], m[b], max) || (!better(m[b], m[l], max) && pos[l] < pos[b])) b = l;
  take(a, m[b], k0 + pos[b], (const char *)(x + pos[b]), max);
  return j;
}

INLINE void best_row_(dm_dtype dt, int64_t s, acc *a, const char *x, int64_t n, int64_t k0, bool max) {
  int64_t j = dt == DM_F32 && s == 4 ? best_f32(a, (const float *)x, n, k0, max) : 0;
  for (; j < n; j++) take(a, ld(dt, x + j * s), k0 + j, x + j * s, max);
}

/* the max of a row, NaN if it holds one */
static double row_max(dm_dtype dt, int64_t s, const char *x, int64_t n) {
  if (dt == DM_F32 && s == 4) return max_f32((const float *)x, n);
  double m = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    double v = ld(dt, x + j * s);
    if (v > m) m = v;
    else if (v != v) return v;
  }
  return m;
}

/* sum of exp(x - m) over a row, storing each term in y (ys bytes apart) when y is given */
static double row_expsum(dm_dtype dt, int64_t s, const char *x, int64_t n, double m, char *y, int64_t ys) {
  if (dt == DM_F32 && s == 4 && (!y || ys == 4)) return expsum_f32((float *)y, (const float *)x, n, (float)m);
  double a = 0;
  for (int64_t j = 0; j < n; j++) {
    double e = ex(dt, ld(dt, x + j * s) - m);
    if (y) st(dt, y + j * ys, e);
    a += e;
  }
  return a;
}

/* logsumexp over rows one after another: the running sum is rescaled when the max grows */
static void lse_row(dm_dtype dt, int64_t s, acc *a, const char *x, int64_t n) {
  double rm = row_max(dt, s, x, n);
  double m = a->m;
  if (m == m && (rm > m || rm != rm)) m = rm;              /* a NaN stays */
  if (isfinite(m)) a->s = a->s * exp(a->m - m) + row_expsum(dt, s, x, n, m, NULL, 0);
  a->m = m;
}

INLINE double pow_row_(dm_dtype dt, int64_t s, const char *x, int64_t n, double p) {
  double a = 0;
  if (p == 2) for (int64_t j = 0; j < n; j++) { double v = ld(dt, x + j * s); a += v * v; }
  else if (p == 1) for (int64_t j = 0; j < n; j++) a += fabs(ld(dt, x + j * s));
  else for (int64_t j = 0; j < n; j++) a += pow(fabs(ld(dt, x + j * s)), p);
  return a;
}

static void acc_row(int kind, acc *a, dm_dtype dt, int64_t s, const char *x, int64_t n, int64_t k0,
                    double p) {
  switch (kind) {
  case R_SUM: case R_MEAN:
    if (dm_dtype_is_float(dt)) a->s += F32_UNIT_DISPATCH(sum_row_, dt, s, x, n);
    else a->is += isum_row(dt, s, x, n);
    break;
  case R_MAX: case R_ARGMAX: F32_UNIT_DISPATCH(best_row_, dt, s, a, x, n, k0, true); break;
  case R_MIN: case R_ARGMIN: F32_UNIT_DISPATCH(best_row_, dt, s, a, x, n, k0, false); break;
  case R_LOGSUMEXP: lse_row(dt, s, a, x, n); break;
  case R_NORM: a->s += F32_UNIT_DISPATCH(pow_row_, dt, s, x, n, p); break;
  }
}

static double acc_value(int kind, const acc *a, int64_t count, double p) {
  switch (kind) {
  case R_SUM: return a->s;
  case R_MEAN: return a->s / (double)count;             /* 0/0: NaN for an empty mean */
  case R_LOGSUMEXP: return isfinite(a->m) ? a->m + log(a->s) : a->m;
  case R_NORM: return p == 2 ? sqrt(a->s) : p == 1 ? a->s : pow(a->s, 1 / p);
  default: return a->m;
  }
}

INLINE void add_lanes_(dm_dtype dt, int64_t s, double *acc, const char *x, int64_t nb) {
  for (int64_t b = 0; b < nb; b++) acc[b] += ld(dt, x + b * s);
}

/* column mode: the sums of nb outputs from pos, stored (divided by count for a mean) */
static void sum_lanes(const plan *pl, int64_t pos, int64_t nb, dm_dtype dt, dm_dtype odt, double div) {
  double acc[LANES] = {0};
  int64_t ls = lane_stride(pl, 0);
  char *ptr[3];
  for (int64_t row = 0; row < pl->n_rows; row++) {
    plan_at(pl, pos, row, ptr);
    for (int64_t j = 0; j < pl->rowlen; j++) F32_UNIT_DISPATCH(add_lanes_, dt, ls, acc, ptr[0] + j * pl->rs[0], nb);
  }
  plan_at(pl, pos, 0, ptr);
  for (int64_t b = 0; b < nb; b++) st(odt, ptr[1] + b * lane_stride(pl, 1), acc[b] / div);
}

typedef struct reduce_ud { int kind; dm_dtype dt; int64_t rs; double p; acc a[LANES]; } reduce_ud;

static void reduce_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  reduce_ud *u = ud;
  acc_row(u->kind, &u->a[b], u->dt, u->rs, q[0], n, k0, u->p);
}

static void cpu_reduce(int kind, dm_tensor *out, dm_tensor *idx, const dm_tensor *x, double p,
                       int64_t base) {
  const dm_tensor *t[3] = {x, out, idx};
  plan pl;
  plan_init(&pl, x, reduced_mask(x, out ? out : idx), 3, t);
  int64_t count = pl.n_rows * pl.rowlen, nb;
  size_t es = dm_dtype_size(x->dtype);
  bool sum = (kind == R_SUM || kind == R_MEAN) && dm_dtype_is_float(x->dtype);
  reduce_ud u = {kind, x->dtype, pl.rs[0], p};
  for (int64_t pos = 0; pos < pl.n_outer; pos += nb) {
    nb = lane_block(&pl, pos);
    if (nb > 1 && sum) { sum_lanes(&pl, pos, nb, x->dtype, out->dtype, kind == R_MEAN ? (double)count : 1); continue; }
    for (int64_t b = 0; b < nb; b++) u.a[b] = (acc){0, kind == R_LOGSUMEXP ? -INFINITY : 0, 0, -1, NULL};
    walk(&pl, pos, nb, reduce_piece, &u);
    for (int64_t b = 0; b < nb; b++) {
      const acc *a = &u.a[b];
      char *q[3];
      lane_at(&pl, pos, b, q);
      if (q[2]) *(int64_t *)q[2] = a->i + base;
      if (!q[1]) continue;
      if (a->best && out->dtype == x->dtype) memcpy(q[1], a->best, es);   /* max, min: exact */
      else if (out->dtype == DM_I64 && !dm_dtype_is_float(x->dtype)) *(int64_t *)q[1] = a->is;
      else st(out->dtype, q[1], acc_value(kind, a, count, p));
    }
  }
}

/* ---- backward of the reductions --------------------------------------------- */

/* one row of the input gradient; g, y: the output's gradient and value; iv: the chosen position */
INLINE void grad_row_(dm_dtype dt, int64_t s, int kind, char *gx, const char *x, int64_t xs,
                      int64_t n, int64_t k0, double g, double y, int64_t iv, double p) {
  for (int64_t j = 0; j < n; j++) {
    double v = 0;
    switch (kind) {
    case R_SUM: case R_MEAN: v = g; break;              /* the mean's 1/n is folded into g */
    case R_MAX: case R_MIN: v = k0 + j == iv ? g : 0; break;
    case R_NORM: {
      /* d|x|_p/dx = sign(x) (|x| / y)^(p-1); zero at x = 0 and for a zero norm */
      double xv = ld(dt, x + j * xs), r = fabs(xv) / y;
      if (xv == 0 || y == 0) v = 0;
      else v = g * copysign(p == 1 ? 1 : p == 2 ? r : pow(r, p - 1), xv);
      break;
    }
    }
    st(dt, gx + j * s, v);
  }
}

INLINE void scale_row_(dm_dtype dt, int64_t s, char *y, int64_t n, double c) {
  for (int64_t j = 0; j < n; j++) st(dt, y + j * s, ld(dt, y + j * s) * c);
}

INLINE void set_lanes_(dm_dtype dt, int64_t s, char *gx, const double *v, int64_t nb) {
  for (int64_t b = 0; b < nb; b++) st(dt, gx + b * s, v[b]);
}

/* column mode for the backward of sums: nb outputs' gradients spread over their rows */
static void spread_lanes(const plan *pl, int64_t pos, int64_t nb, dm_dtype dt, dm_dtype gdt, double scale) {
  double v[LANES];
  int64_t ls = lane_stride(pl, 0);
  char *ptr[5];
  plan_at(pl, pos, 0, ptr);
  for (int64_t b = 0; b < nb; b++) v[b] = ld(gdt, ptr[2] + b * lane_stride(pl, 2)) * scale;
  for (int64_t row = 0; row < pl->n_rows; row++) {
    plan_at(pl, pos, row, ptr);
    for (int64_t j = 0; j < pl->rowlen; j++) F32_UNIT_DISPATCH(set_lanes_, dt, ls, ptr[0] + j * pl->rs[0], v, nb);
  }
}

typedef struct grad_ud {
  int kind; dm_dtype dt, gdt, ydt; const plan *pl; double scale, p; int64_t base;
} grad_ud;

/* q: gx, x, g, y, idx */
static void grad_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  const grad_ud *u = ud;
  const int64_t *rs = u->pl->rs;
  dm_dtype dt = u->dt;
  double gv = ld(u->gdt, q[2]) * u->scale, yv = q[3] ? ld(u->ydt, q[3]) : 0;
  int64_t iv = q[4] ? *(const int64_t *)q[4] - u->base : -1;
  bool fast = dt == DM_F32 && rs[0] == 4 && (!q[1] || rs[1] == 4);
  if (u->kind == R_LOGSUMEXP) {                         /* g exp(x - y) */
    row_expsum(dt, rs[1], q[1], n, yv, q[0], rs[0]);
    if (fast) scale_row_(DM_F32, 4, q[0], n, gv);
    else scale_row_(dt, rs[0], q[0], n, gv);
  }
  else if (fast) grad_row_(DM_F32, 4, u->kind, q[0], q[1], 4, n, k0, gv, yv, iv, u->p);
  else grad_row_(dt, rs[0], u->kind, q[0], q[1], rs[1], n, k0, gv, yv, iv, u->p);
}

static void cpu_reduce_bwd(int kind, dm_tensor *gx, const dm_tensor *g, const dm_tensor *y,
                           const dm_tensor *idx, const dm_tensor *x, double p, int64_t base) {
  const dm_tensor *t[5] = {gx, x, g, y, idx};
  plan pl;
  plan_init(&pl, gx, reduced_mask(gx, g), 5, t);
  double scale = kind == R_MEAN ? 1.0 / (double)(pl.n_rows * pl.rowlen) : 1.0;
  grad_ud u = {kind, gx->dtype, g->dtype, y ? y->dtype : gx->dtype, &pl, scale, p, base};
  int64_t nb;
  for (int64_t pos = 0; pos < pl.n_outer; pos += nb) {
    nb = lane_block(&pl, pos);
    if (nb > 1 && (kind == R_SUM || kind == R_MEAN)) spread_lanes(&pl, pos, nb, gx->dtype, g->dtype, scale);
    else walk(&pl, pos, nb, grad_piece, &u);
  }
}

/* ---- softmax ------------------------------------------------------------------- */

/* the last pass of softmax: y = x - shift (log) or y *= scale */
INLINE void softmax_finish_(dm_dtype dt, int64_t s, char *y, const char *x, int64_t xs, int64_t n,
                            bool lg, double shift, double scale) {
  for (int64_t j = 0; j < n; j++)
    st(dt, y + j * s, lg ? ld(dt, x + j * xs) - shift : ld(dt, y + j * s) * scale);
}

/* softmax in three passes over each lane's row: its max m, the sum s of
** exp(x - m) (stored in y for softmax), then y = exp(x - m) / s or x - m - log(s) */
typedef struct softmax_ud { const plan *pl; dm_dtype dt; bool lg; double m[LANES], s[LANES]; } softmax_ud;

/* q: y, x (forward) or gx, g, y (backward) */
static void max_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  softmax_ud *u = ud;
  double rm = row_max(u->dt, u->pl->rs[1], q[1], n), m = u->m[b];
  if (m == m && (rm > m || rm != rm)) u->m[b] = rm;          /* a NaN stays */
}

static void expsum_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  softmax_ud *u = ud;
  u->s[b] += row_expsum(u->dt, u->pl->rs[1], q[1], n, u->m[b], u->lg ? NULL : q[0], u->pl->rs[0]);
}

static void finish_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  softmax_ud *u = ud;
  const int64_t *rs = u->pl->rs;
  double shift = u->m[b] + log(u->s[b]), scale = 1 / u->s[b];
  if (u->dt == DM_F32 && rs[0] == 4 && rs[1] == 4) softmax_finish_(DM_F32, 4, q[0], q[1], 4, n, u->lg, shift, scale);
  else softmax_finish_(u->dt, rs[0], q[0], q[1], rs[1], n, u->lg, shift, scale);
}

static unsigned dim_mask(const dm_tensor *t, int dim) { return t->ndim ? 1u << dim : 0; }

static void cpu_softmax(dm_tensor *y, const dm_tensor *x, int dim, int lg) {
  const dm_tensor *t[2] = {y, x};
  plan pl;
  plan_init(&pl, x, dim_mask(x, dim), 2, t);
  softmax_ud u = {&pl, y->dtype, lg};
  int64_t nb;
  for (int64_t pos = 0; pos < pl.n_outer; pos += nb) {
    nb = lane_block(&pl, pos);
    for (int64_t b = 0; b < nb; b++) { u.m[b] = -INFINITY; u.s[b] = 0; }
    walk(&pl, pos, nb, max_piece, &u);
    walk(&pl, pos, nb, expsum_piece, &u);
    walk(&pl, pos, nb, finish_piece, &u);
  }
}

/* softmax: gx = y (g - sum(g y)); log_softmax: gx = g - exp(y) sum(g), exp(y) first put in gx */
INLINE double dot_term_(dm_dtype dt, int64_t gs, const char *g, const char *y, int64_t ys, int64_t j, bool lg) {
  return lg ? ld(dt, g + j * gs) : ld(dt, g + j * gs) * ld(dt, y + j * ys);
}

INLINE double softmax_dot_(dm_dtype dt, int64_t gs, const char *g, const char *y, int64_t ys, int64_t n, bool lg) {
  double d0 = 0, d1 = 0, d2 = 0, d3 = 0;        /* four chains hide the add latency */
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    d0 += dot_term_(dt, gs, g, y, ys, j, lg);
    d1 += dot_term_(dt, gs, g, y, ys, j + 1, lg);
    d2 += dot_term_(dt, gs, g, y, ys, j + 2, lg);
    d3 += dot_term_(dt, gs, g, y, ys, j + 3, lg);
  }
  for (; j < n; j++) d0 += dot_term_(dt, gs, g, y, ys, j, lg);
  return (d0 + d1) + (d2 + d3);
}

INLINE void softmax_grad_(dm_dtype dt, int64_t s, char *gx, const char *g, int64_t gs, const char *y,
                          int64_t ys, int64_t n, bool lg, double dot) {
  for (int64_t j = 0; j < n; j++) {
    double gv = ld(dt, g + j * gs);
    st(dt, gx + j * s, lg ? gv - ld(dt, gx + j * s) * dot : ld(dt, y + j * ys) * (gv - dot));
  }
}

/* two passes: the dot of each lane's row (kept in softmax_ud's s), then the gradient */
static void dot_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  softmax_ud *u = ud;
  const int64_t *rs = u->pl->rs;
  bool fast = u->dt == DM_F32 && rs[1] == 4 && rs[2] == 4;
  if (fast) u->s[b] += u->lg ? softmax_dot_(DM_F32, 4, q[1], q[2], 4, n, true)
                             : softmax_dot_(DM_F32, 4, q[1], q[2], 4, n, false);
  else u->s[b] += softmax_dot_(u->dt, rs[1], q[1], q[2], rs[2], n, u->lg);
}

static void softmax_grad_piece(void *ud, int64_t b, char *const *q, int64_t n, int64_t k0) {
  softmax_ud *u = ud;
  const int64_t *rs = u->pl->rs;
  dm_dtype dt = u->dt;
  bool fast = dt == DM_F32 && rs[0] == 4 && rs[1] == 4 && rs[2] == 4;
  if (u->lg) row_expsum(dt, rs[2], q[2], n, 0, q[0], rs[0]);
  if (fast && u->lg) softmax_grad_(DM_F32, 4, q[0], q[1], 4, q[2], 4, n, true, u->s[b]);
  else if (fast) softmax_grad_(DM_F32, 4, q[0], q[1], 4, q[2], 4, n, false, u->s[b]);
  else softmax_grad_(dt, rs[0], q[0], q[1], rs[1], q[2], rs[2], n, u->lg, u->s[b]);
}

static void cpu_softmax_bwd(dm_tensor *gx, const dm_tensor *g, const dm_tensor *y, int dim, int lg) {
  const dm_tensor *t[3] = {gx, g, y};
  plan pl;
  plan_init(&pl, gx, dim_mask(gx, dim), 3, t);
  softmax_ud u = {&pl, gx->dtype, lg};
  int64_t nb;
  for (int64_t pos = 0; pos < pl.n_outer; pos += nb) {
    nb = lane_block(&pl, pos);
    for (int64_t b = 0; b < nb; b++) u.s[b] = 0;
    walk(&pl, pos, nb, dot_piece, &u);
    walk(&pl, pos, nb, softmax_grad_piece, &u);
  }
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(reduce, cpu_reduce),
  DM_KERNEL_ENTRY(reduce_bwd, cpu_reduce_bwd),
  DM_KERNEL_ENTRY(softmax, cpu_softmax),
  DM_KERNEL_ENTRY(softmax_bwd, cpu_softmax_bwd),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
