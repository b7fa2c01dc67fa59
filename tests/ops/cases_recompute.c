/*
** cases_recompute.c — the op "recompute" (vm/ops/recompute.c) on one
** function registered here, y = tanh(a * b) + a, against plain loops in
** double: its backward recomputes the function on a nested tape, and the
** finite-difference check goes through that. (dm.recompute from Lua and the
** model's `recompute` key: tests/lua/recompute_spec.lua.)
*/
#include <math.h>
#include "harness.h"
#include "core/core.h"
#include "ops/recompute.h"

static dm_tensor *tanh_mul_add(void *ud, int n, dm_tensor *const *in, char *err, size_t nerr) {
  (void)ud; (void)n; (void)err; (void)nerr;
  dm_tensor *p = dm_mul(in[0], in[1]), *t = dm_unary("tanh", p);
  dm_tensor *y = dm_add(t, in[0]);
  dm_release(p);
  dm_release(t);
  return y;
}

static int slot(void) {
  static int id = -1;
  if (id < 0) {
    dm_recompute_fn fn = {tanh_mul_add, NULL, NULL};
    id = dm_recompute_register(&fn);
  }
  return id;
}

static void in_recompute(h_rng *r, int k, dm_tensor **in, dm_attrs *a) {
  int64_t shape[3] = {h_size(r), k == 0 ? 1 : h_size(r), h_size(r)};
  in[0] = h_randn(r, 3, shape);
  in[1] = h_randn(r, 3, shape);
  double v = slot();
  *a = dm_attrs_of(1, &v);
}

static void or_recompute(dm_tensor *const *in, const dm_attrs *a, dm_tensor **expect) {
  (void)a;
  expect[0] = h_new(DM_F64, in[0]->ndim, in[0]->shape);
  for (int64_t i = 0; i < dm_numel(in[0]); i++) {
    double x = h_get(in[0], i), y = h_get(in[1], i);
    h_set(expect[0], i, tanh(x * y) + x);
  }
}

static const dm_case cases[] = {
  {.op = "recompute", .label = "tanh(a * b) + a, recomputed", .inputs = in_recompute, .oracle = or_recompute},
};
DM_REGISTER_CASES(cases)
