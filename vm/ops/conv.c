/*
** vm/ops/blocks.c — the model's building blocks as single fused ops, each
** with its own backward kernel:
**
**   rmsnorm(x, gain?; eps)         x / sqrt(mean(x^2) + eps) * gain over the last dim
**   l2norm(x; eps)                 x / sqrt(sum(x^2) + eps) over the last dim
**   cross_entropy(logits, targets; ignore_index, reduction)
**                                  fused with its log-softmax; saves only the
**                                  per-row logsumexp, the backward recomputes softmax
**   causal_conv1d(x, w, cache?; dilation, silu) -> y, new cache
**                                  depthwise, causal, no bias
**   silu_mul(a, b)                 silu(a) * b, the gate of the experts
**
** rmsnorm and l2norm are one forward and one backward over the "rownorm"
** kernels, their kind choosing what divides the sum of squares. The
** forwards save per-row statistics (rstd, lse) only when recording. The
** kinds, kernel signatures and layouts are in blocks.h.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/conv.h"
#include "ops/elementwise.h"

static int64_t int_attr(const char *op, const char *what, double v) {
  if (v != floor(v) || fabs(v) > 9e15) dm_error("%s: %s must be an integer, got %g", op, what, v);
  return (int64_t)v;
}

/* the dtype of per-row statistics: f64 for f64 inputs, else f32 */
static dm_dtype stat_dtype(dm_dtype dt) { return dt == DM_F64 ? DM_F64 : DM_F32; }

/* one value per row (every dim but the last), for backward; NULL when not recording */
static dm_tensor *row_stat(dm_ctx *c, const dm_tensor *x) {
  if (!c->node) return NULL;
  int64_t rows = 1;
  for (int d = 0; d < x->ndim - 1; d++) rows *= x->shape[d];
  return dm_tensor_new(x->device, stat_dtype(x->dtype), 1, &rows);
}

/* saved tensor i, or NULL when the forward saved fewer (an absent optional input, saved last) */
static dm_tensor *saved_opt(dm_ctx *c, int i) { return i < c->node->n_saved ? dm_saved(c, i) : NULL; }

/* ---- rmsnorm, l2norm -------------------------------------------------------------------- */

static void rownorm_forward(dm_ctx *c) {
  const char *name = c->op->name;
  dm_tensor *x = c->in[0], *gain = c->n_in > 1 ? c->in[1] : NULL;
  double eps = dm_attr(c, 0);
  dm_check_float(name, "x", x);
  if (x->ndim == 0) dm_error("%s: x must have at least 1 dim (the one normalised), got a 0-dim tensor", name);
  if (!(eps >= 0) || isinf(eps)) dm_error("%s: eps must be a finite number >= 0, got %g", name, eps);
  if (gain) {
    char sx[128], sg[128];
    dm_check_dtype_equal(name, x, gain);
    if (gain->ndim != 1 || gain->shape[0] != x->shape[x->ndim - 1])
      dm_error("%s: gain of shape %s does not fit x of shape %s (gain is [D], D the last dim of x)", name,
               dm_tensor_shape_str(gain, sg, sizeof sg), dm_tensor_shape_str(x, sx, sizeof sx));
  }
  dm_tensor *y = dm_tensor_new(x->device, x->dtype, x->ndim, x->shape);
  dm_tensor *rstd = row_stat(c, x);
  DM_RUN(rownorm, x->device, c->op->kind, y, rstd, x, gain, eps);
  dm_save(c, x);
  if (rstd) { dm_save(c, rstd); dm_release(rstd); }
  if (gain) dm_save(c, gain);
  c->out[0] = y;
}

static void rownorm_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x = dm_saved(c, 0), *rstd = dm_saved(c, 1), *gain = saved_opt(c, 2);
  dm_tensor *gx = dm_needs_grad(c, 0) ? dm_new_grad(c, 0, x->device) : NULL;
  dm_tensor *gg = gain && dm_needs_grad(c, 1) ? dm_new_grad(c, 1, x->device) : NULL;
  const dm_plan_card *card = dm_plan_card_of(x->device);
  if (card && gg) {
    const int64_t D = x->shape[x->ndim - 1];
    dm_plan_scratch(dm_colsum_scratch(D ? dm_numel(x) / D : 0, D, card->sm_count),
                    "rmsnorm gain partials (kernels/blocks.cu cuda_rownorm_bwd)");
  }
  DM_RUN(rownorm_bwd, x->device, c->op->kind, gx, gg, gout[0], x, gain, rstd);
  gin[0] = gx;
  if (gain) gin[1] = gg;
}

