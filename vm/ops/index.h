/*
** index.h — the index family's kernels (vm/ops/index.c): gathers and scatter-adds along a dim, and
** the range check of an index tensor that other families' ops call too.
*/
#ifndef DM_INDEX_H
#define DM_INDEX_H

#include "core/ops.h"

/* raise (on a device: record, raised at the next synchronisation) unless every idx - base lies in
** 0 .. size-1; `what` names the op */
typedef void (*dm_index_check_k)(const dm_tensor *idx, int64_t size, int64_t base, const char *what);
/* out = x's slices at idx along dim (gather: idx of out's shape; index_select: one index a slice) */
typedef void (*dm_pick_k)(dm_tensor *out, const dm_tensor *x, const dm_tensor *idx, int dim, int64_t base);
/* dst's slices at idx along dim += src's (scatter_add, index_add) */
typedef void (*dm_accum_k)(dm_tensor *dst, const dm_tensor *idx, const dm_tensor *src, int dim, int64_t base);

DM_KERNEL_TYPE(index_check, dm_index_check_k)
DM_KERNEL_TYPE(gather, dm_pick_k)
DM_KERNEL_TYPE(index_select, dm_pick_k)
DM_KERNEL_TYPE(scatter_add, dm_accum_k)
DM_KERNEL_TYPE(index_add, dm_accum_k)

#endif
