/*
** test_moe.c — the routed-expert path as a whole: router product → route →
** sort → experts → combine equals a dense per-token reference (each token
** through its k experts, plain loops in double), its gradients match
** finite differences, it repeats bit for bit, every expert with tokens gets
** a weight gradient and one without gets exact zeros; the counters, the
** capacity mask and the balancing update on known values; the errors.
**
**   test_moe            the tests
**   test_moe --bench    f32 forward + backward timings at the tiny and small presets
*/
#include <math.h>
#include <stdlib.h>
#include <time.h>
#include "check.h"
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/moe.h"

typedef struct shape { int64_t n, d, e, k, r, f; } shape;

/* the parameters of one MoE layer and its input */
typedef struct layer {
  shape s;
  dm_tensor *u, *wr, *bias, *ug, *uu, *cg, *cu, *dw;
} layer;

static dm_tensor *randn(dm_dtype dt, int nd, const int64_t *sh, double scale, double shift) {
  dm_tensor *t = dm_randn(DM_CPU, DM_F64, nd, sh);
  dm_tensor *a = dm_affine(t, scale, shift), *c = dm_cast(a, dt);
  dm_release(t);
  dm_release(a);
  return c;
}

static layer layer_new(shape s, dm_dtype dt, uint64_t seed) {
  dm_manual_seed(seed);
  layer l = {.s = s};
  int64_t su[2] = {s.n, s.d}, sr[2] = {s.d, s.e}, sw[3] = {s.e, s.d, s.r}, sc[2] = {s.e, s.r},
          sd[3] = {s.e, s.r, s.f};
  l.u = randn(dt, 2, su, 1, 0);
  l.wr = randn(dt, 2, sr, 1 / sqrt((double)s.d), 0);
  l.bias = randn(dt, 1, &s.e, 0.1, 0);
  l.ug = randn(dt, 3, sw, 1 / sqrt((double)s.d), 0);
  l.uu = randn(dt, 3, sw, 1 / sqrt((double)s.d), 0);
  l.cg = randn(dt, 2, sc, 0.2, 1);
  l.cu = randn(dt, 2, sc, 0.2, 1);
  l.dw = randn(dt, 3, sd, 1 / sqrt((double)s.r), 0);
  return l;
}

#define PARAMS(l) { (l)->u, (l)->wr, (l)->ug, (l)->uu, (l)->cg, (l)->cu, (l)->dw }
enum { NPARAMS = 7 };
static const char *param_names[NPARAMS] = {"u", "Wr", "Ug", "Uu", "cg", "cu", "D"};

static void layer_free(layer *l) {
  dm_tensor *p[NPARAMS] = PARAMS(l);
  for (int i = 0; i < NPARAMS; i++) { dm_release(p[i]->grad); p[i]->grad = NULL; dm_release(p[i]); }
  dm_release(l->bias);
}

static void requires_grad(layer *l, bool on) {
  dm_tensor *p[NPARAMS] = PARAMS(l);
  for (int i = 0; i < NPARAMS; i++) p[i]->requires_grad = on;
}

/* the path; counts and idx out when asked */
static dm_tensor *layer_forward(layer *l, dm_tensor **counts_out, dm_tensor **idx_out) {
  dm_tensor *logits = dm_matmul(l->u, l->wr, false, false), *idx, *w, *counts, *perm, *off, *inv;
  dm_moe_route(logits, l->bias, l->s.k, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts);
  dm_moe_sort(idx, l->s.e, &perm, &off, &inv);
  dm_tensor *rows = dm_moe_experts(l->u, perm, off, l->ug, l->uu, l->cg, l->cu, l->dw, l->s.k);
  dm_tensor *y = dm_moe_combine(rows, inv, w);
  if (counts_out) *counts_out = counts; else dm_release(counts);
  if (idx_out) *idx_out = idx; else dm_release(idx);
  dm_release(logits); dm_release(w); dm_release(perm); dm_release(off); dm_release(inv); dm_release(rows);
  return y;
}

