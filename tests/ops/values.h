/*
** values.h — the inputs that the model ops' cases (cases_norm.c,
** cases_xent.c, cases_conv.c, cases_silu_mul.c) share: values in multiples
** of 2^-10, exact in f32, so that the f32 runs differ from the oracle only
** by the kernels' own rounding, and shapes of awkward rows.
*/
#ifndef DM_CASES_VALUES_H
#define DM_CASES_VALUES_H

#include <math.h>
#include "harness.h"

#define PERF 1000                  /* the trial index of the large perf inputs (never tested) */

static inline double quantize(double v) { return round(v * 1024) / 1024; }

/* normal values times scale, quantized */
static inline dm_tensor *normal(h_rng *r, int nd, const int64_t *shape, double scale) {
  dm_tensor *t = h_randn(r, nd, shape);
  for (int64_t i = 0; i < dm_numel(t); i++) h_set(t, i, quantize(scale * h_get(t, i)));
  return t;
}

/* [lead..., last]: 0..max_lead leading dims of awkward sizes, at most ~100 rows; returns ndim */
static inline int rows_shape(h_rng *r, int64_t *shape, int64_t last, int max_lead) {
  int nd = (int)h_int(r, 0, max_lead);
  int64_t n = 1;
  for (int d = 0; d < nd; d++) {
    shape[d] = h_size(r);
    while (n * shape[d] > 100) shape[d] = (shape[d] + 1) / 2;
    n *= shape[d];
  }
  shape[nd] = last;
  return nd + 1;
}

#endif
