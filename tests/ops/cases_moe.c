/*
** cases_moe.c — the routed-expert ops against plain loops in double.
**
** The shapes are the awkward ones of a router: one expert, one choice,
** k = E, one token, experts that get no token, odd d, r and F. The sorted
** layout the later ops take (perm, offsets, inv) is built here by the
** slowest obvious method (for each expert, scan every assignment), not by
** the kernel's counting sort. Router logits are drawn so that the scores
** (with the bias) that decide the choice are at least 1e-3 apart: finite
** differences and f32 rounding then never change the choice; a separate
** case makes exact ties on purpose.
*/
#include <math.h>
#include <string.h>
#include "harness.h"
#include "ops/moe.h"
#include "ops/quant.h"

#define TRIALS 6

static double sigmoid(double x) { return 1 / (1 + exp(-x)); }

static dm_tensor *f64_of(int nd, const int64_t *shape) { return h_new(DM_F64, nd, shape); }
static dm_tensor *i64_of(int nd, const int64_t *shape) { return h_new(DM_I64, nd, shape); }
static dm_tensor *vec_i64(int64_t n) { return i64_of(1, &n); }

/* expert ids [N, k], each token's k distinct; with `skip0`, expert 0 gets none */
static dm_tensor *random_ids(h_rng *r, int64_t n, int64_t k, int64_t e, bool skip0) {
  int64_t s[2] = {n, k};
  dm_tensor *idx = i64_of(2, s);
  int64_t lo = skip0 ? 1 : 0;
  for (int64_t t = 0; t < n; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t x;
      bool again;
      do {
        x = h_int(r, lo, e - 1);
        again = false;
        for (int64_t q = 0; q < j; q++) again = again || (int64_t)h_get(idx, t * k + q) == x;
      } while (again);
      h_set(idx, t * k + j, (double)x);
    }
  return idx;
}

/* the sorted layout, slowly: for each expert in turn, its assignments in order */
static void sorted_layout(const dm_tensor *idx, int64_t e, dm_tensor **perm, dm_tensor **offsets, dm_tensor **inv) {
  int64_t rows = dm_numel(idx), p = 0;
  *perm = vec_i64(rows);
  *offsets = vec_i64(e + 1);
  *inv = vec_i64(rows);
  for (int64_t x = 0; x < e; x++) {
    h_set(*offsets, x, (double)p);
    for (int64_t a = 0; a < rows; a++)
      if ((int64_t)h_get(idx, a) == x) {
        h_set(*perm, p, (double)a);
        h_set(*inv, a, (double)p);
        p++;
      }
  }
  h_set(*offsets, e, (double)p);
}

/* the expert that owns sorted position p */
static int64_t owner(const dm_tensor *offsets, int64_t p) {
  int64_t x = 0;
  while (p >= (int64_t)h_get(offsets, x + 1)) x++;
  return x;
}

static dm_tensor *scaled_randn(h_rng *r, int nd, const int64_t *shape, double scale) {
  dm_tensor *t = h_randn(r, nd, shape);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, scale * h_get(t, i));
  return t;
}

/* ---- moe_route -------------------------------------------------------------------------------- */

typedef struct { int64_t n, e, k; bool bias; } route_shape;
static const route_shape route_shapes[TRIALS] = {
  {1, 1, 1, true}, {5, 8, 2, true}, {7, 3, 3, true}, {13, 17, 1, true}, {4, 5, 2, false}, {31, 64, 2, true}};
/* a few rows among many experts (moe.h dm_moe_few: CUDA's own kernels, decoding's shapes) */
static const route_shape few_route_shapes[TRIALS] = {
  {1, 16, 2, true}, {4, 64, 2, true}, {8, 64, 1, false}, {2, 40, 2, true}, {1, 1024, 2, true}, {2, 300, 3, true}};
#define ROUTE_MOST_E 1024                          /* the largest e of the shapes above */

/* selection scores sorted: are the first k+1 (the ones that decide) at least gap apart? */
static bool decisive(const double *sel, int64_t e, int64_t k, double gap) {
  double top[65];
  int64_t m = k + 1 < e ? k + 1 : e;
  bool used[ROUTE_MOST_E] = {0};
  for (int64_t j = 0; j < m; j++) {
    int64_t best = -1;
    for (int64_t x = 0; x < e; x++) if (!used[x] && (best < 0 || sel[x] > sel[best])) best = x;
    used[best] = true;
    top[j] = sel[best];
  }
  for (int64_t j = 0; j + 1 < m; j++) if (top[j] - top[j + 1] < gap) return false;
  return true;
}

