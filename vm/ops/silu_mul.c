/*
** vm/ops/silu_mul.c — the SiLU-gated product as a single fused op with its
** own backward kernel:
**
**   silu_mul(a, b)                 silu(a) * b, the gate of the experts
**
** The kernel signatures are in silu_mul.h.
*/
#include "core/core.h"
#include "core/autograd.h"
#include "ops/silu_mul.h"

static void silu_mul_forward(dm_ctx *c) {
  dm_tensor *a = c->in[0], *b = c->in[1];
  dm_check_float("silu_mul", "a", a);
  dm_check_dtype_equal("silu_mul", a, b);
  dm_check_shape_equal("silu_mul", a, b);
  dm_tensor *y = dm_tensor_new(a->device, a->dtype, a->ndim, a->shape);
  DM_RUN(silu_mul, a->device, y, a, b);
  dm_save(c, a);
  dm_save(c, b);
  c->out[0] = y;
}

static void silu_mul_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *a = dm_saved(c, 0), *b = dm_saved(c, 1);
  dm_tensor *ga = dm_needs_grad(c, 0) ? dm_new_grad(c, 0, a->device) : NULL;
  dm_tensor *gb = dm_needs_grad(c, 1) ? dm_new_grad(c, 1, a->device) : NULL;
  DM_RUN(silu_mul_bwd, a->device, ga, gb, gout[0], a, b);
  gin[0] = ga;
  gin[1] = gb;
}

static dm_op ops[] = {
  {.name = "silu_mul", .doc = "silu(a) * b in one pass (a and b of one shape)",
   .args = "a, b", .lua = DM_LUA_METHOD, .n_in = 2, .n_out = 1, .attrs = "", .forward = silu_mul_forward, .backward = silu_mul_backward},
};
DM_REGISTER_OPS(ops)

/* ---- the C API -------------------------------------------------------------------------- */

dm_tensor *dm_silu_mul(dm_tensor *a, dm_tensor *b) {
  dm_tensor *in[2] = {a, b}, *out;
  dm_attrs none = dm_attrs_of(0, NULL);
  dm_call(&ops[0], 2, in, &none, &out);
  return out;
}
