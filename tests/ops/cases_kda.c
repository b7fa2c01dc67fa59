/*
** cases_kda.c — the KDA recurrence and its gate against plain loops in
** double, written from the spec's equations (model.md), not from the
** kernels:
**
**   S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S_t^T q_t
**   bounded gate  g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))
**   softplus gate g = -exp(A_log[h]) * log(1 + exp(f + dt_bias))
**
** The recurrence's trials mix tiny awkward shapes (T = 1, dk = dv = 1),
** an absent initial state, gates that are exactly zero, at the bound -5
** and at -50, and small checkpoint intervals (chunk 1, 2, 3), so that the
** finite differences of --mode grad go through the backward's chunked
** recompute; both outputs (o and the final state) enter the loss.
**
** The same oracle checks the chunked algorithm (algo 2: chunks of 64,
** sub-chunks of 16), on shapes that end inside a chunk or a sub-chunk
** (T = 1, 17, 65, 100, 130), with the same gate regimes; its finite
** differences go through the chunked backward.
*/
#include <math.h>
#include "harness.h"

#define TRIALS 6
#define PERF_TRIAL (TRIALS + 1)        /* 1-based: trial index TRIALS is the large one */

/* ---- kda ------------------------------------------------------------------------------------ */

/* q or k: random rows of unit length over the last dim, as the model feeds them */
static dm_tensor *unit_rows(h_rng *r, int nd, const int64_t *shape) {
  dm_tensor *t = h_randn(r, nd, shape);
  int64_t d = shape[nd - 1];
  for (int64_t row = 0; row < dm_numel(t) / d; row++) {
    double ss = 0;
    for (int64_t i = 0; i < d; i++) ss += h_get(t, row * d + i) * h_get(t, row * d + i);
    for (int64_t i = 0; i < d; i++) h_set(t, row * d + i, h_get(t, row * d + i) / sqrt(ss + 1e-6));
  }
  return t;
}

/* log-decays by regime: 0 mixed in (-1.5, 0] with exact zeros, 1 all zero,
** 2 the bound -5, the far -50 and ordinary values mixed */
static dm_tensor *gates(h_rng *r, int nd, const int64_t *shape, int regime) {
  dm_tensor *t = h_uniform_t(r, nd, shape, -1.5, 0);
  for (int64_t i = 0; i < dm_numel(t); i++) {
    int64_t pick = h_int(r, 0, 9);
    if (regime == 1 || (regime == 0 && pick < 3)) h_set(t, i, 0);
    if (regime == 2) h_set(t, i, pick < 4 ? -5 : pick < 6 ? -50 : h_get(t, i));
  }
  return t;
}

/* B, T, H, dk, dv, initial state, gate regime, chunk; trial 5 draws its sizes up to maxT */
static void kda_make(h_rng *r, int k, const int64_t (*fixed)[8], int64_t maxT, int algo, dm_tensor **in,
                     dm_attrs *a) {
  int64_t p[8];
  for (int i = 0; i < 8; i++) p[i] = fixed[k][i];
  if (k == 5) {                                        /* random awkward sizes */
    p[0] = h_int(r, 1, 2); p[1] = h_int(r, 1, maxT); p[2] = h_int(r, 1, 3);
    p[3] = h_int(r, 1, 5); p[4] = h_int(r, 1, 5);
  }
  int64_t qs[4] = {p[0], p[1], p[2], p[3]}, vs[4] = {p[0], p[1], p[2], p[4]}, ss[4] = {p[0], p[2], p[3], p[4]};
  in[0] = unit_rows(r, 4, qs);
  in[1] = unit_rows(r, 4, qs);
  in[2] = h_randn(r, 4, vs);
  in[3] = gates(r, 4, qs, (int)p[6]);
  in[4] = h_uniform_t(r, 3, qs, 0.05, 0.95);
  in[5] = NULL;
  if (p[5]) {
    in[5] = h_randn(r, 4, ss);
    for (int64_t i = 0; i < dm_numel(in[5]); i++) h_set(in[5], i, 0.5 * h_get(in[5], i));
  }
  *a = dm_attrs_of(2, (double[]){(double)p[7], algo});
}

static void kda_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  static const int64_t fixed[TRIALS + 1][8] = {
    {1, 5, 2, 3, 4, 1, 0, 2}, {2, 1, 1, 1, 1, 0, 0, 0}, {1, 7, 3, 4, 2, 1, 2, 3},
    {2, 13, 1, 5, 3, 1, 0, 0}, {1, 9, 2, 2, 3, 1, 1, 1}, {0, 0, 0, 0, 0, 1, 2, 4},
    {1, 1024, 4, 64, 64, 1, 0, 0}};
  kda_make(r, k, fixed, 11, 1, in, a);
}

static void kda_chunk_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  static const int64_t fixed[TRIALS + 1][8] = {
    {1, 65, 2, 3, 4, 1, 0, 0}, {2, 1, 1, 1, 1, 0, 0, 0}, {1, 130, 1, 5, 3, 1, 2, 0},
    {1, 17, 2, 4, 2, 1, 1, 0}, {1, 100, 1, 32, 24, 1, 0, 0}, {0, 0, 0, 0, 0, 1, 2, 0},
    {1, 1024, 4, 64, 64, 1, 0, 0}};
  kda_make(r, k, fixed, 150, 2, in, a);
}