/* the score that decides the choice: sigmoid(l) + b, or l + b in the softmax form */
static double route_score(int form, double l, double b) { return (form == DM_MOE_ROUTE_SOFTMAX ? l : sigmoid(l)) + b; }

/* the gate's numerator before the sum over the chosen: sigmoid(l), or exp(l) in the softmax form */
static double route_weight(int form, double l) { return form == DM_MOE_ROUTE_SOFTMAX ? exp(l) : sigmoid(l); }

static void route_inputs(h_rng *r, route_shape s, dm_tensor **in, dm_attrs *a, int form) {
  int64_t sl[2] = {s.n, s.e};
  in[0] = f64_of(2, sl);
  in[1] = s.bias ? h_uniform_t(r, 1, &s.e, -0.4, 0.4) : NULL;
  if (s.bias && s.e > 1) h_set(in[1], 0, -9);          /* expert 0 is never chosen */
  double sel[ROUTE_MOST_E];
  for (int64_t i = 0; i < s.n; i++) {
    do {
      for (int64_t x = 0; x < s.e; x++) {
        double l = h_uniform(r, -3, 3);
        h_set(in[0], i * s.e + x, l);
        sel[x] = route_score(form, l, in[1] ? h_get(in[1], x) : 0);
      }
    } while (!decisive(sel, s.e, s.k, 1e-3));
  }
  *a = dm_attrs_of(2, (double[]){(double)s.k, (double)form});
}

static void in_route(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  route_inputs(r, route_shapes[t], in, a, DM_MOE_ROUTE_SIGMOID);
}
static void in_route_softmax(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  route_inputs(r, route_shapes[t], in, a, DM_MOE_ROUTE_SOFTMAX);
}
static void in_route_few(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  route_inputs(r, few_route_shapes[t], in, a, t % 2 ? DM_MOE_ROUTE_SOFTMAX : DM_MOE_ROUTE_SIGMOID);
}

static void or_route(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *lg = in[0], *b = in[1];
  int64_t n = lg->shape[0], e = lg->shape[1], k = (int64_t)a->v[0], s2[2] = {n, k};
  int form = (int)a->v[1];
  ex[0] = i64_of(2, s2);
  ex[1] = f64_of(2, s2);
  ex[2] = vec_i64(e);
  for (int64_t t = 0; t < n; t++) {
    /* rank every expert: the number of experts ahead of it (higher score, or equal and lower id) */
    double sum = 0;
    for (int64_t x = 0; x < e; x++) {
      double sx = route_score(form, h_get(lg, t * e + x), b ? h_get(b, x) : 0);
      int64_t ahead = 0;
      for (int64_t y = 0; y < e; y++) {
        double sy = route_score(form, h_get(lg, t * e + y), b ? h_get(b, y) : 0);
        ahead += sy > sx || (sy == sx && y < x);
      }
      if (ahead < k) {
        h_set(ex[0], t * k + ahead, (double)x);
        h_set(ex[2], x, h_get(ex[2], x) + 1);
        sum += route_weight(form, h_get(lg, t * e + x));
      }
    }
    for (int64_t j = 0; j < k; j++)
      h_set(ex[1], t * k + j, route_weight(form, h_get(lg, t * e + (int64_t)h_get(ex[0], t * k + j))) / sum);
  }
}

/* exact ties: integer logits from {-1, 0, 1}, a zero bias; the lower id must win */
static void route_ties(h_rng *r, int t, dm_tensor **in, dm_attrs *a, int form) {
  route_shape s = route_shapes[t];
  int64_t sl[2] = {s.n, s.e};
  in[0] = f64_of(2, sl);
  for (int64_t i = 0; i < s.n * s.e; i++) h_set(in[0], i, (double)h_int(r, -1, 1));
  in[1] = f64_of(1, &s.e);
  *a = dm_attrs_of(2, (double[]){(double)s.k, (double)form});
}

static void in_route_ties(h_rng *r, int t, dm_tensor **in, dm_attrs *a) { route_ties(r, t, in, a, DM_MOE_ROUTE_SIGMOID); }
static void in_route_ties_softmax(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  route_ties(r, t, in, a, DM_MOE_ROUTE_SOFTMAX);
}

/* ---- moe_sort --------------------------------------------------------------------------------- */