/* ---- cross_entropy ---------------------------------------------------------------------- */

static void ce_forward(dm_ctx *c) {
  dm_tensor *logits = c->in[0], *targets = c->in[1];
  int64_t ignore = int_attr("cross_entropy", "ignore_index", dm_attr(c, 0));
  int64_t red = int_attr("cross_entropy", "reduction", dm_attr(c, 1));
  dm_check_float("cross_entropy", "logits", logits);
  if (targets->dtype != DM_I64 && targets->dtype != DM_I32 && targets->dtype != DM_U8)
    dm_error("cross_entropy: targets must be i64, i32 or u8 class ids, got %s", dm_dtype_name(targets->dtype));
  if (red < DM_CE_MEAN || red > DM_CE_NONE)
    dm_error("cross_entropy: reduction must be one of " DM_CE_SPELLINGS " (0..2), got %lld", (long long)red);
  char sl[128], st[128];
  bool fits = logits->ndim >= 1 && targets->ndim == logits->ndim - 1 &&
              memcmp(targets->shape, logits->shape, sizeof(int64_t) * (size_t)targets->ndim) == 0;
  if (!fits)
    dm_error("cross_entropy: targets of shape %s do not fit logits of shape %s (logits [..., V], targets [...])",
             dm_tensor_shape_str(targets, st, sizeof st), dm_tensor_shape_str(logits, sl, sizeof sl));
  int64_t classes = logits->shape[logits->ndim - 1];
  if (classes == 0) dm_error("cross_entropy: logits of shape %s have no classes",
                             dm_tensor_shape_str(logits, sl, sizeof sl));
  if (dm_plan_card_of(logits->device))
    dm_plan_scratch(dm_ce_check_scratch(dm_numel(targets), dm_debug_level()),
                    "cross-entropy's target check (kernels/blocks.cu cuda_ce_check)");
  DM_RUN(cross_entropy_check, logits->device, targets, classes, ignore);
  dm_tensor *loss = red == DM_CE_NONE
                  ? dm_tensor_new(logits->device, stat_dtype(logits->dtype), targets->ndim, targets->shape)
                  : dm_tensor_new(logits->device, stat_dtype(logits->dtype), 0, NULL);
  dm_tensor *lse = row_stat(c, logits);
  if (dm_plan_card_of(logits->device))
    dm_plan_scratch(dm_ce_scratch(dm_numel(targets), red != DM_CE_NONE),
                    "cross-entropy partial sums (kernels/blocks.cu cuda_ce)");
  DM_RUN(cross_entropy, logits->device, loss, lse, logits, targets, ignore, (int)red);
  dm_save(c, logits);
  dm_save(c, targets);
  if (lse) { dm_save(c, lse); dm_release(lse); }
  c->out[0] = loss;
}

static void ce_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *logits = dm_saved(c, 0);
  dm_tensor *gx = dm_new_grad(c, 0, logits->device);
  if (dm_plan_card_of(logits->device))
    dm_plan_scratch(dm_ce_bwd_scratch((int)dm_attr(c, 1) == DM_CE_MEAN),
                    "cross-entropy's kept count (kernels/blocks.cu cuda_ce_bwd)");
  DM_RUN(cross_entropy_bwd, logits->device, gx, gout[0], logits, dm_saved(c, 1),
                                                              dm_saved(c, 2), (int64_t)dm_attr(c, 0),
                                                              (int)dm_attr(c, 1));
  gin[0] = gx;
}

/* ---- causal_conv1d ---------------------------------------------------------------------- */

