/*
** vm/ops/engram.c — the Engram family (engram.h has the layout and the
** arithmetic): the table layout, and the ops
**   engram_index(x, prefix?)         attrs heads, rows; list = orders → idx [B, T, nsub] i64
**   engram_unique(idx)               attr bound (optional)  → rows [U], inverse, counts [U]
**   engram_sparse_grad(g, inverse)   attr n_unique           → [n_unique, de]
**   engram_alpha(u, kx, w?)          attr eps                → alpha [...]
** and the sparse Adam step dm_engram_adam (in place, not an op).
**
** engram_index takes the layout as the three numbers it is built from and
** rebuilds it (microseconds), so the op needs no state. Its indices are
** values (rows of the physical table, from 0), like embedding ids: they go
** to the "embedding" op with base 0, and gather and backward stay that op's.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/engram.h"
#include "ops/index.h"

/* ---- the layout ---------------------------------------------------------------------------------- */

static uint64_t mulmod(uint64_t a, uint64_t b, uint64_t m) { return (uint64_t)((unsigned __int128)a * b % m); }

static uint64_t powmod(uint64_t a, uint64_t e, uint64_t m) {
  uint64_t r = 1;
  for (a %= m; e; e >>= 1, a = mulmod(a, a, m))
    if (e & 1) r = mulmod(r, a, m);
  return r;
}