typedef struct { int64_t n, k, e; bool skip0; } sort_shape;
static const sort_shape sort_shapes[TRIALS] = {
  {1, 1, 1, false}, {5, 2, 8, true}, {7, 3, 3, false}, {13, 1, 17, false}, {1, 2, 2, false}, {31, 2, 5, true}};
static const sort_shape few_sort_shapes[TRIALS] = {   /* dm_moe_few: at most 256 rows, one for 8 experts */
  {1, 2, 64, false}, {3, 2, 100, true}, {1, 1, 8, false}, {7, 3, 200, true}, {16, 2, 256, false}, {128, 2, 2048, true}};

static void sort_inputs(h_rng *r, sort_shape s, dm_tensor **in, dm_attrs *a) {
  in[0] = random_ids(r, s.n, s.k, s.e, s.skip0);
  *a = dm_attrs_of(1, (double[]){(double)s.e});
}
static void in_sort(h_rng *r, int t, dm_tensor **in, dm_attrs *a) { sort_inputs(r, sort_shapes[t], in, a); }
static void in_sort_few(h_rng *r, int t, dm_tensor **in, dm_attrs *a) { sort_inputs(r, few_sort_shapes[t], in, a); }

static void or_sort(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  sorted_layout(in[0], (int64_t)a->v[0], &ex[0], &ex[1], &ex[2]);
}

/* ---- moe_experts ------------------------------------------------------------------------------ */

enum { X_U, X_PERM, X_OFFSETS, X_UG, X_UU, X_CG, X_CU, X_D };

typedef struct { int64_t n, d, e, k, r, f; bool skip0; } expert_shape;
static const expert_shape expert_shapes[TRIALS + 1] = {
  {1, 1, 1, 1, 1, 1, false}, {5, 7, 3, 2, 3, 5, true}, {7, 3, 4, 3, 2, 9, true},
  {13, 5, 8, 2, 1, 3, false}, {4, 6, 2, 1, 5, 7, false}, {17, 13, 5, 2, 3, 31, true},
  {2048, 768, 64, 2, 16, 2048, false}};                   /* perf: the small preset */
/* dm_moe_few_experts: a few rows among many experts, F over a block's 256 columns, ranks 1 to 128 */
static const expert_shape few_expert_shapes[TRIALS + 1] = {
  {1, 40, 64, 2, 16, 37, false}, {3, 33, 64, 2, 5, 300, true}, {2, 70, 32, 2, 64, 9, false},
  {1, 8, 8, 1, 128, 513, false}, {4, 100, 64, 2, 1, 1, true}, {16, 24, 256, 2, 7, 20, true},
  {1, 2048, 16, 2, 64, 5461, false}};                    /* perf: b1's one-byte step (16 of its experts) */

/* from idx [n, k] (taken over): the sorted layout, the tokens' rows u [n, d], the expert banks
** and gates at their usual scales, attribute k */
static void expert_inputs(h_rng *r, dm_tensor *idx, int64_t n, int64_t d, int64_t rk, int64_t f, int64_t e,
                          int64_t k, dm_tensor **in, dm_attrs *a) {
  dm_tensor *inv;
  sorted_layout(idx, e, &in[X_PERM], &in[X_OFFSETS], &inv);
  dm_release(idx);
  dm_release(inv);
  int64_t su[2] = {n, d}, sw[3] = {e, d, rk}, sc[2] = {e, rk}, sd[3] = {e, rk, f};
  in[X_U] = h_randn(r, 2, su);
  in[X_UG] = scaled_randn(r, 3, sw, 1 / sqrt((double)d));
  in[X_UU] = scaled_randn(r, 3, sw, 1 / sqrt((double)d));
  in[X_CG] = h_uniform_t(r, 2, sc, 0.5, 1.5);
  in[X_CU] = h_uniform_t(r, 2, sc, 0.5, 1.5);
  in[X_D] = scaled_randn(r, 3, sd, 1 / sqrt((double)rk));
  *a = dm_attrs_of(1, (double[]){(double)k});
}

static void experts_of(h_rng *r, expert_shape s, dm_tensor **in, dm_attrs *a) {
  dm_tensor *idx = random_ids(r, s.n, s.k, s.e, s.skip0);
  expert_inputs(r, idx, s.n, s.d, s.r, s.f, s.e, s.k, in, a);
}
static void in_experts(h_rng *r, int t, dm_tensor **in, dm_attrs *a) { experts_of(r, expert_shapes[t], in, a); }
static void in_experts_few(h_rng *r, int t, dm_tensor **in, dm_attrs *a) { experts_of(r, few_expert_shapes[t], in, a); }

