/* AdamW, Muon (Newton–Schulz) and gradient clipping against float64 references */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "core/core.h"
#include "core/alloc.h"
#include "ops/optim.h"
#include "core/sround.h"
#include "core/code8.h"
#include "core/cuda.h"

/* ---- helpers ------------------------------------------------------------------------------- */

static dm_tensor *randn(int ndim, const int64_t *shape, uint64_t seed, dm_dtype dt) {
  dm_tensor *x = dm_rand_at(DM_CPU, DM_F32, ndim, shape, seed, 0, true);
  if (dt == DM_F32) return x;
  dm_tensor *y = dm_tensor_new(DM_CPU, dt, ndim, shape);
  dm_copy_(y, x);
  dm_release(x);
  return y;
}

/* element i of any float tensor (contiguous) as a double */
static double at(const dm_tensor *t, int64_t i) {
  return dm_load(t->dtype, (const char *)dm_data(t) + (size_t)i * dm_dtype_size(t->dtype));
}

static double *to_doubles(const dm_tensor *t) {
  int64_t n = dm_numel(t);
  double *d = malloc(sizeof *d * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) d[i] = at(t, i);
  return d;
}

static bool close_to(double got, double want, double rtol, double atol) {
  return fabs(got - want) <= atol + rtol * fabs(want);
}

/* every element of t against want[] */
static bool all_close(const dm_tensor *t, const double *want, double rtol, double atol) {
  bool ok = true;
  for (int64_t i = 0; i < dm_numel(t); i++)
    if (!close_to(at(t, i), want[i], rtol, atol)) {
      if (ok) fprintf(stderr, "  element %lld: got %.9g want %.9g\n", (long long)i, at(t, i), want[i]);
      ok = false;
    }
  return ok;
}

/* ---- AdamW -------------------------------------------------------------------------------- */

static void ref_adamw(double *p, const double *g, double *m, double *v, int64_t n, double lr, double b1,
                      double b2, double eps, double wd, int step) {
  double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
  for (int64_t i = 0; i < n; i++) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] = p[i] * (1 - lr * wd) - lr * (m[i] / bc1) / (sqrt(v[i] / bc2) + eps);
  }
}

static void adamw_matches_reference(void) {
  int64_t s0[2] = {3, 5}, s1[1] = {7}, s2[3] = {2, 1, 3};
  const int64_t *shapes[3] = {s0, s1, s2};
  int ndims[3] = {2, 1, 3};
  dm_dtype gdt[3] = {DM_F32, DM_BF16, DM_F32};
  dm_tensor *p[4], *m[4], *v[4], *g[4];
  double *rp[3], *rm[3], *rv[3];
  for (int i = 0; i < 3; i++) {
    p[i] = randn(ndims[i], shapes[i], 10 + i, DM_F32);
    m[i] = dm_zeros(DM_CPU, DM_F32, ndims[i], shapes[i]);
    v[i] = dm_zeros(DM_CPU, DM_F32, ndims[i], shapes[i]);
    rp[i] = to_doubles(p[i]); rm[i] = to_doubles(m[i]); rv[i] = to_doubles(v[i]);
  }
  /* a fourth parameter without a gradient: untouched */
  p[3] = randn(1, s1, 99, DM_F32);
  m[3] = dm_zeros(DM_CPU, DM_F32, 1, s1);
  v[3] = dm_zeros(DM_CPU, DM_F32, 1, s1);
  double *p3 = to_doubles(p[3]);
  bool ok = true;
  for (int step = 1; step <= 4; step++) {
    dm_adamw_hp hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    for (int i = 0; i < 3; i++) g[i] = randn(ndims[i], shapes[i], 100 * step + i, gdt[i]);
    g[3] = NULL;
    dm_adamw_step(4, p, g, m, v, &hp);
    for (int i = 0; i < 3; i++) {
      double *gd = to_doubles(g[i]);           /* bf16 gradients: the rounded values */
      ref_adamw(rp[i], gd, rm[i], rv[i], dm_numel(p[i]), hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step);
      ok = ok && all_close(p[i], rp[i], 1e-5, 1e-6) && all_close(m[i], rm[i], 1e-5, 1e-7) &&
           all_close(v[i], rv[i], 1e-5, 1e-8);
      free(gd);
      dm_release(g[i]);
    }
  }
  CHECK(ok);
  CHECK(all_close(p[3], p3, 0, 0));
  CHECK(at(m[3], 0) == 0 && at(v[3], 0) == 0);
  free(p3);
  for (int i = 0; i < 3; i++) { free(rp[i]); free(rm[i]); free(rv[i]); }
  for (int i = 0; i < 4; i++) { dm_release(p[i]); dm_release(m[i]); dm_release(v[i]); }
}

