/*
** vm/ops/norm.c — the row norms as single fused ops, each with its own
** backward kernel:
**
**   rmsnorm(x, gain?; eps)         x / sqrt(mean(x^2) + eps) * gain over the last dim
**   l2norm(x; eps, scale)          x / sqrt(sum(x^2) + eps) * scale over the last dim
**   add_rmsnorm(h, y, gain?; eps)  s = h + y, u = rmsnorm(s in y's dtype) * gain
**
** Both are one forward and one backward over the "rownorm" kernels, their
** kind choosing what divides the sum of squares. The forward saves each
** row's rstd only when recording. The kinds and kernel signatures are in
** norm.h, the rows' layout and their statistics' dtype in rows.h.
*/
#include <math.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/norm.h"
#include "ops/prims.h"      /* the gain's column sums' scratch */

/* what stands in for the gain when there is none: l2norm's scale (its second attribute), else 1 */
static double norm_scale(const dm_ctx *c) { return c->op->kind == DM_NORM_L2 ? dm_attr(c, 1) : 1.0; }

static void rownorm_forward(dm_ctx *c) {
  const char *name = c->op->name;
  dm_tensor *x = c->in[0], *gain = c->n_in > 1 ? c->in[1] : NULL;
  double eps = dm_attr(c, 0);
  dm_check_float(name, "x", x);
  if (x->ndim == 0) dm_error("%s: x must have at least 1 dim (the one normalised), got a 0-dim tensor", name);
  if (!(eps >= 0) || isinf(eps)) dm_error("%s: eps must be a finite number >= 0, got %g", name, eps);
  if (!isfinite(norm_scale(c))) dm_error("%s: scale must be a finite number, got %g", name, norm_scale(c));
  if (gain) {
    char sx[128], sg[128];
    dm_check_dtype_equal(name, x, gain);
    if (gain->ndim != 1 || gain->shape[0] != x->shape[x->ndim - 1])
      dm_error("%s: gain of shape %s does not fit x of shape %s (gain is [D], D the last dim of x)", name,
               dm_tensor_shape_str(gain, sg, sizeof sg), dm_tensor_shape_str(x, sx, sizeof sx));
  }
  dm_tensor *y = dm_tensor_new(x->device, x->dtype, x->ndim, x->shape);
  dm_tensor *rstd = dm_row_stat(c, x);
  DM_RUN(rownorm, x->device, c->op->kind, y, rstd, x, gain, eps, norm_scale(c));
  dm_save(c, x);
  if (rstd) { dm_save(c, rstd); dm_release(rstd); }
  if (gain) dm_save(c, gain);
  c->out[0] = y;
}

static void rownorm_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x = dm_saved(c, 0), *rstd = dm_saved(c, 1), *gain = dm_saved_opt(c, 2);
  dm_tensor *gx = dm_needs_grad(c, 0) ? dm_new_grad(c, 0, x->device) : NULL;
  dm_tensor *gg = gain && dm_needs_grad(c, 1) ? dm_new_grad(c, 1, x->device) : NULL;
  const dm_plan_card *card = dm_plan_card_of(x->device);
  if (card && gg) {
    const int64_t D = x->shape[x->ndim - 1];
    dm_plan_scratch(dm_colsum_scratch(D ? dm_numel(x) / D : 0, D, card->sm_count),
                    "rmsnorm gain partials (kernels/norm.cu cuda_rownorm_bwd)");
  }
  DM_RUN(rownorm_bwd, x->device, c->op->kind, gx, gg, gout[0], x, gain, rstd, norm_scale(c));
  gin[0] = gx;
  if (gain) gin[1] = gg;
}