/* Experts with given row counts (0, 1, 17, 33: a tile of 32 rows, a part tile, one past it) at the ranks
** the CUDA tensor-core kernels take (and d a multiple of 8), F odd (rows of F off 16-byte boundaries) and
** over 128 (two slices of F). Assignment i of the experts' list goes to token i mod N, slot i / N; no
** expert has more than N rows, so a token's k experts differ. */
typedef struct { int64_t d, r, f, k, e; int64_t counts[8]; } tc_shape;
static const tc_shape tc_shapes[TRIALS] = {
  {32, 16, 24, 2, 8, {0, 1, 17, 33, 5, 10, 0, 14}}, {40, 32, 37, 2, 8, {0, 1, 17, 33, 5, 10, 0, 14}},
  {64, 64, 61, 1, 4, {33, 0, 17, 1}}, {8, 16, 1, 1, 3, {1, 0, 33}},
  {24, 64, 131, 1, 3, {1, 17, 33}}, {16, 128, 9, 1, 4, {17, 0, 33, 2}}};

static void in_experts_tc(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  tc_shape s = tc_shapes[t];
  int64_t rows = 0;
  for (int64_t x = 0; x < s.e; x++) rows += s.counts[x];
  int64_t n = rows / s.k, sn[2] = {n, s.k}, p = 0;
  dm_tensor *idx = i64_of(2, sn);
  for (int64_t x = 0; x < s.e; x++)
    for (int64_t c = 0; c < s.counts[x]; c++, p++) h_set(idx, (p % n) * s.k + p / n, (double)x);
  expert_inputs(r, idx, n, s.d, s.r, s.f, s.e, s.k, in, a);
}

/* one sorted row at a time: its token, its expert, the formula */
static void or_experts(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *u = in[X_U], *perm = in[X_PERM], *off = in[X_OFFSETS];
  int64_t k = (int64_t)a->v[0], rows = dm_numel(perm), d = u->shape[1];
  int64_t r = in[X_UG]->shape[2], f = in[X_D]->shape[2], sy[2] = {rows, f};
  ex[0] = f64_of(2, sy);
  double h[128];
  for (int64_t p = 0; p < rows; p++) {
    int64_t tok = (int64_t)h_get(perm, p) / k, e = owner(off, p);
    for (int64_t i = 0; i < r; i++) {
      double zg = 0, zu = 0;
      for (int64_t c = 0; c < d; c++) {
        zg += h_get(u, tok * d + c) * h_get(in[X_UG], (e * d + c) * r + i);
        zu += h_get(u, tok * d + c) * h_get(in[X_UU], (e * d + c) * r + i);
      }
      zg *= h_get(in[X_CG], e * r + i);
      zu *= h_get(in[X_CU], e * r + i);
      h[i] = zg * sigmoid(zg) * zu;
    }
    for (int64_t o = 0; o < f; o++) {
      double y = 0;
      for (int64_t i = 0; i < r; i++) y += h[i] * h_get(in[X_D], (e * r + i) * f + o);
      h_set(ex[0], p * f + o, y);
    }
  }
}

/* fp8 banks: each factor's codes and scales (bank_fp8, at bf16) after the bank, its slot keeping the
** factor (given for its shape, not read); the tensor-core shapes (the CUDA kernels read the codes there
** in bf16, the CPU and CUDA's f32 decode them first) */
static void in_experts_fp8(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  in_experts_tc(r, t, in, a);
  const dm_op *op = dm_op_find("bank_fp8");
  dm_attrs at = dm_attrs_of(1, (double[]){(double)DM_BF16});
  const int factors[3] = {X_UG, X_UU, X_D};
  for (int i = 0; i < 3; i++) {
    dm_tensor *out[DM_MAXOUT];
    dm_call(op, 1, &in[factors[i]], &at, out);
    in[X_D + 1 + 2 * i] = out[0];
    in[X_D + 2 + 2 * i] = out[1];
  }
}

/* factor i's weights from its codes: the code's value times its block's scale, rounded to f32 (as a
** decode gives them) */
static dm_tensor *decoded_factor(const dm_tensor *w, const dm_tensor *codes, const dm_tensor *scales) {
  int64_t n = w->shape[2], rows = dm_numel(w) / n, nq = codes->shape[2];
  dm_tensor *out = f64_of(3, w->shape);
  for (int64_t q = 0; q < rows; q++)
    for (int64_t j = 0; j < n; j++) {
      double v = dm_e4m3_value((unsigned)h_get(codes, q * nq + j)) * h_get(scales, q * (nq / 32) + j / 32);
      h_set(out, q * n + j, (float)v);
    }
  return out;
}

