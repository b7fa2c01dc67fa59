/*
** cpu/index.c — gather, index_select, scatter_add, index_add, index_check.
**
** One strided walk serves the four data kernels. It visits every position
** p of a "direct" operand (the output of gather/index_select, the source of
** scatter_add/index_add) and finds, through the index, a position k along
** dim in the "indexed" operand:
**   per element (gather, scatter_add): k = idx[p], the walk covers idx's shape;
**   along dim (index_select, index_add): k = idx[p[dim]], idx is 1-D.
** Then either direct[p] = indexed[p with p[dim] = k] (pick) or
** indexed[p with p[dim] = k] += direct[p] (accumulate, in order, so repeated
** indices add up; a 16-bit destination in f32, rounded once). Every index is
** read and range-checked by read_index.
*/
#include "iter.h"
#include "core/ops.h"
#include "core/core.h"
#include "ops/patch.h"
#include "ops/index.h"

/* the index at p as a 0-based position, or an error naming it as the user wrote it */
static int64_t read_index(const char *what, const char *p, dm_dtype dt, int64_t base, int64_t size) {
  int64_t v = dt == DM_I64 ? *(const int64_t *)p : dt == DM_I32 ? *(const int32_t *)p : *(const uint8_t *)p;
  if (v < base || v - base >= size)
    dm_error("%s: index %lld is out of range for a dim of size %lld (indices count from %lld)", what,
             (long long)v, (long long)size, (long long)base);
  return v - base;
}

typedef struct walk {
  const char *what;
  dm_tensor *direct;
  dm_tensor *indexed;
  const dm_tensor *idx;
  int dim;
  int64_t base;
  bool along_dim;      /* idx is 1-D, read at p[dim] */
  bool accumulate;     /* indexed += direct, else direct = indexed */
} walk;

/* n elements: b[i] += a[i] (accumulate) or a[i] = b[i]; strides in bytes */
static void row_op(bool accumulate, dm_dtype dt, char *a, int64_t sa, char *b, int64_t sb, int64_t n) {
  if (!accumulate) { dm_move_elems(a, sa, b, sb, n, dm_dtype_size(dt)); return; }
  switch (dt) {
  case DM_F32: for (int64_t i = 0; i < n; i++) *(float *)(b + i * sb) += *(const float *)(a + i * sa); break;
  case DM_F64: for (int64_t i = 0; i < n; i++) *(double *)(b + i * sb) += *(const double *)(a + i * sa); break;
  default:
    for (int64_t i = 0; i < n; i++) dm_store(dt, b + i * sb, dm_load(dt, b + i * sb) + dm_load(dt, a + i * sa));
  }
}

static void index_walk(const walk *w) {
  const dm_tensor *dt = w->direct, *it = w->indexed, *ix = w->idx;
  int nd = dt->ndim, dim = w->dim, last = nd - 1;
  const int64_t *shape = w->along_dim ? dt->shape : ix->shape;
  int64_t n = 1;
  for (int d = 0; d < nd; d++) n *= shape[d];
  if (n == 0) return;
  /* byte strides of each operand over the walk; indexed steps over dim through the index */
  int64_t es = (int64_t)dm_dtype_size(dt->dtype), xs = (int64_t)dm_dtype_size(ix->dtype);
  int64_t sd[DM_MAXDIM], si[DM_MAXDIM], sx[DM_MAXDIM];
  for (int d = 0; d < nd; d++) {
    sd[d] = dt->strides[d] * es;
    si[d] = d == dim ? 0 : it->strides[d] * es;
    sx[d] = (w->along_dim ? (d == dim ? ix->strides[0] : 0) : ix->strides[d]) * xs;
  }
  char *pd = dm_data(dt), *pi = dm_data(it);
  const char *px = dm_data(ix);
  int64_t size = it->shape[dim], kstride = it->strides[dim] * es, row = shape[last];
  int64_t pos[DM_MAXDIM] = {0}, od = 0, oi = 0, ox = 0;
  for (int64_t e = 0; e < n / row; e++) {
    if (sx[last] == 0) {          /* one index for the whole row (index_select/add away from dim) */
      int64_t k = read_index(w->what, px + ox, ix->dtype, w->base, size);
      row_op(w->accumulate, dt->dtype, pd + od, sd[last], pi + oi + k * kstride, si[last], row);
    } else {
      for (int64_t j = 0; j < row; j++) {
        int64_t k = read_index(w->what, px + ox + j * sx[last], ix->dtype, w->base, size);
        row_op(w->accumulate, dt->dtype, pd + od + j * sd[last], 0, pi + oi + j * si[last] + k * kstride, 0, 1);
      }
    }
    for (int d = last - 1; d >= 0; d--) {      /* the next row, last outer dim fastest */
      od += sd[d]; oi += si[d]; ox += sx[d];
      if (++pos[d] < shape[d]) break;
      od -= sd[d] * shape[d]; oi -= si[d] * shape[d]; ox -= sx[d] * shape[d];
      pos[d] = 0;
    }
  }
}