static void adamw_errors(void) {
  int64_t s[2] = {2, 3}, t[2] = {3, 2};
  dm_tensor *p = dm_zeros(DM_CPU, DM_F32, 2, s), *m = dm_zeros(DM_CPU, DM_F32, 2, s);
  dm_tensor *v = dm_zeros(DM_CPU, DM_F32, 2, s), *bad = dm_zeros(DM_CPU, DM_F32, 2, t);
  dm_tensor *g64 = dm_zeros(DM_CPU, DM_F64, 2, s), *g = dm_zeros(DM_CPU, DM_F32, 2, s);
  dm_adamw_hp hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0, .step = 1};
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &bad, &v, &hp), "parameter 1 has shape [2, 3] but its first moment m has shape [3, 2]");
  EXPECT_ERROR(dm_adamw_step(1, &p, &g64, &m, &v, &hp), "gradient of parameter 1 must be f32 or bf16, got f64");
  EXPECT_ERROR(dm_adamw_step(1, &g64, &g, &m, &v, &hp), "must be an f32 master, got f64");
  dm_tensor *gt = dm_transpose(bad, 0, 1);               /* [2, 3], not contiguous */
  EXPECT_ERROR(dm_adamw_step(1, &p, &gt, &m, &v, &hp), "the gradient of parameter 1 (shape [2, 3]) is not contiguous");
  dm_tensor *pt = dm_transpose(bad, 0, 1), *m64 = dm_zeros(DM_CPU, DM_F64, 2, s);
  EXPECT_ERROR(dm_adamw_step(1, &pt, &g, &m, &v, &hp), "parameter 1 of 1 (shape [2, 3]) is not contiguous");
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &m64, &v, &hp), "the first moment m of parameter 1 must be f32, got f64");
  dm_tensor *none = NULL;
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &none, &v, &hp), "parameter 1 has no first moment m");
  hp.lr = -1;
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &m, &v, &hp), "lr must be in [0, inf), got -1");
  hp.lr = INFINITY;
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &m, &v, &hp), "lr must be in [0, inf), got inf");
  hp.lr = 1e-3;
  dm_release(pt); dm_release(m64);
  hp.step = 0;
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &m, &v, &hp), "step must be >= 1");
  hp.step = 1; hp.beta2 = 1;
  EXPECT_ERROR(dm_adamw_step(1, &p, &g, &m, &v, &hp), "beta2 must be in [0, 1), got 1");
  dm_release(p); dm_release(m); dm_release(v); dm_release(bad); dm_release(g64); dm_release(g); dm_release(gt);
}

/* ---- Newton–Schulz ------------------------------------------------------------------------ */

/* the same iteration in float64 with plain loops, transposing a tall matrix explicitly */
static void ref_ns(const double *g, int m, int n, int steps, dm_ns_coeffs coeffs, double *out) {
  bool tall = m > n;
  int r = tall ? n : m, c = tall ? m : n;
  double *X = malloc(sizeof *X * (size_t)(r * c)), *A = malloc(sizeof *A * (size_t)(r * r));
  double *B = malloc(sizeof *B * (size_t)(r * r)), *Y = malloc(sizeof *Y * (size_t)(r * c));
  double norm = 0;
  for (int i = 0; i < r; i++)
    for (int j = 0; j < c; j++) {
      X[i * c + j] = tall ? g[j * n + i] : g[i * n + j];
      norm += X[i * c + j] * X[i * c + j];
    }
  norm = sqrt(norm) * dm_ns_norm_factor(coeffs) + 1e-7;
  for (int i = 0; i < r * c; i++) X[i] /= norm;
  for (int s = 0; s < steps; s++) {
    double abc[3];
    dm_ns_coefficients(coeffs, s, abc);
    for (int i = 0; i < r; i++)
      for (int j = 0; j < r; j++) {
        double acc = 0;
        for (int k = 0; k < c; k++) acc += X[i * c + k] * X[j * c + k];
        A[i * r + j] = acc;
      }
    for (int i = 0; i < r; i++)
      for (int j = 0; j < r; j++) {
        double acc = 0;
        for (int k = 0; k < r; k++) acc += A[i * r + k] * A[k * r + j];
        B[i * r + j] = abc[1] * A[i * r + j] + abc[2] * acc;
      }
    for (int i = 0; i < r; i++)
      for (int j = 0; j < c; j++) {
        double acc = 0;
        for (int k = 0; k < r; k++) acc += B[i * r + k] * X[k * c + j];
        Y[i * c + j] = abc[0] * X[i * c + j] + acc;
      }
    memcpy(X, Y, sizeof *X * (size_t)(r * c));
  }
  for (int i = 0; i < r; i++)
    for (int j = 0; j < c; j++) {
      if (tall) out[j * n + i] = X[i * c + j];
      else out[i * n + j] = X[i * c + j];
    }
  free(X); free(A); free(B); free(Y);
}

/* eigenvalues of a symmetric k x k matrix (destroyed) by cyclic Jacobi rotations */
static void jacobi_eigen(double *a, int k, double *eig) {
  for (int sweep = 0; sweep < 100; sweep++) {
    double off = 0;
    for (int i = 0; i < k; i++) for (int j = i + 1; j < k; j++) off += a[i * k + j] * a[i * k + j];
    if (off < 1e-24) break;
    for (int p = 0; p < k; p++)
      for (int q = p + 1; q < k; q++) {
        double apq = a[p * k + q];
        if (fabs(apq) < 1e-300) continue;
        double theta = (a[q * k + q] - a[p * k + p]) / (2 * apq);
        double t = (theta >= 0 ? 1 : -1) / (fabs(theta) + sqrt(theta * theta + 1));
        double c = 1 / sqrt(t * t + 1), s = t * c;
        for (int i = 0; i < k; i++) {                 /* columns p, q */
          double aip = a[i * k + p], aiq = a[i * k + q];
          a[i * k + p] = c * aip - s * aiq;
          a[i * k + q] = s * aip + c * aiq;
        }
        for (int j = 0; j < k; j++) {                 /* rows p, q */
          double apj = a[p * k + j], aqj = a[q * k + j];
          a[p * k + j] = c * apj - s * aqj;
          a[q * k + j] = s * apj + c * aqj;
        }
      }
  }
  for (int i = 0; i < k; i++) eig[i] = a[i * k + i];
}

