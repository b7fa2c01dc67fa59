/*
** harness.c — `ops`: every op against its float64 oracle, every backward
** against central finite differences.
**
**   ops [--op NAME] [--mode test|grad|perf|all] [--device cpu|cuda] [--list] [--seed N] [-v]
**
** --device cuda checks the CUDA backend instead: every case's trials run on
** the GPU at f32 and bf16, contiguous and strided, against the float64
** oracle (test), and the GPU's gradients against the float64 CPU gradients
** of the same trial (grad). Without a GPU it prints one "GPU tests skipped"
** line and succeeds.
*/
#include <math.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <float.h>
#include "harness.h"
#include "core/autograd.h"
#include "core/alloc.h"
#include "core/cuda.h"

#define MAXCASES 1024

static const dm_case *cases[MAXCASES];
static int ncases;
static bool verbose;

void h_register(const dm_case *c) {
  if (ncases == MAXCASES) { fprintf(stderr, "too many cases\n"); exit(2); }
  cases[ncases++] = c;
}

/* ---- random inputs -------------------------------------------------------- */

uint64_t h_next(h_rng *r) {                 /* splitmix64 */
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double h_uniform(h_rng *r, double lo, double hi) {
  return lo + (hi - lo) * ((double)(h_next(r) >> 11) * (1.0 / 9007199254740992.0));
}

int64_t h_int(h_rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(h_next(r) % (uint64_t)(hi - lo + 1));
}

int64_t h_size(h_rng *r) {
  static const int64_t sizes[] = {1, 2, 3, 5, 7, 13, 17, 31};
  return sizes[h_next(r) % (sizeof sizes / sizeof sizes[0])];
}

dm_tensor *h_new(dm_dtype dt, int ndim, const int64_t *shape) {
  return dm_zeros(DM_CPU, dt, ndim, shape);
}

dm_tensor *h_uniform_t(h_rng *r, int ndim, const int64_t *shape, double lo, double hi) {
  dm_tensor *t = h_new(DM_F64, ndim, shape);
  double *p = dm_data(t);
  for (int64_t i = 0; i < dm_numel(t); i++) p[i] = h_uniform(r, lo, hi);
  return t;
}

dm_tensor *h_randn(h_rng *r, int ndim, const int64_t *shape) {
  dm_tensor *t = h_new(DM_F64, ndim, shape);
  double *p = dm_data(t);
  for (int64_t i = 0; i < dm_numel(t); i++) {
    double u1 = h_uniform(r, 1e-12, 1), u2 = h_uniform(r, 0, 1);
    p[i] = sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
  }
  return t;
}

dm_tensor *h_indices(h_rng *r, int ndim, const int64_t *shape, int64_t lo, int64_t hi) {
  dm_tensor *t = h_new(DM_I64, ndim, shape);
  int64_t *p = dm_data(t);
  for (int64_t i = 0; i < dm_numel(t); i++) p[i] = h_int(r, lo, hi);
  return t;
}

void h_unravel(const dm_tensor *t, int64_t flat, int64_t *idx) {
  for (int d = t->ndim - 1; d >= 0; d--) { idx[d] = flat % t->shape[d]; flat /= t->shape[d]; }
}

static char *elem(const dm_tensor *t, const int64_t *idx) {
  int64_t off = 0;
  for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
  return (char *)dm_data(t) + off * (int64_t)dm_dtype_size(t->dtype);
}

double h_at(const dm_tensor *t, const int64_t *idx) { return dm_load(t->dtype, elem(t, idx)); }
void h_set_at(dm_tensor *t, const int64_t *idx, double v) { dm_store(t->dtype, elem(t, idx), v); }

double h_get(const dm_tensor *t, int64_t flat) {
  int64_t idx[DM_MAXDIM];
  h_unravel(t, flat, idx);
  return h_at(t, idx);
}

void h_set(dm_tensor *t, int64_t flat, double v) {
  int64_t idx[DM_MAXDIM];
  h_unravel(t, flat, idx);
  h_set_at(t, idx, v);
}

/* ---- errors inside a case --------------------------------------------------- */

static jmp_buf *catcher;
static char caught[1024];

static void on_error(const char *msg, void *ud) {
  snprintf(caught, sizeof caught, "%s", msg);
  if (catcher) longjmp(*catcher, 1);
}

/* ---- comparing ---------------------------------------------------------------- */

/* max |out - ref| / max |ref|; NaN where out has a NaN that ref has not */
static double rel_error(const dm_tensor *out, const dm_tensor *ref) {
  if (!dm_same_shape(out, ref)) return INFINITY;
  double num = 0, den = 0;
  for (int64_t i = 0; i < dm_numel(ref); i++) {
    double o = h_get(out, i), r = h_get(ref, i);
    if (isnan(r) && isnan(o)) continue;
    if (isnan(o) != isnan(r)) return NAN;
    if (isinf(r) || isinf(o)) { if (o != r) return INFINITY; continue; }
    num = fmax(num, fabs(o - r));
    den = fmax(den, fabs(r));
  }
  return den > 0 ? num / den : num;
}

static dm_tensor *as_dtype(dm_tensor *t, dm_dtype dt) {
  if (!t || !dm_dtype_is_float(t->dtype)) { if (t) dm_retain(t); return t; }
  dm_tensor *c = dm_tensor_like_dtype(t, dt);
  dm_copy_(c, t);
  return c;
}

/* the same values in a strided view on dev: every other element of a wider tensor */
static dm_tensor *strided_copy_on(dm_tensor *t, dm_device dev) {
  if (!t || t->ndim == 0) {
    if (!t || dev == t->device) { if (t) dm_retain(t); return t; }
    return dm_to_device(t, dev);
  }
  int64_t wide[DM_MAXDIM];
  memcpy(wide, t->shape, sizeof wide);
  wide[t->ndim - 1] *= 2;
  dm_tensor *base = dm_zeros(dev, t->dtype, t->ndim, wide);
  int64_t strides[DM_MAXDIM];
  memcpy(strides, base->strides, sizeof strides);
  strides[t->ndim - 1] = 2;
  dm_tensor *view = dm_tensor_view(base, t->ndim, t->shape, strides, 1);
  dm_release(base);
  dm_copy_(view, t);
  return view;
}

static dm_tensor *strided_copy(dm_tensor *t) { return strided_copy_on(t, DM_CPU); }

typedef struct trial {
  int n_in;
  dm_tensor *in[DM_MAXIN];
  dm_tensor *expect[DM_MAXOUT];
  dm_attrs a;
} trial;

static void trial_make(const dm_case *c, const dm_op *op, h_rng *r, int k, trial *t) {
  memset(t, 0, sizeof *t);
  c->inputs(r, k, t->in, &t->a);
  t->n_in = op->n_in;
  if (op->n_in < 0) { t->n_in = 0; while (t->n_in < DM_MAXIN && t->in[t->n_in]) t->n_in++; }
}

static void trial_free(const dm_op *op, trial *t) {
  for (int i = 0; i < t->n_in; i++) dm_release(t->in[i]);
  for (int i = 0; i < op->n_out; i++) dm_release(t->expect[i]);
}

static double run_variant(const dm_op *op, trial *t, dm_dtype dt, bool strided) {
  dm_tensor *in[DM_MAXIN] = {0}, *out[DM_MAXOUT] = {0};
  for (int i = 0; i < t->n_in; i++) {
    dm_tensor *c = as_dtype(t->in[i], dt);
    in[i] = strided ? strided_copy(c) : c;
    if (strided) dm_release(c);
  }
  dm_call(op, t->n_in, in, &t->a, out);
  double worst = 0;
  for (int i = 0; i < op->n_out; i++) {
    double e = rel_error(out[i], t->expect[i]);
    worst = isnan(e) || isnan(worst) ? NAN : fmax(worst, e);
    dm_release(out[i]);
  }
  for (int i = 0; i < t->n_in; i++) dm_release(in[i]);
  return worst;
}

static bool case_test(const dm_case *c, const dm_op *op, h_rng *r, char *why, size_t nwhy) {
  int trials = c->trials ? c->trials : 6;
  double tol32 = c->f32_tol ? c->f32_tol : 1e-5;
  for (int k = 0; k < trials; k++) {
    trial t;
    trial_make(c, op, r, k, &t);
    c->oracle(t.in, &t.a, t.expect);
    static const struct { dm_dtype dt; bool strided; const char *name; } variants[] = {
      {DM_F64, false, "f64"}, {DM_F32, false, "f32"}, {DM_F64, true, "f64 strided"},
      {DM_F32, true, "f32 strided"}};
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
      double e = run_variant(op, &t, variants[v].dt, variants[v].strided);
      double tol = variants[v].dt == DM_F64 ? 1e-12 : tol32;
      if (!(e <= tol)) {
        snprintf(why, nwhy, "trial %d, %s: relative error %.3g over %.1g", k, variants[v].name, e, tol);
        trial_free(op, &t);
        return false;
      }
    }
    trial_free(op, &t);
  }
  return true;
}

