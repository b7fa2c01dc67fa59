/*
** vm/ops/reduce.c — reductions (sum, mean, max, min, argmax, argmin,
** logsumexp, norm), sum_to (the backward of broadcasting), softmax and
** log_softmax.
**
** A reduction takes attrs dim (0-based, or -1 for every dim flattened) and
** keepdim; the index-valued ones (max, min, argmax, argmin) take base too,
** added to the 0-based position (Lua passes 1), and norm takes p > 0.
** Positions over several dims count through those dims in row-major order.
**
** dtypes: every reduction takes the float types, computing in double and
** giving the input's type. sum also takes integer inputs and gives an exact
** i64 sum; max, min, argmax and argmin take integers too (compared as
** doubles, so i64 values beyond 2^53 may not order exactly), max and min
** giving values of the input's type. mean, logsumexp, norm and softmax are
** float only. max and min of a NaN-holding slice give that NaN; ties go to
** the first position.
**
** The forward hands the kernels keepdim views of its outputs, so one kernel
** serves every dim choice; one backward kernel computes the input gradient
** of every kind.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "core/autograd.h"

#include "ops/reduce.h"

/* R_SUM_TO only names the op; its kernel call is a R_SUM over several dims */
enum { R_SUM_TO = R_NORM + 1 };

static bool has_index(int kind) { return kind >= R_MAX && kind <= R_ARGMIN; }
static bool takes_int(int kind) { return kind != R_MEAN && kind != R_LOGSUMEXP && kind != R_NORM; }

/* Which dims of an input of ndim dims the op reduces (mask) and which of
** those its output drops (removed); the output's dims are the rest. */
typedef struct geom { unsigned mask, removed; } geom;

static geom reduce_geom(const char *op, int ndim, const int64_t *shape, const dm_attrs *a) {
  geom g = {0, 0};
  int64_t dim = dm_int_attr(op, "dim", a->v[0]);
  if (dim == -1) g.mask = (1u << ndim) - 1;
  else if (dim < 0 || dim >= (ndim ? ndim : 1))
    dm_error("%s: dim %lld is out of range for a tensor of %d dims (dims count from 1)", op,
             (long long)dim + 1, ndim);
  else if (ndim) g.mask = 1u << dim;
  if (a->v[1] == 0) g.removed = g.mask;
  return g;
}

/* sum_to: the leading extra dims are removed, dims where the target has 1 are kept */
static geom sum_to_geom(int ndim, const int64_t *shape, const dm_attrs *a) {
  geom g = {0, 0};
  int lead = ndim - a->nlist;
  for (int d = 0; d < ndim; d++)
    if (d < lead) g.mask |= g.removed |= 1u << d;
    else if (a->list[d - lead] == 1 && shape[d] != 1) g.mask |= 1u << d;
  return g;
}

static geom op_geom(dm_ctx *c, int ndim, const int64_t *shape) {
  return c->op->kind == R_SUM_TO ? sum_to_geom(ndim, shape, &c->a)
                                 : reduce_geom(c->op->name, ndim, shape, &c->a);
}

/* t (an output or its gradient) seen with the input's ndim dims: size 1 where dims were removed */
static dm_tensor *full_view(dm_tensor *t, int ndim, geom g) {
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  for (int d = 0, j = 0; d < ndim; d++) {
    if ((g.removed >> d) & 1) { shape[d] = 1; strides[d] = 0; }
    else { shape[d] = t->shape[j]; strides[d] = t->strides[j]; j++; }
  }
  return dm_tensor_view(t, ndim, shape, strides, t->offset);
}

static void check_sum_to(const dm_tensor *x, const dm_attrs *a) {
  bool ok = a->nlist <= x->ndim;
  for (int i = 0; ok && i < a->nlist; i++) {
    int64_t want = a->list[i], have = x->shape[x->ndim - a->nlist + i];
    ok = want == have || want == 1;
  }
  if (!ok) {
    char sa[128], sb[128];
    dm_error("sum_to: a tensor of shape %s cannot be summed to shape %s (not broadcast from it)",
             dm_tensor_shape_str(x, sa, sizeof sa), dm_shape_str(sb, sizeof sb, a->nlist, a->list));
  }
}

