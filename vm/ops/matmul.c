/*
** vm/ops/matmul.c — matrix products.
**
**   matmul(a, b; transpose_a, transpose_b): op(a)[..., m, k] @ op(b)[..., k, n]
**   -> [..., m, n], where op swaps the last two dims when its flag is set and
**   the batch dims broadcast as in NumPy. Both inputs need at least 2 dims: a
**   vector must be reshaped to [1, k] or [k, 1], so that which side it stands
**   on is always explicit. The product comes in the inputs' dtype, or with
**   out = f32 from 16-bit inputs: their f32 sums kept, not rounded to 16
**   bits; its gradient is taken as a cast's, in the inputs' dtype.
**
** The backward is two more matmuls with the flags rearranged (no transpose
** is ever materialised), summed down over broadcast batch dims.
*/
#include <limits.h>
#include <stdio.h>
#include "core/core.h"
#include "ops/matmul.h"


/* rows and cols of op(t)'s matrices */
static void op_dims(const dm_tensor *t, bool tr, int64_t *rows, int64_t *cols) {
  int64_t r = t->shape[t->ndim - 2], c = t->shape[t->ndim - 1];
  *rows = tr ? c : r;
  *cols = tr ? r : c;
}

/* shapes that do not fit: name both, with their flags */
__attribute__((noreturn))
static void mismatch(const char *why, const dm_tensor *a, const dm_tensor *b, bool ta, bool tb) {
  char sa[128], sb[128];
  dm_error("matmul: %s (a %s with transpose_a = %s, b %s with transpose_b = %s)", why,
           dm_tensor_shape_str(a, sa, sizeof sa), ta ? "true" : "false",
           dm_tensor_shape_str(b, sb, sizeof sb), tb ? "true" : "false");
}

/* checks a and b and gives the output shape; returns its ndim */
static int out_shape(dm_tensor *a, dm_tensor *b, bool ta, bool tb, int64_t *shape) {
  dm_tensor *in[2] = {a, b};
  for (int i = 0; i < 2; i++)
    if (in[i]->ndim < 2) {
      char s[128];
      dm_error("matmul: input %d has shape %s, but matmul takes matrices [..., rows, cols]; reshape a "
               "vector of length k to [1, k] (a row) or [k, 1] (a column)", i + 1,
               dm_tensor_shape_str(in[i], s, sizeof s));
    }
  dm_check_dtype_equal("matmul", a, b);
  if (!dm_dtype_is_float(a->dtype)) dm_error("matmul needs a float dtype, got %s", dm_dtype_name(a->dtype));
  int64_t m, k, kb, n;
  op_dims(a, ta, &m, &k);
  op_dims(b, tb, &kb, &n);
  char why[96];
  if (k != kb) {
    snprintf(why, sizeof why, "inner dims do not agree, %lld and %lld", (long long)k, (long long)kb);
    mismatch(why, a, b, ta, tb);
  }
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) mismatch("a matrix dim is over BLAS's int range", a, b, ta, tb);
  int na = a->ndim - 2, nb = b->ndim - 2, nd = na > nb ? na : nb;
  for (int d = 0; d < nd; d++) {
    int64_t x = d < nd - na ? 1 : a->shape[d - (nd - na)];
    int64_t y = d < nd - nb ? 1 : b->shape[d - (nd - nb)];
    if (x != y && x != 1 && y != 1) {
      snprintf(why, sizeof why, "batch dims do not broadcast, %lld and %lld", (long long)x, (long long)y);
      mismatch(why, a, b, ta, tb);
    }
    shape[d] = x == 1 ? y : x;
  }
  shape[nd] = m;
  shape[nd + 1] = n;
  return nd + 2;
}

/* the product's dtype: the inputs', or f32 from 16-bit ones (attribute out, -1: the inputs') */
static dm_dtype out_dtype(const dm_ctx *c, dm_dtype in) {
  if (dm_attr(c, 2) == -1) return in;
  dm_dtype out = dm_attr_dtype(c, 2);
  bool sixteen = in == DM_BF16 || in == DM_F16;
  if (out != in && !(out == DM_F32 && sixteen))
    dm_error("matmul: out = %s from %s inputs; the product comes in the inputs' dtype, or in f32 from bf16 or "
             "f16 ones", dm_dtype_name(out), dm_dtype_name(in));
  return out;
}