/* ---- add_rmsnorm: s = h + y, u = rmsnorm(s in y's dtype) * gain ---------------------------
** The block's residual add and the next branch's norm (nn.residual): one pass instead of the four
** of y's cast, the add, s's cast and rmsnorm, with their bits. It saves s in y's dtype, what
** rmsnorm would have saved; its backward is theirs: rmsnorm's kernel, the cast of its gradient to
** h's dtype added to s's own, and that sum cast to y's dtype for y. */
static void add_rownorm_forward(dm_ctx *c) {
  const char *name = c->op->name;
  dm_tensor *h = c->in[0], *y = c->in[1], *gain = c->in[2];
  double eps = dm_attr(c, 0);
  dm_check_float(name, "h", h);
  dm_check_float(name, "y", y);
  dm_check_device_equal(name, h, y);
  char sh[128], sy[128];
  if (h->ndim == 0 || !dm_same_shape(h, y))
    dm_error("%s: h and y must be of one shape with at least 1 dim, got %s and %s", name,
             dm_tensor_shape_str(h, sh, sizeof sh), dm_tensor_shape_str(y, sy, sizeof sy));
  if (!(eps >= 0) || isinf(eps)) dm_error("%s: eps must be a finite number >= 0, got %g", name, eps);
  if (gain) {
    dm_check_dtype_equal("add_rmsnorm (gain and y)", gain, y);
    if (gain->ndim != 1 || gain->shape[0] != h->shape[h->ndim - 1])
      dm_error("%s: gain of shape %s does not fit h of shape %s (gain is [D], D the last dim of h)", name,
               dm_tensor_shape_str(gain, sy, sizeof sy), dm_tensor_shape_str(h, sh, sizeof sh));
  }
  dm_tensor *hc = dm_contiguous(h), *yc = dm_contiguous(y);
  dm_tensor *sum = dm_tensor_new(h->device, h->dtype, h->ndim, h->shape);
  dm_tensor *u = dm_tensor_new(h->device, y->dtype, h->ndim, h->shape);
  dm_tensor *x = NULL;                 /* s in y's dtype, kept for the backward */
  if (c->node) x = h->dtype == y->dtype ? (dm_retain(sum), sum) : dm_tensor_new(h->device, y->dtype, h->ndim, h->shape);
  dm_tensor *rstd = dm_row_stat(c, u);
  DM_RUN(add_rownorm, h->device, sum, x, u, rstd, hc, yc, gain, eps);
  dm_release(hc);
  dm_release(yc);
  if (x) { dm_save(c, x); dm_release(x); }
  if (rstd) { dm_save(c, rstd); dm_release(rstd); }
  if (gain) dm_save(c, gain);
  c->out[0] = sum;
  c->out[1] = u;
}

/* the gradient of s and of y (gy NULL when not wanted) as the ops add_rmsnorm stands for give them:
** rmsnorm's gradient, cast to h's dtype, added to s's own; that sum cast to y's dtype. One kernel
** where the device has it and the gradients are contiguous, else those ops. */
static dm_tensor *add_rownorm_grads(dm_ctx *c, dm_tensor *g, dm_tensor *gu, dm_tensor *x, dm_tensor *gain,
                                    dm_tensor *rstd, dm_tensor **gy) {
  dm_dtype hdt = dm_in_dtype(c, 0), ydt = dm_in_dtype(c, 1);
  bool want_y = dm_needs_grad(c, 1);
  *gy = NULL;
  if (dm_is_contiguous(g) && dm_is_contiguous(gu) && g->dtype == hdt && dm_kernel_find("add_rownorm_bwd", x->device)) {
    dm_tensor *gs = dm_tensor_new(x->device, hdt, x->ndim, x->shape);
    if (want_y) *gy = ydt == hdt ? (dm_retain(gs), gs) : dm_tensor_new(x->device, ydt, x->ndim, x->shape);
    DM_RUN(add_rownorm_bwd, x->device, gs, *gy == gs ? NULL : *gy, g, gu, x, gain, rstd);
    return gs;
  }
  dm_tensor *gx = dm_tensor_new(x->device, x->dtype, x->ndim, x->shape);
  DM_RUN(rownorm_bwd, x->device, DM_NORM_RMS, gx, NULL, gu, x, gain, rstd, 1.0);
  dm_tensor *gxh = gx->dtype == hdt ? (dm_retain(gx), gx) : dm_cast(gx, hdt);
  dm_tensor *gs = dm_add(g, gxh);                  /* s's gradient: its own and the norm's, as autograd sums */
  dm_release(gxh);
  dm_release(gx);
  if (want_y) *gy = ydt == hdt ? (dm_retain(gs), gs) : dm_cast(gs, ydt);
  return gs;
}

