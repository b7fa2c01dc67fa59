/*
** vm/ops/shape.c — shapes and views: reshape, permute, transpose, narrow,
** expand, squeeze, unsqueeze, contiguous, cast, clone, cat, stack.
**
** A view is a new tensor header over its input's storage (dm_tensor_view):
** no kernel runs. What must copy (reshape of an unviewable layout,
** contiguous, cast, clone, cat, stack) uses the "copy" kernel through
** dm_copy_, so this family has no kernels of its own. Every op returns a
** distinct tensor object, even when it is only a view of the whole input:
** the tape links a node to its output object.
*/
#include <math.h>
#include <string.h>
#include "core/core.h"
#include "ops/elementwise.h"

/* ---- helpers --------------------------------------------------------------------------- */

static int64_t shape_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

/* a contiguous copy of x in dtype dt */
static dm_tensor *copy_as(const dm_tensor *x, dm_dtype dt) {
  dm_tensor *c = dm_tensor_like_dtype(x, dt);
  dm_copy_(c, x);
  return c;
}

/* a header over all of x, same layout */
static dm_tensor *same_view(const dm_tensor *x) {
  return dm_tensor_view(x, x->ndim, x->shape, x->strides, x->offset);
}

/* x[..., start:start+len, ...] along dim, as a view */
static dm_tensor *narrow_view(const dm_tensor *x, int dim, int64_t start, int64_t len) {
  int64_t shape[DM_MAXDIM];
  memcpy(shape, x->shape, sizeof shape);
  shape[dim] = len;
  return dm_tensor_view(x, x->ndim, shape, x->strides, x->offset + start * x->strides[dim]);
}

/* x[..., i, ...] along dim, the dim removed, as a view */
static dm_tensor *select_view(const dm_tensor *x, int dim, int64_t i) {
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  int n = 0;
  for (int d = 0; d < x->ndim; d++)
    if (d != dim) { shape[n] = x->shape[d]; strides[n++] = x->strides[d]; }
  return dm_tensor_view(x, n, shape, strides, x->offset + i * x->strides[dim]);
}

/* a list attribute is at most DM_MAXDIM long: the binding enforces it, C callers too */
static void check_list_len(const char *what, int n) {
  if (n < 0 || n > DM_MAXDIM) dm_error("%s: a shape has at most %d dims, got %d", what, DM_MAXDIM, n);
}

/* ---- reshape ----------------------------------------------------------------------------- */

/* the requested shape with its -1 filled in, or an error naming both shapes */
static int reshape_target(const dm_tensor *x, const dm_attrs *a, int64_t *shape) {
  char sx[128], sr[128];
  int n = a->nlist, infer = -1;
  int64_t known = 1;
  check_list_len("reshape", n);
  for (int d = 0; d < n; d++) {
    shape[d] = a->list[d];
    if (shape[d] == -1 && infer < 0) infer = d;
    else if (shape[d] < 0)
      dm_error("reshape: bad target shape %s for a tensor of shape %s (sizes are >= 0, one may be -1)",
               dm_shape_str(sr, sizeof sr, n, a->list), dm_tensor_shape_str(x, sx, sizeof sx));
    else known *= shape[d];
  }
  int64_t numel = dm_numel(x);
  if (infer >= 0 && known > 0 && numel % known == 0) shape[infer] = numel / known;
  if ((infer >= 0 && (known == 0 || numel % known != 0)) || shape_numel(n, shape) != numel)
    dm_error("reshape: a tensor of shape %s (%lld elements) cannot be seen as shape %s",
             dm_tensor_shape_str(x, sx, sizeof sx), (long long)numel,
             dm_shape_str(sr, sizeof sr, n, a->list));
  return n;
}

