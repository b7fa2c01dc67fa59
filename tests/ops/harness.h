/*
** harness.h — the op test harness: every op against a float64 oracle and
** its backward against central finite differences.
**
** An op family adds a file tests/ops/cases_<family>.c with one dm_case per
** op (or several for one op) and registers them with DM_REGISTER_CASES.
** A case makes float64 CPU inputs for a trial (random, awkward shapes) and
** an oracle that computes the expected outputs with plain loops in double.
** The harness does the rest:
**   test: runs the op in f64 and f32 on the inputs, as given and as
**         non-contiguous copies, and compares with the oracle
**         (relative error |out-ref|/|ref| in the max norm: f64 1e-12, f32 tol);
**         outputs of the kernels are NaN-poisoned by allocation when
**         DM_POISON is set (the harness sets it).
**   grad: in f64, loss = sum(out_k * w_k) with random w; compares the
**         backward with central differences (eps 1e-6, rel 1e-6).
**   perf: times the op on the case's perf trial, if it has one.
*/
#ifndef DM_HARNESS_H
#define DM_HARNESS_H

#include <stdio.h>
#include "core/core.h"

typedef struct h_rng { uint64_t s; } h_rng;

/* random numbers for making inputs (independent of the runtime's generator) */
uint64_t h_next(h_rng *r);
double h_uniform(h_rng *r, double lo, double hi);
int64_t h_int(h_rng *r, int64_t lo, int64_t hi);          /* inclusive */
/* an awkward size: 1, a small odd number, or a larger one */
int64_t h_size(h_rng *r);
/* f64 CPU tensors */
dm_tensor *h_randn(h_rng *r, int ndim, const int64_t *shape);
dm_tensor *h_uniform_t(h_rng *r, int ndim, const int64_t *shape, double lo, double hi);
dm_tensor *h_indices(h_rng *r, int ndim, const int64_t *shape, int64_t lo, int64_t hi);  /* i64 */
dm_tensor *h_new(dm_dtype dt, int ndim, const int64_t *shape);                            /* zeros */

/* element access by flat index in row-major order of the shape (any strides) */
double h_get(const dm_tensor *t, int64_t flat);
void h_set(dm_tensor *t, int64_t flat, double v);
/* multi-index helpers */
void h_unravel(const dm_tensor *t, int64_t flat, int64_t *idx);
double h_at(const dm_tensor *t, const int64_t *idx);
void h_set_at(dm_tensor *t, const int64_t *idx, double v);

typedef struct dm_case {
  const char *op;            /* the registered op it covers */
  const char *label;         /* a few words: "broadcast", "dim 2" */
  /* inputs for trial `trial` (0..trials-1): f64 CPU tensors, attrs as the op takes them */
  void (*inputs)(h_rng *r, int trial, dm_tensor **in, dm_attrs *a);
  /* expected outputs from plain loops in double */
  void (*oracle)(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect);
  int trials;                /* 0 means 6 */
  double f32_tol;            /* 0 means 1e-5 */
  bool no_grad;              /* skip the finite-difference check (not differentiable) */
  /* perf: trial perf_trial-1 gives a large input (0: no perf run) */
  int perf_trial;
} dm_case;

void h_register(const dm_case *c);

#define DM_REGISTER_CASES(table)                                          \
  __attribute__((constructor)) static void h_register_cases_(void) {      \
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)         \
      h_register(&table[i]);                                              \
  }

#endif