static double get(const dm_tensor *t, int64_t i) { return dm_load(t->dtype, (const char *)dm_data(t) + i * (int64_t)dm_dtype_size(t->dtype)); }
static double sigm(double x) { return 1 / (1 + exp(-x)); }

/* the dense reference: each token scored against every expert, its top k by hand, each through its formula */
static double *dense_reference(const layer *l) {
  shape s = l->s;
  double *y = calloc((size_t)(s.n * s.f), sizeof *y), *sc = malloc(sizeof(double) * (size_t)s.e);
  double *h = malloc(sizeof(double) * (size_t)s.r);
  int *chosen = malloc(sizeof(int) * (size_t)s.e);
  for (int64_t t = 0; t < s.n; t++) {
    for (int64_t e = 0; e < s.e; e++) {
      double z = 0;
      for (int64_t c = 0; c < s.d; c++) z += get(l->u, t * s.d + c) * get(l->wr, c * s.e + e);
      sc[e] = sigm(z);
      chosen[e] = 0;
    }
    double sum = 0;
    for (int64_t j = 0; j < s.k; j++) {
      int64_t best = -1;
      for (int64_t e = 0; e < s.e; e++)
        if (!chosen[e] && (best < 0 || sc[e] + get(l->bias, e) > sc[best] + get(l->bias, best))) best = e;
      chosen[best] = 1;
      sum += sc[best];
    }
    for (int64_t e = 0; e < s.e; e++) {
      if (!chosen[e]) continue;
      for (int64_t i = 0; i < s.r; i++) {
        double zg = 0, zu = 0;
        for (int64_t c = 0; c < s.d; c++) {
          zg += get(l->u, t * s.d + c) * get(l->ug, (e * s.d + c) * s.r + i);
          zu += get(l->u, t * s.d + c) * get(l->uu, (e * s.d + c) * s.r + i);
        }
        zg *= get(l->cg, e * s.r + i);
        zu *= get(l->cu, e * s.r + i);
        h[i] = zg * sigm(zg) * zu;
      }
      for (int64_t o = 0; o < s.f; o++) {
        double v = 0;
        for (int64_t i = 0; i < s.r; i++) v += h[i] * get(l->dw, (e * s.r + i) * s.f + o);
        y[t * s.f + o] += sc[e] / sum * v;
      }
    }
  }
  free(sc); free(h); free(chosen);
  return y;
}

static double rel_error(const dm_tensor *t, const double *ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < dm_numel(t); i++) {
    num = fmax(num, fabs(get(t, i) - ref[i]));
    den = fmax(den, fabs(ref[i]));
    if (isnan(get(t, i))) return NAN;
  }
  return num / den;
}

static void path_equals_dense_reference(void) {
  static const shape shapes[] = {
    {37, 11, 6, 2, 3, 9}, {1, 5, 1, 1, 1, 1}, {9, 7, 4, 4, 2, 5}, {23, 3, 16, 1, 5, 13}, {64, 64, 8, 2, 8, 128}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    dm_dtype dts[2] = {DM_F64, DM_F32};
    for (int v = 0; v < 2; v++) {
      layer l = layer_new(shapes[i], dts[v], 100 + i);
      dm_tensor *y = layer_forward(&l, NULL, NULL);
      double *ref = dense_reference(&l);
      double e = rel_error(y, ref);
      CHECK(e <= (v == 0 ? 1e-12 : 1e-5));
      if (!(e <= (v == 0 ? 1e-12 : 1e-5))) fprintf(stderr, "  shape %zu %s: relative error %g\n", i, dm_dtype_name(dts[v]), e);
      free(ref);
      dm_release(y);
      layer_free(&l);
    }
  }
}

/* loss = sum(y * R) for a fixed R */
static double loss_of(layer *l, const dm_tensor *r) {
  dm_tensor *y = layer_forward(l, NULL, NULL);
  double s = 0;
  for (int64_t i = 0; i < dm_numel(y); i++) s += get(y, i) * get(r, i);
  dm_release(y);
  return s;
}

