/*
** vm/ops/index.c — ops that address one tensor through another's values:
** gather, index_select, scatter_add, embedding, and patch_index, which
** makes the ids that group bytes into patches (vm/ops/patch.h).
**
** Index tensors hold i64, i32 or u8 (byte ids). Every op takes a numeric
** attribute `base`, the value that names the first position (Lua passes 1,
** embedding 0: byte values and class ids are values), and checks every
** index against the size it addresses with the "index_check" kernel before
** it allocates anything, so a bad index leaves nothing behind. The error
** names the index as the user wrote it and the size. Index inputs take no
** gradient (nondiff).
**
** Kernels (vm/cpu/index.c): gather and index_select read, scatter_add and
** index_add accumulate in place; index_add is the backward of both
** index_select and embedding, scatter_add the backward of gather.
*/
#include <string.h>
#include "core/core.h"
#include "core/alloc.h"
#include "patch.h"
#include "ops/index.h"

/* ---- checks ------------------------------------------------------------------------------- */

static void check_index_dtype(const char *what, const dm_tensor *idx) {
  if (idx->dtype != DM_I64 && idx->dtype != DM_I32 && idx->dtype != DM_U8)
    dm_error("%s: indices must be i64, i32 or u8, got %s", what, dm_dtype_name(idx->dtype));
}

/* every index within base .. base+size-1 */
static void check_indices(const char *what, const dm_tensor *idx, int64_t size, int64_t base) {
  DM_RUN(index_check, idx->device, idx, size, base, what);
}

static void check_not_scalar(const char *what, const dm_tensor *x) {
  if (x->ndim == 0) dm_error("%s: the tensor indexed must have at least 1 dim", what);
}

/* idx (and x) fit gather's and scatter_add's rule: idx has x's dims, and is no
** larger than x outside dim (no larger than `bound`, when given, anywhere) */
static void check_elementwise_index(const char *what, const dm_tensor *x, const dm_tensor *idx, int dim,
                                    const dm_tensor *bound) {
  char sx[128], si[128], sb[128];
  bool ok = idx->ndim == x->ndim && (!bound || bound->ndim == x->ndim);
  for (int d = 0; ok && d < x->ndim; d++)
    ok = (d == dim || idx->shape[d] <= x->shape[d]) && (!bound || idx->shape[d] <= bound->shape[d]);
  if (ok) return;
  dm_tensor_shape_str(idx, si, sizeof si);
  dm_tensor_shape_str(x, sx, sizeof sx);
  if (bound)
    dm_error("%s: an index of shape %s does not fit a tensor of shape %s and a source of shape %s "
             "(same dims; no larger than the source, nor than the tensor outside dim %d)",
             what, si, sx, dm_tensor_shape_str(bound, sb, sizeof sb), dim + 1);
  dm_error("%s: an index of shape %s does not fit a tensor of shape %s (same dims; no larger outside dim %d)",
           what, si, sx, dim + 1);
}

static int64_t attr_base(const dm_ctx *c, int at) { return (int64_t)c->a.v[at]; }

/* the checks gather, index_select and scatter_add start with: x (in[0]) indexed
** along the attribute dim by idx (in[1]); returns the 0-based dim, sets base */
static int check_dim_index(dm_ctx *c, const char *what, int64_t *base) {
  dm_tensor *x = c->in[0], *idx = c->in[1];
  check_not_scalar(what, x);
  int dim = dm_check_dim(what, x, (int64_t)c->a.v[0]);
  *base = attr_base(c, 1);
  check_index_dtype(what, idx);
  return dim;
}

static dm_tensor *zeros_of_input(dm_ctx *c, int i, dm_device dev) {
  return dm_zeros(dev, dm_in_dtype(c, i), dm_in_ndim(c, i), dm_in_shape(c, i));
}

/* ---- gather ------------------------------------------------------------------------------- */

/* out[i][j] = x[idx[i][j] - base][j] for dim 0, and so on */
static void gather_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0], *idx = c->in[1];
  int64_t base;
  int dim = check_dim_index(c, "gather", &base);
  check_elementwise_index("gather", x, idx, dim, NULL);
  check_indices("gather", idx, x->shape[dim], base);
  dm_tensor *out = dm_tensor_new(x->device, x->dtype, idx->ndim, idx->shape);
  DM_RUN(gather, x->device, out, x, idx, dim, base);
  dm_save(c, idx);
  c->out[0] = out;
}

/* a plan's share of an accumulation into dst of n sources: the CUDA kernels' sort by destination */
static void plan_accumulate(const dm_tensor *dst, int64_t n, const char *what) {
  if (dm_plan_card_of(dst->device)) dm_plan_scratch(dm_index_accumulate_scratch(dst->dtype, n), what);
}