static int ascending(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* the min(m, n) singular values of an m x n matrix (row-major doubles), ascending */
static void singular_values(const double *x, int m, int n, double *sv) {
  int k = m < n ? m : n;
  double *gram = malloc(sizeof *gram * (size_t)(k * k));
  for (int i = 0; i < k; i++)
    for (int j = 0; j < k; j++) {
      double acc = 0;
      if (m <= n) for (int l = 0; l < n; l++) acc += x[i * n + l] * x[j * n + l];
      else for (int l = 0; l < m; l++) acc += x[l * n + i] * x[l * n + j];
      gram[i * k + j] = acc;
    }
  jacobi_eigen(gram, k, sv);
  for (int i = 0; i < k; i++) sv[i] = sqrt(fmax(sv[i], 0));
  qsort(sv, (size_t)k, sizeof *sv, ascending);
  free(gram);
}

/* what NS does to one singular value x of the normalised matrix */
static double ns_scalar(double x, int steps, dm_ns_coeffs coeffs) {
  for (int s = 0; s < steps; s++) {
    double abc[3];
    dm_ns_coefficients(coeffs, s, abc);
    x = abc[0] * x + abc[1] * x * x * x + abc[2] * x * x * x * x * x;
  }
  return x;
}

static void coefficients_pinned(void) {
  double abc[3];
  dm_ns_coefficients(DM_NS_QUINTIC, 3, abc);
  CHECK(abc[0] == 3.4445 && abc[1] == -4.7750 && abc[2] == 2.0315);
  dm_ns_coefficients(DM_NS_POLAR_EXPRESS, 0, abc);
  CHECK(close_to(abc[0], 8.28721201814563 / 1.01, 1e-15, 0));
  CHECK(close_to(abc[1], -23.595886519098837 / pow(1.01, 3), 1e-15, 0));
  CHECK(close_to(abc[2], 17.300387312530933 / pow(1.01, 5), 1e-15, 0));
  dm_ns_coefficients(DM_NS_POLAR_EXPRESS, 12, abc);           /* the last repeats, undivided */
  CHECK(abc[0] == 1.875 && abc[1] == -1.25 && abc[2] == 0.375);
  CHECK(dm_ns_norm_factor(DM_NS_QUINTIC) == 1.0 && dm_ns_norm_factor(DM_NS_POLAR_EXPRESS) == 1.01);
}

/* NS of awkward shapes against the float64 loops. NS maps each singular
** value σ of the normalised matrix through the composed polynomial, so the
** output's singular values are checked against that map, and against the
** band it guarantees: the quintic keeps every σ >= 2e-3 in about (0.68,
** 1.2); Polar Express (designed for σ >= 1e-3) in about (0.84, 1.124). A
** random square matrix has a few smaller σ, which stay small. */
static void ns_matches_reference_and_band(void) {
  const int shapes[][2] = {{3, 7}, {7, 3}, {64, 64}, {1, 5}, {16, 48}};
  struct { dm_ns_coeffs c; double from, lo, hi; } kinds[2] = {
    {DM_NS_QUINTIC, 2e-3, 0.675, 1.21}, {DM_NS_POLAR_EXPRESS, 1e-3, 0.835, 1.13}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    int m = shapes[s][0], n = shapes[s][1], k = m < n ? m : n;
    dm_tensor *g = randn(2, (int64_t[]){m, n}, 7 + s, DM_F32);
    double *gd = to_doubles(g), *want = malloc(sizeof *want * (size_t)(m * n));
    double *sin = malloc(sizeof *sin * (size_t)k), *sout = malloc(sizeof *sout * (size_t)k), fro = 0;
    double *mapped = malloc(sizeof *mapped * (size_t)k);
    for (int i = 0; i < m * n; i++) fro += gd[i] * gd[i];
    singular_values(gd, m, n, sin);
    for (int c = 0; c < 2; c++) {
      dm_tensor *x = dm_newton_schulz(g, 5, kinds[c].c, DM_F32);
      CHECK(x->ndim == 2 && x->shape[0] == m && x->shape[1] == n && x->dtype == DM_F32);
      ref_ns(gd, m, n, 5, kinds[c].c, want);
      CHECK(all_close(x, want, 1e-4, 2e-5));
      double *xd = to_doubles(x);
      singular_values(xd, m, n, sout);
      int small = 0;                  /* inputs under the band's range map to the smallest outputs */
      for (int i = 0; i < k; i++) {
        double xin = sin[i] / (sqrt(fro) * dm_ns_norm_factor(kinds[c].c) + 1e-7);
        small += xin < kinds[c].from;
        mapped[i] = ns_scalar(xin, 5, kinds[c].c);
      }
      qsort(mapped, (size_t)k, sizeof *mapped, ascending);      /* the map is not monotone */
      bool follows = true, in_band = true;
      for (int i = 0; i < k; i++) {
        follows = follows && close_to(sout[i], mapped[i], 0, 2e-3);
        if (i >= small) in_band = in_band && sout[i] > kinds[c].lo && sout[i] < kinds[c].hi;
      }
      if (!follows || !in_band)
        fprintf(stderr, "  %dx%d coeffs %d: singular values in [%.4f, %.4f]\n", m, n, c, sout[0], sout[k - 1]);
      if (m == 64 && c == 0) printf("64x64 quintic: %d of 64 singular values under the band's range\n", small);
      CHECK(follows && in_band);
      CHECK(sout[k - 1] < kinds[c].hi);
      free(xd);
      dm_release(x);
    }
    free(gd); free(want); free(sin); free(sout); free(mapped);
    dm_release(g);
  }
}

/* the stack [B, m, n] gives what each matrix gives alone; tall = transpose of wide */
static void ns_batched_and_transposed(void) {
  int64_t s3[3] = {3, 5, 9};
  dm_tensor *g = randn(3, s3, 21, DM_F32);
  dm_tensor *all = dm_newton_schulz(g, 5, DM_NS_QUINTIC, DM_F32);
  bool same = true;
  for (int b = 0; b < 3; b++) {
    dm_tensor *one = dm_narrow(g, 0, b, 1);
    dm_tensor *x = dm_newton_schulz(one, 5, DM_NS_QUINTIC, DM_F32);
    for (int i = 0; i < 45; i++) same = same && at(x, i) == at(all, b * 45 + i);
    dm_release(one);
    dm_release(x);
  }
  CHECK(same);
  dm_tensor *gt = dm_transpose(g, 1, 2), *xt = dm_newton_schulz(gt, 5, DM_NS_QUINTIC, DM_F32);
  CHECK(xt->shape[1] == 9 && xt->shape[2] == 5);
  bool transposed = true;
  for (int b = 0; b < 3; b++)
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 9; j++)
        transposed = transposed && close_to(at(xt, b * 45 + j * 5 + i), at(all, b * 45 + i * 9 + j), 1e-4, 1e-5);
  CHECK(transposed);
  dm_release(g); dm_release(all); dm_release(gt); dm_release(xt);
}

