/*
** vm/ops/quant.c — the low-bit formats as an op:
**
**   quantize(x; format, block)     x through fp8_e4m3, nvfp4, ternary or binary, block by block along the
**                                  last dim, dequantised (vm/ops/quant.h has the formats)
**   quant_encode(x; format, block) -> codes, scales     the same values as bits (a file's form)
**   quant_decode(codes, scales; format, block, n) -> y  and back, f32
**   littlebit(x, row, col) -> w     row * sign(x) * col, LittleBit's binary factor, in one pass;
**                                  its backward passes the sign's gradient straight through
**
** The formats take no gradient: quantisation-aware training passes the gradient
** straight through, w + (quantize(w) - w) with the difference detached
** (nn/moe.lua), which is the function's derivative nowhere but where it is wanted.
*/
#include <math.h>
#include "core/core.h"
#include "ops/quant.h"

/* the format and block attributes (0, 1), checked; block 0 is the format's own */
static int format_block(const dm_ctx *c, int64_t *block) {
  const char *name = c->op->name;
  double fv = dm_attr(c, 0), bv = dm_attr(c, 1);   /* a missing format is refused by dm_call, naming its words */
  if (fv != floor(fv) || fv < 0 || fv >= DM_QUANT_NFORMATS)
    dm_error("%s: format must be one of " DM_QUANT_SPELLINGS " (0..%d), got %g", name, DM_QUANT_NFORMATS - 1, fv);
  if (bv != floor(bv) || bv < 0 || bv > 1e9)
    dm_error("%s: block must be a whole number >= 0 (0: the format's own), got %g", name, bv);
  int format = (int)fv;
  *block = bv > 0 ? (int64_t)bv : dm_quant_default_block(format);
  return format;
}

static void check_rows(const char *name, const dm_tensor *x) {
  if (x->ndim == 0) dm_error("%s: x must have at least 1 dim (the rows' blocks lie along the last), got a 0-dim tensor", name);
}

/* quantize's and quant_encode's input: x checked (a float tensor with a last dim), the format
** and block read; x made contiguous (released by the caller) */
typedef struct {
  dm_tensor *x;
  int format;
  int64_t block;
} quant_input;

static quant_input quant_input_of(dm_ctx *c) {
  const char *name = c->op->name;
  quant_input q;
  dm_check_float(name, "x", c->in[0]);
  q.format = format_block(c, &q.block);
  check_rows(name, c->in[0]);
  q.x = dm_contiguous(c->in[0]);
  return q;
}

static void quantize_forward(dm_ctx *c) {
  quant_input q = quant_input_of(c);
  dm_tensor *y = dm_tensor_new(q.x->device, q.x->dtype, q.x->ndim, q.x->shape);
  DM_RUN(quantize, q.x->device, y, q.x, q.format, q.block);
  dm_release(q.x);
  c->out[0] = y;
}

