/*
** coalesce.h — the one dimension merge every strided walk uses (the CPU
** iterators and reductions, the CUDA layouts and row leads): nops operands
** over `shape`, str[k][d] operand k's stride along dim d. Size-1 dims are
** dropped (their index is always 0), and a dim is merged into the one
** before it when every operand steps through both as one (the outer's
** stride is the inner's times its size). In place; returns the number of
** dims left, 0 when every dim was of size 1 (the caller's scalar).
*/
#ifndef DM_COALESCE_H
#define DM_COALESCE_H

#include <stdbool.h>
#include <stdint.h>
#include "core/dm.h"

#include "core/hd.h"

DM_HD int dm_coalesce(int ndim, int64_t *shape, int nops, int64_t (*str)[DM_MAXDIM]) {
  int m = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    bool merge = m > 0;
    for (int k = 0; k < nops && merge; k++) merge = str[k][m - 1] == str[k][d] * shape[d];
    if (merge) {
      shape[m - 1] *= shape[d];
      for (int k = 0; k < nops; k++) str[k][m - 1] = str[k][d];
      continue;
    }
    shape[m] = shape[d];
    for (int k = 0; k < nops; k++) str[k][m] = str[k][d];
    m++;
  }
  return m;
}

/* The same for a layout that keeps at least one dim: the dims past the merged ones zeroed, and
** all dims of size 1 (a scalar) as one dim of size 1, every stride 0. Returns the dims, >= 1. */
DM_HD int dm_coalesce_layout(int ndim, int64_t *shape, int nops, int64_t (*str)[DM_MAXDIM]) {
  int m = dm_coalesce(ndim, shape, nops, str);
  for (int d = m; d < ndim; d++) {
    shape[d] = 0;
    for (int k = 0; k < nops; k++) str[k][d] = 0;
  }
  if (m == 0) {
    shape[0] = 1;
    for (int k = 0; k < nops; k++) str[k][0] = 0;
    m = 1;
  }
  return m;
}

#endif