/* the Gram form: taken for clearly rectangular matrices with a small side; a
** stack gives each matrix's own bits; the tall form is the wide one transposed;
** and a bank of it agrees with the iteration on the matrix itself (float64) */
static void ns_gram_form(void) {
  CHECK(dm_ns_gram(64, 5461) && dm_ns_gram(2048, 64) && dm_ns_gram(1, 2) && dm_ns_gram(256, 512));
  CHECK(!dm_ns_gram(64, 127) && !dm_ns_gram(2048, 2048) && !dm_ns_gram(2048, 5461) && !dm_ns_gram(300, 900));
  int64_t s3[3] = {3, 4, 11};
  dm_tensor *g = randn(3, s3, 31, DM_F32);
  dm_tensor *all = dm_newton_schulz(g, 5, DM_NS_POLAR_EXPRESS, DM_F32);
  bool same = true, near_ref = true;
  for (int b = 0; b < 3; b++) {
    dm_tensor *one = dm_narrow(g, 0, b, 1);
    dm_tensor *x = dm_newton_schulz(one, 5, DM_NS_POLAR_EXPRESS, DM_F32);
    for (int i = 0; i < 44; i++) same = same && at(x, i) == at(all, b * 44 + i);
    double *gd = to_doubles(one), want[44];
    ref_ns(gd, 4, 11, 5, DM_NS_POLAR_EXPRESS, want);
    near_ref = near_ref && all_close(x, want, 1e-4, 2e-5);
    free(gd);
    dm_release(one);
    dm_release(x);
  }
  CHECK(same);
  CHECK(near_ref);
  dm_tensor *gt = dm_transpose(g, 1, 2), *xt = dm_newton_schulz(gt, 5, DM_NS_POLAR_EXPRESS, DM_F32);
  bool transposed = true;
  for (int b = 0; b < 3; b++)
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 11; j++)
        transposed = transposed && close_to(at(xt, b * 44 + j * 4 + i), at(all, b * 44 + i * 11 + j), 1e-4, 1e-5);
  CHECK(transposed);
  dm_tensor *x16 = dm_newton_schulz(g, 5, DM_NS_QUINTIC, DM_BF16);    /* runs in f32, rounded at the end */
  CHECK(x16->dtype == DM_BF16 && x16->shape[2] == 11);
  CHECK(!dm_cuda_tf32());                                   /* the products' TF32 is put back */
  dm_release(g); dm_release(all); dm_release(gt); dm_release(xt); dm_release(x16);
}

/* bf16 NS (the GPU's dtype) stays in a somewhat wider band */
static void ns_bf16_band(void) {
  dm_tensor *g = randn(2, (int64_t[]){24, 40}, 5, DM_F32);
  dm_tensor *x = dm_newton_schulz(g, 5, DM_NS_QUINTIC, DM_BF16);
  CHECK(x->dtype == DM_BF16);
  double *xd = to_doubles(x), sv[24];
  singular_values(xd, 24, 40, sv);
  CHECK(sv[0] > 0.6 && sv[23] < 1.3);
  free(xd);
  dm_release(x);
  EXPECT_ERROR(dm_newton_schulz(g, 0, DM_NS_QUINTIC, DM_F32), "steps must be >= 1, got 0");
  EXPECT_ERROR(dm_newton_schulz(g, 5, DM_NS_QUINTIC, DM_F64), "runs in f32 or bf16, got f64");
  dm_tensor *v = dm_zeros(DM_CPU, DM_F32, 1, (int64_t[]){4});
  EXPECT_ERROR(dm_newton_schulz(v, 5, DM_NS_QUINTIC, DM_F32), "got shape [4]");
  dm_release(v);
  dm_release(g);
}

/* ---- Muon ----------------------------------------------------------------------------------- */