/* x's shape with the last dim replaced by last */
static dm_tensor *shaped_like(const dm_tensor *x, int64_t last, dm_dtype dt) {
  int64_t shape[DM_MAXDIM];
  for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
  shape[x->ndim - 1] = last;
  return dm_tensor_new(x->device, dt, x->ndim, shape);
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void encode_forward(dm_ctx *c) {
  quant_input q = quant_input_of(c);
  int64_t n = q.x->shape[q.x->ndim - 1];
  dm_tensor *codes = shaped_like(q.x, ceil_div(n, dm_quant_per_byte(q.format)), DM_U8);
  dm_tensor *scales = shaped_like(q.x, ceil_div(n, q.block), q.format == DM_QUANT_NVFP4 ? DM_U8 : DM_F32);
  DM_RUN(quant_encode, q.x->device, codes, scales, q.x, q.format, q.block);
  dm_release(q.x);
  c->out[0] = codes;
  c->out[1] = scales;
}

static void decode_forward(dm_ctx *c) {
  dm_tensor *codes = c->in[0], *scales = c->in[1];
  int64_t block;
  int format = format_block(c, &block);
  double nv = dm_attr(c, 2);
  if (nv != floor(nv) || nv < 0 || nv > 9e15) dm_error("quant_decode: n (the row's elements) must be a whole number >= 0, got %g", nv);
  int64_t n = (int64_t)nv;
  char sc[128], ss[128];
  dm_shape_str(sc, sizeof sc, codes->ndim, codes->shape);
  dm_shape_str(ss, sizeof ss, scales->ndim, scales->shape);
  bool e4m3_scales = format == DM_QUANT_NVFP4;
  if (codes->dtype != DM_U8 || (e4m3_scales ? scales->dtype != DM_U8 : !dm_dtype_is_float(scales->dtype)))
    dm_error("quant_decode: codes must be u8 and scales %s for this format, got %s and %s",
             e4m3_scales ? "u8 (E4M3 codes)" : "a float tensor", dm_dtype_name(codes->dtype), dm_dtype_name(scales->dtype));
  check_rows("quant_decode", codes);
  bool fits = codes->ndim == scales->ndim && codes->shape[codes->ndim - 1] == ceil_div(n, dm_quant_per_byte(format)) &&
              scales->shape[scales->ndim - 1] == ceil_div(n, block);
  for (int d = 0; fits && d < codes->ndim - 1; d++) fits = codes->shape[d] == scales->shape[d];
  if (!fits)
    dm_error("quant_decode: codes %s and scales %s are not the form of rows of %lld elements in blocks of %lld "
             "(%d to a byte)", sc, ss, (long long)n, (long long)block, dm_quant_per_byte(format));
  dm_check_device_equal("quant_decode", codes, scales);
  dm_tensor *cc = dm_contiguous(codes);
  dm_tensor *scc = e4m3_scales || scales->dtype == DM_F32 ? dm_contiguous(scales) : dm_cast(scales, DM_F32);
  dm_tensor *y = shaped_like(codes, n, DM_F32);
  DM_RUN(quant_decode, codes->device, y, cc, scc, format, block);
  dm_release(cc);
  dm_release(scc);
  c->out[0] = y;
}

/* ---- littlebit ------------------------------------------------------------------------------ */

/* x [E, m, n], row [E, m, 1], col [E, 1, n] of one float dtype and device */
static void check_littlebit(const dm_tensor *x, const dm_tensor *row, const dm_tensor *col) {
  dm_check_float("littlebit", "x", x);
  dm_check_dtype_equal("littlebit", x, row);
  dm_check_dtype_equal("littlebit", x, col);
  dm_check_device_equal("littlebit", x, row);
  dm_check_device_equal("littlebit", x, col);
  char sx[128], sr[128], sc[128];
  dm_shape_str(sx, sizeof sx, x->ndim, x->shape);
  dm_shape_str(sr, sizeof sr, row->ndim, row->shape);
  dm_shape_str(sc, sizeof sc, col->ndim, col->shape);
  bool fits = x->ndim == 3 && row->ndim == 3 && col->ndim == 3 && row->shape[0] == x->shape[0] &&
              row->shape[1] == x->shape[1] && row->shape[2] == 1 && col->shape[0] == x->shape[0] &&
              col->shape[1] == 1 && col->shape[2] == x->shape[2];
  if (!fits)
    dm_error("littlebit: x must be [E, m, n] with row [E, m, 1] and col [E, 1, n], got x %s, row %s, col %s",
             sx, sr, sc);
}

static void littlebit_forward(dm_ctx *c) {
  check_littlebit(c->in[0], c->in[1], c->in[2]);
  dm_tensor *x = dm_contiguous(c->in[0]), *row = dm_contiguous(c->in[1]), *col = dm_contiguous(c->in[2]);
  dm_tensor *w = dm_tensor_new(x->device, x->dtype, x->ndim, x->shape);
  DM_RUN(littlebit, x->device, w, x, row, col);
  dm_save(c, x);
  dm_save(c, row);
  dm_save(c, col);
  dm_release(x);
  dm_release(row);
  dm_release(col);
  c->out[0] = w;
}

static void littlebit_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *x = dm_saved(c, 0), *row = dm_saved(c, 1), *col = dm_saved(c, 2);
  dm_tensor *g = dm_contiguous(gout[0]);
  for (int i = 0; i < 3; i++) gin[i] = dm_needs_grad(c, i) ? dm_new_grad(c, i, x->device) : NULL;
  if (dm_numel(x) == 0) {        /* no products: the scales' sums over an empty side are zeros */
    for (int i = 1; i < 3; i++) if (gin[i]) dm_fill(gin[i], 0);
  } else {
    DM_RUN(littlebit_bwd, x->device, gin[0], gin[1], gin[2], g, x, row, col);
  }
  dm_release(g);
}