/* Strides that show x's elements in `shape` without a copy, or false when
** its layout does not allow it. Dims of x that are laid out as one block
** (a "chunk") may be split and merged freely; a target dim may not span two
** chunks. (The same rule as torch's computeStride.) */
static bool view_strides(const dm_tensor *x, int n, const int64_t *shape, int64_t *strides) {
  if (x->ndim == 0 || dm_numel(x) == 0) { dm_contiguous_strides(n, shape, strides); return true; }
  int vd = n - 1;
  int64_t chunk_stride = x->strides[x->ndim - 1], x_numel = 1, v_numel = 1;
  for (int d = x->ndim - 1; d >= 0; d--) {
    x_numel *= x->shape[d];
    bool chunk_ends = d == 0 || (x->shape[d - 1] != 1 && x->strides[d - 1] != x_numel * chunk_stride);
    if (!chunk_ends) continue;
    while (vd >= 0 && (v_numel < x_numel || shape[vd] == 1)) {
      strides[vd] = v_numel * chunk_stride;
      v_numel *= shape[vd--];
    }
    if (v_numel != x_numel) return false;
    if (d > 0) { chunk_stride = x->strides[d - 1]; x_numel = v_numel = 1; }
  }
  return vd == -1;
}

static dm_tensor *reshape_to(const dm_tensor *x, int n, const int64_t *shape) {
  int64_t strides[DM_MAXDIM];
  if (view_strides(x, n, shape, strides)) return dm_tensor_view(x, n, shape, strides, x->offset);
  dm_tensor *c = copy_as(x, x->dtype);
  dm_contiguous_strides(n, shape, strides);
  dm_tensor *v = dm_tensor_view(c, n, shape, strides, 0);
  dm_release(c);
  return v;
}

static void reshape_fwd(dm_ctx *c) {
  int64_t shape[DM_MAXDIM];
  int n = reshape_target(c->in[0], &c->a, shape);
  c->out[0] = reshape_to(c->in[0], n, shape);
}

/* the backward of every op that only rearranges the shape: reshape, squeeze, unsqueeze */
static void reshape_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  gin[0] = dm_reshape(g[0], dm_in_ndim(c, 0), dm_in_shape(c, 0));
}

/* ---- permute, transpose -------------------------------------------------------------------- */

static void check_perm(const dm_tensor *x, int n, const int64_t *perm) {
  bool seen[DM_MAXDIM] = {false};
  bool ok = n == x->ndim;
  for (int d = 0; ok && d < n; d++) {
    ok = perm[d] >= 0 && perm[d] < n && !seen[perm[d]];
    if (ok) seen[perm[d]] = true;
  }
  if (!ok) {
    char sp[128], sx[128];
    int64_t shown[DM_MAXDIM];          /* as the Lua user wrote it */
    for (int d = 0; d < n && d < DM_MAXDIM; d++) shown[d] = perm[d] + 1;
    dm_error("permute: %s is not a permutation of the dims of a tensor of shape %s (dims count from 1)",
             dm_shape_str(sp, sizeof sp, n, shown), dm_tensor_shape_str(x, sx, sizeof sx));
  }
}

static dm_tensor *permute_view(const dm_tensor *x, const int64_t *perm) {
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  for (int d = 0; d < x->ndim; d++) {
    shape[d] = x->shape[perm[d]];
    strides[d] = x->strides[perm[d]];
  }
  return dm_tensor_view(x, x->ndim, shape, strides, x->offset);
}

static void permute_fwd(dm_ctx *c) {
  check_perm(c->in[0], c->a.nlist, c->a.list);
  c->out[0] = permute_view(c->in[0], c->a.list);
}

static void permute_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  int64_t inv[DM_MAXDIM];
  for (int d = 0; d < c->a.nlist; d++) inv[c->a.list[d]] = d;
  gin[0] = dm_permute(g[0], inv);
}

static void transpose_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  int d0 = dm_check_dim("transpose", x, (int64_t)c->a.v[0]);
  int d1 = dm_check_dim("transpose", x, (int64_t)c->a.v[1]);
  int64_t perm[DM_MAXDIM];
  for (int d = 0; d < x->ndim; d++) perm[d] = d;
  if (x->ndim > 0) { perm[d0] = d1; perm[d1] = d0; }
  c->out[0] = permute_view(x, perm);
}

static void transpose_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  gin[0] = dm_transpose(g[0], (int)c->a.v[0], (int)c->a.v[1]);
}

/* ---- narrow ------------------------------------------------------------------------------- */