/* two [4, 6] matrices (batched together), a bank [3, 5, 2] (tall experts),
** one bf16 gradient, one parameter without a gradient; two steps */
static void muon_matches_reference(void) {
  int64_t sa[2] = {4, 6}, sb[3] = {3, 5, 2};
  const int64_t *shapes[4] = {sa, sb, sa, sa};
  int nd[4] = {2, 3, 2, 2};
  dm_tensor *p[4], *b[4], *g[4];
  double *rp[4], *rb[4];
  for (int i = 0; i < 4; i++) {
    p[i] = randn(nd[i], shapes[i], 30 + i, DM_F32);
    b[i] = dm_zeros(DM_CPU, DM_F32, nd[i], shapes[i]);
    rp[i] = to_doubles(p[i]);
    rb[i] = to_doubles(b[i]);
  }
  double p3[24];
  for (int i = 0; i < 24; i++) p3[i] = rp[3][i];
  dm_muon_hp hp = {.lr = 0.02, .momentum = 0.95, .weight_decay = 0.1, .nesterov = true, .ns_steps = 5,
                   .coeffs = DM_NS_QUINTIC, .ns_dtype = DM_F32};
  bool ok = true;
  for (int step = 1; step <= 2; step++) {
    for (int i = 0; i < 3; i++) g[i] = randn(nd[i], shapes[i], 200 * step + i, i == 2 ? DM_BF16 : DM_F32);
    g[3] = NULL;
    dm_muon_step(4, p, g, b, &hp);
    for (int i = 0; i < 3; i++) {
      double *gd = to_doubles(g[i]);
      int64_t n = dm_numel(p[i]);
      double *u = malloc(sizeof *u * (size_t)n), *o = malloc(sizeof *o * (size_t)n);
      for (int64_t e = 0; e < n; e++) {
        rb[i][e] = hp.momentum * rb[i][e] + gd[e];
        u[e] = gd[e] + hp.momentum * rb[i][e];
      }
      int batch = nd[i] == 3 ? (int)shapes[i][0] : 1, rows = (int)shapes[i][nd[i] - 2], cols = (int)shapes[i][nd[i] - 1];
      for (int k = 0; k < batch; k++) ref_ns(u + k * rows * cols, rows, cols, 5, DM_NS_QUINTIC, o + k * rows * cols);
      double scale = 0.2 * sqrt(rows > cols ? rows : cols);
      for (int64_t e = 0; e < n; e++) rp[i][e] = rp[i][e] * (1 - hp.lr * hp.weight_decay) - hp.lr * scale * o[e];
      ok = ok && all_close(p[i], rp[i], 1e-5, 1e-5) && all_close(b[i], rb[i], 1e-6, 1e-6);
      free(gd); free(u); free(o);
      dm_release(g[i]);
    }
  }
  CHECK(ok);
  CHECK(all_close(p[3], p3, 0, 0));
  for (int i = 0; i < 4; i++) { free(rp[i]); free(rb[i]); dm_release(p[i]); dm_release(b[i]); }
}

/* The CPU's momentum and apply kernels with a pitched stack (the layout CUDA
** uses, rows padded to 8): the stack's pad is left alone, and each element
** lands on row e / cols, column e % cols. */
static void muon_kernels_pitched(void) {
  int64_t ps[3] = {2, 3, 5}, ss[3] = {2, 3, 8};
  dm_tensor *buf = randn(3, ps, 7, DM_F32), *g = randn(3, ps, 8, DM_F32), *p = randn(3, ps, 9, DM_F32);
  dm_tensor *out = dm_zeros(DM_CPU, DM_F32, 3, ss);
  double *b0 = to_doubles(buf), *gd = to_doubles(g), *p0 = to_doubles(p);
  dm_fill(out, -7.0);
  dm_muon_momentum_k momentum = DM_KERNEL(muon_momentum, DM_CPU);
  momentum(1, &buf, &g, &out, 0.5, true, NULL, NULL, 0, 5, 8, NULL);
  bool ok = true;
  for (int64_t e = 0; e < 30; e++) {
    double bj = (float)(0.5f * (float)b0[e] + (float)gd[e]);
    ok = ok && at(buf, e) == bj && at(out, e / 5 * 8 + e % 5) == (float)((float)gd[e] + 0.5f * (float)bj);
  }
  for (int64_t r = 0; r < 6; r++)
    for (int64_t c = 5; c < 8; c++) ok = ok && at(out, r * 8 + c) == -7.0;
  CHECK(ok);
  dm_muon_apply_k apply = DM_KERNEL(muon_apply, DM_CPU);
  dm_muon_hp hp = {.lr = 0.5, .weight_decay = 0};
  apply(1, &p, &out, NULL, &hp, 1.0, 5, 8);
  ok = true;
  for (int64_t e = 0; e < 30; e++) ok = ok && at(p, e) == (float)((float)p0[e] - 0.5f * (float)at(out, e / 5 * 8 + e % 5));
  CHECK(ok);
  free(b0); free(gd); free(p0);
  dm_release(buf); dm_release(g); dm_release(p); dm_release(out);
}

static void muon_errors(void) {
  int64_t s[2] = {2, 3}, v[1] = {3};
  dm_tensor *p = dm_zeros(DM_CPU, DM_F32, 2, s), *b = dm_zeros(DM_CPU, DM_F32, 2, s);
  dm_tensor *g = dm_zeros(DM_CPU, DM_F32, 2, s), *vec = dm_zeros(DM_CPU, DM_F32, 1, v);
  dm_tensor *bad = dm_zeros(DM_CPU, DM_F32, 1, v);
  dm_muon_hp hp = {.lr = 0.02, .momentum = 0.95, .weight_decay = 0.1, .nesterov = true, .ns_steps = 5,
                   .coeffs = DM_NS_QUINTIC, .ns_dtype = DM_F32};
  EXPECT_ERROR(dm_muon_step(1, &vec, &bad, &bad, &hp), "parameter 1 has shape [3]; Muon takes matrices [m, n] and banks [E, m, n]");
  EXPECT_ERROR(dm_muon_step(1, &p, &g, &bad, &hp), "parameter 1 has shape [2, 3] but its momentum buffer has shape [3]");
  hp.ns_steps = 0;
  EXPECT_ERROR(dm_muon_step(1, &p, &g, &b, &hp), "Newton-Schulz steps must be >= 1, got 0");
  hp.ns_steps = 5; hp.ns_dtype = DM_F16;
  EXPECT_ERROR(dm_muon_step(1, &p, &g, &b, &hp), "runs in f32 or bf16, got f16");
  hp.ns_dtype = DM_F32; hp.momentum = 1.5;
  EXPECT_ERROR(dm_muon_step(1, &p, &g, &b, &hp), "momentum must be in [0, 1), got 1.5");
  hp.momentum = 0.95; hp.coeffs = (dm_ns_coeffs)7;
  EXPECT_ERROR(dm_muon_step(1, &p, &g, &b, &hp), "unknown Newton-Schulz coefficients 7");
  hp.coeffs = DM_NS_QUINTIC;
  static dm_tensor *many[DM_MUON_MAXLIST + 1];
  for (int i = 0; i <= DM_MUON_MAXLIST; i++) many[i] = p;
  EXPECT_ERROR(dm_muon_step(DM_MUON_MAXLIST + 1, many, many, many, &hp), "at most 1024 tensors per call, got 1025");
  dm_tensor *none = NULL;
  EXPECT_ERROR(dm_muon_step(1, &none, &g, &b, &hp), "parameter 1 of 1 is missing");
  dm_release(p); dm_release(b); dm_release(g); dm_release(vec); dm_release(bad);
}