static void gather_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_tensor *gx = zeros_of_input(c, 0, g[0]->device);
  plan_accumulate(gx, dm_numel(dm_saved(c, 0)), "scatter_add sort (kernels/index.cu sorted_accumulate)");
  DM_RUN(scatter_add, gx->device, gx, dm_saved(c, 0), g[0], (int)c->a.v[0], attr_base(c, 1));
  gin[0] = gx;
}

/* ---- index_select ------------------------------------------------------------------------- */

static void index_select_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0], *idx = c->in[1];
  int64_t base;
  int dim = check_dim_index(c, "index_select", &base);
  if (idx->ndim != 1) {
    char si[128];
    dm_error("index_select: the index must be 1-D, got shape %s", dm_tensor_shape_str(idx, si, sizeof si));
  }
  check_indices("index_select", idx, x->shape[dim], base);
  int64_t shape[DM_MAXDIM];
  memcpy(shape, x->shape, sizeof shape);
  shape[dim] = idx->shape[0];
  dm_tensor *out = dm_tensor_new(x->device, x->dtype, x->ndim, shape);
  DM_RUN(index_select, x->device, out, x, idx, dim, base);
  dm_save(c, idx);
  c->out[0] = out;
}

/* rows picked through a 1-D index flow back with index_add: repeated indices accumulate */
static void index_select_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_tensor *gx = zeros_of_input(c, 0, g[0]->device);
  plan_accumulate(gx, dm_saved(c, 0)->shape[0], "index_add sort (kernels/index.cu sorted_accumulate)");
  DM_RUN(index_add, gx->device, gx, dm_saved(c, 0), g[0], (int)c->a.v[0], attr_base(c, 1));
  gin[0] = gx;
}

/* ---- scatter_add -------------------------------------------------------------------------- */

/* out = x, then out[idx[i][j] - base][j] += src[i][j] for dim 0, and so on */
static void scatter_add_fwd(dm_ctx *c) {
  dm_tensor *x = c->in[0], *idx = c->in[1], *src = c->in[2];
  int64_t base;
  int dim = check_dim_index(c, "scatter_add", &base);
  dm_check_dtype_equal("scatter_add", x, src);
  check_elementwise_index("scatter_add", x, idx, dim, src);
  check_indices("scatter_add", idx, x->shape[dim], base);
  dm_tensor *out = dm_tensor_like(x);
  dm_copy_(out, x);
  plan_accumulate(out, dm_numel(idx), "scatter_add sort (kernels/index.cu sorted_accumulate)");
  DM_RUN(scatter_add, x->device, out, idx, src, dim, base);
  dm_save(c, idx);
  c->out[0] = out;
}

static void scatter_add_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  if (dm_needs_grad(c, 0)) { dm_retain(g[0]); gin[0] = g[0]; }
  if (dm_needs_grad(c, 2)) {
    /* src's gradient is g gathered through idx where idx reaches, 0 beyond */
    dm_tensor *idx = dm_saved(c, 0), *gs = zeros_of_input(c, 2, g[0]->device);
    dm_tensor *part = dm_tensor_view(gs, idx->ndim, idx->shape, gs->strides, 0);
    DM_RUN(gather, gs->device, part, g[0], idx, (int)c->a.v[0], attr_base(c, 1));
    dm_release(part);
    gin[2] = gs;
  }
}

/* ---- embedding ---------------------------------------------------------------------------- */

