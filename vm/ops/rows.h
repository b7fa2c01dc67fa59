/*
** rows.h — what the row ops (norm.h, xent.h) share: their layout, and the
** per-row statistics their forwards save for the backward.
**
** Layouts. The ops hand kernels tensors of any strides, except what the
** ops allocate themselves: outputs, gradients and the per-row statistics
** (rstd, lse) are contiguous. A "row" is the last dim; rows are counted
** through the leading dims in row-major order, and a statistic tensor holds
** one value per row, [rows], f64 for f64 inputs and f32 otherwise.
*/
#ifndef DM_ROWS_H
#define DM_ROWS_H

#include "core/ops.h"

/* the dtype of per-row statistics: f64 for f64 inputs, else f32 */
static inline dm_dtype dm_stat_dtype(dm_dtype dt) { return dt == DM_F64 ? DM_F64 : DM_F32; }

/* one value per row (every dim but the last), for backward; NULL when not recording */
static inline dm_tensor *dm_row_stat(dm_ctx *c, const dm_tensor *x) {
  if (!c->node) return NULL;
  int64_t rows = 1;
  for (int d = 0; d < x->ndim - 1; d++) rows *= x->shape[d];
  return dm_tensor_new(x->device, dm_stat_dtype(x->dtype), 1, &rows);
}

#endif
