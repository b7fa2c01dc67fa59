/*
** cpu/rows.h — how the CPU kernels of norm.c, xent.c and conv.c reach
** strided operands: the address of a row or an element through the leading
** dims, a row's length and byte step, the count of rows.
*/
#ifndef DM_CPU_ROWS_H
#define DM_CPU_ROWS_H

#include "core/tensor.h"

/* the address of element r of t's first nd dims, counted row-major (later dims at 0) */
static inline char *addr(const dm_tensor *t, int nd, int64_t r) {
  int64_t off = 0;
  for (int d = nd - 1; d >= 0; d--) {
    off += (r % t->shape[d]) * t->strides[d];
    r /= t->shape[d];
  }
  return (char *)dm_data(t) + off * (int64_t)dm_dtype_size(t->dtype);
}

/* the first element of row r (rows: the last dim), element r of the whole tensor */
static inline char *row_at(const dm_tensor *t, int64_t r) { return addr(t, t->ndim - 1, r); }
static inline char *elem_at(const dm_tensor *t, int64_t r) { return addr(t, t->ndim, r); }

static inline int64_t row_len(const dm_tensor *t) { return t->shape[t->ndim - 1]; }
static inline int64_t n_rows(const dm_tensor *t) { return row_len(t) ? dm_numel(t) / row_len(t) : 0; }
/* byte stride along a row */
static inline int64_t row_step(const dm_tensor *t) { return t->strides[t->ndim - 1] * (int64_t)dm_dtype_size(t->dtype); }

#endif