static void reduce_forward(dm_ctx *c) {
  const char *name = c->op->name;
  int kind = c->op->kind;
  dm_tensor *x = c->in[0];
  if (!dm_dtype_is_float(x->dtype) && !takes_int(kind))
    dm_error("%s: needs a float tensor, got %s", name, dm_dtype_name(x->dtype));
  if (kind == R_SUM_TO) check_sum_to(x, &c->a);
  geom g = op_geom(c, x->ndim, x->shape);
  double p = 0;
  int64_t base = 0;
  if (kind == R_NORM) {
    p = c->a.v[2];
    if (!(p > 0) || isinf(p)) dm_error("norm: p must be a positive finite number, got %g", p);
  }
  if (has_index(kind)) {
    base = dm_int_attr(name, "base", c->a.v[2]);
    for (int d = 0; d < x->ndim; d++)
      if (((g.mask >> d) & 1) && x->shape[d] == 0) {
        char buf[128];
        dm_error("%s: cannot reduce over an empty dim (dim %d of shape %s)", name, d + 1,
                 dm_tensor_shape_str(x, buf, sizeof buf));
      }
  }
  int64_t shape[DM_MAXDIM];
  int ndim = 0;
  for (int d = 0; d < x->ndim; d++)
    if (!((g.removed >> d) & 1)) shape[ndim++] = (g.mask >> d) & 1 ? 1 : x->shape[d];
  bool int_sum = (kind == R_SUM || kind == R_SUM_TO) && !dm_dtype_is_float(x->dtype);
  dm_tensor *out = kind == R_ARGMAX || kind == R_ARGMIN ? NULL
                 : dm_tensor_new(x->device, int_sum ? DM_I64 : x->dtype, ndim, shape);
  dm_tensor *idx = has_index(kind) ? dm_tensor_new(x->device, DM_I64, ndim, shape) : NULL;
  dm_tensor *outv = out ? full_view(out, x->ndim, g) : NULL;
  dm_tensor *idxv = idx ? full_view(idx, x->ndim, g) : NULL;
  int kk = kind == R_SUM_TO ? R_SUM : kind;
  DM_RUN(reduce, x->device, kk, outv, idxv, x, p, base);
  dm_release(outv);
  dm_release(idxv);
  if (kind == R_MAX || kind == R_MIN) dm_save(c, idx);
  if (kind == R_LOGSUMEXP || kind == R_NORM) { dm_save(c, x); dm_save(c, out); }
  c->out[0] = out ? out : idx;
  if (out && idx) c->out[1] = idx;
}

/* logsumexp's gradient g exp(x - y) in 16 bits: y rounded to 16 bits carries up to half an ulp of |y|
** into the exponential (1.6% at |y| = 6 in bf16), and two backends may round y to different
** neighbours. It runs in f32 instead, from y summed again in f32, for one rounding of the gradient. */
static void lse_grad_f32(dm_tensor *gx, dm_tensor *gv, dm_tensor *x, geom g) {
  int64_t ys[DM_MAXDIM];
  for (int d = 0; d < x->ndim; d++) ys[d] = (g.mask >> d) & 1 ? 1 : x->shape[d];
  dm_tensor *x32 = dm_cast(x, DM_F32), *g32 = dm_cast(gv, DM_F32);
  dm_tensor *y32 = dm_tensor_new(x->device, DM_F32, x->ndim, ys);
  dm_tensor *gx32 = dm_tensor_new(x->device, DM_F32, x->ndim, x->shape);
  DM_RUN(reduce, x->device, R_LOGSUMEXP, y32, NULL, x32, 0, 0);
  DM_RUN(reduce_bwd, x->device, R_LOGSUMEXP, gx32, g32, y32, NULL, x32, 0, 0);
  dm_copy_(gx, gx32);
  dm_release(x32);
  dm_release(g32);
  dm_release(y32);
  dm_release(gx32);
}