/* loss = sum_k sum(out_k * w_k), in plain double over the outputs' values; *mag: the sum of its
** terms' magnitudes (the scale of its rounding) */
static double loss_value(const dm_op *op, trial *t, dm_tensor *const *w, double *mag) {
  dm_tensor *out[DM_MAXOUT];
  dm_call(op, t->n_in, t->in, &t->a, out);
  double s = 0, m = 0;
  for (int i = 0; i < op->n_out; i++) {
    if (w[i])
      for (int64_t j = 0; j < dm_numel(out[i]); j++) {
        double term = h_get(out[i], j) * h_get(w[i], j);
        s += term;
        m += fabs(term);
      }
    dm_release(out[i]);
  }
  *mag = m;
  return s;
}

static bool input_differentiable(const dm_op *op, const trial *t, int i) {
  return t->in[i] && dm_dtype_is_float(t->in[i]->dtype) && !(i < 32 && ((op->nondiff >> i) & 1));
}

static bool case_grad(const dm_case *c, const dm_op *op, h_rng *r, char *why, size_t nwhy) {
  int trials = c->trials ? c->trials : 6;
  for (int k = 0; k < trials; k++) {
    trial t;
    trial_make(c, op, r, k, &t);
    for (int i = 0; i < t.n_in; i++)
      if (input_differentiable(op, &t, i)) t.in[i]->requires_grad = true;
    dm_tensor *out[DM_MAXOUT], *w[DM_MAXOUT] = {0};
    dm_call(op, t.n_in, t.in, &t.a, out);
    dm_tensor *loss = NULL;
    for (int i = 0; i < op->n_out; i++) {
      if (dm_dtype_is_float(out[i]->dtype)) {
        w[i] = h_randn(r, out[i]->ndim, out[i]->shape);
        dm_tensor *prod = dm_mul(out[i], w[i]);
        dm_tensor *s = dm_sum(prod, -1, false);
        dm_release(prod);
        if (loss) { dm_tensor *l2 = dm_add(loss, s); dm_release(loss); dm_release(s); loss = l2; }
        else loss = s;
      }
      dm_release(out[i]);
    }
    bool ok = true;
    if (loss && loss->requires_grad) {
      dm_backward(loss, NULL);
      dm_set_grad_enabled(false);
      for (int i = 0; i < t.n_in && ok; i++) {
        if (!input_differentiable(op, &t, i)) continue;
        dm_tensor *x = t.in[i];
        if (!x->grad) { snprintf(why, nwhy, "trial %d: input %d got no gradient", k, i + 1); ok = false; break; }
        /* the central difference's own rounding, noise: the loss's terms are rounded at about
        ** DBL_EPSILON of their magnitude, and the difference divides that by 2 eps (with a small
        ** gradient and a large loss it is what limits the comparison, not the op) */
        double num = 0, den = 0, noise = 0;
        int64_t n = dm_numel(x), step = n > 150 ? n / 150 + 1 : 1;   /* at most ~150 probes */
        for (int64_t j = (int64_t)(h_next(r) % (uint64_t)step); j < n; j += step) {
          double x0 = h_get(x, j), eps = 1e-6, mp, mm;
          h_set(x, j, x0 + eps);
          double lp = loss_value(op, &t, w, &mp);
          h_set(x, j, x0 - eps);
          double lm = loss_value(op, &t, w, &mm);
          h_set(x, j, x0);
          double fd = (lp - lm) / (2 * eps), an = h_get(x->grad, j);
          num = fmax(num, fabs(fd - an));
          den = fmax(den, fabs(fd));
          noise = fmax(noise, 8 * DBL_EPSILON * fmax(mp, mm) / (2 * eps));
        }
        double e = fmax(num - noise, 0) / fmax(den, 1e-3);
        if (!(e <= 1e-6)) {
          snprintf(why, nwhy, "trial %d: input %d: gradient relative error %.3g over 1e-6 (beyond the finite "
                   "difference's rounding, %.3g)", k, i + 1, e, noise);
          ok = false;
        }
      }
      dm_set_grad_enabled(true);
    }
    dm_release(loss);
    for (int i = 0; i < op->n_out; i++) dm_release(w[i]);
    for (int i = 0; i < t.n_in; i++) if (t.in[i]) { dm_release(t.in[i]->grad); t.in[i]->grad = NULL; }
    trial_free(op, &t);
    dm_tape_clear();
    if (!ok) return false;
  }
  return true;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static bool case_perf(const dm_case *c, const dm_op *op, h_rng *r, char *why, size_t nwhy) {
  if (!c->perf_trial) { snprintf(why, nwhy, "no perf trial"); return true; }
  trial t;
  trial_make(c, op, r, c->perf_trial - 1, &t);
  dm_tensor *in[DM_MAXIN] = {0}, *out[DM_MAXOUT];
  double bytes = 0, times[7];
  for (int i = 0; i < t.n_in; i++) { in[i] = as_dtype(t.in[i], DM_F32); if (in[i]) bytes += (double)in[i]->storage->nbytes; }
  dm_set_grad_enabled(false);
  for (int rep = 0; rep < 7; rep++) {
    double t0 = now_s();
    dm_call(op, t.n_in, in, &t.a, out);
    times[rep] = now_s() - t0;
    if (rep == 0) for (int i = 0; i < op->n_out; i++) bytes += (double)out[i]->storage->nbytes;
    for (int i = 0; i < op->n_out; i++) dm_release(out[i]);
  }
  dm_set_grad_enabled(true);
  qsort(times, 7, sizeof times[0], cmp_double);
  snprintf(why, nwhy, "f32 median %.3f ms, %.2f GB/s (bytes in + out)", times[3] * 1e3, bytes / times[3] * 1e-9);
  for (int i = 0; i < t.n_in; i++) dm_release(in[i]);
  t.n_in = op->n_in < 0 ? t.n_in : op->n_in;
  for (int i = 0; i < t.n_in; i++) dm_release(t.in[i]);
  return true;
}


/* ---- the GPU mode: the CUDA backend against the same oracles -------------------------- */

static const struct { dm_dtype dt; const char *name; } gpu_dtypes[] = {{DM_F32, "f32"}, {DM_BF16, "bf16"}};

static double gpu_tol(const dm_case *c, dm_dtype dt) {
  double t32 = c->f32_tol ? c->f32_tol : 1e-5;
  return dt == DM_F32 ? t32 : fmax(1e-2, t32);
}

/* t's values after a round trip through dt, in f64: the inputs the GPU sees,
** so the oracle answers for exactly those and the tolerance covers the op alone */
static dm_tensor *rounded(dm_tensor *t, dm_dtype dt) {
  if (!t || !dm_dtype_is_float(t->dtype)) { if (t) dm_retain(t); return t; }
  dm_tensor *c = as_dtype(t, dt), *back = as_dtype(c, DM_F64);
  dm_release(c);
  return back;
}

/* a CPU tensor as dt on the GPU, contiguous or strided */
static dm_tensor *on_gpu(dm_tensor *t, dm_dtype dt, bool strided) {
  if (!t) return NULL;
  dm_tensor *c = as_dtype(t, dt);
  dm_tensor *d = strided ? strided_copy_on(c, DM_CUDA) : dm_to_device(c, DM_CUDA);
  dm_release(c);
  return d;
}

static dm_tensor *to_host(dm_tensor *t) { return dm_to_device(t, DM_CPU); }

/* the flat index where out is furthest from ref (NaN first) */
static int64_t worst_at(const dm_tensor *out, const dm_tensor *ref) {
  int64_t at = 0;
  double worst = -1;
  for (int64_t i = 0; i < dm_numel(ref) && dm_same_shape(out, ref); i++) {
    double d = fabs(h_get(out, i) - h_get(ref, i));
    if (isnan(d)) return i;
    if (d > worst) { worst = d; at = i; }
  }
  return at;
}

static bool case_test_gpu(const dm_case *c, const dm_op *op, h_rng *r, char *why, size_t nwhy) {
  int trials = c->trials ? c->trials : 6;
  for (int k = 0; k < trials; k++) {
    trial t;
    trial_make(c, op, r, k, &t);
    for (size_t v = 0; v < sizeof gpu_dtypes / sizeof gpu_dtypes[0]; v++) {
      dm_dtype dt = gpu_dtypes[v].dt;
      dm_tensor *rin[DM_MAXIN] = {0}, *expect[DM_MAXOUT] = {0};
      for (int i = 0; i < t.n_in; i++) rin[i] = rounded(t.in[i], dt);
      c->oracle(rin, &t.a, expect);
      double tol = gpu_tol(c, dt), worst = 0;
      for (int strided = 0; strided < 2 && worst <= tol; strided++) {
        dm_tensor *in[DM_MAXIN] = {0}, *out[DM_MAXOUT] = {0};
        for (int i = 0; i < t.n_in; i++) in[i] = on_gpu(rin[i], dt, strided);
        dm_call(op, t.n_in, in, &t.a, out);
        for (int i = 0; i < op->n_out; i++) {
          dm_tensor *h = to_host(out[i]);
          double e = rel_error(h, expect[i]);
          if (!(e <= tol) && worst <= tol) {
            int64_t j = worst_at(h, expect[i]);
            snprintf(why, nwhy, "trial %d, cuda %s%s: output %d: relative error %.3g over %.1g; worst element "
                     "%lld of %lld: cuda %.6g, f64 %.6g", k, gpu_dtypes[v].name, strided ? " strided" : "", i + 1,
                     e, tol, (long long)j, (long long)dm_numel(h), dm_numel(h) ? h_get(h, j) : NAN,
                     dm_numel(h) ? h_get(expect[i], j) : NAN);
          }
          worst = isnan(e) || isnan(worst) ? NAN : fmax(worst, e);
          dm_release(h);
          dm_release(out[i]);
        }
        for (int i = 0; i < t.n_in; i++) dm_release(in[i]);
      }
      for (int i = 0; i < t.n_in; i++) dm_release(rin[i]);
      for (int i = 0; i < op->n_out; i++) dm_release(expect[i]);
      if (!(worst <= tol)) { trial_free(op, &t); return false; }
    }
    trial_free(op, &t);
  }
  return true;
}

/* loss = sum_k sum(out_k * w_k) on dev in dt, from the inputs rin (f64, CPU);
** grads[i] receives input i's gradient as an f64 CPU tensor (NULL when it got none) */
static void grads_on(const dm_op *op, const trial *t, dm_tensor *const *rin, dm_tensor *const *w, dm_device dev,
                     dm_dtype dt, dm_tensor **grads) {
  dm_tensor *in[DM_MAXIN] = {0}, *out[DM_MAXOUT], *loss = NULL;
  for (int i = 0; i < t->n_in; i++) {
    in[i] = dev == DM_CPU ? as_dtype(rin[i], dt) : on_gpu(rin[i], dt, false);
    if (input_differentiable(op, t, i)) in[i]->requires_grad = true;
  }
  dm_call(op, t->n_in, in, &t->a, out);
  for (int i = 0; i < op->n_out; i++) {
    if (w[i]) {
      dm_tensor *wd = dev == DM_CPU ? as_dtype(w[i], out[i]->dtype) : on_gpu(w[i], out[i]->dtype, false);
      dm_tensor *prod = dm_mul(out[i], wd), *part = dm_sum(prod, -1, false);
      dm_tensor *sum = dm_cast(part, DM_F64);     /* outputs may differ in dtype (kda: o bf16, S f32) */
      dm_release(wd);
      dm_release(prod);
      dm_release(part);
      if (loss) { dm_tensor *l2 = dm_add(loss, sum); dm_release(loss); dm_release(sum); loss = l2; }
      else loss = sum;
    }
    dm_release(out[i]);
  }
  if (loss && loss->requires_grad) dm_backward(loss, NULL);
  dm_release(loss);
  for (int i = 0; i < t->n_in; i++) {
    grads[i] = NULL;
    if (!in[i]) continue;
    if (input_differentiable(op, t, i) && in[i]->grad) {
      dm_tensor *h = to_host(in[i]->grad);
      grads[i] = as_dtype(h, DM_F64);
      dm_release(h);
    }
    dm_release(in[i]->grad);
    in[i]->grad = NULL;
    in[i]->requires_grad = false;
    dm_release(in[i]);
  }
  dm_tape_clear();
}

/* cases that passed only as "no worse than the CPU at the same dtype" */
static int as_cpu_passes;

/* Some backwards lose precision in f32 or bf16 whatever the backend (1 - y^2
** of a saved tanh near 1). When the GPU misses the tolerance, the CPU
** computes the same trial at the same dtype: a GPU within twice its error
** (libm ulps differ) passes, and says so. */
static bool case_grad_gpu(const dm_case *c, const dm_op *op, h_rng *r, char *why, size_t nwhy) {
  int trials = c->trials ? c->trials : 6;
  bool ok = true, as_cpu = false;
  for (int k = 0; k < trials && ok; k++) {
    trial t;
    trial_make(c, op, r, k, &t);
    for (size_t v = 0; v < sizeof gpu_dtypes / sizeof gpu_dtypes[0] && ok; v++) {
      dm_dtype dt = gpu_dtypes[v].dt;
      dm_tensor *rin[DM_MAXIN] = {0}, *out[DM_MAXOUT], *w[DM_MAXOUT] = {0};
      dm_tensor *ref[DM_MAXIN] = {0}, *got[DM_MAXIN] = {0};
      for (int i = 0; i < t.n_in; i++) rin[i] = rounded(t.in[i], dt);
      dm_set_grad_enabled(false);                /* the outputs' shapes, for the weights */
      dm_call(op, t.n_in, rin, &t.a, out);
      dm_set_grad_enabled(true);
      for (int i = 0; i < op->n_out; i++) {
        if (dm_dtype_is_float(out[i]->dtype)) {
          dm_tensor *w0 = h_randn(r, out[i]->ndim, out[i]->shape);
          w[i] = rounded(w0, dt);
          dm_release(w0);
        }
        dm_release(out[i]);
      }
      grads_on(op, &t, rin, w, DM_CPU, DM_F64, ref);
      grads_on(op, &t, rin, w, DM_CUDA, dt, got);
      double tol = gpu_tol(c, dt);
      dm_tensor *cpu[DM_MAXIN] = {0};
      bool have_cpu = false;
      for (int i = 0; i < t.n_in && ok; i++) {
        if (!input_differentiable(op, &t, i) || !ref[i]) continue;
        double e = got[i] ? rel_error(got[i], ref[i]) : INFINITY;
        if (e <= tol) continue;
        if (!have_cpu && got[i] && !isnan(e)) { grads_on(op, &t, rin, w, DM_CPU, dt, cpu); have_cpu = true; }
        double ec = cpu[i] ? rel_error(cpu[i], ref[i]) : NAN;
        if (e <= 2 * ec) {
          as_cpu = true;
          snprintf(why, nwhy, "as the CPU at %s: trial %d, input %d: cuda %.3g, cpu %.3g (over %.1g)",
                   gpu_dtypes[v].name, k, i + 1, e, ec, tol);
          continue;
        }
        if (got[i]) {
          int64_t j = worst_at(got[i], ref[i]);
          snprintf(why, nwhy, "trial %d, cuda %s: input %d: gradient relative error %.3g over %.1g (cpu at %s "
                   "%.3g); worst element %lld of %lld: cuda %.6g, cpu %.6g, f64 %.6g, input %.6g", k,
                   gpu_dtypes[v].name, i + 1, e, tol, gpu_dtypes[v].name, ec, (long long)j,
                   (long long)dm_numel(ref[i]), h_get(got[i], j), cpu[i] ? h_get(cpu[i], j) : NAN,
                   h_get(ref[i], j), dm_numel(rin[i]) == dm_numel(ref[i]) ? h_get(rin[i], j) : NAN);
        } else
          snprintf(why, nwhy, "trial %d, cuda %s: input %d got no gradient", k, gpu_dtypes[v].name, i + 1);
        ok = false;
      }
      for (int i = 0; i < t.n_in; i++) {
        dm_release(rin[i]); dm_release(ref[i]); dm_release(got[i]); dm_release(cpu[i]);
      }
      for (int i = 0; i < op->n_out; i++) dm_release(w[i]);
    }
    trial_free(op, &t);
  }
  if (ok && as_cpu) as_cpu_passes++;
  return ok;
}

/* ---- the driver ------------------------------------------------------------------ */

/* one case in one mode; an error raised by the core fails it with its message */
static bool on_cuda;

static bool run_mode(const dm_case *c, const dm_op *op, int m, uint64_t seed, char *why, size_t nwhy) {
  h_rng r = {seed};
  jmp_buf jb;
  volatile bool ok = false;
  if (!op) { snprintf(why, nwhy, "case names an unknown op"); return false; }
  catcher = &jb;
  if (setjmp(jb) == 0) {
    if (on_cuda) ok = m == 0 ? case_test_gpu(c, op, &r, why, nwhy) : case_grad_gpu(c, op, &r, why, nwhy);
    else ok = m == 0 ? case_test(c, op, &r, why, nwhy)
            : m == 1 ? case_grad(c, op, &r, why, nwhy)
            : case_perf(c, op, &r, why, nwhy);
  } else snprintf(why, nwhy, "error: %s", caught);
  catcher = NULL;
  return ok;
}

static int count_cases(const dm_op *op) {
  int n = 0;
  for (int i = 0; i < ncases; i++) n += strcmp(cases[i]->op, op->name) == 0;
  return n;
}

static void list_ops(void) {
  int diff = 0;
  for (int i = 0; i < dm_op_count(); i++) {
    const dm_op *op = dm_op_at(i);
    diff += op->backward != NULL;
    printf("%-18s %-5s %d case%s  %s\n", op->name, op->backward ? "grad" : "-", count_cases(op),
           count_cases(op) == 1 ? " " : "s", op->doc);
  }
  printf("%d ops, %d differentiable\n", dm_op_count(), diff);
}

/* an error of a build that lacks the op's CUDA kernel: counted apart from failures */
static bool missing_kernel(const char *why) { return strstr(why, "no cuda kernel for '") != NULL; }

int main(int argc, char **argv) {
  const char *only = NULL, *mode = "test", *device = "cpu";
  uint64_t seed = 1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--op") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--mode") && i + 1 < argc) mode = argv[++i];
    else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--list")) { list_ops(); return 0; }
    else if (!strcmp(argv[i], "-v")) verbose = true;
    else {
      fprintf(stderr, "usage: ops [--op NAME] [--mode test|grad|perf|all] [--device cpu|cuda] [--seed N] "
                      "[--list] [-v]\n");
      return 2;
    }
  }
  bool do_test = !strcmp(mode, "test") || !strcmp(mode, "all");
  bool do_grad = !strcmp(mode, "grad") || !strcmp(mode, "all");
  bool do_perf = !strcmp(mode, "perf");
  if (!do_test && !do_grad && !do_perf) { fprintf(stderr, "ops: unknown mode '%s'\n", mode); return 2; }
  if (only && !dm_op_find(only)) { fprintf(stderr, "ops: unknown op '%s' (see --list)\n", only); return 2; }
  if (strcmp(device, "cpu") && strcmp(device, "cuda")) { fprintf(stderr, "ops: unknown device '%s'\n", device); return 2; }
  on_cuda = !strcmp(device, "cuda");
  if (on_cuda && do_perf) { fprintf(stderr, "ops: --mode perf runs on the CPU; GPU timings: tools/gpu.sh\n"); return 2; }
  setenv("DM_POISON", "1", 1);
  if (on_cuda && !dm_cuda_available()) {
    printf("GPU tests skipped: no CUDA device (%s)\n", dm_cuda_unavailable_reason());
    return 0;
  }
  dm_set_error_handler(on_error, NULL);
  int passed = 0, failed = 0, missing = 0;
  for (int i = 0; i < dm_op_count(); i++) {
    const dm_op *op = dm_op_at(i);
    if (only && strcmp(only, op->name)) continue;
    if (do_test && count_cases(op) == 0) {
      printf("FAIL %-18s has no test case in tests/ops\n", op->name);
      failed++;
    }
  }
  for (int i = 0; i < ncases; i++) {
    const dm_case *c = cases[i];
    if (only && strcmp(only, c->op)) continue;
    const dm_op *op = dm_op_find(c->op);
    static const char *modes[] = {"test", "grad", "perf"};
    bool on[] = {do_test, do_grad && op && op->backward && !c->no_grad, do_perf};
    for (int m = 0; m < 3; m++) {
      if (!on[m]) continue;
      char why[1200] = "";
      bool ok = run_mode(c, op, m, seed * 7919 + (uint64_t)i, why, sizeof why);
      dm_tape_clear();
      bool absent = !ok && on_cuda && missing_kernel(why);
      if (ok) passed++; else if (absent) missing++; else failed++;
      if (!ok || verbose || m == 2)
        printf("%s %-18s %-4s %-22s %s\n", ok ? "ok  " : absent ? "TODO" : "FAIL", c->op, modes[m], c->label, why);
    }
  }
  if (on_cuda)
    printf("cuda (%s): %d passed (%d of them grads only as precise as the CPU's at that dtype), "
           "%d failed, %d without a CUDA kernel yet\n", dm_cuda_device_info().name, passed, as_cpu_passes,
           failed, missing);
  else printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
