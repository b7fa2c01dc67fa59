/*
** vm/ops/xent.c — cross-entropy as a single fused op with its own backward
** kernel:
**
**   cross_entropy(logits, targets; ignore_index, reduction)
**                                  fused with its log-softmax; saves only the
**                                  per-row logsumexp, the backward recomputes softmax
**
** The kinds, kernel signatures and scratch are in xent.h, the rows' layout
** in rows.h.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/xent.h"

static void ce_forward(dm_ctx *c) {
  dm_tensor *logits = c->in[0], *targets = c->in[1];
  int64_t ignore = dm_int_attr("cross_entropy", "ignore_index", dm_attr(c, 0));
  int64_t red = dm_int_attr("cross_entropy", "reduction", dm_attr(c, 1));
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
                    "cross-entropy's target check (kernels/xent.cu cuda_ce_check)");
  DM_RUN(cross_entropy_check, logits->device, targets, classes, ignore);
  dm_tensor *loss = red == DM_CE_NONE
                  ? dm_tensor_new(logits->device, dm_stat_dtype(logits->dtype), targets->ndim, targets->shape)
                  : dm_tensor_new(logits->device, dm_stat_dtype(logits->dtype), 0, NULL);
  dm_tensor *lse = dm_row_stat(c, logits);
  if (dm_plan_card_of(logits->device))
    dm_plan_scratch(dm_ce_scratch(dm_numel(targets), red != DM_CE_NONE),
                    "cross-entropy partial sums (kernels/xent.cu cuda_ce)");
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
                    "cross-entropy's kept count (kernels/xent.cu cuda_ce_bwd)");
  DM_RUN(cross_entropy_bwd, logits->device, gx, gout[0], logits, dm_saved(c, 1),
                                                              dm_saved(c, 2), (int64_t)dm_attr(c, 0),
                                                              (int)dm_attr(c, 1));
  gin[0] = gx;
}

static dm_op ops[] = {
  {.name = "cross_entropy",
   .doc = "log-softmax cross-entropy of logits [..., V] at class ids [...] (0-based; ignore_index -1: none; "
          "reduction 0 mean over kept rows, 1 sum, 2 none)",
   .args = "logits [..., V], targets [...]", .lua = DM_LUA_FN,
   .n_in = 2, .n_out = 1, .attrs = "ignore_index:int~-1,reduction=" DM_CE_SPELLINGS "~mean", .nondiff = 2,
   .forward = ce_forward, .backward = ce_backward},
};
DM_REGISTER_OPS(ops)

/* ---- the C API -------------------------------------------------------------------------- */

dm_tensor *dm_cross_entropy(dm_tensor *logits, dm_tensor *targets, int64_t ignore_index, int reduction) {
  dm_tensor *in[2] = {logits, targets}, *out;
  double v[2] = {(double)ignore_index, reduction};
  dm_attrs at = dm_attrs_of(2, v);
  dm_call(&ops[0], 2, in, &at, &out);
  return out;
}