/* Miller–Rabin with the first twelve primes as bases: exact for every n < 3.3e24 */
static bool is_prime(uint64_t n) {
  static const uint64_t bases[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  if (n < 2) return false;
  for (int i = 0; i < 12; i++) {
    if (n == bases[i]) return true;
    if (n % bases[i] == 0) return false;
  }
  uint64_t d = n - 1;
  int r = 0;
  while (!(d & 1)) { d >>= 1; r++; }
  for (int i = 0; i < 12; i++) {
    uint64_t x = powmod(bases[i], d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int k = 1; k < r && composite; k++) {
      x = mulmod(x, x, n);
      composite = x != n - 1;
    }
    if (composite) return false;
  }
  return true;
}

int64_t dm_engram_prev_prime(int64_t n) {
  for (int64_t k = n; k >= 2; k--)
    if (is_prime((uint64_t)k)) return k;
  return 0;
}

void dm_engram_layout_make(dm_engram_layout *L, int norders, const int64_t *orders, int64_t heads,
                           int64_t rows) {
  if (norders < 1 || norders > DM_ENGRAM_MAXORDER)
    dm_error("engram layout: 1 to %d orders, got %d", DM_ENGRAM_MAXORDER, norders);
  for (int i = 0; i < norders; i++) {
    if (orders[i] < 1 || orders[i] > DM_ENGRAM_MAXORDER)
      dm_error("engram layout: order %lld is outside 1..%d", (long long)orders[i], DM_ENGRAM_MAXORDER);
    if (i > 0 && orders[i] <= orders[i - 1])
      dm_error("engram layout: orders must increase, got %lld after %lld", (long long)orders[i],
               (long long)orders[i - 1]);
  }
  if (heads < 1 || heads * norders > DM_ENGRAM_MAXSUB)
    dm_error("engram layout: %lld heads for %d orders (at most %d sub-tables)", (long long)heads, norders,
             DM_ENGRAM_MAXSUB);
  if (rows < 2) dm_error("engram layout: rows per order must be at least 2, got %lld", (long long)rows);
  memset(L, 0, sizeof *L);
  static const uint64_t mult[DM_ENGRAM_MAXORDER] = DM_ENGRAM_MULTIPLIERS;
  memcpy(L->mult, mult, sizeof mult);
  L->norders = norders;
  L->heads = (int32_t)heads;
  L->rows = rows;
  int64_t next_prime_below = rows;       /* each hashed sub-table takes the largest prime left */
  for (int i = 0; i < norders; i++) {
    int n = (int)orders[i];
    L->orders[i] = n;
    if (n > L->max_order) L->max_order = n;
    bool direct = n * 8 < 63 && (int64_t)1 << (8 * n) <= rows;
    for (int k = 0; k < heads; k++) {
      dm_engram_sub *s = &L->sub[L->nsub++];
      s->order = n;
      s->head = k;
      s->direct = direct;
      s->offset = L->total_rows;
      if (direct) s->size = (int64_t)1 << (8 * n);
      else {
        s->size = dm_engram_prev_prime(next_prime_below);
        if (s->size == 0)
          dm_error("engram layout: not enough primes <= %lld for the hashed sub-tables (raise rows)",
                   (long long)rows);
        next_prime_below = s->size - 1;
      }
      L->total_rows += s->size;
    }
  }
}

/* the layout an engram_index call names in its attributes */
static void layout_of_attrs(const dm_attrs *a, dm_engram_layout *L) {
  if (a->nv < 2 || a->nlist < 1)
    dm_error("engram_index: needs the attributes {heads, rows, list = orders}");
  if (a->v[0] != (double)(int64_t)a->v[0] || a->v[1] != (double)(int64_t)a->v[1])
    dm_error("engram_index: heads and rows must be integers, got %g and %g", a->v[0], a->v[1]);
  dm_engram_layout_make(L, a->nlist, a->list, (int64_t)a->v[0], (int64_t)a->v[1]);
}

/* ---- checks ----------------------------------------------------------------------------------- */

static void check_byte_tensor(const char *what, const char *name, const dm_tensor *t) {
  char s[128];
  if (t->dtype != DM_U8 && t->dtype != DM_I32 && t->dtype != DM_I64)
    dm_error("%s: %s must hold bytes as u8, i32 or i64, got %s", what, name, dm_dtype_name(t->dtype));
  if (t->ndim != 2)
    dm_error("%s: %s must be 2-D [B, T], got shape %s", what, name, dm_tensor_shape_str(t, s, sizeof s));
  if (t->dtype != DM_U8)      /* byte values 0..255 */
    DM_RUN(index_check, t->device, t, 256, 0, what);
}

static void check_index_dtype(const char *what, const dm_tensor *t) {
  if (t->dtype != DM_I64 && t->dtype != DM_I32)
    dm_error("%s: indices must be i64 or i32, got %s", what, dm_dtype_name(t->dtype));
}

/* a contiguous i64 version of an index tensor */
static dm_tensor *as_i64(dm_tensor *t) {
  return t->dtype == DM_I64 ? dm_contiguous(t) : dm_cast(t, DM_I64);
}

/* ---- engram_index ------------------------------------------------------------------------------ */

static void index_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0], *prefix = c->in[1];
  dm_engram_layout L;
  layout_of_attrs(&c->a, &L);
  check_byte_tensor("engram_index", "x", x);
  if (prefix) {
    check_byte_tensor("engram_index", "prefix", prefix);
    if (prefix->shape[0] != x->shape[0]) {
      char sx[128], sp[128];
      dm_error("engram_index: x of shape %s and prefix of shape %s have different batch sizes",
               dm_tensor_shape_str(x, sx, sizeof sx), dm_tensor_shape_str(prefix, sp, sizeof sp));
    }
  }
  int64_t shape[3] = {x->shape[0], x->shape[1], L.nsub};
  dm_tensor *idx = dm_tensor_new(x->device, DM_I64, 3, shape);
  dm_tensor *xc = dm_contiguous(x), *pc = prefix ? dm_contiguous(prefix) : NULL;
  DM_RUN(engram_index, x->device, idx, xc, pc, &L);
  dm_release(xc);
  dm_release(pc);
  c->out[0] = idx;
}

dm_tensor *dm_engram_index(dm_tensor *x, dm_tensor *prefix, const dm_engram_layout *L) {
  dm_attrs a = dm_attrs_of(2, (double[]){L->heads, (double)L->rows});
  a.nlist = L->norders;
  for (int i = 0; i < L->norders; i++) a.list[i] = L->orders[i];
  dm_tensor *in[2] = {x, prefix}, *out;
  dm_call(dm_op_get("engram_index"), 2, in, &a, &out);
  return out;
}

/* ---- engram_unique ---------------------------------------------------------------------------- */

/* the first n elements of a 1-D tensor, as a view */
static dm_tensor *head_view(dm_tensor *t, int64_t n) {
  int64_t stride = 1;
  return dm_tensor_view(t, 1, &n, &stride, t->offset);
}