static void path_gradients_match_differences(void) {
  shape s = {19, 7, 5, 2, 3, 6};
  layer l = layer_new(s, DM_F64, 7);
  int64_t sy[2] = {s.n, s.f};
  dm_tensor *r = randn(DM_F64, 2, sy, 1, 0);
  requires_grad(&l, true);
  dm_tensor *y = layer_forward(&l, NULL, NULL);
  dm_backward(y, r);
  dm_release(y);
  dm_set_grad_enabled(false);
  dm_tensor *p[NPARAMS] = PARAMS(&l);
  for (int i = 0; i < NPARAMS; i++) {
    double num = 0, den = 0;
    CHECK(p[i]->grad != NULL);
    if (!p[i]->grad) continue;
    int64_t n = dm_numel(p[i]), step = n > 40 ? n / 40 : 1;
    for (int64_t j = 0; j < n; j += step) {
      double *x = (double *)dm_data(p[i]) + j, x0 = *x, eps = 1e-6;
      *x = x0 + eps;
      double lp = loss_of(&l, r);
      *x = x0 - eps;
      double lm = loss_of(&l, r);
      *x = x0;
      double fd = (lp - lm) / (2 * eps), an = get(p[i]->grad, j);
      num = fmax(num, fabs(fd - an));
      den = fmax(den, fabs(fd));
    }
    double e = num / fmax(den, 1e-3);
    CHECK(e < 1e-6);
    if (!(e < 1e-6)) fprintf(stderr, "  %s: gradient relative error %g\n", param_names[i], e);
  }
  dm_set_grad_enabled(true);
  dm_release(r);
  layer_free(&l);
}

/* forward + backward at the tiny preset in f32: y and every gradient, bit for bit, twice */
typedef struct run_result { dm_tensor *y, *grads[NPARAMS]; } run_result;

static run_result run_once(shape s) {
  layer l = layer_new(s, DM_F32, 11);
  int64_t sy[2] = {s.n, s.f};
  dm_tensor *g = randn(DM_F32, 2, sy, 1, 0);
  requires_grad(&l, true);
  run_result out;
  out.y = layer_forward(&l, NULL, NULL);
  dm_backward(out.y, g);
  dm_tensor *p[NPARAMS] = PARAMS(&l);
  for (int i = 0; i < NPARAMS; i++) { out.grads[i] = p[i]->grad; p[i]->grad = NULL; }
  dm_release(g);
  layer_free(&l);
  return out;
}

static bool same_bits(const dm_tensor *a, const dm_tensor *b) {
  return a && b && dm_numel(a) == dm_numel(b) &&
         memcmp(dm_data(a), dm_data(b), (size_t)dm_numel(a) * dm_dtype_size(a->dtype)) == 0;
}

static void deterministic(void) {
  shape tiny = {512, 64, 8, 2, 8, 128};
  run_result a = run_once(tiny), b = run_once(tiny);
  CHECK(same_bits(a.y, b.y));
  for (int i = 0; i < NPARAMS; i++) {
    CHECK(same_bits(a.grads[i], b.grads[i]));
    dm_release(a.grads[i]);
    dm_release(b.grads[i]);
  }
  dm_release(a.y);
  dm_release(b.y);
}

/* every expert with tokens gets a nonzero weight gradient; one without gets exact zeros */
static void every_expert_gets_its_gradient(void) {
  shape s = {64, 9, 8, 2, 4, 5};
  layer l = layer_new(s, DM_F32, 5);
  float *b = dm_data(l.bias);
  b[3] = -10;                                 /* expert 3 is never chosen */
  requires_grad(&l, true);
  dm_tensor *counts;
  dm_tensor *y = layer_forward(&l, &counts, NULL);
  int64_t sy[2] = {s.n, s.f};
  dm_tensor *g = randn(DM_F32, 2, sy, 1, 0);
  dm_backward(y, g);
  const int64_t *c = dm_data(counts);
  dm_tensor *banks[5] = {l.ug, l.uu, l.cg, l.cu, l.dw};
  for (int64_t e = 0; e < s.e; e++) {
    CHECK((c[e] == 0) == (e == 3));
    for (int i = 0; i < 5; i++) {
      dm_tensor *gr = banks[i]->grad;
      int64_t per = dm_numel(gr) / s.e;
      double mag = 0;
      bool finite = true;
      for (int64_t j = 0; j < per; j++) {
        double v = get(gr, e * per + j);
        finite = finite && isfinite(v);
        mag += fabs(v);
      }
      CHECK(finite);                          /* written: no NaN poison left */
      CHECK(e == 3 ? mag == 0 : mag > 0);
    }
  }
  dm_release(g); dm_release(y); dm_release(counts);
  layer_free(&l);
}