/* out[..., :] = table[ids[...] - base, :]: index_select of rows through the flattened ids */
static void embedding_fwd(dm_ctx *c) {
  dm_tensor *table = c->in[0], *ids = c->in[1];
  char st[128];
  if (table->ndim != 2)
    dm_error("embedding: the table must be 2-D [vocab, dim], got shape %s", dm_tensor_shape_str(table, st, sizeof st));
  check_index_dtype("embedding", ids);
  if (ids->ndim == DM_MAXDIM)
    dm_error("embedding: ids of shape %s leave no room for the embedding dim", dm_tensor_shape_str(ids, st, sizeof st));
  int64_t base = attr_base(c, 0);
  check_indices("embedding", ids, table->shape[0], base);
  int64_t n = dm_numel(ids), shape[DM_MAXDIM];
  memcpy(shape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  shape[ids->ndim] = table->shape[1];
  dm_tensor *flat = dm_reshape(ids, 1, &n);
  dm_tensor *out = dm_tensor_new(table->device, table->dtype, ids->ndim + 1, shape);
  int64_t rows_shape[2] = {n, table->shape[1]}, rows_strides[2] = {table->shape[1], 1};
  dm_tensor *rows = dm_tensor_view(out, 2, rows_shape, rows_strides, 0);
  DM_RUN(index_select, table->device, rows, table, flat, 0, base);
  dm_release(rows);
  dm_save(c, flat);
  dm_release(flat);
  c->out[0] = out;
}

static void embedding_bwd(dm_ctx *c, dm_tensor *const *g, dm_tensor **gin) {
  dm_tensor *flat = dm_saved(c, 0), *gt = zeros_of_input(c, 0, g[0]->device);
  int64_t rows_shape[2] = {flat->shape[0], dm_in_shape(c, 0)[1]};
  dm_tensor *rows = dm_reshape(g[0], 2, rows_shape);
  plan_accumulate(gt, flat->shape[0], "index_add sort (kernels/index.cu sorted_accumulate)");
  DM_RUN(index_add, gt->device, gt, flat, rows, 0, attr_base(c, 0));
  dm_release(rows);
  gin[0] = gt;
}

/* ---- patch_index -------------------------------------------------------------------------- */

/* the ids that group the bytes x [B, T] into patches by the rule of vm/ops/patch.h:
** pool [B, slots], ctx [B, T], count [B] (i64; no gradient) */
static void patch_index_fwd(dm_ctx *c) {
  const char *what = "patch_index";
  dm_tensor *x = c->in[0], *breaks = c->in[1];
  const int64_t min_len = (int64_t)c->a.v[0], max_len = (int64_t)c->a.v[1], slots = (int64_t)c->a.v[2];
  char s[128];
  if (x->dtype != DM_U8 || x->ndim != 2)
    dm_error("%s: x must be bytes, u8 [B, T], got %s %s", what, dm_dtype_name(x->dtype),
             dm_tensor_shape_str(x, s, sizeof s));
  if (breaks->dtype != DM_U8 || breaks->ndim != 1 || breaks->shape[0] != 256)
    dm_error("%s: breaks must be u8 [256] (a flag for each byte value), got %s %s", what,
             dm_dtype_name(breaks->dtype), dm_tensor_shape_str(breaks, s, sizeof s));
  dm_check_device_equal(what, x, breaks);
  if (min_len < 1 || max_len < min_len)
    dm_error("%s: the patch lengths must satisfy 1 <= min_len <= max_len, got min_len %lld, max_len %lld", what,
             (long long)min_len, (long long)max_len);
  const int64_t B = x->shape[0], T = x->shape[1];
  if (slots < dm_patch_slots(T, min_len))
    dm_error("%s: %lld slots cannot hold the patches of %lld bytes with min_len %lld (at most %lld patches)", what,
             (long long)slots, (long long)T, (long long)min_len, (long long)dm_patch_slots(T, min_len));
  dm_tensor *xc = dm_contiguous(x), *bc = dm_contiguous(breaks);
  const int64_t ps[2] = {B, slots};
  dm_tensor *pool = dm_tensor_new(x->device, DM_I64, 2, ps), *ctx = dm_tensor_new(x->device, DM_I64, 2, x->shape);
  dm_tensor *count = dm_tensor_new(x->device, DM_I64, 1, &B);
  DM_RUN(patch_index, x->device, pool, ctx, count, xc, bc, min_len, max_len);
  dm_release(xc);
  dm_release(bc);
  c->out[0] = pool;
  c->out[1] = ctx;
  c->out[2] = count;
}

static dm_op ops[] = {
  {.name = "gather", .doc = "out[i][j] = x[idx[i][j] - base][j] along dim (torch's gather)",
   .args = "x, dim, idx", .lua = DM_LUA_METHOD, .n_in = 2, .n_out = 1, .attrs = "dim:dim,base@1~0", .nondiff = 1u << 1,
   .forward = gather_fwd, .backward = gather_bwd},
  {.name = "index_select", .doc = "the slices of x along dim named by a 1-D index",
   .args = "x, dim, idx [n]", .lua = DM_LUA_METHOD, .n_in = 2, .n_out = 1, .attrs = "dim:dim,base@1~0", .nondiff = 1u << 1,
   .forward = index_select_fwd, .backward = index_select_bwd},
  {.name = "scatter_add", .doc = "x with src added at idx along dim (torch's scatter_add)",
   .args = "x, dim, idx, src", .lua = DM_LUA_METHOD, .n_in = 3, .n_out = 1, .attrs = "dim:dim,base@1~0", .nondiff = 1u << 1,
   .forward = scatter_add_fwd, .backward = scatter_add_bwd},
  {.name = "embedding", .doc = "rows of table[vocab, dim] for ids of any shape: [..., dim]",
   .n_in = 2, .n_out = 1, .attrs = "base~0", .nondiff = 1u << 1,
   .forward = embedding_fwd, .backward = embedding_bwd},
  {.name = "patch_index",
   .doc = "the ids that group bytes into patches (vm/ops/patch.h): pool [B, slots], ctx [B, T], count [B]",
   .args = "x [B, T], breaks [256]", .lua = DM_LUA_FN, .n_in = 2, .n_out = 3, .attrs = "min_len,max_len,slots",
   .nondiff = 3u, .forward = patch_index_fwd},
};
DM_REGISTER_OPS(ops)