/* attrs: bound (optional, > 0), padded (1: the static form, engram.h) */
static void unique_fwd(dm_ctx *c) {
  dm_tensor *idx = c->in[0];
  check_index_dtype("engram_unique", idx);
  int64_t bound = dm_attr(c, 0) > 0 ? (int64_t)dm_attr(c, 0) : (int64_t)1 << 62;   /* 0: no bound */
  bool padded = dm_attr(c, 1) != 0;
  DM_RUN(index_check, idx->device, idx, bound, 0, "engram_unique");
  int64_t M = dm_numel(idx), one = 1;
  dm_tensor *ic = as_i64(idx);
  dm_tensor *rows = dm_tensor_new(idx->device, DM_I64, 1, &M), *counts = dm_tensor_new(idx->device, DM_I64, 1, &M);
  dm_tensor *inverse = dm_tensor_new(idx->device, DM_I64, idx->ndim, idx->shape);
  dm_tensor *nu = dm_tensor_new(idx->device, DM_I64, 1, &one);
  if (padded) {                         /* the tail past U: row 0, count 0 */
    dm_fill(rows, 0.0);
    dm_fill(counts, 0.0);
  }
  if (dm_plan_card_of(idx->device))
    dm_plan_scratch(dm_engram_unique_scratch(M), "engram_unique sort (kernels/engram.cu cuda_engram_unique)");
  DM_RUN(engram_unique, idx->device, rows, inverse, counts, nu, ic);
  int64_t U = M;                        /* on the meta device, or padded: as if every row were distinct */
  if (!padded && nu->device != DM_META) {
    dm_tensor *nu_host = nu->device == DM_CPU ? (dm_retain(nu), nu) : dm_to_device(nu, DM_CPU);
    U = *(int64_t *)dm_data(nu_host);
    dm_release(nu_host);
  }
  c->out[0] = head_view(rows, U);
  c->out[1] = inverse;
  c->out[2] = head_view(counts, U);
  c->out[3] = nu;
  dm_release(rows);
  dm_release(counts);
  dm_release(ic);
}

void dm_engram_unique(dm_tensor *idx, dm_tensor **rows, dm_tensor **inverse, dm_tensor **counts) {
  dm_tensor *out[4];
  dm_call(dm_op_get("engram_unique"), 1, &idx, NULL, out);
  *rows = out[0];
  *inverse = out[1];
  *counts = out[2];
  dm_release(out[3]);
}

void dm_engram_unique_padded(dm_tensor *idx, dm_tensor **rows, dm_tensor **inverse, dm_tensor **counts,
                             dm_tensor **n_unique) {
  dm_tensor *out[4];
  dm_attrs a = dm_attrs_of(2, (double[]){0, 1});
  dm_call(dm_op_get("engram_unique"), 1, &idx, &a, out);
  *rows = out[0];
  *inverse = out[1];
  *counts = out[2];
  *n_unique = out[3];
}

/* ---- engram_sparse_grad --------------------------------------------------------------------------- */

static void sparse_grad_fwd(dm_ctx *c) {
  dm_tensor *g = c->in[0], *inverse = c->in[1];
  char sg[128], si[128];
  dm_check_float("engram_sparse_grad", "the input", g);
  check_index_dtype("engram_sparse_grad", inverse);
  if (g->ndim != 2)
    dm_error("engram_sparse_grad: the gradients must be 2-D [M, de], got shape %s",
             dm_tensor_shape_str(g, sg, sizeof sg));
  if (dm_numel(inverse) != g->shape[0])
    dm_error("engram_sparse_grad: gradients of shape %s need %lld inverse entries, got shape %s",
             dm_tensor_shape_str(g, sg, sizeof sg), (long long)g->shape[0],
             dm_tensor_shape_str(inverse, si, sizeof si));
  double nd = dm_attr(c, 0);
  if (nd < 0 || nd != (double)(int64_t)nd)
    dm_error("engram_sparse_grad: the attribute n_unique must be an integer >= 0, got %g", nd);
  int64_t U = (int64_t)nd;
  DM_RUN(index_check, inverse->device, inverse, U, 0, "engram_sparse_grad");
  int64_t shape[2] = {U, g->shape[1]};
  dm_tensor *out = dm_tensor_new(g->device, g->dtype, 2, shape);
  dm_tensor *gc = dm_contiguous(g), *ic = as_i64(inverse);
  int64_t M = g->shape[0];
  dm_tensor *flat = dm_reshape(ic, 1, &M);
  if (dm_plan_card_of(g->device))
    dm_plan_scratch(dm_engram_sparse_grad_scratch(M, U, g->shape[1]),
                    "engram_sparse_grad sort (kernels/engram.cu cuda_engram_sparse_grad)");
  DM_RUN(engram_sparse_grad, g->device, out, gc, flat);
  dm_save(c, flat);
  dm_release(flat);
  dm_release(ic);
  dm_release(gc);
  c->out[0] = out;
}