static void kda_oracle(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *q = in[0], *k = in[1], *v = in[2], *g = in[3], *beta = in[4], *s0 = in[5];
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
  ex[0] = h_new(DM_F64, 4, (int64_t[]){B, T, H, dv});
  ex[1] = h_new(DM_F64, 4, (int64_t[]){B, H, dk, dv});
  double S[64][64], e[64];
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) S[i][j] = s0 ? h_at(s0, (int64_t[]){b, h, i, j}) : 0;
      for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < dk; i++) {
          double decay = exp(h_at(g, (int64_t[]){b, t, h, i}));
          for (int64_t j = 0; j < dv; j++) S[i][j] *= decay;
        }
        for (int64_t j = 0; j < dv; j++) {
          e[j] = h_at(v, (int64_t[]){b, t, h, j});
          for (int64_t i = 0; i < dk; i++) e[j] -= S[i][j] * h_at(k, (int64_t[]){b, t, h, i});
        }
        double bt = h_at(beta, (int64_t[]){b, t, h});
        for (int64_t i = 0; i < dk; i++)
          for (int64_t j = 0; j < dv; j++) S[i][j] += bt * h_at(k, (int64_t[]){b, t, h, i}) * e[j];
        for (int64_t j = 0; j < dv; j++) {
          double o = 0;
          for (int64_t i = 0; i < dk; i++) o += S[i][j] * h_at(q, (int64_t[]){b, t, h, i});
          h_set_at(ex[0], (int64_t[]){b, t, h, j}, o);
        }
      }
      for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) h_set_at(ex[1], (int64_t[]){b, h, i, j}, S[i][j]);
    }
}

/* ---- kda_gate ------------------------------------------------------------------------------- */

static void gate_inputs(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  /* f's shape, heads (0: no A_log), dt_bias as [H, dk] (else flat), kind, lb */
  static const struct { int nd; int64_t f[4]; int64_t heads; bool headed_bias; int kind; double lb; } t[TRIALS + 1] = {
    {3, {2, 3, 8}, 2, false, 0, -5},   {3, {5, 2, 3}, 2, true, 1, 0},   {1, {7}, 0, false, 0, -2},
    {3, {1, 4, 6}, 3, false, 1, 0},    {4, {3, 1, 4, 4}, 4, false, 0, -7}, {2, {5, 6}, 0, true, 1, 0},
    {3, {8, 1024, 2048}, 32, false, 0, -5}};
  int nd = t[k].nd;
  int64_t D = t[k].f[nd - 1];
  if (nd >= 2 && t[k].heads && t[k].f[nd - 2] == t[k].heads) D *= t[k].heads;   /* [..., H, dk] */
  if (k == 5) D = 6;
  in[0] = h_randn(r, nd, t[k].f);
  for (int64_t i = 0; i < dm_numel(in[0]); i++) h_set(in[0], i, 2 * h_get(in[0], i));
  int64_t H = t[k].heads ? t[k].heads : 2;
  in[1] = t[k].heads ? h_uniform_t(r, 1, &H, -1, 2.8) : NULL;
  int64_t bs[2] = {H, D / H}, flat = D;
  in[2] = t[k].headed_bias ? h_randn(r, 2, bs) : h_randn(r, 1, &flat);
  *a = dm_attrs_of(2, (double[]){t[k].kind, t[k].lb});
}

static double sigmoid(double x) { return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x)); }

static void gate_oracle(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  const dm_tensor *f = in[0], *a_log = in[1], *bias = in[2];
  int64_t D = dm_numel(bias), heads = a_log ? dm_numel(a_log) : 1;
  ex[0] = h_new(DM_F64, f->ndim, f->shape);
  for (int64_t i = 0; i < dm_numel(f); i++) {
    int64_t c = i % D;
    double z = h_get(f, i) + h_get(bias, c), A = a_log ? h_get(a_log, c / (D / heads)) : 0;
    double g = a->v[0] == 0 ? a->v[1] * sigmoid(exp(A) * z)
                            : -exp(A) * (z > 30 ? z + exp(-z) : log1p(exp(z)));
    h_set(ex[0], i, g);
  }
}

static const dm_case cases[] = {
  {.op = "kda", .label = "recurrence", .inputs = kda_inputs, .oracle = kda_oracle, .trials = TRIALS,
   .perf_trial = PERF_TRIAL},
  {.op = "kda", .label = "chunked", .inputs = kda_chunk_inputs, .oracle = kda_oracle, .trials = TRIALS,
   .perf_trial = PERF_TRIAL},
  {.op = "kda_gate", .label = "bounded, softplus", .inputs = gate_inputs, .oracle = gate_oracle,
   .trials = TRIALS, .perf_trial = PERF_TRIAL},
};
DM_REGISTER_CASES(cases)