static void reduce_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  int kind = c->op->kind, ndim = dm_in_ndim(c, 0);
  const int64_t *shape = dm_in_shape(c, 0);
  geom g = op_geom(c, ndim, shape);
  dm_tensor *x = NULL, *y = NULL, *idx = NULL;
  if (kind == R_MAX || kind == R_MIN) idx = dm_saved(c, 0);
  if (kind == R_LOGSUMEXP || kind == R_NORM) { x = dm_saved(c, 0); y = dm_saved(c, 1); }
  dm_tensor *gx = dm_tensor_new(gout[0]->device, dm_in_dtype(c, 0), ndim, shape);
  dm_tensor *gv = full_view(gout[0], ndim, g);
  dm_tensor *yv = y ? full_view(y, ndim, g) : NULL;
  dm_tensor *iv = idx ? full_view(idx, ndim, g) : NULL;
  int64_t base = has_index(kind) ? (int64_t)c->a.v[2] : 0;
  int kk = kind == R_SUM_TO ? R_SUM : kind;
  if (kind == R_LOGSUMEXP && dm_dtype_size(x->dtype) == 2) lse_grad_f32(gx, gv, x, g);
  else DM_RUN(reduce_bwd, gx->device, kk, gx, gv, yv, iv, x, c->a.v[2], base);
  dm_release(gv);
  dm_release(yv);
  dm_release(iv);
  gin[0] = gx;
}

/* softmax and log_softmax: kind 1 is the log */
/* the dim, -1 the last (the only one of a 0-dim tensor) */
static int softmax_dim(dm_ctx *c, const dm_tensor *x) {
  int64_t dim = dm_int_attr(c->op->name, "dim", dm_attr(c, 0));
  return dm_check_dim(c->op->name, x, dim == -1 ? (x->ndim ? x->ndim - 1 : 0) : dim);
}

static void softmax_forward(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  if (!dm_dtype_is_float(x->dtype))
    dm_error("%s: needs a float tensor, got %s", c->op->name, dm_dtype_name(x->dtype));
  int dim = softmax_dim(c, x);
  dm_tensor *y = dm_tensor_like(x);
  DM_RUN(softmax, x->device, y, x, dim, c->op->kind);
  dm_save(c, y);
  c->out[0] = y;
}

static void softmax_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  dm_tensor *y = dm_saved(c, 0);
  dm_tensor *gx = dm_tensor_like(y);
  DM_RUN(softmax_bwd, y->device, gx, gout[0], y, softmax_dim(c, y), c->op->kind);
  gin[0] = gx;
}

