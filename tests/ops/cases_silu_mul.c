/*
** cases_silu_mul.c — silu_mul against a plain loop in double, over
** awkward shapes of 0 to 3 dims. Values are multiples of 2^-10 (values.h).
*/
#include <math.h>
#include "harness.h"
#include "values.h"
#include "ops/silu_mul.h"

static void in_silu_mul(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[DM_MAXDIM];
  int nd = (int)h_int(r, 0, 3);
  for (int d = 0; d < nd; d++) shape[d] = h_size(r);
  in[0] = normal(r, nd, shape, 3);
  in[1] = normal(r, nd, shape, 1);
}

static void o_silu_mul(dm_tensor *const *in, const dm_attrs *a, dm_tensor **ex) {
  ex[0] = h_new(DM_F64, in[0]->ndim, in[0]->shape);
  for (int64_t i = 0; i < dm_numel(ex[0]); i++) {
    double x = h_get(in[0], i);
    h_set(ex[0], i, x / (1 + exp(-x)) * h_get(in[1], i));
  }
}

static const dm_case cases[] = {
  {"silu_mul", "any shape", in_silu_mul, o_silu_mul, .trials = 8},
};
DM_REGISTER_CASES(cases)
