/*
** vm/ops/elementwise.c — unary ops, broadcasting binary ops and comparisons,
** where, and the in-place helpers of the optimisers.
**
** Each table of elementwise.h becomes one dm_op per kind sharing one
** forward and one backward; the kernels expand the same table.
*/
#include <string.h>
#include "core/core.h"
#include "core/autograd.h"
#include "ops/elementwise.h"

/* t summed down to shape (the backward of broadcasting); consumes t */
static dm_tensor *sum_to_owned(dm_tensor *t, int ndim, const int64_t *shape) {
  if (t->ndim == ndim && memcmp(t->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0) return t;
  dm_tensor *s = dm_sum_to(t, ndim, shape);
  dm_release(t);
  return s;
}

/* ---- unary ------------------------------------------------------------------------- */

#define SAVES_(ID, nm, f, df, saves, diff) [DM_UNARY_##ID] = saves,
static const int unary_saves[DM_NUNARY] = { DM_UNARY_OPS(SAVES_) };

static void unary_forward(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  int kind = c->op->kind;
  dm_check_float(c->op->name, "the input", x);
  dm_tensor *y = dm_tensor_like(x);
  DM_RUN(unary, x->device, kind, y, x, &c->a);
  if (unary_saves[kind] & DM_SAVE_X) dm_save(c, x);
  if (unary_saves[kind] & DM_SAVE_Y) dm_save(c, y);
  c->out[0] = y;
}

static void unary_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  int kind = c->op->kind, k = 0;
  const dm_tensor *x = unary_saves[kind] & DM_SAVE_X ? dm_saved(c, k++) : NULL;
  const dm_tensor *y = unary_saves[kind] & DM_SAVE_Y ? dm_saved(c, k++) : NULL;
  dm_tensor *g = dm_new_grad(c, 0, gout[0]->device);
  DM_RUN(unary_bwd, g->device, kind, g, gout[0], x, y, &c->a);
  gin[0] = g;
}

/* docs and attribute names by kind */
#define DOC_NEG      "-x"
#define DOC_EXP      "e^x"
#define DOC_LOG      "natural logarithm"
#define DOC_SQRT     "square root"
#define DOC_RSQRT    "1 / sqrt(x)"
#define DOC_TANH     "hyperbolic tangent"
#define DOC_SIGMOID  "1 / (1 + e^-x)"
#define DOC_SILU     "x * sigmoid(x)"
#define DOC_SOFTPLUS "log(1 + e^x), computed without overflow"
#define DOC_ABS      "|x|"
#define DOC_RELU     "max(x, 0)"
#define DOC_SQUARE   "x * x"
#define DOC_SIGN     "-1, 0 or 1 (not differentiable)"
#define DOC_POW      "x ^ p"
#define DOC_CLAMP    "x limited to [lo, hi] (infinite bounds leave a side open)"
#define DOC_AFFINE   "scale * x + shift (x * 2, x + 1, 2 - x from Lua)"
#define DOC_RDIV     "s / x"
#define ATTRS_NEG ""
#define ATTRS_EXP ""
#define ATTRS_LOG ""
#define ATTRS_SQRT ""
#define ATTRS_RSQRT ""
#define ATTRS_TANH ""
#define ATTRS_SIGMOID ""
#define ATTRS_SILU ""
#define ATTRS_SOFTPLUS ""
#define ATTRS_ABS ""
#define ATTRS_RELU ""
#define ATTRS_SQUARE ""
#define ATTRS_SIGN ""
#define ATTRS_POW "p"
#define ATTRS_CLAMP "lo~-inf,hi~inf"
#define ATTRS_AFFINE "scale,shift"
#define ATTRS_RDIV "s"

/* the Lua surface from the descriptor: x:exp() and dm.exp(x), x:pow(p), x:clamp(lo, hi) (nil: that side
** open), dm.affine(x, scale, shift), dm.rdiv(x, s); the metamethods (x * 2, 1 / x) are written by hand
** (lua/dormouse/ops/elementwise.lua) */
#define LUA_NEG DM_LUA_METHOD
#define LUA_EXP DM_LUA_METHOD
#define LUA_LOG DM_LUA_METHOD
#define LUA_SQRT DM_LUA_METHOD
#define LUA_RSQRT DM_LUA_METHOD
#define LUA_TANH DM_LUA_METHOD
#define LUA_SIGMOID DM_LUA_METHOD
#define LUA_SILU DM_LUA_METHOD
#define LUA_SOFTPLUS DM_LUA_METHOD
#define LUA_ABS DM_LUA_METHOD
#define LUA_RELU DM_LUA_METHOD
#define LUA_SQUARE DM_LUA_METHOD
#define LUA_SIGN DM_LUA_METHOD
#define LUA_POW DM_LUA_METHOD
#define LUA_CLAMP DM_LUA_METHOD
#define LUA_AFFINE DM_LUA_FN
#define LUA_RDIV DM_LUA_FN