static void or_experts_fp8(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  dm_tensor *held[X_D + 1];
  for (int i = 0; i <= X_D; i++) held[i] = in[i];
  held[X_UG] = decoded_factor(in[X_UG], in[X_D + 1], in[X_D + 2]);
  held[X_UU] = decoded_factor(in[X_UU], in[X_D + 3], in[X_D + 4]);
  held[X_D] = decoded_factor(in[X_D], in[X_D + 5], in[X_D + 6]);
  or_experts(held, a, ex);
  dm_release(held[X_UG]);
  dm_release(held[X_UU]);
  dm_release(held[X_D]);
}

/* ---- moe_combine ------------------------------------------------------------------------------ */

typedef struct { int64_t n, k, f; } combine_shape;
static const combine_shape combine_shapes[TRIALS + 1] = {
  {1, 1, 1}, {5, 2, 7}, {7, 3, 1}, {13, 1, 5}, {1, 4, 3}, {17, 2, 31}, {2048, 2, 2048}};

/* a random permutation of n */
static dm_tensor *shuffle(h_rng *r, int64_t n) {
  dm_tensor *p = vec_i64(n);
  for (int64_t i = 0; i < n; i++) h_set(p, i, (double)i);
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = h_int(r, 0, i);
    double v = h_get(p, i);
    h_set(p, i, h_get(p, j));
    h_set(p, j, v);
  }
  return p;
}

static void in_combine(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  combine_shape s = combine_shapes[t];
  int64_t sr[2] = {s.n * s.k, s.f}, sw[2] = {s.n, s.k};
  in[0] = h_randn(r, 2, sr);
  in[1] = shuffle(r, s.n * s.k);
  in[2] = h_uniform_t(r, 2, sw, 0.05, 1);
  *a = dm_attrs_of(0, NULL);
}

static void or_combine(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *rows = in[0], *inv = in[1], *w = in[2];
  int64_t n = w->shape[0], k = w->shape[1], f = rows->shape[1], sy[2] = {n, f};
  ex[0] = f64_of(2, sy);
  for (int64_t t = 0; t < n; t++)
    for (int64_t o = 0; o < f; o++) {
      double y = 0;
      for (int64_t j = 0; j < k; j++) y += h_get(w, t * k + j) * h_get(rows, (int64_t)h_get(inv, t * k + j) * f + o);
      h_set(ex[0], t * f + o, y);
    }
}

/* ---- moe_capacity ----------------------------------------------------------------------------- */

static void in_capacity(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  sort_shape s = sort_shapes[t];
  int64_t sw[2] = {s.n, s.k};
  dm_tensor *idx = random_ids(r, s.n, s.k, s.e, s.skip0), *perm;
  in[0] = h_uniform_t(r, 2, sw, 0.05, 1);
  in[1] = idx;
  sorted_layout(idx, s.e, &perm, &in[3], &in[2]);
  dm_release(perm);
  *a = dm_attrs_of(1, (double[]){(double)(t % 4)});      /* capacity 0 (drop all) to 3 */
}

/* rank of an assignment = how many earlier assignments chose the same expert */
static void or_capacity(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *w = in[0], *idx = in[1];
  int64_t rows = dm_numel(w), e = in[3]->shape[0] - 1, cap = (int64_t)a->v[0];
  ex[0] = f64_of(w->ndim, w->shape);
  ex[1] = vec_i64(e);
  for (int64_t x = 0; x < rows; x++) {
    int64_t rank = 0, id = (int64_t)h_get(idx, x);
    for (int64_t y = 0; y < x; y++) rank += (int64_t)h_get(idx, y) == id;
    h_set(ex[0], x, rank < cap ? h_get(w, x) : 0);
    if (rank >= cap) h_set(ex[1], id, h_get(ex[1], id) + 1);
  }
}

/* ---- moe_counters, moe_balance_ ------------------------------------------------------------------- */

static void in_counts(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  static const int64_t sizes[TRIALS] = {1, 2, 5, 8, 17, 64};
  int64_t e = sizes[t];
  in[0] = vec_i64(e);
  for (int64_t x = 0; x < e; x++) h_set(in[0], x, t == 0 ? 0 : (double)(h_int(r, 0, 2) ? h_int(r, 0, 40) : 0));
  *a = dm_attrs_of(0, NULL);
}

