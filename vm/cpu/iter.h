/*
** iter.h — walking strided operands on the CPU.
**
** dm_iter lines up one output and up to three inputs of any strides over
** the output's shape (inputs of fewer dims or size-1 dims broadcast with
** stride 0), merges dims that are contiguous in every operand, and calls a
** row function for each run of the innermost dim. Kernels write only the
** row function, for one element type or through dm_load/dm_store.
*/
#ifndef DM_CPU_ITER_H
#define DM_CPU_ITER_H

#include "../tensor.h"

#define DM_ITER_MAXOPS 4

typedef struct dm_iter {
  int nops;                                 /* operand 0 is the output */
  int ndim;
  int64_t shape[DM_MAXDIM];
  int64_t stride[DM_ITER_MAXOPS][DM_MAXDIM];  /* in bytes */
  char *base[DM_ITER_MAXOPS];
} dm_iter;

/* p[i] points at operand i's first element of the row, st[i] is its byte stride */
typedef void (*dm_row_fn)(char **p, const int64_t *st, int64_t n, void *ud);

void dm_iter_init(dm_iter *it, dm_tensor *out, int nin, dm_tensor *const *ins);
void dm_iter_run(dm_iter *it, dm_row_fn row, void *ud);

/* operand-0-only walk, e.g. fill */
void dm_iter_run1(dm_tensor *t, dm_row_fn row, void *ud);

#endif
