/*
** index.h — the index family's kernels (vm/ops/index.c): gathers and scatter-adds along a dim, and
** the range check of an index tensor that other families' ops call too.
*/
#ifndef DM_INDEX_H
#define DM_INDEX_H

#include "core/ops.h"
#include "ops/prims.h"    /* dm_radix_sort_scratch */

/* raise (on a device: record, raised at the next synchronisation) unless every idx - base lies in
** 0 .. size-1; `what` names the op */
typedef void (*dm_index_check_k)(const dm_tensor *idx, int64_t size, int64_t base, const char *what);
/* out = x's slices at idx along dim (gather: idx of out's shape; index_select: one index a slice) */
typedef void (*dm_pick_k)(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base);
/* dst's slices at idx along dim += src's (scatter_add, index_add) */
typedef void (*dm_accum_k)(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base);

/* ---- the CUDA kernels' device scratch, in bytes (core/alloc.h): kernels/index.cu sizes its with
** these, and an op hands the same to a plan ---- */

/* scatter_add and index_add into a float dtype sort their n sources by destination (kernels/index.cu
** sorted_accumulate; n: index_add's index length, scatter_add's index elements): two (key, value)
** pairs of n and the largest key, then the radix sort's bucket offsets and one pass's counters (the
** passes take turns). Integer dtypes add with atomics and take none. */
static inline int64_t dm_index_sort_arrays(int64_t n) { return 8 * (4 * n + 1); }
static inline int64_t dm_index_accumulate_scratch(dm_dtype dt, int64_t n) {
  if (n <= 0 || !dm_dtype_is_float(dt)) return 0;
  return dm_index_sort_arrays(n) + dm_radix_sort_scratch(n);
}

DM_KERNEL_TYPE(index_check, dm_index_check_k)
DM_KERNEL_TYPE(gather, dm_pick_k)
DM_KERNEL_TYPE(index_select, dm_pick_k)
DM_KERNEL_TYPE(scatter_add, dm_accum_k)
DM_KERNEL_TYPE(index_add, dm_accum_k)

#endif
