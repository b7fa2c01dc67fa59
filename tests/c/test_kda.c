/*
** test_kda.c — the KDA op against docs/kda.md §3: an independent
** float64 reference (the recurrence of docs/kda.md §1 and its exact backward, every
** state kept), shapes T = 1 .. 1000, the gate regimes, split against
** whole with the state carried, causality, determinism, the checkpoint
** interval, the initial state's gradient, the gate's extremes, the error
** messages; then the CPU timing of one forward and backward.
**
** The metric is docs/kda.md's: rel(a, ref) = |a - ref|_2 / |ref|_2 per
** tensor, with NaN and Inf failing. Every run's loss is
** sum(o * W) + sum(S_T * WS) with fixed random W and WS, so both outputs'
** gradients enter the backward.
*/
#include <math.h>
#include <stdlib.h>
#include <time.h>
#include "check.h"
#include "core/core.h"
#include "core/autograd.h"
#include "ops/kda.h"

enum { Q, K, V, G, BETA, S0, NIN };
static const char *in_names[NIN] = {"q", "k", "v", "g", "beta", "S0"};

/* ---- random numbers (splitmix64), independent of the runtime's generator ---------------------- */

static uint64_t rng_s = 12345;

static double urand(void) {
  uint64_t z = (rng_s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (double)((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
}

static double nrand(void) { return sqrt(-2 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand()); }

/* ---- tensors ---------------------------------------------------------------------------------- */

static dm_tensor *f64_new(int nd, const int64_t *shape) { return dm_zeros(DM_CPU, DM_F64, nd, shape); }
static double *D(const dm_tensor *t) { return dm_data(t); }

/* a contiguous copy in dtype dt, no autograd */
static dm_tensor *cast(const dm_tensor *t, dm_dtype dt) {
  dm_tensor *c = dm_tensor_like_dtype(t, dt);
  dm_copy_(c, t);
  return c;
}

/* t's values rounded through dt, kept in f64 */
static void round_through(dm_tensor *t, dm_dtype dt) {
  dm_tensor *c = cast(t, dt);
  dm_copy_(t, c);
  dm_release(c);
}

/* ---- a problem: f64 inputs and loss weights --------------------------------------------------- */

typedef struct {
  int64_t B, T, H, dk, dv;
  dm_tensor *in[NIN];          /* f64, contiguous; in[S0] may be NULL */
  dm_tensor *w, *ws;           /* loss weights of o and of the final state */
} problem;

enum { GATE_MIXED, GATE_ZERO, GATE_BOUND, GATE_FAR, GATE_HALF_ZERO, GATE_LOGSIG, GATE_LOGSIG10, GATE_NEG_INF };
static const char *gate_names[] = {"mixed", "zero", "bound -5", "-50", "half zero", "logsigmoid",
                                   "logsigmoid/10", "-inf"};

static double log_decay(int regime) {
  double x = nrand(), ls = x < 0 ? x - log1p(exp(x)) : -log1p(exp(-x));
  switch (regime) {
  case GATE_ZERO: return 0;
  case GATE_BOUND: return -5;
  case GATE_FAR: return -50;
  case GATE_HALF_ZERO: return urand() < 0.5 ? 0 : ls;
  case GATE_LOGSIG: return ls;
  case GATE_LOGSIG10: return ls / 10;
  case GATE_NEG_INF: return urand() < 0.3 ? -INFINITY : ls;
  default: return urand() < 0.2 ? 0 : -1.5 * urand();
  }
}

/* q, k unit rows (eps 1e-6 as the model), v ~ N(0, 1), beta = sigmoid(N(0, 1)), S0 ~ N(0, 0.25) */
static problem make(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int regime, bool with_s0) {
  problem p = {B, T, H, dk, dv};
  int64_t qs[4] = {B, T, H, dk}, vs[4] = {B, T, H, dv}, ss[4] = {B, H, dk, dv};
  p.in[Q] = f64_new(4, qs);
  p.in[K] = f64_new(4, qs);
  p.in[V] = f64_new(4, vs);
  p.in[G] = f64_new(4, qs);
  p.in[BETA] = f64_new(3, qs);
  p.in[S0] = with_s0 ? f64_new(4, ss) : NULL;
  p.w = f64_new(4, vs);
  p.ws = f64_new(4, ss);
  for (int x = Q; x <= K; x++)
    for (int64_t r = 0; r < B * T * H; r++) {
      double *row = D(p.in[x]) + r * dk, n2 = 0;
      for (int64_t i = 0; i < dk; i++) { row[i] = nrand(); n2 += row[i] * row[i]; }
      for (int64_t i = 0; i < dk; i++) row[i] /= sqrt(n2 + 1e-6);
    }
  for (int64_t i = 0; i < dm_numel(p.in[V]); i++) D(p.in[V])[i] = nrand();
  for (int64_t i = 0; i < dm_numel(p.in[G]); i++) D(p.in[G])[i] = log_decay(regime);
  for (int64_t i = 0; i < dm_numel(p.in[BETA]); i++) D(p.in[BETA])[i] = 1 / (1 + exp(-nrand()));
  if (with_s0) for (int64_t i = 0; i < dm_numel(p.in[S0]); i++) D(p.in[S0])[i] = 0.5 * nrand();
  for (int64_t i = 0; i < dm_numel(p.w); i++) D(p.w)[i] = nrand();
  for (int64_t i = 0; i < dm_numel(p.ws); i++) D(p.ws)[i] = nrand();
  return p;
}

static problem clone_problem(const problem *p) {
  problem c = *p;
  for (int i = 0; i < NIN; i++) c.in[i] = p->in[i] ? dm_clone(p->in[i]) : NULL;
  c.w = dm_clone(p->w);
  c.ws = dm_clone(p->ws);
  return c;
}

static void free_problem(problem *p) {
  for (int i = 0; i < NIN; i++) dm_release(p->in[i]);
  dm_release(p->w);
  dm_release(p->ws);
}

/* ---- results: f64 copies of o, S_T and the six gradients ------------------------------------- */

typedef struct { dm_tensor *o, *sT, *grad[NIN]; } result;

static void free_result(result *r) {
  dm_release(r->o);
  dm_release(r->sT);
  for (int i = 0; i < NIN; i++) dm_release(r->grad[i]);
}

static result new_result(const problem *p) {
  result r = {0};
  r.o = f64_new(4, (int64_t[]){p->B, p->T, p->H, p->dv});
  r.sT = f64_new(4, (int64_t[]){p->B, p->H, p->dk, p->dv});
  for (int i = 0; i < NIN; i++)
    if (p->in[i]) r.grad[i] = f64_new(p->in[i]->ndim, p->in[i]->shape);
  return r;
}

/* ---- the reference: docs/kda.md §1 in float64, every state kept --------------------------- */

/* the step's decayed state Sp = diag(exp(g)) prev and delta error e = v - Sp^T k */
static void decay_and_error(int64_t dk, int64_t dv, const double *g, const double *k, const double *v,
                            const double *prev, double *Sp, double *e) {
  for (int64_t i = 0; i < dk; i++)
    for (int64_t j = 0; j < dv; j++) Sp[i * dv + j] = exp(g[i]) * prev[i * dv + j];
  for (int64_t j = 0; j < dv; j++) {
    e[j] = v[j];
    for (int64_t i = 0; i < dk; i++) e[j] -= Sp[i * dv + j] * k[i];
  }
}

static result reference(const problem *p) {
  const int64_t T = p->T, H = p->H, dk = p->dk, dv = p->dv, nS = dk * dv;
  result r = new_result(p);
  double *S = malloc(sizeof(double) * (size_t)((T + 1) * nS)), *Sp = malloc(sizeof(double) * (size_t)nS);
  double *dS = malloc(sizeof(double) * (size_t)nS), *e = malloc(sizeof(double) * (size_t)dv);
  double *de = malloc(sizeof(double) * (size_t)dv);
  for (int64_t b = 0; b < p->B; b++)
    for (int64_t h = 0; h < H; h++) {
#define AT(x, t, d) (D(p->in[x]) + (((b) * T + (t)) * H + (h)) * (d))
      const double *s0 = p->in[S0] ? D(p->in[S0]) + (b * H + h) * nS : NULL;
      for (int64_t n = 0; n < nS; n++) S[n] = s0 ? s0[n] : 0;
      for (int64_t t = 0; t < T; t++) {
        const double *q = AT(Q, t, dk), *k = AT(K, t, dk), *v = AT(V, t, dv), *g = AT(G, t, dk);
        double beta = *AT(BETA, t, 1), *prev = S + t * nS, *next = S + (t + 1) * nS;
        decay_and_error(dk, dv, g, k, v, prev, Sp, e);
        for (int64_t i = 0; i < dk; i++)
          for (int64_t j = 0; j < dv; j++) next[i * dv + j] = Sp[i * dv + j] + beta * k[i] * e[j];
        double *o = D(r.o) + ((b * T + t) * H + h) * dv;
        for (int64_t j = 0; j < dv; j++) {
          o[j] = 0;
          for (int64_t i = 0; i < dk; i++) o[j] += next[i * dv + j] * q[i];
        }
      }
      for (int64_t n = 0; n < nS; n++) {
        D(r.sT)[(b * H + h) * nS + n] = S[T * nS + n];
        dS[n] = D(p->ws)[(b * H + h) * nS + n];
      }
      for (int64_t t = T - 1; t >= 0; t--) {
        const double *q = AT(Q, t, dk), *k = AT(K, t, dk), *v = AT(V, t, dv), *g = AT(G, t, dk);
        const double *dout = D(p->w) + ((b * T + t) * H + h) * dv, *prev = S + t * nS, *next = S + (t + 1) * nS;
        double beta = *AT(BETA, t, 1);
        double *dq = D(r.grad[Q]) + ((b * T + t) * H + h) * dk, *dk_ = D(r.grad[K]) + ((b * T + t) * H + h) * dk;
        double *dv_ = D(r.grad[V]) + ((b * T + t) * H + h) * dv, *dg = D(r.grad[G]) + ((b * T + t) * H + h) * dk;
        double *dbeta = D(r.grad[BETA]) + (b * T + t) * H + h;
        decay_and_error(dk, dv, g, k, v, prev, Sp, e);
        for (int64_t i = 0; i < dk; i++)
          for (int64_t j = 0; j < dv; j++) dS[i * dv + j] += q[i] * dout[j];
        for (int64_t i = 0; i < dk; i++) {
          dq[i] = 0;
          for (int64_t j = 0; j < dv; j++) dq[i] += next[i * dv + j] * dout[j];
        }
        *dbeta = 0;
        for (int64_t i = 0; i < dk; i++)
          for (int64_t j = 0; j < dv; j++) *dbeta += k[i] * dS[i * dv + j] * e[j];
        for (int64_t j = 0; j < dv; j++) {
          de[j] = 0;
          for (int64_t i = 0; i < dk; i++) de[j] += dS[i * dv + j] * k[i];
          de[j] *= beta;
          dv_[j] = de[j];
        }
        for (int64_t i = 0; i < dk; i++) {
          dk_[i] = 0;
          for (int64_t j = 0; j < dv; j++) dk_[i] += beta * dS[i * dv + j] * e[j] - Sp[i * dv + j] * de[j];
        }
        for (int64_t i = 0; i < dk; i++) {
          dg[i] = 0;
          for (int64_t j = 0; j < dv; j++) {
            double dsp = dS[i * dv + j] - k[i] * de[j];
            dg[i] += Sp[i * dv + j] * dsp;
            dS[i * dv + j] = exp(g[i]) * dsp;
          }
        }
      }
      if (r.grad[S0]) for (int64_t n = 0; n < nS; n++) D(r.grad[S0])[(b * H + h) * nS + n] = dS[n];
#undef AT
    }
  free(S); free(Sp); free(dS); free(e); free(de);
  return r;
}

/* ---- the op ------------------------------------------------------------------------------------ */

/* sum(y * w) as an f64 scalar, w cast to y's dtype */
static dm_tensor *weighted(dm_tensor *y, const dm_tensor *w) {
  dm_tensor *wc = cast(w, y->dtype), *m = dm_mul(y, wc), *s = dm_sum(m, -1, false), *s64 = dm_cast(s, DM_F64);
  dm_release(wc);
  dm_release(m);
  dm_release(s);
  return s64;
}

static dm_tensor *add_owned(dm_tensor *a, dm_tensor *b) {
  dm_tensor *s = dm_add(a, b);
  dm_release(a);
  dm_release(b);
  return s;
}

/* the dtype input i runs in when q, k and v run in dt: gates and state in f32 (f64 for f64) */
static dm_dtype in_dtype(int i, dm_dtype dt) { return i <= V ? dt : dt == DM_F64 ? DM_F64 : DM_F32; }

static void make_leaves(const problem *p, dm_dtype dt, dm_tensor **x) {
  for (int i = 0; i < NIN; i++) {
    x[i] = p->in[i] ? cast(p->in[i], in_dtype(i, dt)) : NULL;
    if (x[i]) x[i]->requires_grad = true;
  }
}

static result collect(const problem *p, dm_tensor *o, dm_tensor *sT, dm_tensor **x) {
  result r = {cast(o, DM_F64), cast(sT, DM_F64)};
  for (int i = 0; i < NIN; i++) {
    if (!x[i]) continue;
    r.grad[i] = x[i]->grad ? cast(x[i]->grad, DM_F64) : f64_new(x[i]->ndim, x[i]->shape);
    dm_release(x[i]);
  }
  return r;
}

/* forward and backward of the whole problem with q, k, v in dt */
static result run_op(const problem *p, dm_dtype dt, int64_t chunk) {
  dm_tensor *x[NIN], *sT;
  make_leaves(p, dt, x);
  dm_tensor *o = dm_kda(x[Q], x[K], x[V], x[G], x[BETA], x[S0], chunk, &sT);
  dm_tensor *loss = add_owned(weighted(o, p->w), weighted(sT, p->ws));
  dm_backward(loss, NULL);
  dm_release(loss);
  result r = collect(p, o, sT, x);
  dm_release(o);
  dm_release(sT);
  return r;
}

/* the same in two segments [0, t1) and [t1, T), the first's final state the second's initial one */
static result run_split(const problem *p, dm_dtype dt, int64_t t1) {
  dm_tensor *x[NIN], *seg[2][NIN], *o[2], *s[2], *loss = NULL;
  make_leaves(p, dt, x);
  int64_t start[2] = {0, t1}, len[2] = {t1, p->T - t1};
  for (int h = 0; h < 2; h++) {
    for (int i = Q; i <= BETA; i++) seg[h][i] = dm_narrow(x[i], 1, start[h], len[h]);
    seg[h][S0] = h == 0 ? x[S0] : s[0];
    o[h] = dm_kda(seg[h][Q], seg[h][K], seg[h][V], seg[h][G], seg[h][BETA], seg[h][S0], 0, &s[h]);
    dm_tensor *wpart = dm_narrow(p->w, 1, start[h], len[h]);
    dm_tensor *l = weighted(o[h], wpart);
    dm_release(wpart);
    loss = loss ? add_owned(loss, l) : l;
  }
  loss = add_owned(loss, weighted(s[1], p->ws));
  dm_backward(loss, NULL);
  dm_release(loss);
  dm_tensor *whole = dm_tensor_new(DM_CPU, o[0]->dtype, 4, (int64_t[]){p->B, p->T, p->H, p->dv});
  for (int h = 0; h < 2; h++) {
    dm_tensor *part = dm_narrow(whole, 1, start[h], len[h]);
    dm_copy_(part, o[h]);
    dm_release(part);
  }
  result r = collect(p, whole, s[1], x);
  dm_release(whole);
  for (int h = 0; h < 2; h++) {
    for (int i = Q; i <= BETA; i++) dm_release(seg[h][i]);
    dm_release(o[h]);
    dm_release(s[h]);
  }
  return r;
}

/* ---- comparing ---------------------------------------------------------------------------------- */

/* |a - ref|_2 / |ref|_2 (the absolute norm when ref is zero); Inf when a has a NaN or Inf */
static double rel(const dm_tensor *a, const dm_tensor *ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < dm_numel(ref); i++) {
    double x = D(a)[i], y = D(ref)[i];
    if (!isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static bool same_bits(const dm_tensor *a, const dm_tensor *b) {
  return dm_numel(a) == dm_numel(b) && memcmp(D(a), D(b), sizeof(double) * (size_t)dm_numel(a)) == 0;
}

/* the worst forward (o, S_T) and gradient errors of r against ref */
static void errors(const result *r, const result *ref, double *fwd, double *bwd) {
  *fwd = fmax(rel(r->o, ref->o), rel(r->sT, ref->sT));
  *bwd = 0;
  for (int i = 0; i < NIN; i++) if (ref->grad[i]) *bwd = fmax(*bwd, rel(r->grad[i], ref->grad[i]));
}

static bool expect_close(const char *what, const result *r, const result *ref, double tol_fwd, double tol_bwd) {
  double f, b;
  errors(r, ref, &f, &b);
  bool ok = f <= tol_fwd && b <= tol_bwd;
  CHECK(ok);
  if (!ok) {
    fprintf(stderr, "  %s: forward %.3g (tol %.0g), gradients %.3g (tol %.0g)\n", what, f, tol_fwd, b, tol_bwd);
    for (int i = 0; i < NIN; i++)
      if (ref->grad[i]) fprintf(stderr, "    d%s %.3g\n", in_names[i], rel(r->grad[i], ref->grad[i]));
  }
  return ok;
}

static bool same_result(const result *a, const result *b) {
  bool ok = same_bits(a->o, b->o) && same_bits(a->sT, b->sT);
  for (int i = 0; i < NIN; i++) if (a->grad[i]) ok = ok && same_bits(a->grad[i], b->grad[i]);
  return ok;
}

/* ---- the tests ------------------------------------------------------------------------------- */

/* f64 against the reference to 1e-12; f32 to 1e-5 (o, S_T) and 2e-5 (gradients); bf16 q, k, v
** (f32 gates and state) against the reference on the same rounded values to 1e-2 */
static void check_problem(const char *what, const problem *p, bool with_bf16) {
  result ref = reference(p);
  result r64 = run_op(p, DM_F64, 0), r32 = run_op(p, DM_F32, 0);
  double f64f, f64b, f32f, f32b;
  errors(&r64, &ref, &f64f, &f64b);
  errors(&r32, &ref, &f32f, &f32b);
  char name[160];
  snprintf(name, sizeof name, "%s f64", what);
  expect_close(name, &r64, &ref, 1e-12, 1e-12);
  snprintf(name, sizeof name, "%s f32", what);
  expect_close(name, &r32, &ref, 1e-5, 2e-5);
  printf("  %-44s f64 %.1e %.1e   f32 %.1e %.1e", what, f64f, f64b, f32f, f32b);
  if (with_bf16) {
    problem pr = clone_problem(p);
    for (int i = Q; i <= V; i++) round_through(pr.in[i], DM_BF16);
    round_through(pr.w, DM_BF16);
    result rref = reference(&pr), r16 = run_op(&pr, DM_BF16, 0);
    double f, b;
    errors(&r16, &rref, &f, &b);
    snprintf(name, sizeof name, "%s bf16", what);
    expect_close(name, &r16, &rref, 1e-2, 1e-2);
    printf("   bf16 %.1e %.1e", f, b);
    free_result(&rref); free_result(&r16); free_problem(&pr);
  }
  printf("\n");
  free_result(&ref); free_result(&r64); free_result(&r32);
}

static void shapes(void) {
  printf("forward / gradient errors (rel L2) against the float64 reference:\n");
  static const int64_t cfg[][5] = {{1, 1, 1, 4, 4}, {2, 15, 3, 5, 7}, {1, 17, 2, 8, 8}, {1, 63, 2, 16, 12},
                                   {2, 64, 1, 6, 6}, {2, 65, 1, 16, 16}, {1, 127, 1, 60, 32}, {1, 1000, 2, 8, 6}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    problem p = make(cfg[c][0], cfg[c][1], cfg[c][2], cfg[c][3], cfg[c][4], GATE_MIXED, c % 3 != 1);
    char what[96];
    snprintf(what, sizeof what, "B=%lld T=%lld H=%lld dk=%lld dv=%lld%s", (long long)p.B, (long long)p.T,
             (long long)p.H, (long long)p.dk, (long long)p.dv, p.in[S0] ? "" : " no S0");
    check_problem(what, &p, true);
    free_problem(&p);
  }
}

static void gate_regimes(void) {
  for (int g = GATE_ZERO; g <= GATE_NEG_INF; g++) {
    problem p = make(1, 70, 2, 8, 8, g, true);
    char what[96];
    snprintf(what, sizeof what, "gate %s, T=70", gate_names[g]);
    check_problem(what, &p, false);
    free_problem(&p);
  }
}

/* [0, T) in one call equals [0, t1) then [t1, T) with the state carried, gradients through
** the carried state included: f64 to 1e-12, f32 to 1e-6 (both are in fact bit for bit) */
static void split_whole(void) {
  problem p = make(2, 130, 2, 6, 5, GATE_MIXED, true);
  static const int64_t cuts[] = {1, 63, 64, 65, 129};
  for (int d = 0; d < 2; d++) {
    dm_dtype dt = d ? DM_F32 : DM_F64;
    result whole = run_op(&p, dt, 0);
    bool bits = true;
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
      result split = run_split(&p, dt, cuts[c]);
      char what[64];
      snprintf(what, sizeof what, "split at %lld, %s", (long long)cuts[c], dm_dtype_name(dt));
      expect_close(what, &split, &whole, d ? 1e-6 : 1e-12, d ? 1e-6 : 1e-12);
      bits = bits && same_result(&split, &whole);
      free_result(&split);
    }
    printf("split vs whole (cuts 1, 63, 64, 65, 129), %s: %s\n", dm_dtype_name(dt),
           bits ? "bit-identical" : "within tolerance, not bit-identical");
    free_result(&whole);
  }
  free_problem(&p);
}

/* rows t < P of a [B, T, ...] tensor agree bit for bit */
static bool prefix_same(const dm_tensor *a, const dm_tensor *b, int64_t P) {
  dm_tensor *x = dm_narrow((dm_tensor *)a, 1, 0, P), *y = dm_narrow((dm_tensor *)b, 1, 0, P);
  dm_tensor *xc = cast(x, DM_F64), *yc = cast(y, DM_F64);
  bool same = same_bits(xc, yc);
  dm_release(x); dm_release(y); dm_release(xc); dm_release(yc);
  return same;
}

/* New values for every input at positions >= P leave the outputs at t < P, and, for a loss
** that reads only those outputs, every gradient at t < P and S0's, bit for bit unchanged. */
static void causality(void) {
  static const int64_t Ps[] = {37, 64, 70, 99};
  for (int d = 0; d < 2; d++)
    for (size_t c = 0; c < sizeof Ps / sizeof Ps[0]; c++) {
      int64_t P = Ps[c];
      problem p = make(1, 100, 2, 8, 8, GATE_MIXED, true);
      for (int64_t i = 0; i < dm_numel(p.ws); i++) D(p.ws)[i] = 0;
      for (int64_t t = P; t < p.T; t++)
        for (int64_t n = 0; n < p.H * p.dv; n++) D(p.w)[t * p.H * p.dv + n] = 0;
      problem p2 = clone_problem(&p);
      for (int i = Q; i <= BETA; i++) {
        int64_t row = dm_numel(p2.in[i]) / p.T;
        for (int64_t n = P * row; n < p.T * row; n++)
          D(p2.in[i])[n] = i == G ? -10 * urand() : i == BETA ? urand() : 3 * nrand();
      }
      dm_dtype dt = d ? DM_F32 : DM_F64;
      result a = run_op(&p, dt, 0), b = run_op(&p2, dt, 0);
      bool ok = prefix_same(a.o, b.o, P) && same_bits(a.grad[S0], b.grad[S0]);
      for (int i = Q; i <= BETA; i++) ok = ok && prefix_same(a.grad[i], b.grad[i], P);
      ok = ok && !same_bits(a.o, b.o);                 /* the perturbation did change later outputs */
      CHECK(ok);
      if (!ok) fprintf(stderr, "  causality broken at P = %lld in %s\n", (long long)P, dm_dtype_name(dt));
      free_result(&a); free_result(&b); free_problem(&p); free_problem(&p2);
    }
}

/* two runs are bit-identical, and so are runs with any checkpoint interval */
static void determinism(void) {
  problem p = make(2, 200, 3, 12, 10, GATE_MIXED, true);
  result a = run_op(&p, DM_F32, 0), b = run_op(&p, DM_F32, 0);
  CHECK(same_result(&a, &b));
  static const int64_t chunks[] = {1, 7, 63, 200, 1000};
  for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
    result r = run_op(&p, DM_F32, chunks[c]);
    CHECK(same_result(&r, &a));
    free_result(&r);
  }
  free_result(&a); free_result(&b); free_problem(&p);
}

/* loss of problem p in f64 through the reference */
static double ref_loss(const problem *p) {
  result r = reference(p);
  double s = 0;
  for (int64_t i = 0; i < dm_numel(r.o); i++) s += D(r.o)[i] * D(p->w)[i];
  for (int64_t i = 0; i < dm_numel(r.sT); i++) s += D(r.sT)[i] * D(p->ws)[i];
  free_result(&r);
  return s;
}

static void initial_state(void) {
  /* finite differences on every element of S0 */
  problem p = make(2, 20, 2, 4, 3, GATE_MIXED, true);
  result r = run_op(&p, DM_F64, 5);
  double num = 0, den = 0;
  for (int64_t n = 0; n < dm_numel(p.in[S0]); n++) {
    double x0 = D(p.in[S0])[n], eps = 1e-6;
    D(p.in[S0])[n] = x0 + eps;
    double lp = ref_loss(&p);
    D(p.in[S0])[n] = x0 - eps;
    double lm = ref_loss(&p);
    D(p.in[S0])[n] = x0;
    double fd = (lp - lm) / (2 * eps);
    num = fmax(num, fabs(fd - D(r.grad[S0])[n]));
    den = fmax(den, fabs(fd));
  }
  CHECK(num / den <= 1e-7);
  printf("initial state: dS0 against central differences, rel %.1e\n", num / den);
  free_result(&r);
  /* no S0 is a zero S0 */
  problem z = clone_problem(&p);
  for (int64_t n = 0; n < dm_numel(z.in[S0]); n++) D(z.in[S0])[n] = 0;
  dm_release(p.in[S0]);
  p.in[S0] = NULL;
  result a = run_op(&p, DM_F32, 0), b = run_op(&z, DM_F32, 0);
  CHECK(same_bits(a.o, b.o) && same_bits(a.sT, b.sT));
  free_result(&a); free_result(&b); free_problem(&z); free_problem(&p);
  /* with beta = 0 and g = 0 the state passes unchanged: S_T = S0, and with a loss
  ** of S_T alone dS0 = dS_T, exactly */
  problem id = make(1, 9, 2, 3, 4, GATE_ZERO, true);
  for (int64_t n = 0; n < dm_numel(id.in[BETA]); n++) D(id.in[BETA])[n] = 0;
  for (int64_t n = 0; n < dm_numel(id.w); n++) D(id.w)[n] = 0;        /* only S_T in the loss */
  result ri = run_op(&id, DM_F32, 4);
  dm_tensor *s0 = cast(id.in[S0], DM_F32), *s0d = cast(s0, DM_F64), *ws = cast(id.ws, DM_F32), *wsd = cast(ws, DM_F64);
  CHECK(same_bits(ri.sT, s0d) && same_bits(ri.grad[S0], wsd));
  dm_release(s0); dm_release(s0d); dm_release(ws); dm_release(wsd);
  free_result(&ri); free_problem(&id);
}

/* the gate at its extremes: no NaN forward or backward, g in [lb, 0] (bounded) or <= 0 */
static void gate_extremes(void) {
  int64_t fs[3] = {3, 5, 8}, hs[1] = {2}, ds[1] = {8};
  dm_tensor *f = f64_new(3, fs), *a_log = f64_new(1, hs), *dt_bias = f64_new(1, ds);
  static const double fv[] = {-1e4, -200, -30, -1, 0.5, 30, 200, 1e4};
  for (int64_t i = 0; i < dm_numel(f); i++) D(f)[i] = fv[i % 8] * (1 + 0.1 * urand());
  D(a_log)[0] = 100;                                   /* e^100 overflows f32 */
  D(a_log)[1] = -3;
  for (int64_t i = 0; i < 8; i++) D(dt_bias)[i] = 0.1 * nrand();
  for (int kind = 0; kind < 2; kind++)
    for (int d = 0; d < 2; d++) {
      dm_dtype dt = d ? DM_F32 : DM_F64;
      dm_tensor *x[3] = {cast(f, dt), cast(a_log, dt), cast(dt_bias, dt)};
      for (int i = 0; i < 3; i++) x[i]->requires_grad = true;
      dm_tensor *g = dm_kda_gate(x[0], x[1], x[2], kind, -5);
      dm_tensor *gd = cast(g, DM_F64);
      bool ok = g->dtype == (d ? DM_F32 : DM_F64);
      for (int64_t i = 0; i < dm_numel(gd); i++) {
        double v = D(gd)[i];
        ok = ok && !isnan(v) && v <= 0 && (kind == 1 || v >= -5);
      }
      /* a loss that reads half the gates: zero upstream gradients next to infinite slopes */
      dm_tensor *w = f64_new(3, fs);
      for (int64_t i = 0; i < dm_numel(w); i++) D(w)[i] = i % 2;
      dm_tensor *l = weighted(g, w);
      dm_backward(l, NULL);
      for (int i = 0; i < 3; i++) {
        dm_tensor *gr = cast(x[i]->grad, DM_F64);
        for (int64_t n = 0; n < dm_numel(gr); n++) ok = ok && !isnan(D(gr)[n]);
        dm_release(gr);
      }
      CHECK(ok);
      if (!ok) fprintf(stderr, "  gate extremes: kind %d in %s\n", kind, dm_dtype_name(dt));
      dm_release(l); dm_release(w); dm_release(g); dm_release(gd);
      for (int i = 0; i < 3; i++) dm_release(x[i]);
    }
  dm_release(f); dm_release(a_log); dm_release(dt_bias);
}

static void errors_named(void) {
  problem p = make(1, 6, 2, 3, 4, GATE_MIXED, true);
  dm_tensor *v5 = f64_new(4, (int64_t[]){1, 5, 2, 4}), *k32 = cast(p.in[K], DM_F32);
  dm_tensor *bad_s0 = f64_new(4, (int64_t[]){1, 2, 4, 3}), *beta4 = f64_new(4, (int64_t[]){1, 6, 2, 1});
  dm_tensor **in = p.in;
  EXPECT_ERROR(dm_kda(in[Q], in[K], v5, in[G], in[BETA], in[S0], 0, NULL), "[1, 5, 2, 4]");
  CHECK(strstr(check_msg, "[1, 6, 2, 3]") != NULL);   /* q's shape too */
  EXPECT_ERROR(dm_kda(in[Q], k32, in[V], in[G], in[BETA], in[S0], 0, NULL), "f64 and f32");
  EXPECT_ERROR(dm_kda(in[Q], in[K], in[V], in[G], in[BETA], bad_s0, 0, NULL), "[1, 2, 3, 4]");
  EXPECT_ERROR(dm_kda(in[Q], in[K], in[V], in[G], beta4, in[S0], 0, NULL), "beta has shape [1, 6, 2, 1]");
  dm_attrs a = dm_attrs_of(1, (double[]){1.5});
  dm_tensor *out[2];
  EXPECT_ERROR(dm_call(dm_op_get("kda"), 6, in, &a, out), "chunk must be a whole number");
  dm_tensor *f = f64_new(2, (int64_t[]){2, 5}), *bias4 = f64_new(1, (int64_t[]){4}), *a3 = f64_new(1, (int64_t[]){3});
  dm_tensor *f4 = f64_new(2, (int64_t[]){2, 4});
  EXPECT_ERROR(dm_kda_gate(f, NULL, bias4, 0, -5), "f of shape [2, 5]");
  CHECK(strstr(check_msg, "[4]") != NULL);
  EXPECT_ERROR(dm_kda_gate(f4, a3, bias4, 0, -5), "A_log of shape [3]");
  EXPECT_ERROR(dm_kda_gate(f4, NULL, bias4, 0, 1), "lb must be negative");
  EXPECT_ERROR(dm_kda_gate(f4, NULL, bias4, 2, -5), "kind must be one of bounded|softplus");
  dm_release(v5); dm_release(k32); dm_release(bad_s0); dm_release(beta4);
  dm_release(f); dm_release(bias4); dm_release(a3); dm_release(f4);
  free_problem(&p);
}

/* B=1, T=1024, H=4, dk=dv=64 in f32: the median of 5 forwards, and of 5 forward+backwards */
static void timing(void) {
  problem p = make(1, 1024, 4, 64, 64, GATE_LOGSIG, true);
  double tf[5], tb[5];
  for (int rep = 0; rep < 5; rep++) {
    dm_tensor *x[NIN], *sT;
    make_leaves(&p, DM_F32, x);
    dm_set_grad_enabled(false);
    double t0 = check_now_ms();
    dm_tensor *o = dm_kda(x[Q], x[K], x[V], x[G], x[BETA], x[S0], 0, &sT);
    tf[rep] = check_now_ms() - t0;
    dm_release(o); dm_release(sT);
    dm_set_grad_enabled(true);
    t0 = check_now_ms();                                     /* the loss's mul and sum are noise here */
    o = dm_kda(x[Q], x[K], x[V], x[G], x[BETA], x[S0], 0, &sT);
    dm_tensor *loss = add_owned(weighted(o, p.w), weighted(sT, p.ws));
    dm_backward(loss, NULL);
    tb[rep] = check_now_ms() - t0;
    dm_release(loss); dm_release(o); dm_release(sT);
    for (int i = 0; i < NIN; i++) dm_release(x[i]);
  }
  qsort(tf, 5, sizeof tf[0], check_cmp_double);
  qsort(tb, 5, sizeof tb[0], check_cmp_double);
  printf("timing, CPU f32, B=1 T=1024 H=4 dk=dv=64: forward %.1f ms, forward+backward %.1f ms\n", tf[2], tb[2]);
  free_problem(&p);
}

int main(void) {
  check_begin();
  shapes();
  gate_regimes();
  split_whole();
  causality();
  determinism();
  initial_state();
  gate_extremes();
  errors_named();
  CHECK(dm_tape_size() == 0);
  if (!getenv("DM_KDA_NO_TIMING")) timing();
  return check_end();
}