/* ---- clipping ------------------------------------------------------------------------------- */

static double ref_sumsq(dm_tensor *const *g, int n) {
  double s = 0;
  for (int i = 0; i < n; i++)
    if (g[i]) for (int64_t e = 0; e < dm_numel(g[i]); e++) s += at(g[i], e) * at(g[i], e);
  return s;
}

static void clip_norm_and_scale(void) {
  int64_t s0[2] = {33, 17}, s1[1] = {5};
  dm_tensor *g[3] = {randn(2, s0, 40, DM_F32), NULL, randn(1, s1, 41, DM_BF16)};
  double want = sqrt(ref_sumsq(g, 3));
  double *before0 = to_doubles(g[0]), *before2 = to_doubles(g[2]);
  bool finite = false;
  CHECK(close_to(dm_clip_grad_norm(3, g, 0, &finite), want, 1e-13, 0) && finite);   /* 0: no clipping */
  CHECK(all_close(g[0], before0, 0, 0));
  CHECK(close_to(dm_clip_grad_norm(3, g, want * 2, &finite), want, 1e-13, 0));      /* under the limit */
  CHECK(all_close(g[0], before0, 0, 0) && all_close(g[2], before2, 0, 0));
  double max_norm = want / 3;
  CHECK(close_to(dm_clip_grad_norm(3, g, max_norm, &finite), want, 1e-13, 0) && finite);
  double s = max_norm / want;
  bool exact = true;
  for (int64_t e = 0; e < dm_numel(g[0]); e++) exact = exact && at(g[0], e) == (double)(float)(before0[e] * s);
  for (int64_t e = 0; e < dm_numel(g[2]); e++)
    exact = exact && at(g[2], e) == (double)dm_bf16_to_f32(dm_f32_to_bf16((float)(before2[e] * s)));
  CHECK(exact);
  CHECK(close_to(sqrt(ref_sumsq(g, 3)), max_norm, 1e-2, 0));     /* bf16 rounding of the small part */
  CHECK(close_to(dm_clip_grad_norm(3, g, 0, NULL), sqrt(ref_sumsq(g, 3)), 1e-13, 0));
  CHECK(dm_clip_grad_norm(0, g, 1, &finite) == 0 && finite);
  free(before0); free(before2);
  dm_release(g[0]); dm_release(g[2]);
}

static void clip_reports_non_finite(void) {
  int64_t s[1] = {6};
  const double bad[2] = {NAN, INFINITY};
  for (int k = 0; k < 2; k++) {
    dm_tensor *g[2] = {randn(1, s, 50, DM_F32), randn(1, s, 51, DM_BF16)};
    dm_store(g[1]->dtype, (char *)dm_data(g[1]) + 2 * 2, bad[k]);
    double *before = to_doubles(g[0]);
    bool finite = true;
    double norm = dm_clip_grad_norm(2, g, 1e-3, &finite);
    CHECK(!finite && !isfinite(norm));
    CHECK(all_close(g[0], before, 0, 0));                  /* not scaled: the step is skipped */
    free(before);
    dm_release(g[0]); dm_release(g[1]);
  }
  /* huge but finite f32 values: double accumulation does not overflow */
  dm_tensor *h = dm_full(DM_CPU, DM_F32, 1, s, 3e38);
  bool finite = false;
  CHECK(close_to(dm_clip_grad_norm(1, &h, 0, &finite), 3e38 * sqrt(6.0), 1e-7, 0) && finite);
  dm_release(h);
}

static void clip_errors(void) {
  int64_t s[2] = {3, 4};
  dm_tensor *g = dm_zeros(DM_CPU, DM_F32, 2, s), *t = dm_transpose(g, 0, 1);
  dm_tensor *i = dm_zeros(DM_CPU, DM_I32, 2, s);
  EXPECT_ERROR(dm_clip_grad_norm(1, &t, 1, NULL), "gradient 1 (shape [4, 3]) is not contiguous");
  EXPECT_ERROR(dm_clip_grad_norm(1, &i, 1, NULL), "gradient 1 must be a float tensor, got i32");
  EXPECT_ERROR(dm_clip_grad_norm(1, &g, -1, NULL), "max_norm must be >= 0");
  dm_release(g); dm_release(t); dm_release(i);
}