static void narrow_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  if (x->ndim == 0) dm_error("narrow: a 0-dim tensor cannot be narrowed");
  int dim = dm_check_dim("narrow", x, (int64_t)c->a.v[0]);
  int64_t start = (int64_t)c->a.v[1], len = (int64_t)c->a.v[2], size = x->shape[dim];
  /* messages count starts from 1, as the Lua user writes them */
  if (start < 0 || len < 0 || start > size - len)
    dm_error("narrow: start %lld with length %lld does not fit in dim %d of size %lld (starts count from 1)",
             (long long)start + 1, (long long)len, dim + 1, (long long)size);
  c->out[0] = narrow_view(x, dim, start, len);
}

static void narrow_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_tensor *z = dm_zeros(g[0]->device, dm_in_dtype(c, 0), dm_in_ndim(c, 0), dm_in_shape(c, 0));
  dm_tensor *part = narrow_view(z, (int)c->a.v[0], (int64_t)c->a.v[1], (int64_t)c->a.v[2]);
  dm_copy_(part, g[0]);
  dm_release(part);
  gin[0] = z;
}

/* ---- expand ------------------------------------------------------------------------------- */

static void expand_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  int n = c->a.nlist, lead = n - x->ndim;
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  check_list_len("expand", n);
  bool ok = lead >= 0;
  for (int d = 0; ok && d < n; d++) {
    int64_t want = c->a.list[d];
    if (d < lead) {                           /* a new leading dim */
      ok = want >= 0;
      shape[d] = want;
      strides[d] = 0;
      continue;
    }
    int64_t have = x->shape[d - lead];
    if (want == -1 || want == have) { shape[d] = have; strides[d] = x->strides[d - lead]; }
    else if (have == 1 && want >= 0) { shape[d] = want; strides[d] = 0; }
    else ok = false;
  }
  if (!ok) {
    char sx[128], sw[128];
    dm_error("expand: a tensor of shape %s cannot be expanded to %s (only size-1 dims grow; -1 keeps a dim)",
             dm_tensor_shape_str(x, sx, sizeof sx), dm_shape_str(sw, sizeof sw, n, c->a.list));
  }
  c->out[0] = dm_tensor_view(x, n, shape, strides, x->offset);
}

static void expand_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  gin[0] = dm_sum_to(g[0], dm_in_ndim(c, 0), dm_in_shape(c, 0));
}

/* ---- squeeze, unsqueeze ------------------------------------------------------------------- */

/* attr dim: the dim to drop if its size is 1 (otherwise nothing changes), or -1 for every size-1 dim */
static void squeeze_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  int64_t want = (int64_t)c->a.v[0];
  int only = want == -1 || x->ndim == 0 ? -1 : dm_check_dim("squeeze", x, want);
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  int n = 0;
  for (int d = 0; d < x->ndim; d++) {
    if (x->shape[d] == 1 && (only < 0 || only == d)) continue;
    shape[n] = x->shape[d];
    strides[n++] = x->strides[d];
  }
  c->out[0] = dm_tensor_view(x, n, shape, strides, x->offset);
}

static void unsqueeze_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  int64_t at = (int64_t)c->a.v[0];
  if (at < 0 || at > x->ndim || x->ndim == DM_MAXDIM)
    dm_error("unsqueeze: dim %lld is out of range for a tensor of %d dims (dims count from 1, up to %d)",
             (long long)at + 1, x->ndim, x->ndim + 1);
  int64_t shape[DM_MAXDIM], strides[DM_MAXDIM];
  for (int d = 0, s = 0; d <= x->ndim; d++) {
    if (d == at) { shape[d] = 1; strides[d] = d < x->ndim ? x->strides[d] * x->shape[d] : 1; continue; }
    shape[d] = x->shape[s];
    strides[d] = x->strides[s++];
  }
  c->out[0] = dm_tensor_view(x, x->ndim + 1, shape, strides, x->offset);
}

/* ---- contiguous, clone, cast -------------------------------------------------------------- */

static void contiguous_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  c->out[0] = dm_is_contiguous(x) ? same_view(x) : copy_as(x, x->dtype);
}