static void cpu_gather(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  index_walk(&(walk){"gather", out, (dm_tensor *)x, idx, dim, base, false, false});
}

static void cpu_index_select(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base) {
  index_walk(&(walk){"index_select", out, (dm_tensor *)x, idx, dim, base, true, false});
}

/* An accumulating walk. A 16-bit destination adds in f32 copies and rounds once: a rounding at
** every add would lose the small adds of a row hit many times (a byte embedding's gradient).
** The f32 adds in increasing source position are the CUDA kernels' (kernels/index.cu), bit for bit. */
static void accumulate(walk w) {
  dm_tensor *dst = w.indexed, *src = w.direct;
  if (dst->dtype != DM_BF16 && dst->dtype != DM_F16) { index_walk(&w); return; }
  dm_tensor *acc = dm_tensor_like_dtype(dst, DM_F32), *src32 = dm_tensor_like_dtype(src, DM_F32);
  dm_copy_(acc, dst);
  dm_copy_(src32, src);
  w.indexed = acc;
  w.direct = src32;
  index_walk(&w);
  dm_copy_(dst, acc);
  dm_release(acc);
  dm_release(src32);
}

static void cpu_scatter_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate((walk){"scatter_add", (dm_tensor *)src, dst, idx, dim, base, false, true});
}

static void cpu_index_add(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base) {
  accumulate((walk){"index_add", (dm_tensor *)src, dst, idx, dim, base, true, true});
}

typedef struct { const char *what; dm_dtype dt; int64_t size, base; } check_spec;

static void check_row(char **p, const int64_t *st, int64_t n, void *ud) {
  const check_spec *c = ud;
  for (int64_t i = 0; i < n; i++) read_index(c->what, p[0] + i * st[0], c->dt, c->base, c->size);
}

/* raises on the first index outside base .. base+size-1 (ops call it before they allocate) */
static void cpu_index_check(const dm_tensor *idx, int64_t size, int64_t base, const char *what) {
  check_spec c = {what, idx->dtype, size, base};
  dm_iter_walk((dm_tensor *)idx, 0, NULL, check_row, &c);
}

/* the patch rule a row at a time (vm/ops/patch.h) */
static void cpu_patch_index(dm_tensor *pool, dm_tensor *ctx, dm_tensor *count, const dm_tensor *x,
                            const dm_tensor *breaks, int64_t min_len, int64_t max_len) {
  const int64_t B = x->shape[0], T = x->shape[1], slots = pool->shape[1];
  const uint8_t *px = dm_data(x), *pb = dm_data(breaks);
  int64_t *pp = dm_data(pool), *pc = dm_data(ctx), *pn = dm_data(count);
  for (int64_t b = 0; b < B; b++)
    pn[b] = dm_patch_row(px + b * T, T, pb, min_len, max_len, b, slots, pp + b * slots, pc + b * T);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(gather, cpu_gather),
  DM_KERNEL_ENTRY(index_select, cpu_index_select),
  DM_KERNEL_ENTRY(scatter_add, cpu_scatter_add),
  DM_KERNEL_ENTRY(index_add, cpu_index_add),
  DM_KERNEL_ENTRY(index_check, cpu_index_check),
  DM_KERNEL_ENTRY(patch_index, cpu_patch_index),
};
DM_REGISTER_KERNELS(DM_CPU, kernels)
