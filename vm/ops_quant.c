/*
** ops_quant.c — the low-bit formats as an op:
**
**   quantize(x; format, block)     x through fp8_e4m3, nvfp4 or ternary, block by block along the
**                                  last dim, dequantised (vm/quant.h has the formats)
**
** It takes no gradient: quantisation-aware training passes the gradient
** straight through, w + (quantize(w) - w) with the difference detached
** (nn/moe.lua), which is the function's derivative nowhere but where it is wanted.
*/
#include <math.h>
#include "core.h"
#include "quant.h"

static void quantize_forward(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  dm_check_float("quantize", "x", x);
  double fv = c->a.nv > 0 ? c->a.v[0] : -1, bv = c->a.nv > 1 ? c->a.v[1] : 0;
  if (fv != floor(fv) || fv < 0 || fv >= DM_QUANT_NFORMATS)
    dm_error("quantize: format must be one of " DM_QUANT_SPELLINGS " (0..%d), got %g", DM_QUANT_NFORMATS - 1, fv);
  if (bv != floor(bv) || bv < 0 || bv > 1e9) dm_error("quantize: block must be a whole number >= 0 (0: the format's own), got %g", bv);
  int format = (int)fv;
  int64_t block = bv > 0 ? (int64_t)bv : dm_quant_default_block(format);
  if (x->ndim == 0) dm_error("quantize: x must have at least 1 dim (the rows' blocks lie along the last), got a 0-dim tensor");
  dm_tensor *xc = dm_contiguous(x);
  dm_tensor *y = dm_tensor_new(x->device, x->dtype, x->ndim, x->shape);
  DM_KERNEL(dm_quantize_k, "quantize", x->device)(y, xc, format, block);
  dm_release(xc);
  c->out[0] = y;
}

static dm_op ops[] = {
  {.name = "quantize",
   .doc = "x through a low-bit format block by block along the last dim, dequantised (no gradient; "
          "block 0: 32 for fp8_e4m3 and ternary, 16 for nvfp4)",
   .n_in = 1, .n_out = 1, .attrs = "format=" DM_QUANT_SPELLINGS ",block", .nondiff = 1,
   .forward = quantize_forward},
};
DM_REGISTER_OPS(ops)

dm_tensor *dm_quantize(dm_tensor *x, int format, int64_t block) {
  double v[2] = {format, (double)block};
  dm_attrs at = dm_attrs_of(2, v);
  dm_tensor *out[DM_MAXOUT];
  dm_call(&ops[0], 1, &x, &at, out);
  return out[0];
}