static void clone_fwd(dm_ctx *c) { c->out[0] = copy_as(c->in[0], c->in[0]->dtype); }

/* the gradient passes through unchanged (contiguous, clone) */
static void identity_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_retain(g[0]);
  gin[0] = g[0];
}

/* The dtype a cast's backward gives a leaf x its gradient in (attribute grad): x's, or the copy's
** own when asked (-1: x's). A parameter's copy in the compute dtype keeps its gradient in that
** dtype: the gradient then reaches the master with no widening pass, and the optimisers read it as
** it is (the autograd widens a leaf's gradient to the leaf's dtype before a second one is added). */
static dm_dtype cast_grad_dtype(const dm_ctx *c, dm_dtype in) {
  if (dm_attr(c, 1) == -1) return in;
  dm_dtype g = dm_attr_dtype(c, 1), out = dm_attr_dtype(c, 0);
  if (g != in && g != out)
    dm_error("%s: grad = %s; the gradient comes in x's dtype (%s) or the copy's (%s)", c->op->name,
             dm_dtype_name(g), dm_dtype_name(in), dm_dtype_name(out));
  return g;
}

static void cast_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  dm_dtype dt = dm_attr_dtype(c, 0);
  cast_grad_dtype(c, x->dtype);
  c->out[0] = dt == x->dtype ? same_view(x) : copy_as(x, dt);
}

/* reached only for float outputs: the tape gives integer outputs no gradient. A gradient kept in the
** copy's dtype is for a leaf: an op that made x takes its gradient in x's dtype. */
static void cast_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_dtype to = dm_in_leaf(c, 0) ? cast_grad_dtype(c, dm_in_dtype(c, 0)) : dm_in_dtype(c, 0);
  if (g[0]->dtype == to) {                       /* passed on as it came */
    dm_retain(g[0]);
    gin[0] = g[0];
  } else gin[0] = dm_cast(g[0], to);
}

/* ---- stand_in: a copy's place in the graph when a kernel reads the copy in another form -------
** x's shape in dtype, holding no values: one NaN seen through zero strides (a read that was not meant
** shows), its gradient passed to x as a cast's (the fp8 banks: moe_experts reads their codes). */
static void stand_in_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0];
  dm_dtype dt = dm_attr_dtype(c, 0);
  if (!dm_dtype_is_float(x->dtype) || !dm_dtype_is_float(dt))
    dm_error("stand_in: x and the dtype must be float, got %s and %s", dm_dtype_name(x->dtype), dm_dtype_name(dt));
  cast_grad_dtype(c, x->dtype);
  dm_tensor *one = dm_tensor_new(x->device, dt, 0, NULL);
  dm_fill(one, NAN);
  int64_t strides[DM_MAXDIM] = {0};
  c->out[0] = dm_tensor_view(one, x->ndim, x->shape, strides, one->offset);
  dm_release(one);
}

/* A bf16 copy of an f32 bank met again (a recompute casts afresh in each
** recomputation): its gradient is cast and added slice by slice, so that only
** a slice of it is ever held in f32, not a second bank. */
#define CAST_SLICE ((int64_t)1 << 24)          /* elements: 64 MiB of f32 */

static void cast_bwd_into(dm_ctx *c, dm_tensor *const *g, dm_tensor *acc) {
  dm_tensor *grad = g[0];
  if (!dm_is_contiguous(grad) || dm_numel(grad) <= CAST_SLICE) {
    dm_tensor *part = dm_cast(grad, acc->dtype);
    dm_add_(acc, part, 1.0);
    dm_release(part);
    return;
  }
  (void)c;
  int64_t n = dm_numel(grad);
  dm_tensor *flat_g = dm_reshape(grad, 1, &n), *flat_acc = dm_reshape(acc, 1, &n);
  for (int64_t at = 0; at < n; at += CAST_SLICE) {
    int64_t len = n - at < CAST_SLICE ? n - at : CAST_SLICE;
    dm_tensor *src = dm_narrow(flat_g, 0, at, len), *dst = dm_narrow(flat_acc, 0, at, len);
    dm_tensor *part = dm_cast(src, acc->dtype);
    dm_add_(dst, part, 1.0);
    dm_release(part);
    dm_release(src);
    dm_release(dst);
  }
  dm_release(flat_g);
  dm_release(flat_acc);
}