#define UNARY_OP_(ID, nm, f, df, saves, diff)                                            \
  {.name = nm, .doc = DOC_##ID, .n_in = 1, .n_out = 1, .attrs = ATTRS_##ID, \
                     .kind = DM_UNARY_##ID, .forward = unary_forward,                    \
                     .backward = (diff) ? unary_backward : NULL, .args = "x", .lua = LUA_##ID},

/* ---- binary ------------------------------------------------------------------------ */

#define IS_CMP_(ID, nm, f, da, db, cmp) [DM_BINARY_##ID] = cmp,
static const bool binary_is_cmp[DM_NBINARY] = { DM_BINARY_OPS(IS_CMP_) };

/* add and sub need no operand values for their gradients */
static bool binary_saves(int kind) {
  return kind != DM_BINARY_ADD && kind != DM_BINARY_SUB && !binary_is_cmp[kind];
}

static void binary_forward(dm_ctx *c) {
  dm_tensor *a = c->in[0], *b = c->in[1];
  int kind = c->op->kind;
  dm_check_dtype_equal(c->op->name, a, b);
  int64_t shape[DM_MAXDIM];
  int n = dm_broadcast_shape(c->op->name, a->ndim, a->shape, b->ndim, b->shape, shape);
  dm_tensor *out = dm_tensor_new(a->device, binary_is_cmp[kind] ? DM_U8 : a->dtype, n, shape);
  DM_RUN(binary, a->device, kind, out, a, b, 1.0);
  if (binary_saves(kind)) { dm_save(c, a); dm_save(c, b); }
  c->out[0] = out;
}

static void binary_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  int kind = c->op->kind;
  dm_tensor *g = gout[0];
  bool na = dm_needs_grad(c, 0), nb = dm_needs_grad(c, 1);
  dm_tensor *ga = NULL, *gb = NULL;          /* at the output's shape */
  if (!binary_saves(kind)) {                 /* add, sub: g itself */
    if (na) { dm_retain(g); ga = g; }
    if (nb) { dm_retain(g); gb = g; }
  } else {
    if (na) ga = dm_tensor_like(g);
    if (nb) gb = dm_tensor_like(g);
    DM_RUN(binary_bwd, g->device, kind, ga, gb, g, dm_saved(c, 0), dm_saved(c, 1));
  }
  if (na) gin[0] = sum_to_owned(ga, dm_in_ndim(c, 0), dm_in_shape(c, 0));
  if (nb) {
    gin[1] = sum_to_owned(gb, dm_in_ndim(c, 1), dm_in_shape(c, 1));
    if (kind == DM_BINARY_SUB) {             /* negate after summing: fewer elements */
      dm_tensor *neg = dm_neg(gin[1]);
      dm_release(gin[1]);
      gin[1] = neg;
    }
  }
}

#define BDOC_ADD     "a + b, broadcasting"
#define BDOC_SUB     "a - b, broadcasting"
#define BDOC_MUL     "a * b, broadcasting"
#define BDOC_DIV     "a / b, broadcasting"
#define BDOC_MAXIMUM "the larger of a and b, broadcasting (NaN wins; ties split the gradient)"
#define BDOC_MINIMUM "the smaller of a and b, broadcasting (NaN wins; ties split the gradient)"
#define BDOC_EQ      "a == b as u8 0/1, broadcasting"
#define BDOC_NE      "a ~= b as u8 0/1, broadcasting"
#define BDOC_LT      "a < b as u8 0/1, broadcasting"
#define BDOC_LE      "a <= b as u8 0/1, broadcasting"
#define BDOC_GT      "a > b as u8 0/1, broadcasting"
#define BDOC_GE      "a >= b as u8 0/1, broadcasting"

/* dm.add(a, b) ... dm.div(a, b) from the descriptor (the methods x:add(y) are the metamethods', which
** keep a number beside a float tensor as an attribute); the others also methods, x:maximum(y), x:eq(y) */
#define BLUA_ADD     DM_LUA_FN
#define BLUA_SUB     DM_LUA_FN
#define BLUA_MUL     DM_LUA_FN
#define BLUA_DIV     DM_LUA_FN
#define BLUA_MAXIMUM DM_LUA_METHOD
#define BLUA_MINIMUM DM_LUA_METHOD
#define BLUA_EQ      DM_LUA_METHOD
#define BLUA_NE      DM_LUA_METHOD
#define BLUA_LT      DM_LUA_METHOD
#define BLUA_LE      DM_LUA_METHOD
#define BLUA_GT      DM_LUA_METHOD
#define BLUA_GE      DM_LUA_METHOD