/* The Lua surface from the descriptors: x:sum(), x:sum(dim, keepdim), x:norm(p, dim, keepdim), x:softmax(dim)
** (dim nil: every dim, or for the softmaxes the last); max and min are written by hand
** (lua/dormouse/ops/reduce.lua: without a dim they give the value alone) */
#define RED "dim:dim~-1,keepdim:bool~false"
#define POSITIONS RED ",base@1~0"
static dm_op ops[] = {
  {.name = "sum", .doc = "sum over dim (absent: every dim); integers give i64", .n_in = 1, .n_out = 1, .attrs = RED,
   .kind = R_SUM, .forward = reduce_forward, .backward = reduce_backward, .args = "x", .lua = DM_LUA_METHOD},
  {.name = "mean", .doc = "mean over dim (absent: every dim)", .n_in = 1, .n_out = 1, .attrs = RED,
   .kind = R_MEAN, .forward = reduce_forward, .backward = reduce_backward, .args = "x", .lua = DM_LUA_METHOD},
  {.name = "max", .doc = "max over dim (absent: every dim): values and i64 positions from base", .n_in = 1, .n_out = 2,
   .attrs = POSITIONS, .kind = R_MAX, .forward = reduce_forward, .backward = reduce_backward},
  {.name = "min", .doc = "min over dim (absent: every dim): values and i64 positions from base", .n_in = 1, .n_out = 2,
   .attrs = POSITIONS, .kind = R_MIN, .forward = reduce_forward, .backward = reduce_backward},
  {.name = "argmax", .doc = "i64 position of the max over dim (absent: every dim, row-major), from 1 in Lua", .n_in = 1,
   .n_out = 1, .attrs = POSITIONS, .kind = R_ARGMAX, .forward = reduce_forward, .args = "x", .lua = DM_LUA_METHOD},
  {.name = "argmin", .doc = "i64 position of the min over dim (absent: every dim, row-major), from 1 in Lua", .n_in = 1,
   .n_out = 1, .attrs = POSITIONS, .kind = R_ARGMIN, .forward = reduce_forward, .args = "x", .lua = DM_LUA_METHOD},
  {.name = "logsumexp", .doc = "log(sum(exp(x))) over dim (absent: every dim), max-shifted", .n_in = 1, .n_out = 1,
   .attrs = RED, .kind = R_LOGSUMEXP, .forward = reduce_forward, .backward = reduce_backward, .args = "x",
   .lua = DM_LUA_METHOD},
  {.name = "norm", .doc = "p-norm (sum |x|^p)^(1/p) over dim (absent: every dim), p > 0 (absent: 2)", .n_in = 1, .n_out = 1,
   .attrs = RED ",p~2", .kind = R_NORM, .forward = reduce_forward, .backward = reduce_backward,
   .args = "x, p, dim, keepdim", .lua = DM_LUA_METHOD},
  {.name = "sum_to", .doc = "sum down to a shape the input was broadcast from", .n_in = 1, .n_out = 1,
   .attrs = "list=shape", .kind = R_SUM_TO, .forward = reduce_forward, .backward = reduce_backward, .args = "x",
   .lua = DM_LUA_METHOD},
  {.name = "softmax", .doc = "softmax over dim (absent: the last), max-shifted", .n_in = 1, .n_out = 1,
   .attrs = "dim:dim~-1", .kind = 0, .forward = softmax_forward, .backward = softmax_backward, .args = "x",
   .lua = DM_LUA_METHOD},
  {.name = "log_softmax", .doc = "log of softmax over dim (absent: the last), max-shifted", .n_in = 1, .n_out = 1,
   .attrs = "dim:dim~-1", .kind = 1, .forward = softmax_forward, .backward = softmax_backward, .args = "x",
   .lua = DM_LUA_METHOD},
};
DM_REGISTER_OPS(ops)

/* ---- the C API ------------------------------------------------------------------- */

static dm_tensor *reduce1(dm_op *op, dm_tensor *a, int dim, bool keepdim) {
  double v[2] = {dim < 0 ? -1 : dim, keepdim};
  dm_attrs at = dm_attrs_of(2, v);
  dm_tensor *out[DM_MAXOUT];
  dm_call(op, 1, &a, &at, out);
  return out[0];
}

dm_tensor *dm_sum(dm_tensor *a, int dim, bool keepdim) { return reduce1(&ops[0], a, dim, keepdim); }
dm_tensor *dm_mean(dm_tensor *a, int dim, bool keepdim) { return reduce1(&ops[1], a, dim, keepdim); }

dm_tensor *dm_sum_to(dm_tensor *a, int ndim, const int64_t *shape) {
  dm_check_live(a);
  /* the common no-op of broadcasting backward: outside recording, aliasing is harmless */
  if (ndim == a->ndim && !memcmp(shape, a->shape, sizeof(int64_t) * (size_t)ndim) && !dm_recording()) {
    dm_retain(a);
    return a;
  }
  if (ndim < 0 || ndim > DM_MAXDIM) dm_error("sum_to: a shape has at most %d dims, got %d", DM_MAXDIM, ndim);
  dm_attrs at = dm_attrs_list(ndim, shape);
  dm_tensor *out[DM_MAXOUT];
  dm_call(&ops[8], 1, &a, &at, out);
  return out[0];
}