/* each lookup's gradient is its unique row's: the embedding lookup of gout */
static void sparse_grad_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *in[2] = {gout[0], dm_saved(c, 0)};
  dm_attrs a = dm_attrs_of(1, (double[]){0});
  gin[0] = dm_call1("embedding", 2, in, &a);
}

dm_tensor *dm_engram_sparse_grad(dm_tensor *g, dm_tensor *inverse, int64_t n_unique) {
  dm_tensor *in[2] = {g, inverse};
  dm_attrs a = dm_attrs_of(1, (double[]){(double)n_unique});
  return dm_call1("engram_sparse_grad", 2, in, &a);
}

/* ---- engram_alpha ---------------------------------------------------------------------------------- */

static double attr_eps(const dm_ctx *c) { return dm_attr(c, 0); }

static void alpha_fwd(dm_ctx *c) {
  dm_tensor *u = c->in[0], *kx = c->in[1], *w = c->in[2];
  char su[128], sw[128];
  dm_check_float("engram_alpha", "the input", u);
  dm_check_dtype_equal("engram_alpha", u, kx);
  dm_check_shape_equal("engram_alpha", u, kx);
  if (u->ndim == 0 || u->shape[u->ndim - 1] == 0)
    dm_error("engram_alpha: u and kx need a last dim of size >= 1, got shape %s",
             dm_tensor_shape_str(u, su, sizeof su));
  if (w) {
    dm_check_dtype_equal("engram_alpha", u, w);
    if (w->ndim != 1 || w->shape[0] != u->shape[u->ndim - 1])
      dm_error("engram_alpha: the gain must be [d] for u of shape %s, got shape %s",
               dm_tensor_shape_str(u, su, sizeof su), dm_tensor_shape_str(w, sw, sizeof sw));
  }
  double eps = attr_eps(c);
  if (!(eps >= 0)) dm_error("engram_alpha: eps must be >= 0, got %g", eps);
  dm_tensor *alpha = dm_tensor_new(u->device, u->dtype, u->ndim - 1, u->shape);
  dm_tensor *uc = dm_contiguous(u), *kc = dm_contiguous(kx), *wc = w ? dm_contiguous(w) : NULL;
  DM_RUN(engram_alpha, u->device, alpha, uc, kc, wc, eps);
  dm_save(c, uc);
  dm_save(c, kc);
  if (wc) dm_save(c, wc);
  dm_release(uc);
  dm_release(kc);
  dm_release(wc);
  c->out[0] = alpha;
}

/* one pass: the kernel recomputes each token's norms and writes the gradients it is asked for */
static void alpha_bwd(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  bool has_w = dm_in_ndim(c, 2) == 1;           /* an absent optional input has no dims */
  dm_tensor *u = dm_saved(c, 0), *kx = dm_saved(c, 1), *w = has_w ? dm_saved(c, 2) : NULL;
  dm_tensor *gu = dm_needs_grad(c, 0) ? dm_tensor_like(u) : NULL;
  dm_tensor *gk = dm_needs_grad(c, 1) ? dm_tensor_like(kx) : NULL;
  dm_tensor *gw = has_w && dm_needs_grad(c, 2) ? dm_tensor_like(w) : NULL;
  dm_tensor *g = dm_contiguous(gout[0]);
  const dm_plan_card *card = dm_plan_card_of(g->device);
  if (card && gw)
    dm_plan_scratch(dm_engram_alpha_bwd_scratch(dm_numel(g), u->shape[u->ndim - 1], u->dtype == DM_F64 ? 8 : 4,
                                                card->sm_count),
                    "engram_alpha w's partial sums (kernels/engram.cu cuda_engram_alpha_bwd)");
  DM_RUN(engram_alpha_bwd, g->device, gu, gk, gw, g, u, kx, w, attr_eps(c));
  dm_release(g);
  gin[0] = gu;
  gin[1] = gk;
  gin[2] = gw;
}

