/*
** elementwise.h — the elementwise family's formulas and in-place helpers.
**
** One X-macro table per arity gives, for each kind, its forward formula and
** its derivative; the forward and backward kernels of every backend expand
** the same table, so a formula is written once. The formulas are plain
** expressions in the compute type T of their operands (float for f32, bf16
** and f16, double for f64): constants are integers so that a float stays a
** float, and the math functions are the type-generic ones of <tgmath.h>.
*/
#ifndef DM_ELEMENTWISE_H
#define DM_ELEMENTWISE_H

#include "core/ops.h"

/* what a unary backward needs: the input x, the output y */
#define DM_SAVE_X 1
#define DM_SAVE_Y 2

/* X(ID, name, f(x), f'(x, y), saves, differentiable)
** p = attr v[0], q = attr v[1], converted to T. */
#define DM_UNARY_OPS(X)                                                              \
  X(NEG,      "neg",      -x,                       -1,                 0,         1) \
  X(EXP,      "exp",      exp(x),                   y,                  DM_SAVE_Y, 1) \
  X(LOG,      "log",      log(x),                   1 / x,              DM_SAVE_X, 1) \
  X(SQRT,     "sqrt",     sqrt(x),                  1 / (2 * y),        DM_SAVE_Y, 1) \
  X(RSQRT,    "rsqrt",    1 / sqrt(x),              -(y * y * y) / 2,   DM_SAVE_Y, 1) \
  X(TANH,     "tanh",     tanh(x),                  1 - y * y,          DM_SAVE_Y, 1) \
  X(SIGMOID,  "sigmoid",  DM_SIGMOID(x),            y * (1 - y),        DM_SAVE_Y, 1) \
  X(SILU,     "silu",     x * DM_SIGMOID(x),        DM_DSILU(x),        DM_SAVE_X, 1) \
  X(SOFTPLUS, "softplus", DM_SOFTPLUS(x),           DM_SIGMOID(x),      DM_SAVE_X, 1) \
  X(ABS,      "abs",      fabs(x),                  DM_SIGN(x),         DM_SAVE_X, 1) \
  X(RELU,     "relu",     x > 0 ? x : 0,            x > 0,              DM_SAVE_X, 1) \
  X(SQUARE,   "square",   x * x,                    2 * x,              DM_SAVE_X, 1) \
  X(SIGN,     "sign",     DM_SIGN(x),               0,                  0,         0) \
  X(POW,      "pow",      pow(x, p),                p * pow(x, p - 1),  DM_SAVE_X, 1) \
  X(CLAMP,    "clamp",    x < p ? p : x > q ? q : x, x >= p && x <= q,  DM_SAVE_X, 1) \
  X(AFFINE,   "affine",   p * x + q,                p,                  0,         1) \
  X(RDIV,     "rdiv",     p / x,                    -p / (x * x),       DM_SAVE_X, 1)

#define DM_SIGMOID(x) (1 / (1 + exp(-(x))))
#define DM_SIGN(x) (((x) > 0) - ((x) < 0))
/* max(x, 0) + log(1 + e^-|x|): never overflows */
#define DM_SOFTPLUS(x) (((x) > 0 ? (x) : 0) + log1p(exp(-fabs(x))))
#define DM_DSILU(x) ({ __typeof__(x) s_ = DM_SIGMOID(x); s_ * (1 + (x) * (1 - s_)); })

/* X(ID, name, f(a, b), df/da * g, df/db * g, comparison)
** g is the output's gradient; p scales b in add and sub (the in-place axpy
** of optimisers), the ops pass 1. Comparisons give u8 and no gradient.
** maximum and minimum propagate NaN and split the gradient on ties. */
#define DM_BINARY_OPS(X)                                                                      \
  X(ADD,     "add",     a + p * b,              g,                     p * g,                 0) \
  X(SUB,     "sub",     a - p * b,              g,                     -(p * g),              0) \
  X(MUL,     "mul",     a * b,                  g * b,                 g * a,                 0) \
  X(DIV,     "div",     a / b,                  g / b,                 -(g * a) / (b * b),    0) \
  X(MAXIMUM, "maximum", a > b || a != a ? a : b, a > b ? g : a == b ? g / 2 : 0,                 \
                                                 b > a ? g : a == b ? g / 2 : 0,              0) \
  X(MINIMUM, "minimum", a < b || a != a ? a : b, a < b ? g : a == b ? g / 2 : 0,                 \
                                                 b < a ? g : a == b ? g / 2 : 0,              0) \
  X(EQ,      "eq",      a == b,                 0,                     0,                     1) \
  X(NE,      "ne",      a != b,                 0,                     0,                     1) \
  X(LT,      "lt",      a < b,                  0,                     0,                     1) \
  X(LE,      "le",      a <= b,                 0,                     0,                     1) \
  X(GT,      "gt",      a > b,                  0,                     0,                     1) \
  X(GE,      "ge",      a >= b,                 0,                     0,                     1)

#define DM_KIND_(ID, ...) DM_UNARY_##ID,
enum { DM_UNARY_OPS(DM_KIND_) DM_NUNARY };
#undef DM_KIND_
#define DM_KIND_(ID, ...) DM_BINARY_##ID,
enum { DM_BINARY_OPS(DM_KIND_) DM_NBINARY };
#undef DM_KIND_

/* The kernels, registered as "unary", "unary_bwd", "binary", "binary_bwd",
** "where", "where_bwd". Outputs may alias an operand at the same positions
** (the in-place helpers below do). In the backwards a missing operand is
** NULL; ga and gb, when both are given, have the same shape and strides. */
typedef void (*dm_unary_k)(int kind, dm_tensor *out, const dm_tensor *x, const dm_attrs *a);
typedef void (*dm_unary_bwd_k)(int kind, dm_tensor *gin, const dm_tensor *gout, const dm_tensor *x,
                               const dm_tensor *y, const dm_attrs *a);
typedef void (*dm_binary_k)(int kind, dm_tensor *out, const dm_tensor *a, const dm_tensor *b, double p);
typedef void (*dm_binary_bwd_k)(int kind, dm_tensor *ga, dm_tensor *gb, const dm_tensor *g,
                                const dm_tensor *a, const dm_tensor *b);
typedef void (*dm_where_k)(dm_tensor *out, const dm_tensor *cond, const dm_tensor *a, const dm_tensor *b);
typedef void (*dm_where_bwd_k)(dm_tensor *ga, dm_tensor *gb, const dm_tensor *cond, const dm_tensor *g);

/* In place, no autograd (optimisers): the target must not require a
** gradient while grad mode is on; b broadcasts to a's shape. */
void dm_add_(dm_tensor *a, dm_tensor *b, double alpha);         /* a += alpha * b */
void dm_mul_(dm_tensor *a, dm_tensor *b);                       /* a *= b */
void dm_affine_(dm_tensor *a, double scale, double shift);      /* a = scale * a + shift */

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(binary, dm_binary_k)
DM_KERNEL_TYPE(binary_bwd, dm_binary_bwd_k)
DM_KERNEL_TYPE(unary, dm_unary_k)
DM_KERNEL_TYPE(unary_bwd, dm_unary_bwd_k)
DM_KERNEL_TYPE(where, dm_where_k)
DM_KERNEL_TYPE(where_bwd, dm_where_bwd_k)

#endif