static void add_rownorm_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x = dm_saved(c, 0), *rstd = dm_saved(c, 1), *gain = dm_saved_opt(c, 2);
  if (gain && dm_needs_grad(c, 2)) {
    dm_tensor *gg = dm_new_grad(c, 2, x->device);
    const dm_plan_card *card = dm_plan_card_of(x->device);
    if (card) {
      const int64_t D = x->shape[x->ndim - 1];
      dm_plan_scratch(dm_colsum_scratch(D ? dm_numel(x) / D : 0, D, card->sm_count),
                      "add_rmsnorm gain partials (kernels/norm.cu cuda_rownorm_bwd)");
    }
    DM_RUN(rownorm_bwd, x->device, DM_NORM_RMS, NULL, gg, gout[1], x, gain, rstd, 1.0);
    gin[2] = gg;
  }
  dm_tensor *gy, *gs = add_rownorm_grads(c, gout[0], gout[1], x, gain, rstd, &gy);
  if (gy) gin[1] = gy;
  if (dm_needs_grad(c, 0)) gin[0] = gs;
  else dm_release(gs);
}

static dm_op ops[] = {
  {.name = "rmsnorm", .doc = "x / sqrt(mean(x^2 over the last dim) + eps) * gain (gain [D], optional)",
   .args = "x [..., D], gain [D]", .lua = DM_LUA_METHOD,
   .n_in = 2, .n_out = 1, .attrs = "eps~1e-6", .optional = 2, .kind = DM_NORM_RMS,
   .forward = rownorm_forward, .backward = rownorm_backward},
  {.name = "l2norm", .doc = "x / sqrt(sum(x^2 over the last dim) + eps) * scale",
   .args = "x [..., D]", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "eps~1e-6,scale~1", .kind = DM_NORM_L2,
   .forward = rownorm_forward, .backward = rownorm_backward},
  {.name = "add_rmsnorm", .doc = "s = h + y (in h's dtype), u = rmsnorm(s in y's dtype) * gain (gain [D], optional): "
                                 "a residual add and the next norm, the bits of the add, the cast and rmsnorm",
   .args = "h [..., D], y [..., D], gain [D]", .lua = DM_LUA_FN,
   .n_in = 3, .n_out = 2, .attrs = "eps~1e-6", .optional = 4,
   .forward = add_rownorm_forward, .backward = add_rownorm_backward},
};
DM_REGISTER_OPS(ops)

/* ---- the C API -------------------------------------------------------------------------- */

static dm_tensor *call1(const dm_op *op, int n, dm_tensor *const *in, int nv, const double *v) {
  dm_attrs at = dm_attrs_of(nv, v);
  dm_tensor *out[DM_MAXOUT];
  dm_call(op, n, in, &at, out);
  for (int i = 1; i < op->n_out; i++) dm_release(out[i]);
  return out[0];
}

dm_tensor *dm_rmsnorm(dm_tensor *x, dm_tensor *gain, double eps) {
  dm_tensor *in[2] = {x, gain};
  return call1(&ops[0], 2, in, 1, &eps);
}

dm_tensor *dm_l2norm(dm_tensor *x, double eps) { return call1(&ops[1], 1, &x, 2, (double[]){eps, 1.0}); }

dm_tensor *dm_add_rmsnorm(dm_tensor *h, dm_tensor *y, dm_tensor *gain, double eps, dm_tensor **u) {
  dm_tensor *in[3] = {h, y, gain}, *out[DM_MAXOUT];
  dm_attrs at = dm_attrs_of(1, &eps);
  dm_call(&ops[2], 3, in, &at, out);
  *u = out[1];
  return out[0];
}