dm_tensor *dm_engram_alpha(dm_tensor *u, dm_tensor *kx, dm_tensor *w, double eps) {
  dm_tensor *in[3] = {u, kx, w};
  dm_attrs a = dm_attrs_of(1, &eps);
  return dm_call1("engram_alpha", 3, in, &a);
}

/* ---- sparse Adam ------------------------------------------------------------------------------------ */

dm_engram_adam_hp dm_engram_adam_prepare(double lr, double beta1, double beta2, double eps, int64_t step) {
  if (step < 1) dm_error("engram_adam: the step counts from 1, got %lld", (long long)step);
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1))
    dm_error("engram_adam: betas must lie in [0, 1), got %g and %g", beta1, beta2);
  if (!(eps > 0) || !(lr >= 0)) dm_error("engram_adam: needs lr >= 0 and eps > 0, got %g and %g", lr, eps);
  dm_engram_adam_hp hp = {lr, beta1, beta2, eps, 0, 0};
  hp.step_size = lr / (1 - pow(beta1, (double)step));
  hp.rbc2 = 1 / sqrt(1 - pow(beta2, (double)step));
  return hp;
}

/* the table and its f32 or f64 moments (nstate tensors in all), the row list and the gradients of an
** update of n rows */
static void check_adam(const char *what, dm_tensor *const *state, int nstate, const dm_tensor *rows,
                       const dm_tensor *grads, int64_t n) {
  char s1[128], s2[128];
  const dm_tensor *table = state[0];
  for (int i = 0; i < nstate; i++) {
    dm_check_live(state[i]);
    if (state[i]->requires_grad && dm_grad_enabled())
      dm_error("%s: in-place update of a tensor that requires grad; wrap it in dm.no_grad", what);
    if (!dm_is_contiguous(state[i])) dm_error("%s: the table and its moments must be contiguous", what);
    if (i > 0) {
      dm_check_shape_equal(what, table, state[i]);
      dm_check_dtype_equal(what, table, state[i]);
      dm_check_device_equal(what, table, state[i]);
    }
  }
  dm_check_live(rows);
  dm_check_live(grads);
  if (table->ndim != 2)
    dm_error("%s: the table must be 2-D [R, de], got shape %s", what, dm_tensor_shape_str(table, s1, sizeof s1));
  if (table->dtype != DM_F32 && table->dtype != DM_F64)
    dm_error("%s: the table must be f32 or f64, got %s", what, dm_dtype_name(table->dtype));
  dm_check_dtype_equal(what, table, grads);
  dm_check_device_equal(what, table, grads);
  dm_check_device_equal(what, table, rows);
  if (rows->dtype != DM_I64 || rows->ndim != 1 || !dm_is_contiguous(rows))
    dm_error("%s: rows must be a contiguous 1-D i64 tensor, got %s of shape %s", what, dm_dtype_name(rows->dtype),
             dm_tensor_shape_str(rows, s1, sizeof s1));
  if (grads->ndim != 2 || grads->shape[1] != table->shape[1] || !dm_is_contiguous(grads))
    dm_error("%s: gradients of shape %s do not fit a table of shape %s (contiguous [n, de])", what,
             dm_tensor_shape_str(grads, s1, sizeof s1), dm_tensor_shape_str(table, s2, sizeof s2));
  if (n < 0 || n > rows->shape[0] || n > grads->shape[0])
    dm_error("%s: %lld rows asked for, with %lld rows and %lld gradient rows given", what, (long long)n,
             (long long)rows->shape[0], (long long)grads->shape[0]);
}

void dm_engram_adam(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                    const dm_tensor *grads, int64_t n, double lr, double beta1, double beta2, double eps,
                    int64_t step) {
  dm_tensor *state[3] = {table, m, v};
  check_adam("engram_adam", state, 3, rows, grads, n);
  dm_engram_adam_hp hp = dm_engram_adam_prepare(lr, beta1, beta2, eps, step);
  if (dm_plan_card_of(table->device))
    dm_plan_scratch(dm_engram_adam_scratch(n), "engram_adam's flag and constants (kernels/engram.cu engram_adam_run)");
  DM_RUN(engram_adam, table->device, table, m, v, rows, grads, n, &hp);
  for (int i = 0; i < 3; i++) dm_mark_written(state[i]);
}