static void counters_on_known_counts(void) {
  int64_t four = 4;
  dm_tensor *c = dm_zeros(DM_CPU, DM_I64, 1, &four);
  int64_t *p = dm_data(c);
  p[0] = 4; p[1] = 0; p[2] = 2; p[3] = 2;
  dm_moe_stats s = dm_moe_counters(c);
  CHECK(s.busiest_share == 0.5);
  CHECK(fabs(s.entropy - (-(0.5 * log(0.5) + 0.5 * log(0.25)))) < 1e-15);
  CHECK(s.dead == 1);
  p[0] = p[1] = p[2] = p[3] = 3;
  s = dm_moe_counters(c);
  CHECK(s.busiest_share == 0.25 && fabs(s.entropy - log(4)) < 1e-15 && s.dead == 0);
  /* balancing: below the mean goes up, above goes down, at the mean stays */
  p[0] = 5; p[1] = 3; p[2] = 1; p[3] = 3;
  dm_tensor *bias = dm_zeros(DM_CPU, DM_F32, 1, &four);
  dm_moe_balance_(bias, c, 0.5);
  const float *b = dm_data(bias);
  CHECK(b[0] == -0.5f && b[1] == 0 && b[2] == 0.5f && b[3] == 0);
  dm_release(bias);
  dm_release(c);
}

/* capacity C: the first C assignments of each expert (in token order) stay; drops sum to the overflow */
static void capacity_drops_and_counts(void) {
  shape s = {40, 4, 3, 2, 2, 3};
  layer l = layer_new(s, DM_F64, 3);
  dm_tensor *logits = dm_matmul(l.u, l.wr, false, false), *idx, *w, *counts, *perm, *off, *inv, *drops;
  dm_moe_route(logits, l.bias, s.k, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts);
  dm_moe_sort(idx, s.e, &perm, &off, &inv);
  int64_t cap = 20;                           /* ceil(0.75 * 80 / 3) */
  dm_tensor *kept = dm_moe_capacity(w, idx, inv, off, cap, &drops);
  const int64_t *c = dm_data(counts), *dr = dm_data(drops);
  int64_t zeros = 0;
  for (int64_t a = 0; a < s.n * s.k; a++) zeros += get(kept, a) == 0;
  int64_t total = 0;
  for (int64_t e = 0; e < s.e; e++) {
    CHECK(dr[e] == (c[e] > cap ? c[e] - cap : 0));
    total += dr[e];
  }
  CHECK(total == zeros && total > 0);
  dm_release(logits); dm_release(idx); dm_release(w); dm_release(counts); dm_release(perm);
  dm_release(off); dm_release(inv); dm_release(drops); dm_release(kept);
  layer_free(&l);
}