/* Stochastic rounding to bf16: a bf16 value stays itself whatever the bits; one between two
** neighbours goes up exactly when its dropped 16 bits and the random ones carry; the sign is kept;
** NaN stays NaN and the infinities stay; the same key gives the same bits, another key others. */
static float bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void sround_bits_and_values(void) {
  uint32_t rs[] = {0, 1, 0x7fff, 0x8000, 0xffff, 0x12345678};
  for (int i = 0; i < 6; i++) {
    CHECK(bf16_value(dm_bf16_stochastic(1.0f, rs[i])) == 1.0f);
    CHECK(bf16_value(dm_bf16_stochastic(-3.5f, rs[i])) == -3.5f);
  }
  float v = 1.0f + 0x3000 * 0x1p-23f;      /* 1 + 3/16 of bf16's gap at 1: its low 16 bits 0x3000 */
  CHECK(bf16_value(dm_bf16_stochastic(v, 0x0000)) == 1.0f);
  CHECK(bf16_value(dm_bf16_stochastic(v, 0xcfff)) == 1.0f);
  CHECK(bf16_value(dm_bf16_stochastic(v, 0xd000)) == 1.0078125f);
  CHECK(bf16_value(dm_bf16_stochastic(v, 0x1ffff)) == 1.0078125f);   /* only the low 16 bits count */
  CHECK(bf16_value(dm_bf16_stochastic(-v, 0xd000)) == -1.0078125f);
  CHECK(isnan(bf16_value(dm_bf16_stochastic(NAN, 0xffff))));
  CHECK(bf16_value(dm_bf16_stochastic(INFINITY, 0xffff)) == INFINITY);
  CHECK(bf16_value(dm_bf16_stochastic(-INFINITY, 0xffff)) == -INFINITY);
  /* over many draws the share rounded up is 3/16 */
  int up = 0, n = 1 << 16;
  for (int e = 0; e < n; e++) up += bf16_value(dm_bf16_stochastic(v, dm_sround_bits(9, 2, 5, e))) > 1.0f;
  CHECK(fabs((double)up / n - 3.0 / 16) < 0.01);
  CHECK(dm_sround_bits(9, 2, 5, 77) == dm_sround_bits(9, 2, 5, 77));
  CHECK(dm_sround_bits(9, 2, 5, 77) != dm_sround_bits(9, 2, 6, 77));
  CHECK(dm_sround_bits(9, 2, 5, 77) != dm_sround_bits(9, 3, 5, 77));
  CHECK(dm_sround_bits(9, 2, 5, 77) != dm_sround_bits(8, 2, 5, 77));
}

/* The 8-bit codes: exact values decode to themselves whatever the random bits; a value between
** two codes lands on one of them, above with the probability of its place (its mean is the value);
** signs, 0, 1, NaN and the subnormal codes; decode(encode) is within one code step: 6.25% (unsigned) or
** 12.5% (signed) of the value. */
static void code8_codes(void) {
  float exact[] = {0.0f, 1.0f, 0.5f, 0.75f, 0x1p-14f, 0x1p-16f * 3, 0.6875f};
  uint32_t rs[] = {0, 0xffffffffu, 0x12345678u};
  for (int i = 0; i < 7; i++)
    for (int k = 0; k < 3; k++) {
      CHECK(dm_code8_unsigned(dm_code8_encode_unsigned(exact[i], rs[k])) == exact[i]);
      CHECK(dm_code8_signed(dm_code8_encode_signed(-exact[i], rs[k])) == -exact[i]);
    }
  CHECK(dm_code8_encode_unsigned(1.5f, 0) == dm_code8_encode_unsigned(1.0f, 0));
  CHECK(dm_code8_encode_unsigned(NAN, 0) == 0 && dm_code8_encode_signed(-0.0f, 7) == 0);
  /* every code decodes in [0, 1], in increasing order up to 1.0 */
  for (int c = 1; c <= 240; c++) CHECK(dm_code8_unsigned((uint8_t)c) > dm_code8_unsigned((uint8_t)(c - 1)));
  CHECK(dm_code8_unsigned(240) == 1.0f && dm_code8_signed(120) == 1.0f);
  /* the mean of many encodings is the value, normal and subnormal */
  float xs[] = {0.3f, 0.0001f, 0x1p-17f * 3.3f, 0.97f};
  for (int i = 0; i < 4; i++)
    for (int sgn = 0; sgn < 2; sgn++) {
      double sum = 0, worst = 0;
      int n = 1 << 15;
      for (int e = 0; e < n; e++) {
        uint32_t r = dm_sround_bits(5, (uint32_t)i, sgn, e);
        float d = sgn ? dm_code8_signed(dm_code8_encode_signed(xs[i], r)) : dm_code8_unsigned(dm_code8_encode_unsigned(xs[i], r));
        sum += d;
        worst = fmax(worst, fabs(d - xs[i]) / xs[i]);
      }
      CHECK(fabs(sum / n - xs[i]) < 0.005 * xs[i]);
      if (xs[i] >= 0x1p-14f) CHECK(worst <= (sgn ? 0.126 : 0.063));
    }
}