/* the at forms' scalars, one element each on the table's device; returns the row list's bound */
static int64_t check_at(const char *what, const dm_tensor *table, const dm_tensor *rows, const dm_tensor *grads,
                        const dm_tensor *n_at, const dm_tensor *lr_at, const dm_tensor *step_at,
                        const dm_tensor *sumsq_at) {
  dm_check_live(table);
  if (n_at) dm_check_scalar(what, "n_at", n_at, DM_I64, table->device);
  dm_check_scalar(what, "lr_at", lr_at, DM_F64, table->device);
  dm_check_scalar(what, "step_at", step_at, DM_I64, table->device);
  if (sumsq_at) dm_check_scalar(what, "sumsq_at", sumsq_at, DM_F64, table->device);
  return rows->shape[0] < grads->shape[0] ? rows->shape[0] : grads->shape[0];
}

/* on the CPU the scalars are read at once: false for a step the firewall skips, else *n the rows */
static bool cpu_at(const char *what, const dm_tensor *n_at, const dm_tensor *sumsq_at, int64_t cap, int64_t *n) {
  if (sumsq_at && !isfinite(*(const double *)dm_data(sumsq_at))) return false;
  *n = n_at ? *(const int64_t *)dm_data(n_at) : cap;
  if (*n < 0 || *n > cap) dm_error("%s: n_at holds %lld, outside 0..%lld", what, (long long)*n, (long long)cap);
  return true;
}

void dm_engram_adam_at(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_tensor *rows,
                       const dm_tensor *grads, const dm_tensor *n_at, double beta1, double beta2, double eps,
                       const dm_tensor *lr_at, const dm_tensor *step_at, const dm_tensor *sumsq_at) {
  const char *what = "engram_adam_at";
  dm_tensor *state[3] = {table, m, v};
  int64_t cap = check_at(what, table, rows, grads, n_at, lr_at, step_at, sumsq_at), n;
  check_adam(what, state, 3, rows, grads, cap);
  if (table->device == DM_CPU) {       /* read at once, then the ordinary update */
    if (!cpu_at(what, n_at, sumsq_at, cap, &n)) return;
    dm_engram_adam(table, m, v, rows, grads, n, *(const double *)dm_data(lr_at), beta1, beta2, eps,
                   *(const int64_t *)dm_data(step_at));
    return;
  }
  dm_engram_adam_hp hp = dm_engram_adam_prepare(0, beta1, beta2, eps, 1);   /* betas and eps checked here */
  dm_engram_adam_scalars at = {n_at ? dm_data(n_at) : NULL, dm_data(step_at), dm_data(lr_at), sumsq_at ? dm_data(sumsq_at) : NULL};
  if (dm_plan_card_of(table->device))
    dm_plan_scratch(dm_engram_adam_scratch(cap), "engram_adam's flag and constants (kernels/engram.cu engram_adam_run)");
  DM_RUN(engram_adam_at, table->device, table, m, v, rows, grads, cap, &hp, &at);
  for (int i = 0; i < 3; i++) dm_mark_written(state[i]);
}

/* an 8-bit state beside its f32 table: codes [R, de] u8, scales [R] f32, all on the table's device */
static void check_8bit(const char *what, const dm_tensor *table, const dm_engram_8bit *m8) {
  char s1[128], s2[128];
  if (table->dtype != DM_F32) dm_error("%s: 8-bit moments take an f32 table, got %s", what, dm_dtype_name(table->dtype));
  const dm_tensor *codes[2] = {m8->m, m8->v}, *scales[2] = {m8->m_scale, m8->v_scale};
  const char *names[2] = {"m", "v"};
  for (int k = 0; k < 2; k++) {
    dm_check_live(codes[k]);
    dm_check_live(scales[k]);
    if (codes[k]->dtype != DM_U8 || !dm_same_shape(codes[k], table) || !dm_is_contiguous(codes[k]))
      dm_error("%s: the %s codes must be contiguous u8 of the table's shape %s, got %s %s", what, names[k],
               dm_tensor_shape_str(table, s1, sizeof s1), dm_dtype_name(codes[k]->dtype),
               dm_tensor_shape_str(codes[k], s2, sizeof s2));
    if (scales[k]->dtype != DM_F32 || scales[k]->ndim != 1 || scales[k]->shape[0] != table->shape[0] ||
        !dm_is_contiguous(scales[k]))
      dm_error("%s: the %s scales must be contiguous f32 [%lld] (one a row), got %s %s", what, names[k],
               (long long)table->shape[0], dm_dtype_name(scales[k]->dtype),
               dm_tensor_shape_str(scales[k], s2, sizeof s2));
    dm_check_device_equal(what, table, codes[k]);
    dm_check_device_equal(what, table, scales[k]);
  }
}