static void errors_name_shapes_and_values(void) {
  shape s = {6, 4, 3, 2, 2, 5};
  layer l = layer_new(s, DM_F32, 9);
  dm_tensor *logits = dm_matmul(l.u, l.wr, false, false), *idx, *w, *counts, *perm, *off, *inv, *x;
  EXPECT_ERROR(dm_moe_route(logits, l.bias, 4, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts), "k = 4 experts per token");
  EXPECT_ERROR(dm_moe_route(logits, l.cg, 2, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts), "bias has shape [3, 2], expected [E] = [3]");
  dm_moe_route(logits, l.bias, s.k, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts);
  EXPECT_ERROR(dm_moe_sort(idx, 2, &perm, &off, &inv), "out of range for a dim of size 2");
  dm_moe_sort(idx, s.e, &perm, &off, &inv);
  EXPECT_ERROR(x = dm_moe_experts(l.u, perm, off, l.ug, l.uu, l.cg, l.cu, l.dw, 3), "perm has shape [12]");
  EXPECT_ERROR(x = dm_moe_experts(l.u, perm, off, l.ug, l.ug, l.cg, l.cu, l.cg, 2),
               "D must be 3-D [E, r, F], got shape [3, 2]");
  EXPECT_ERROR(x = dm_moe_experts(l.u, perm, off, l.ug, l.uu, l.cg, l.wr, l.dw, 2),
               "cu has shape [4, 3], expected [E, r] = [3, 2] from Ug of shape [3, 4, 2]");
  EXPECT_ERROR(x = dm_moe_experts(l.u, perm, counts, l.ug, l.uu, l.cg, l.cu, l.dw, 2), "offsets has shape [3]");
  int64_t *o = dm_data(off);
  int64_t keep = o[1];
  o[1] = o[2] + 1;
  EXPECT_ERROR(x = dm_moe_experts(l.u, perm, off, l.ug, l.uu, l.cg, l.cu, l.dw, 2), "offsets decrease at expert 1");
  o[1] = keep;
  EXPECT_ERROR(x = dm_moe_combine(l.u, inv, w), "y_rows has shape [6, 4], expected [N * k, F] = [12, 4]");
  EXPECT_ERROR(x = dm_moe_combine(w, inv, w), "y_rows has shape [6, 2], expected");
  dm_tensor *w64 = dm_cast(w, DM_F64);
  int64_t s12[2] = {12, 3};
  dm_tensor *rows = dm_zeros(DM_CPU, DM_F32, 2, s12);
  EXPECT_ERROR(x = dm_moe_combine(rows, inv, w64), "w is f64 but y_rows is f32");
  EXPECT_ERROR(x = dm_moe_combine(rows, w, w), "inv must be i64, got f32");
  dm_release(w64); dm_release(rows);
  dm_release(logits); dm_release(idx); dm_release(w); dm_release(counts); dm_release(perm);
  dm_release(off); dm_release(inv);
  layer_free(&l);
  (void)x;
}

static void no_memory_left_behind(void) {
  dm_mem_stats before = dm_memory_stats(DM_CPU);
  shape s = {33, 6, 5, 2, 3, 7};
  run_result r = run_once(s);
  dm_release(r.y);
  for (int i = 0; i < NPARAMS; i++) dm_release(r.grads[i]);
  dm_tape_clear();
  dm_mem_stats after = dm_memory_stats(DM_CPU);
  CHECK(after.count == before.count && after.allocated == before.allocated);
}

/* ---- timing ----------------------------------------------------------------------------------- */