/* ---- cat, stack --------------------------------------------------------------------------- */

/* every input has the first one's dtype, and its shape except along `skip` (-1: none) */
static void check_alike(const char *what, dm_ctx *c, int skip) {
  dm_tensor *first = c->in[0];
  for (int i = 1; i < c->n_in; i++) {
    dm_tensor *t = c->in[i];
    char sa[128], sb[128];
    if (t->dtype != first->dtype)
      dm_error("%s: input %d has dtype %s, input 1 has %s", what, i + 1, dm_dtype_name(t->dtype),
               dm_dtype_name(first->dtype));
    bool ok = t->ndim == first->ndim;
    for (int d = 0; ok && d < t->ndim; d++) ok = d == skip || t->shape[d] == first->shape[d];
    if (!ok)
      dm_error("%s: input %d has shape %s, which does not match input 1's %s%s", what, i + 1,
               dm_tensor_shape_str(t, sa, sizeof sa), dm_tensor_shape_str(first, sb, sizeof sb),
               skip >= 0 ? " outside the cat dim" : "");
  }
}

static void cat_fwd(dm_ctx *c) {
  dm_tensor *first = c->in[0];
  if (first->ndim == 0) dm_error("cat: 0-dim tensors cannot be concatenated (use stack)");
  int dim = dm_check_dim("cat", first, (int64_t)c->a.v[0]);
  check_alike("cat", c, dim);
  int64_t shape[DM_MAXDIM];
  memcpy(shape, first->shape, sizeof shape);
  shape[dim] = 0;
  for (int i = 0; i < c->n_in; i++) shape[dim] += c->in[i]->shape[dim];
  dm_tensor *out = dm_tensor_new(first->device, first->dtype, first->ndim, shape);
  for (int i = 0, at = 0; i < c->n_in; at += c->in[i++]->shape[dim]) {
    dm_tensor *part = narrow_view(out, dim, at, c->in[i]->shape[dim]);
    dm_copy_(part, c->in[i]);
    dm_release(part);
  }
  c->out[0] = out;
}

static void cat_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  int dim = (int)c->a.v[0];
  for (int i = 0, at = 0; i < c->n_in; at += dm_in_shape(c, i++)[dim])
    if (dm_needs_grad(c, i)) gin[i] = narrow_view(g[0], dim, at, dm_in_shape(c, i)[dim]);
}

static void stack_fwd(dm_ctx *c) {
  dm_tensor *first = c->in[0];
  int64_t dim = (int64_t)c->a.v[0];
  if (dim < 0 || dim > first->ndim || first->ndim == DM_MAXDIM)
    dm_error("stack: dim %lld is out of range for inputs of %d dims (dims count from 1, up to %d)",
             (long long)dim + 1, first->ndim, first->ndim + 1);
  check_alike("stack", c, -1);
  int64_t shape[DM_MAXDIM];
  for (int d = 0, s = 0; d <= first->ndim; d++) shape[d] = d == dim ? c->n_in : first->shape[s++];
  dm_tensor *out = dm_tensor_new(first->device, first->dtype, first->ndim + 1, shape);
  for (int i = 0; i < c->n_in; i++) {
    dm_tensor *part = select_view(out, (int)dim, i);
    dm_copy_(part, c->in[i]);
    dm_release(part);
  }
  c->out[0] = out;
}

static void stack_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  for (int i = 0; i < c->n_in; i++)
    if (dm_needs_grad(c, i)) gin[i] = select_view(g[0], (int)c->a.v[0], i);
}

/* ---- registration and the C API ----------------------------------------------------------- */