static void written_8bit(dm_tensor *table, const dm_engram_8bit *m8) {
  dm_mark_written(table);
  dm_mark_written(m8->m); dm_mark_written(m8->m_scale); dm_mark_written(m8->v); dm_mark_written(m8->v_scale);
}

void dm_engram_adam_8bit(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows, const dm_tensor *grads,
                       int64_t n, double lr, double beta1, double beta2, double eps, int64_t step) {
  const char *what = "engram_adam_8bit";
  dm_tensor *state[1] = {table};
  check_adam(what, state, 1, rows, grads, n);
  check_8bit(what, table, m8);
  dm_engram_adam_hp hp = dm_engram_adam_prepare(lr, beta1, beta2, eps, step);
  if (dm_plan_card_of(table->device))
    dm_plan_scratch(dm_engram_adam_scratch(n), "engram_adam's flag and constants (kernels/engram.cu engram_adam_8bit)");
  DM_RUN(engram_adam_8bit, table->device, table, m8, rows, grads, n, &hp, step, NULL);
  written_8bit(table, m8);
}

void dm_engram_adam_8bit_at(dm_tensor *table, const dm_engram_8bit *m8, const dm_tensor *rows, const dm_tensor *grads,
                          const dm_tensor *n_at, double beta1, double beta2, double eps, const dm_tensor *lr_at,
                          const dm_tensor *step_at, const dm_tensor *sumsq_at) {
  const char *what = "engram_adam_8bit_at";
  dm_tensor *state[1] = {table};
  int64_t cap = check_at(what, table, rows, grads, n_at, lr_at, step_at, sumsq_at), n;
  check_adam(what, state, 1, rows, grads, cap);
  check_8bit(what, table, m8);
  if (table->device == DM_CPU) {       /* read at once, then the ordinary update */
    if (!cpu_at(what, n_at, sumsq_at, cap, &n)) return;
    dm_engram_adam_8bit(table, m8, rows, grads, n, *(const double *)dm_data(lr_at), beta1, beta2, eps,
                      *(const int64_t *)dm_data(step_at));
    return;
  }
  dm_engram_adam_hp hp = dm_engram_adam_prepare(0, beta1, beta2, eps, 1);   /* betas and eps checked here */
  dm_engram_adam_scalars at = {n_at ? dm_data(n_at) : NULL, dm_data(step_at), dm_data(lr_at), sumsq_at ? dm_data(sumsq_at) : NULL};
  if (dm_plan_card_of(table->device))
    dm_plan_scratch(dm_engram_adam_scratch(cap), "engram_adam's flag and constants (kernels/engram.cu engram_adam_8bit)");
  DM_RUN(engram_adam_8bit, table->device, table, m8, rows, grads, cap, &hp, 0, &at);
  written_8bit(table, m8);
}

static dm_op ops[] = {
  {.name = "engram_index", .doc = "Engram n-gram rows [B, T, nsub] i64 of bytes x [B, T] (prefix [B, P] before them)",
   .n_in = 2, .n_out = 1, .attrs = "heads:int,rows:int,list=orders", .optional = 1u << 1, .nondiff = 3u,
   .forward = index_fwd},
  {.name = "engram_unique", .doc = "the distinct rows of idx (increasing), the inverse map, the counts and their number",
   .n_in = 1, .n_out = 4, .attrs = "bound:int~0,padded:bool~false", .nondiff = 1u, .forward = unique_fwd},
  {.name = "engram_sparse_grad", .doc = "per-lookup gradients [M, de] summed per unique row (deterministic)",
   .n_in = 2, .n_out = 1, .attrs = "n_unique:int", .nondiff = 1u << 1,
   .forward = sparse_grad_fwd, .backward = sparse_grad_bwd},
  {.name = "engram_alpha", .doc = "sigmoid(dot(rmsnorm(u), w * rmsnorm(kx)) / sqrt(d)) over the last dim",
   .n_in = 3, .n_out = 1, .attrs = "eps~1e-6", .optional = 1u << 2,
   .forward = alpha_fwd, .backward = alpha_bwd},
};
DM_REGISTER_OPS(ops)