static void or_counters(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  int64_t e = in[0]->shape[0], three = 3;
  double total = 0, most = 0, dead = 0, h = 0;
  for (int64_t x = 0; x < e; x++) {
    double c = h_get(in[0], x);
    total += c;
    most = fmax(most, c);
    dead += c == 0;
  }
  for (int64_t x = 0; x < e; x++) {
    double p = total > 0 ? h_get(in[0], x) / total : 0;
    if (p > 0) h -= p * log(p);
  }
  ex[0] = f64_of(1, &three);
  h_set(ex[0], 0, total > 0 ? most / total : 0);
  h_set(ex[0], 1, h);
  h_set(ex[0], 2, dead);
}

static void in_balance(h_rng *r, int t, dm_tensor **in, dm_attrs *a) {
  dm_tensor *counts[1];
  in_counts(r, t, counts, a);
  if (t == 2) for (int64_t x = 0; x < 5; x++) h_set(counts[0], x, 7);   /* all at the mean: no change */
  in[0] = h_uniform_t(r, 1, counts[0]->shape, -0.1, 0.1);
  in[1] = counts[0];
  *a = dm_attrs_of(1, (double[]){t % 2 ? 1e-3 : 0.25});
}

static void or_balance(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  int64_t e = in[0]->shape[0];
  double mean = 0;
  for (int64_t x = 0; x < e; x++) mean += h_get(in[1], x) / (double)e;
  ex[0] = f64_of(1, &e);
  for (int64_t x = 0; x < e; x++) {
    double c = h_get(in[1], x), sign = mean > c + 1e-9 ? 1 : mean < c - 1e-9 ? -1 : 0;
    h_set(ex[0], x, h_get(in[0], x) + a->v[0] * sign);
  }
}

static const dm_case cases[] = {
  {.op = "moe_route", .label = "separated scores", .inputs = in_route, .oracle = or_route},
  {.op = "moe_route", .label = "exact ties", .inputs = in_route_ties, .oracle = or_route, .no_grad = true},
  {.op = "moe_route", .label = "softmax form, separated scores", .inputs = in_route_softmax, .oracle = or_route},
  {.op = "moe_route", .label = "softmax form, exact ties", .inputs = in_route_ties_softmax, .oracle = or_route,
   .no_grad = true},
  {.op = "moe_route", .label = "a few rows among many experts, both forms", .inputs = in_route_few,
   .oracle = or_route},
  {.op = "moe_sort", .label = "empty experts", .inputs = in_sort, .oracle = or_sort, .no_grad = true},
  {.op = "moe_sort", .label = "a few rows among many experts", .inputs = in_sort_few, .oracle = or_sort,
   .no_grad = true},
  {.op = "moe_experts", .label = "odd d r F, empty experts", .inputs = in_experts, .oracle = or_experts,
   .perf_trial = TRIALS + 1},
  {.op = "moe_experts", .label = "experts of 0, 1, 17, 33 rows at ranks 16 to 128", .inputs = in_experts_tc,
   .oracle = or_experts},
  {.op = "moe_experts", .label = "a few rows among many experts", .inputs = in_experts_few, .oracle = or_experts,
   .perf_trial = TRIALS + 1},
  {.op = "moe_combine", .label = "random permutation", .inputs = in_combine, .oracle = or_combine,
   .perf_trial = TRIALS + 1},
  {.op = "moe_capacity", .label = "capacity 0 to 3", .inputs = in_capacity, .oracle = or_capacity},
  {.op = "moe_counters", .label = "dead experts", .inputs = in_counts, .oracle = or_counters, .no_grad = true},
  {.op = "moe_balance_", .label = "signs and ties", .inputs = in_balance, .oracle = or_balance, .no_grad = true},
  /* the factors' gradient is the straight-through one (the 16-bit op's), which finite differences of the
  ** codes' products cannot see: tests/lua/model_spec.lua checks it against QAT's, and the GPU checks
  ** against the 16-bit kernels on the decoded banks (tests/gpu/check_moe.lua) */
  {.op = "moe_experts", .label = "fp8 banks, experts of 0, 1, 17, 33 rows at ranks 16 to 128",
   .inputs = in_experts_fp8, .oracle = or_experts_fp8, .no_grad = true},
};
DM_REGISTER_CASES(cases)
