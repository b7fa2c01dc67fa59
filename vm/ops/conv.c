/*
** vm/ops/conv.c — the causal depthwise convolution as a single fused op
** with its own backward kernel:
**
**   causal_conv1d(x, w, cache?; dilation, silu) -> y, new cache
**                                  depthwise, causal, no bias
**
** silu = 1 gives silu of the convolution: by the backend's fused kernels
** where it has them, else the convolution then the elementwise SiLU (the
** backward runs the convolution again either way). The kernel signatures,
** scratch and layouts are in conv.h.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/conv.h"
#include "ops/elementwise.h"

/* saved tensor i, or NULL when the forward saved fewer (an absent optional input, saved last) */
/* attr 1 (silu): the output is silu of the convolution */
static bool conv_silu(const dm_ctx *c) {
  double v = dm_attr(c, 1);
  if (v != 0 && v != 1) dm_error("causal_conv1d: silu must be 0 or 1, got %g", v);
  return v == 1;
}

static void conv_forward(dm_ctx *c) {
  dm_tensor *x = c->in[0], *w = c->in[1], *cache = c->in[2];
  int64_t dil = dm_int_attr("causal_conv1d", "dilation", dm_attr(c, 0));
  char sx[128], sw[128], sc[128];
  dm_check_float("causal_conv1d", "x", x);
  dm_check_dtype_equal("causal_conv1d", x, w);
  if (x->ndim != 3) dm_error("causal_conv1d: x must be [B, T, C], got shape %s", dm_tensor_shape_str(x, sx, sizeof sx));
  if (w->ndim != 2 || w->shape[0] != x->shape[2] || w->shape[1] < 1)
    dm_error("causal_conv1d: w of shape %s does not fit x of shape %s (w is [C, K], K >= 1)",
             dm_tensor_shape_str(w, sw, sizeof sw), dm_tensor_shape_str(x, sx, sizeof sx));
  if (dil < 1) dm_error("causal_conv1d: dilation must be >= 1, got %lld", (long long)dil);
  int64_t past = (w->shape[1] - 1) * dil;
  int64_t cshape[3] = {x->shape[0], past, x->shape[2]};
  if (cache) {
    dm_check_dtype_equal("causal_conv1d", x, cache);
    if (cache->ndim != 3 || memcmp(cache->shape, cshape, sizeof cshape) != 0)
      dm_error("causal_conv1d: cache of shape %s does not fit x of shape %s and w of shape %s "
               "(the cache is [B, (K-1)*dilation, C], dilation %lld)",
               dm_tensor_shape_str(cache, sc, sizeof sc), dm_tensor_shape_str(x, sx, sizeof sx),
               dm_tensor_shape_str(w, sw, sizeof sw), (long long)dil);
  }
  dm_tensor *y = dm_tensor_new(x->device, x->dtype, 3, x->shape);
  dm_tensor *cout = dm_tensor_new(x->device, x->dtype, 3, cshape);
  dm_conv_k fused = conv_silu(c) ? DM_KERNEL_OPT(causal_conv1d_silu, x->device) : NULL;
  if (fused) fused(y, cout, x, w, cache, dil);
  else DM_RUN(causal_conv1d, x->device, y, cout, x, w, cache, dil);
  if (conv_silu(c) && !fused) {      /* y = silu(conv): the conv's output is not kept, the backward recomputes it */
    dm_attrs none = dm_attrs_of(0, NULL);
    DM_RUN(unary, x->device, DM_UNARY_SILU, y, y, &none);
  }
  dm_save(c, x);
  dm_save(c, w);
  if (cache) dm_save(c, cache);
  c->out[0] = y;
  c->out[1] = cout;
}

static void conv_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x = dm_saved(c, 0), *w = dm_saved(c, 1), *cache = dm_saved_opt(c, 2);
  dm_tensor *gx = dm_needs_grad(c, 0) ? dm_new_grad(c, 0, x->device) : NULL;
  dm_tensor *gw = dm_needs_grad(c, 1) ? dm_new_grad(c, 1, x->device) : NULL;
  dm_tensor *gc = cache && dm_needs_grad(c, 2) ? dm_new_grad(c, 2, x->device) : NULL;
  int64_t dil = (int64_t)dm_attr(c, 0);
  dm_tensor *gy = gout[0], *gz = NULL;
  if (conv_silu(c)) {                /* the convolution again, then dy/dz = silu'(z) in its place */
    gz = dm_tensor_new(x->device, x->dtype, 3, x->shape);
    dm_conv_silu_dz_k fused = DM_KERNEL_OPT(causal_conv1d_silu_dz, x->device);
    if (fused) fused(gz, gy, x, w, cache, dil);
    else {
      int64_t past = (w->shape[1] - 1) * dil, cshape[3] = {x->shape[0], past, x->shape[2]};
      dm_tensor *scratch_cache = dm_tensor_new(x->device, x->dtype, 3, cshape);
      DM_RUN(causal_conv1d, x->device, gz, scratch_cache, x, w, cache, dil);
      dm_release(scratch_cache);
      dm_attrs none = dm_attrs_of(0, NULL);
      DM_RUN(unary_bwd, x->device, DM_UNARY_SILU, gz, gy, gz, NULL, &none);
    }
    gy = gz;
  }
  const dm_plan_card *card = dm_plan_card_of(x->device);
  if (card && gw) {
    const int64_t B = x->shape[0], T = x->shape[1], K = w->shape[1];
    const int64_t span = (gx ? T : 0) + (gc ? (K - 1) * dil : 0);   /* the input gradients' positions */
    dm_plan_scratch(dm_conv_bwd_scratch(B, T, x->shape[2], K, span, card->sm_count),
                    "causal_conv1d weight partials (kernels/conv.cu conv_bwd_runs)");
  }
  DM_RUN(causal_conv1d_bwd, x->device, gx, gw, gc, gy, gout[1], x, w, cache, dil);
  dm_release(gz);
  gin[0] = gx;
  gin[1] = gw;
  gin[2] = gc;
}

static dm_op ops[] = {
  {.name = "causal_conv1d",
   .doc = "depthwise causal conv of x [B, T, C] by w [C, K] with a cache [B, (K-1)*dilation, C] "
          "(optional, zeros) of the past -> y (silu = 1: silu of the conv, recomputed in the backward), "
          "the new cache",
   .n_in = 3, .n_out = 2, .attrs = "dilation:int~1,silu:bool~false", .optional = 4,
   .forward = conv_forward, .backward = conv_backward},
};
DM_REGISTER_OPS(ops)

/* ---- the C API -------------------------------------------------------------------------- */

dm_tensor *dm_causal_conv1d(dm_tensor *x, dm_tensor *w, dm_tensor *cache, int64_t dilation,
                            dm_tensor **cache_out) {
  dm_tensor *in[3] = {x, w, cache}, *out[DM_MAXOUT];
  double v = (double)dilation;
  dm_attrs at = dm_attrs_of(1, &v);
  dm_call(&ops[0], 3, in, &at, out);
  if (cache_out) *cache_out = out[1];
  else dm_release(out[1]);
  return out[0];
}