static dm_op ops[] = {
  {.name = "quantize",
   .doc = "x through a low-bit format block by block along the last dim, dequantised (no gradient; "
          "block 0: 16 for nvfp4, 32 for the others)",
   .args = "x [..., n]", .lua = DM_LUA_METHOD,
   .n_in = 1, .n_out = 1, .attrs = "format=" DM_QUANT_SPELLINGS ",block:int~0", .nondiff = 1,
   .forward = quantize_forward},
  {.name = "quant_encode",
   .doc = "x as a low-bit format's codes [..., ceil(n / per byte)] u8 and its blocks' scales [..., ceil(n / block)] "
          "(f32; E4M3 codes in u8 for nvfp4)",
   .args = "x [..., n]", .lua = DM_LUA_FN,
   .n_in = 1, .n_out = 2, .attrs = "format=" DM_QUANT_SPELLINGS ",block:int~0", .nondiff = 1,
   .forward = encode_forward},
  {.name = "quant_decode", .doc = "a low-bit format's codes and scales back to values, rows of n elements, f32",
   .args = "codes [..., nc], scales [..., nb]", .lua = DM_LUA_FN,
   .n_in = 2, .n_out = 1, .attrs = "format=" DM_QUANT_SPELLINGS ",block:int~0,n:int", .nondiff = 3,
   .forward = decode_forward},
  {.name = "littlebit",
   .doc = "LittleBit's binary factor row * sign(x) * col in one pass, the sign's gradient passed straight "
          "through to x",
   .args = "x [E, m, n], row [E, m, 1], col [E, 1, n]", .lua = DM_LUA_FN, .n_in = 3, .n_out = 1, .attrs = "", .forward = littlebit_forward, .backward = littlebit_backward},
};
DM_REGISTER_OPS(ops)

dm_tensor *dm_quantize(dm_tensor *x, int format, int64_t block) {
  double v[2] = {format, (double)block};
  dm_attrs at = dm_attrs_of(2, v);
  dm_tensor *out[DM_MAXOUT];
  dm_call(&ops[0], 1, &x, &at, out);
  return out[0];
}

dm_tensor *dm_quant_encode(dm_tensor *x, int format, int64_t block, dm_tensor **scales) {
  double v[2] = {format, (double)block};
  dm_attrs at = dm_attrs_of(2, v);
  dm_tensor *out[DM_MAXOUT];
  dm_call(&ops[1], 1, &x, &at, out);
  if (scales) *scales = out[1];
  else dm_release(out[1]);
  return out[0];
}

dm_tensor *dm_quant_decode(dm_tensor *codes, dm_tensor *scales, int format, int64_t block, int64_t n) {
  double v[3] = {format, (double)block, (double)n};
  dm_attrs at = dm_attrs_of(3, v);
  dm_tensor *in[2] = {codes, scales}, *out[DM_MAXOUT];
  dm_call(&ops[2], 2, in, &at, out);
  return out[0];
}