/* f32, the router product included; median of reps */
static void bench(const char *name, shape s, int reps) {
  layer l = layer_new(s, DM_F32, 1);
  int64_t sy[2] = {s.n, s.f};
  dm_tensor *g = randn(DM_F32, 2, sy, 1, 0);
  requires_grad(&l, true);
  enum { T_ROUTER, T_ROUTE, T_SORT, T_EXPERTS, T_COMBINE, T_FWD, T_BWD, T_N };
  static const char *tn[T_N] = {"router matmul", "moe_route", "moe_sort", "moe_experts", "moe_combine",
                                "forward", "backward"};
  double times[T_N][16];
  for (int rep = 0; rep < reps; rep++) {
    double t0 = (check_now_ms() * 1e-3);
    dm_tensor *logits = dm_matmul(l.u, l.wr, false, false), *idx, *w, *counts, *perm, *off, *inv;
    double t1 = (check_now_ms() * 1e-3);
    dm_moe_route(logits, l.bias, s.k, DM_MOE_ROUTE_SIGMOID, &idx, &w, &counts);
    double t2 = (check_now_ms() * 1e-3);
    dm_moe_sort(idx, s.e, &perm, &off, &inv);
    double t3 = (check_now_ms() * 1e-3);
    dm_tensor *rows = dm_moe_experts(l.u, perm, off, l.ug, l.uu, l.cg, l.cu, l.dw, s.k);
    double t4 = (check_now_ms() * 1e-3);
    dm_tensor *y = dm_moe_combine(rows, inv, w);
    double t5 = (check_now_ms() * 1e-3);
    dm_backward(y, g);
    double t6 = (check_now_ms() * 1e-3);
    double tt[T_N] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0, t6 - t5};
    for (int i = 0; i < T_N; i++) times[i][rep] = tt[i];
    dm_release(logits); dm_release(idx); dm_release(w); dm_release(counts); dm_release(perm);
    dm_release(off); dm_release(inv); dm_release(rows); dm_release(y);
    dm_tensor *p[NPARAMS] = PARAMS(&l);
    for (int i = 0; i < NPARAMS; i++) { dm_release(p[i]->grad); p[i]->grad = NULL; }
  }
  printf("%s: N=%lld d=%lld E=%lld k=%lld r=%lld F=%lld, f32, median of %d\n", name, (long long)s.n,
         (long long)s.d, (long long)s.e, (long long)s.k, (long long)s.r, (long long)s.f, reps);
  for (int i = 0; i < T_N; i++) {
    qsort(times[i], (size_t)reps, sizeof(double), check_cmp_double);
    printf("  %-14s %9.3f ms\n", tn[i], times[i][reps / 2] * 1e3);
  }
  double fwd = times[T_FWD][reps / 2], bwd = times[T_BWD][reps / 2];
  printf("  %-14s %9.3f ms\n", "fwd + bwd", (fwd + bwd) * 1e3);
  dm_release(g);
  layer_free(&l);
}

/* One rule for which expert kernels run, read by the CUDA dispatch and the planner alike: the
** tensor-core kernels where their shapes fit, unless DM_MOE_FMA (set and not "0") forces the FMA
** ones; fp8 banks reach the kernels only on that path (elsewhere the op decodes them) */
static void one_expert_path(void) {
  unsetenv("DM_MOE_FMA");
  CHECK(dm_moe_tc_path(DM_BF16, 64, 4096, 768, 2048, 16));          /* small's experts */
  CHECK(!dm_moe_tc_path(DM_F32, 64, 4096, 768, 2048, 16));          /* f32: the FMA kernels */
  CHECK(!dm_moe_tc_path(DM_BF16, 64, 4096, 770, 2048, 16));         /* d not a multiple of 8 */
  CHECK(dm_moe_fp8_shapes(DM_BF16, 64, 4096, 768, 2048, 16));
  setenv("DM_MOE_FMA", "1", 1);
  CHECK(dm_moe_fma_forced());
  CHECK(!dm_moe_tc_path(DM_BF16, 64, 4096, 768, 2048, 16));
  CHECK(!dm_moe_fp8_shapes(DM_BF16, 64, 4096, 768, 2048, 16));
  setenv("DM_MOE_FMA", "0", 1);
  CHECK(!dm_moe_fma_forced() && dm_moe_tc_path(DM_BF16, 64, 4096, 768, 2048, 16));
  unsetenv("DM_MOE_FMA");
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--bench")) {
    int reps = argc > 2 ? atoi(argv[2]) : 7;
    if (reps < 1 || reps > 16) reps = 7;
    bench("tiny", (shape){512, 64, 8, 2, 8, 128}, reps);
    bench("small", (shape){2048, 768, 64, 2, 16, 2048}, reps);
    return 0;
  }
  setenv("DM_POISON", "1", 1);
  check_begin();
  path_equals_dense_reference();
  path_gradients_match_differences();
  deterministic();
  every_expert_gets_its_gradient();
  counters_on_known_counts();
  capacity_drops_and_counts();
  errors_name_shapes_and_values();
  no_memory_left_behind();
  one_expert_path();
  return check_end();
}