static dm_op ops[] = {
  {.name = "reshape", .doc = "the same elements in a new shape (one entry may be -1: inferred); a view when the layout allows",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "list=shape", .forward = reshape_fwd, .backward = reshape_bwd},
  {.name = "permute", .doc = "reorder the dims (perm: x's dims in their new order), a view",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "list=perm:dim", .forward = permute_fwd, .backward = permute_bwd},
  {.name = "transpose", .doc = "swap two dims, a view",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "d0:dim,d1:dim", .forward = transpose_fwd, .backward = transpose_bwd},
  {.name = "narrow", .doc = "len positions from start along dim, a view",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "dim:dim,start:pos,len:int", .forward = narrow_fwd, .backward = narrow_bwd},
  {.name = "expand", .doc = "repeat size-1 dims (and add leading dims) without copying (-1 keeps a dim)",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "list=shape", .forward = expand_fwd, .backward = expand_bwd},
  {.name = "squeeze", .doc = "drop dim if its size is 1, or every size-1 dim (dim absent), a view",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "dim:dim~-1", .forward = squeeze_fwd, .backward = reshape_bwd},
  {.name = "unsqueeze", .doc = "insert a size-1 dim at dim, a view",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "dim:newdim", .forward = unsqueeze_fwd, .backward = reshape_bwd},
  {.name = "contiguous", .doc = "a contiguous tensor of the same values (a view when already contiguous)",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "", .forward = contiguous_fwd,
   .backward = identity_bwd},
  {.name = "clone", .doc = "a contiguous copy",
   .args = "x", .lua = DM_LUA_METHOD, .n_in = 1, .n_out = 1, .attrs = "", .forward = clone_fwd,
   .backward = identity_bwd},
  {.name = "cast", .doc = "convert to another dtype; integer results take no gradient; grad: the dtype x's "
                          "gradient comes in (absent: x's; or the copy's own)",
   .args = "x", .lua = DM_LUA_FN, .n_in = 1, .n_out = 1, .attrs = "dtype:dtype,grad:dtype~-1", .forward = cast_fwd, .backward = cast_bwd,
   .backward_into = cast_bwd_into},
  {.name = "stand_in", .doc = "x's shape in dtype without values (a NaN through zero strides), its gradient x's as "
   "a cast's: the place of a copy a kernel reads in another form", .args = "x", .lua = DM_LUA_FN, .n_in = 1,
   .n_out = 1, .attrs = "dtype:dtype,grad:dtype~-1", .forward = stand_in_fwd, .backward = cast_bwd, .backward_into = cast_bwd_into},
  {.name = "cat", .doc = "join tensors along an existing dim",
   .n_in = -1, .n_out = 1, .attrs = "dim", .forward = cat_fwd, .backward = cat_bwd},
  {.name = "stack", .doc = "join same-shaped tensors along a new dim",
   .n_in = -1, .n_out = 1, .attrs = "dim", .forward = stack_fwd, .backward = stack_bwd},
};
DM_REGISTER_OPS(ops)

static dm_tensor *call_list(const char *name, dm_tensor *a, int n, const int64_t *list) {
  check_list_len(name, n);
  dm_attrs at = dm_attrs_list(n, list);
  return dm_call1(name, 1, &a, &at);
}

static dm_tensor *call_attrs(const char *name, dm_tensor *a, int n, const double *v) {
  dm_attrs at = dm_attrs_of(n, v);
  return dm_call1(name, 1, &a, &at);
}

dm_tensor *dm_reshape(dm_tensor *a, int ndim, const int64_t *shape) {
  return call_list("reshape", a, ndim, shape);
}

dm_tensor *dm_permute(dm_tensor *a, const int64_t *perm) { return call_list("permute", a, a->ndim, perm); }

dm_tensor *dm_transpose(dm_tensor *a, int d0, int d1) {
  return call_attrs("transpose", a, 2, (double[]){d0, d1});
}

dm_tensor *dm_narrow(dm_tensor *a, int dim, int64_t start, int64_t len) {
  return call_attrs("narrow", a, 3, (double[]){dim, (double)start, (double)len});
}

dm_tensor *dm_expand(dm_tensor *a, int ndim, const int64_t *shape) {
  return call_list("expand", a, ndim, shape);
}

dm_tensor *dm_contiguous(dm_tensor *a) { return dm_call1("contiguous", 1, &a, NULL); }

dm_tensor *dm_cast(dm_tensor *a, dm_dtype dt) { return call_attrs("cast", a, 1, (double[]){dt}); }