#define BINARY_OP_(ID, nm, f, da, db, cmp)                                               \
  {.name = nm, .doc = BDOC_##ID, .n_in = 2, .n_out = 1, .attrs = "",  \
                      .args = "a:number, b:number", .lua = BLUA_##ID,                    \
                      .kind = DM_BINARY_##ID, .forward = binary_forward,                 \
                      .backward = (cmp) ? NULL : binary_backward},

/* ---- where ---------------------------------------------------------------------------- */

static void where_forward(dm_ctx *c) {
  dm_tensor *cond = c->in[0], *a = c->in[1], *b = c->in[2];
  dm_check_dtype_equal("where", a, b);
  int64_t ab[DM_MAXDIM], shape[DM_MAXDIM];
  int nab = dm_broadcast_shape("where", a->ndim, a->shape, b->ndim, b->shape, ab);
  int n = dm_broadcast_shape("where (condition against values)", cond->ndim, cond->shape, nab, ab, shape);
  dm_tensor *out = dm_tensor_new(a->device, a->dtype, n, shape);
  DM_RUN(where, a->device, out, cond, a, b);
  dm_save(c, cond);
  c->out[0] = out;
}

static void where_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *g = gout[0];
  bool na = dm_needs_grad(c, 1), nb = dm_needs_grad(c, 2);
  dm_tensor *ga = na ? dm_tensor_like(g) : NULL, *gb = nb ? dm_tensor_like(g) : NULL;
  DM_RUN(where_bwd, g->device, ga, gb, dm_saved(c, 0), g);
  if (na) gin[1] = sum_to_owned(ga, dm_in_ndim(c, 1), dm_in_shape(c, 1));
  if (nb) gin[2] = sum_to_owned(gb, dm_in_ndim(c, 2), dm_in_shape(c, 2));
}

/* ---- in place, no autograd ---------------------------------------------------------- */

static void check_inplace(const char *what, dm_tensor *a) {
  dm_check_live(a);
  if (a->requires_grad && dm_grad_enabled())
    dm_error("%s: in-place op on a tensor that requires grad; wrap it in dm.no_grad", what);
}

/* b must broadcast to a's shape; returns b, or a copy of it when it overlaps a
** other than position for position (the kernel reads each element just before
** writing it) */
static dm_tensor *inplace_operand(const char *what, dm_tensor *a, dm_tensor *b) {
  dm_check_live(b);
  dm_check_dtype_equal(what, a, b);
  dm_check_device_equal(what, a, b);
  int64_t shape[DM_MAXDIM];
  int n = dm_broadcast_shape(what, a->ndim, a->shape, b->ndim, b->shape, shape);
  if (n != a->ndim || memcmp(shape, a->shape, sizeof(int64_t) * (size_t)n) != 0) {
    char sa[128], sb[128];
    dm_error("%s: a tensor of shape %s cannot be written in place with one of shape %s", what,
             dm_tensor_shape_str(a, sa, sizeof sa), dm_tensor_shape_str(b, sb, sizeof sb));
  }
  bool same_view = b->offset == a->offset && dm_same_shape(a, b) &&
                   memcmp(a->strides, b->strides, sizeof(int64_t) * (size_t)a->ndim) == 0;
  if (b->storage == a->storage && !same_view) return dm_clone(b);
  dm_retain(b);
  return b;
}

static void binary_inplace(const char *what, int kind, dm_tensor *a, dm_tensor *b, double p) {
  check_inplace(what, a);
  dm_tensor *bb = inplace_operand(what, a, b);
  DM_RUN(binary, a->device, kind, a, a, bb, p);
  dm_release(bb);
  dm_mark_written(a);
}

void dm_add_(dm_tensor *a, dm_tensor *b, double alpha) { binary_inplace("add_", DM_BINARY_ADD, a, b, alpha); }
void dm_mul_(dm_tensor *a, dm_tensor *b) { binary_inplace("mul_", DM_BINARY_MUL, a, b, 1.0); }