/* attr 1 (silu): the output is silu of the convolution */
static bool conv_silu(const dm_ctx *c) {
  double v = dm_attr(c, 1);
  if (v != 0 && v != 1) dm_error("causal_conv1d: silu must be 0 or 1, got %g", v);
  return v == 1;
}

static void conv_forward(dm_ctx *c) {
  dm_tensor *x = c->in[0], *w = c->in[1], *cache = c->in[2];
  int64_t dil = int_attr("causal_conv1d", "dilation", dm_attr(c, 0));
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
  dm_tensor *x = dm_saved(c, 0), *w = dm_saved(c, 1), *cache = saved_opt(c, 2);
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
                    "causal_conv1d weight partials (kernels/blocks.cu conv_bwd_runs)");
  }
  DM_RUN(causal_conv1d_bwd, x->device, gx, gw, gc, gy, gout[1], x, w, cache, dil);
  dm_release(gz);
  gin[0] = gx;
  gin[1] = gw;
  gin[2] = gc;
}

/* ---- silu_mul --------------------------------------------------------------------------- */

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
  {.name = "rmsnorm", .doc = "x / sqrt(mean(x^2 over the last dim) + eps) * gain (gain [D], optional)",
   .args = "x [..., D], gain [D]", .lua = DM_LUA_METHOD,
   .n_in = 2, .n_out = 1, .attrs = "eps~1e-6", .optional = 2, .kind = DM_NORM_RMS,
   .forward = rownorm_forward, .backward = rownorm_backward},
  {.name = "l2norm", .doc = "x / sqrt(sum(x^2 over the last dim) + eps)",
   .args = "x [..., D]", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "eps~1e-6", .kind = DM_NORM_L2,
   .forward = rownorm_forward, .backward = rownorm_backward},
  {.name = "cross_entropy",
   .doc = "log-softmax cross-entropy of logits [..., V] at class ids [...] (0-based; ignore_index -1: none; "
          "reduction 0 mean over kept rows, 1 sum, 2 none)",
   .args = "logits [..., V], targets [...]", .lua = DM_LUA_FN,
   .n_in = 2, .n_out = 1, .attrs = "ignore_index:int~-1,reduction=" DM_CE_SPELLINGS "~mean", .nondiff = 2,
   .forward = ce_forward, .backward = ce_backward},
  {.name = "causal_conv1d",
   .doc = "depthwise causal conv of x [B, T, C] by w [C, K] with a cache [B, (K-1)*dilation, C] "
          "(optional, zeros) of the past -> y (silu = 1: silu of the conv, recomputed in the backward), "
          "the new cache",
   .n_in = 3, .n_out = 2, .attrs = "dilation:int~1,silu:bool~false", .optional = 4,
   .forward = conv_forward, .backward = conv_backward},
  {.name = "silu_mul", .doc = "silu(a) * b in one pass (a and b of one shape)",
   .args = "a, b", .lua = DM_LUA_METHOD, .n_in = 2, .n_out = 1, .attrs = "", .forward = silu_mul_forward, .backward = silu_mul_backward},
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

dm_tensor *dm_l2norm(dm_tensor *x, double eps) { return call1(&ops[1], 1, &x, 1, &eps); }

dm_tensor *dm_cross_entropy(dm_tensor *logits, dm_tensor *targets, int64_t ignore_index, int reduction) {
  dm_tensor *in[2] = {logits, targets};
  double v[2] = {(double)ignore_index, reduction};
  return call1(&ops[2], 2, in, 2, v);
}

dm_tensor *dm_causal_conv1d(dm_tensor *x, dm_tensor *w, dm_tensor *cache, int64_t dilation,
                            dm_tensor **cache_out) {
  dm_tensor *in[3] = {x, w, cache}, *out[DM_MAXOUT];
  double v = (double)dilation;
  dm_attrs at = dm_attrs_of(1, &v);
  dm_call(&ops[3], 3, in, &at, out);
  if (cache_out) *cache_out = out[1];
  else dm_release(out[1]);
  return out[0];
}

dm_tensor *dm_silu_mul(dm_tensor *a, dm_tensor *b) {
  dm_tensor *in[2] = {a, b};
  return call1(&ops[4], 2, in, 0, NULL);
}