/* AdamW with 8-bit moments against float64 from the moments it decoded: parameters of 300 (a
** partial block), 600 and 7 elements, a bf16 gradient, one without a gradient; five steps. The
** parameters follow the reference to 1e-5; each block's scales are its largest moments; each code
** decodes within a code's step of the moment it stores. */
static void adamw_8bit_against_reference(void) {
  int64_t s0[2] = {3, 100}, s1[1] = {600}, s2[1] = {7};
  const int64_t *shapes[3] = {s0, s1, s2};
  int ndims[3] = {2, 1, 1};
  dm_dtype gdt[3] = {DM_F32, DM_BF16, DM_F32};
  dm_tensor *p[4], *mc[4], *ms[4], *rc[4], *rsc[4], *g[4];
  for (int i = 0; i < 4; i++) {
    int nd = i < 3 ? ndims[i] : 1;
    const int64_t *sh = i < 3 ? shapes[i] : s2;
    p[i] = randn(nd, sh, 30 + i, DM_F32);
    mc[i] = dm_zeros(DM_CPU, DM_U8, nd, sh);
    rc[i] = dm_zeros(DM_CPU, DM_U8, nd, sh);
    int64_t nb = dm_code8_blocks(dm_numel(p[i]));
    ms[i] = dm_zeros(DM_CPU, DM_F32, 1, &nb);
    rsc[i] = dm_zeros(DM_CPU, DM_F32, 1, &nb);
  }
  double *p3 = to_doubles(p[3]);
  bool ok_p = true, ok_scale = true, ok_codes = true;
  for (int step = 1; step <= 5; step++) {
    dm_adamw_hp hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    double bc1 = 1 - pow(hp.beta1, step), bc2 = 1 - pow(hp.beta2, step);
    for (int i = 0; i < 3; i++) g[i] = randn(ndims[i], shapes[i], 200 * step + i, gdt[i]);
    g[3] = NULL;
    double *rp[3], *rm[3], *rr[3];
    for (int i = 0; i < 3; i++) {                    /* the reference, from the moments as decoded */
      int64_t n = dm_numel(p[i]);
      double *gd = to_doubles(g[i]);
      rp[i] = to_doubles(p[i]); rm[i] = malloc(n * sizeof(double)); rr[i] = malloc(n * sizeof(double));
      const uint8_t *mcd = dm_data(mc[i]), *rcd = dm_data(rc[i]);
      const float *msd = dm_data(ms[i]), *rsd = dm_data(rsc[i]);
      for (int64_t e = 0; e < n; e++) {
        double mo = (double)dm_code8_signed(mcd[e]) * msd[e / DM_CODE8_BLOCK];
        double ro = (double)dm_code8_unsigned(rcd[e]) * rsd[e / DM_CODE8_BLOCK];
        double m1 = hp.beta1 * mo + (1 - hp.beta1) * gd[e], v1 = hp.beta2 * ro * ro + (1 - hp.beta2) * gd[e] * gd[e];
        rm[i][e] = m1; rr[i][e] = sqrt(v1);
        rp[i][e] = rp[i][e] * (1 - hp.lr * hp.weight_decay) - hp.lr / bc1 * m1 / (sqrt(v1 / bc2) + hp.eps);
      }
      free(gd);
    }
    dm_adamw_8bit_step(4, p, g, mc, ms, rc, rsc, &hp, 77);
    for (int i = 0; i < 3; i++) {
      int64_t n = dm_numel(p[i]);
      ok_p = ok_p && all_close(p[i], rp[i], 1e-5, 1e-6);
      const uint8_t *mcd = dm_data(mc[i]), *rcd = dm_data(rc[i]);
      const float *msd = dm_data(ms[i]), *rsd = dm_data(rsc[i]);
      for (int64_t b = 0; b < dm_code8_blocks(n); b++) {
        double mmax = 0, rmax = 0;
        for (int64_t e = b * DM_CODE8_BLOCK; e < n && e < (b + 1) * DM_CODE8_BLOCK; e++) {
          mmax = fmax(mmax, fabs(rm[i][e]));
          rmax = fmax(rmax, rr[i][e]);
        }
        ok_scale = ok_scale && fabs(msd[b] - mmax) <= 1e-5 * mmax && fabs(rsd[b] - rmax) <= 1e-5 * rmax;
      }
      for (int64_t e = 0; e < n; e++) {
        double sm = msd[e / DM_CODE8_BLOCK], sr = rsd[e / DM_CODE8_BLOCK];
        double dm_ = dm_code8_signed(mcd[e]) * sm, dr = dm_code8_unsigned(rcd[e]) * sr;
        ok_codes = ok_codes && fabs(dm_ - rm[i][e]) <= 0.126 * fabs(rm[i][e]) + 0x1p-17 * sm + 1e-6 * sm &&
                   fabs(dr - rr[i][e]) <= 0.063 * rr[i][e] + 0x1p-18 * sr + 1e-6 * sr;
      }
      free(rp[i]); free(rm[i]); free(rr[i]);
      dm_release(g[i]);
    }
  }
  CHECK(ok_p);
  CHECK(ok_scale);
  CHECK(ok_codes);
  CHECK(all_close(p[3], p3, 0, 0));                  /* no gradient: untouched */
  CHECK(((uint8_t *)dm_data(mc[3]))[0] == 0 && at(ms[3], 0) == 0);
  free(p3);
  /* a scale of the wrong length is refused, naming the role */
  int64_t wrong = 5;
  dm_tensor *bad = dm_zeros(DM_CPU, DM_F32, 1, &wrong);
  dm_adamw_hp hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .step = 1};
  dm_tensor *bads[1] = {bad};
  g[0] = randn(ndims[0], shapes[0], 1, DM_F32);
  EXPECT_ERROR(dm_adamw_8bit_step(1, p, g, mc, bads, rc, rsc, &hp, 1),
               "the first moment scales of parameter 1 must be contiguous f32 [2]");
  dm_release(g[0]);
  dm_release(bad);
  for (int i = 0; i < 4; i++) {
    dm_release(p[i]); dm_release(mc[i]); dm_release(ms[i]); dm_release(rc[i]); dm_release(rsc[i]);
  }
}

int main(void) {
  check_begin();
  int64_t before = dm_memory_stats(DM_CPU).allocated;
  adamw_matches_reference();
  adamw_errors();
  coefficients_pinned();
  ns_matches_reference_and_band();
  ns_batched_and_transposed();
  ns_gram_form();
  ns_bf16_band();
  muon_matches_reference();
  muon_kernels_pitched();
  muon_errors();
  sround_bits_and_values();
  code8_codes();
  adamw_8bit_against_reference();
  clip_norm_and_scale();
  clip_reports_non_finite();
  clip_errors();
  CHECK(dm_memory_stats(DM_CPU).allocated == before);      /* nothing leaked, errors included */
  return check_end();
}