void dm_affine_(dm_tensor *a, double scale, double shift) {
  check_inplace("affine_", a);
  dm_check_float("affine_", "the input", a);
  double v[2] = {scale, shift};
  dm_attrs at = dm_attrs_of(2, v);
  DM_RUN(unary, a->device, DM_UNARY_AFFINE, a, a, &at);
  dm_mark_written(a);
}

/* the helpers as ops, for the Lua layer: the output is the target itself */
static void add__forward(dm_ctx *c) { dm_add_(c->in[0], c->in[1], dm_attr(c, 0)); }
static void mul__forward(dm_ctx *c) { dm_mul_(c->in[0], c->in[1]); }
static void affine__forward(dm_ctx *c) { dm_affine_(c->in[0], dm_attr(c, 0), dm_attr(c, 1)); }
static void inplace_forward(dm_ctx *c) {
  dm_forward_fn fns[] = {add__forward, mul__forward, affine__forward};
  fns[c->op->kind](c);
  dm_retain(c->in[0]);
  c->out[0] = c->in[0];
}

/* one table: the unary kinds, the binary kinds, then these */
static dm_op ops[] = {
  DM_UNARY_OPS(UNARY_OP_)
  DM_BINARY_OPS(BINARY_OP_)
  {.name = "where", .doc = "cond ? a : b elementwise, broadcasting (cond of any dtype, nonzero is true)",
   .args = "cond, a:number, b:number", .lua = DM_LUA_FN,
   .n_in = 3, .n_out = 1, .attrs = "", .nondiff = 1, .forward = where_forward, .backward = where_backward},
  {.name = "add_", .doc = "a += alpha * b in place, b broadcasting (no autograd)", .n_in = 2, .n_out = 1,
   .attrs = "alpha~1", .kind = 0, .forward = inplace_forward},
  {.name = "mul_", .doc = "a *= b in place, b broadcasting (no autograd)", .n_in = 2, .n_out = 1,
   .attrs = "", .kind = 1, .forward = inplace_forward},
  {.name = "affine_", .doc = "a = scale * a + shift in place (no autograd)", .n_in = 1, .n_out = 1,
   .args = "a", .lua = DM_LUA_FN, .attrs = "scale,shift", .kind = 2, .forward = inplace_forward},
};
DM_REGISTER_OPS(ops)
#define UNARY_OP(kind) (&ops[kind])
#define BINARY_OP(kind) (&ops[DM_NUNARY + (kind)])
#define WHERE_OP (&ops[DM_NUNARY + DM_NBINARY])

/* ---- the C API ------------------------------------------------------------------------ */

static dm_tensor *call(const dm_op *op, int n, dm_tensor *const *in, const dm_attrs *a) {
  dm_tensor *out;
  dm_call(op, n, in, a, &out);
  return out;
}

static dm_tensor *call2(int kind, dm_tensor *a, dm_tensor *b) {
  dm_tensor *in[2] = {a, b};
  return call(BINARY_OP(kind), 2, in, NULL);
}

dm_tensor *dm_add(dm_tensor *a, dm_tensor *b) { return call2(DM_BINARY_ADD, a, b); }
dm_tensor *dm_sub(dm_tensor *a, dm_tensor *b) { return call2(DM_BINARY_SUB, a, b); }
dm_tensor *dm_mul(dm_tensor *a, dm_tensor *b) { return call2(DM_BINARY_MUL, a, b); }
dm_tensor *dm_div(dm_tensor *a, dm_tensor *b) { return call2(DM_BINARY_DIV, a, b); }
dm_tensor *dm_neg(dm_tensor *a) { return call(UNARY_OP(DM_UNARY_NEG), 1, &a, NULL); }

dm_tensor *dm_affine(dm_tensor *a, double scale, double shift) {
  double v[2] = {scale, shift};
  dm_attrs at = dm_attrs_of(2, v);
  return call(UNARY_OP(DM_UNARY_AFFINE), 1, &a, &at);
}

/* the unary ops without attributes, by name */
dm_tensor *dm_unary(const char *name, dm_tensor *a) {
  for (int k = 0; k < DM_NUNARY; k++)
    if (strcmp(UNARY_OP(k)->name, name) == 0) {
      if (UNARY_OP(k)->attrs[0])
        dm_error("dm_unary: '%s' takes attributes (%s); call it with dm_call", name, UNARY_OP(k)->attrs);
      return call(UNARY_OP(k), 1, &a, NULL);
    }
  dm_error("dm_unary: unknown unary op '%s'", name);
}

dm_tensor *dm_where(dm_tensor *cond, dm_tensor *a, dm_tensor *b) {
  dm_tensor *in[3] = {cond, a, b};
  return call(WHERE_OP, 3, in, NULL);
}