static void matmul_forward(dm_ctx *c) {
  dm_tensor *a = c->in[0], *b = c->in[1];
  bool ta = c->a.v[0] != 0, tb = c->a.v[1] != 0;
  int64_t shape[DM_MAXDIM];
  int nd = out_shape(a, b, ta, tb, shape);
  c->out[0] = dm_tensor_new(a->device, out_dtype(c, a->dtype), nd, shape);
  DM_RUN(matmul, a->device, c->out[0], a, b, ta, tb);
  /* a's gradient needs b and b's needs a: keep only what will be used */
  if (c->node && dm_needs_grad(c, 1)) dm_save(c, a);
  if (c->node && dm_needs_grad(c, 0)) dm_save(c, b);
}

/* t [..., r, c] as one [(...) * r, c] matrix: a view when its rows lie at
** one stride through the batch dims, else a view of a contiguous copy */
static dm_tensor *as_rows(dm_tensor *t) {
  int nd = t->ndim;
  int64_t rows = 1, rstride = t->shape[nd - 1], expect = 0;
  bool seen = false, ok = true;
  for (int d = nd - 2; d >= 0; d--) {
    rows *= t->shape[d];
    if (t->shape[d] == 1) continue;
    if (!seen) { rstride = t->strides[d]; expect = rstride; seen = true; }
    ok = ok && t->strides[d] == expect;
    expect *= t->shape[d];
  }
  dm_tensor *src = ok ? t : dm_clone(t);
  if (!ok) rstride = t->shape[nd - 1];
  int64_t shape[2] = {rows, t->shape[nd - 1]}, strides[2] = {rstride, src->strides[nd - 1]};
  dm_tensor *v = dm_tensor_view(src, 2, shape, strides, src->offset);
  if (!ok) dm_release(src);
  return v;
}

/* g summed down to input i's shape where its batch dims were broadcast; takes g */
static dm_tensor *fit(dm_ctx *c, int i, dm_tensor *g) {
  int nd = dm_in_ndim(c, i);
  const int64_t *shape = dm_in_shape(c, i);
  bool same = g->ndim == nd;
  for (int d = 0; same && d < nd; d++) same = g->shape[d] == shape[d];
  if (same) return g;
  dm_tensor *s = dm_sum_to(g, nd, shape);
  dm_release(g);
  return s;
}

/* With C = op(A) op(B) and G = dC: d op(A) = G op(B)^T and d op(B) = op(A)^T G;
** a transposed input takes the transpose of that, written as the swapped
** product (dA = op(B) G^T when A was transposed), so every case is one matmul. */
static void matmul_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  bool ta = c->a.v[0] != 0, tb = c->a.v[1] != 0;
  int k = 0;
  dm_tensor *a = dm_needs_grad(c, 1) ? dm_saved(c, k++) : NULL;
  dm_tensor *b = dm_needs_grad(c, 0) ? dm_saved(c, k++) : NULL;
  dm_dtype in = dm_in_dtype(c, 0);
  dm_tensor *g = gout[0]->dtype == in ? (dm_retain(gout[0]), gout[0]) : dm_cast(gout[0], in);   /* out = f32: a cast's */
  if (dm_needs_grad(c, 0))
    gin[0] = fit(c, 0, ta ? dm_matmul(b, g, tb, true) : dm_matmul(g, b, false, !tb));
  if (dm_needs_grad(c, 1)) {
    if (dm_in_ndim(c, 1) == 2 && a->ndim > 2 && !ta) {
      /* a shared 2-D b (a weight) against batched rows of a: sum the batch
      ** inside one product over all rows instead of summing a batch of products */
      dm_tensor *a2 = as_rows(a), *g2 = as_rows(g);
      gin[1] = tb ? dm_matmul(g2, a2, true, false) : dm_matmul(a2, g2, true, false);
      dm_release(a2);
      dm_release(g2);
    } else
      gin[1] = fit(c, 1, tb ? dm_matmul(g, a, true, ta) : dm_matmul(a, g, !ta, false));
  }
  dm_release(g);
}

dm_tensor *dm_matmul(dm_tensor *a, dm_tensor *b, bool transpose_a, bool transpose_b) {
  dm_tensor *in[2] = {a, b};
  dm_attrs at = dm_attrs_of(3, (double[]){transpose_a, transpose_b, -1});     /* out: the inputs' dtype */
  return dm_call1("matmul", 2, in, &at);
}

static dm_op ops[] = {
  {.name = "matmul", .doc = "op(a)[..., m, k] @ op(b)[..., k, n] -> [..., m, n]; batch dims broadcast; out: the "
                            "product's dtype (absent: the inputs'; f32 from bf16 or f16 ones)",
   .args = "a, b", .lua = DM_LUA_METHOD, .n_in = 2, .n_out = 1,
   .attrs = "transpose_a:bool~false,transpose_b:bool~false,out:dtype~-1",
   .forward = matmul_forward, .backward = matmul_backward},
};
DM_REGISTER_OPS(ops)
