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

#include <string.h>
#include "core/tensor.h"

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

/* n elements of es bytes from src to dst, byte strides ds and ss (ss 0: one
** value repeated). Each size gets its own loop, so that every element is a
** load and a store rather than a call to memcpy. */
#define DM_MOVE_LOOP_(K) for (int64_t i = 0; i < n; i++) memcpy(dst + i * ds, src + i * ss, K)
static inline void dm_move_elems(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n, size_t es) {
  if (ds == (int64_t)es && ss == (int64_t)es) { memcpy(dst, src, (size_t)n * es); return; }
  switch (es) {
  case 1: DM_MOVE_LOOP_(1); break;
  case 2: DM_MOVE_LOOP_(2); break;
  case 4: DM_MOVE_LOOP_(4); break;
  case 8: DM_MOVE_LOOP_(8); break;
  default: DM_MOVE_LOOP_(es); break;
  }
}
#undef DM_MOVE_LOOP_

/* init and run in one call; nin may be 0 (a fill) */
void dm_iter_walk(dm_tensor *out, int nin, dm_tensor *const *ins, dm_row_fn row, void *ud);

/* A backward that writes two gradients (ga, gb; either may be NULL) in one
** walk: dm_iter walks one of them, the lead; the other has the lead's shape
** and strides, so it sits at the same byte offset from its own base. */
typedef struct dm_grad2 {
  bool want_a, want_b;
  char *lead_base, *other_base;     /* other_base: NULL unless both are wanted */
} dm_grad2;

/* the lead to walk (NULL when neither is wanted); raises, naming the op,
** when both are given and their shapes or strides differ */
dm_tensor *dm_grad2_init(dm_grad2 *u, dm_tensor *ga, dm_tensor *gb, const char *op);

/* where ga and gb are (NULL when not wanted), given where the lead is */
static inline void dm_grad2_at(const dm_grad2 *u, char *lead, char **ga, char **gb) {
  *ga = u->want_a ? lead : NULL;
  *gb = !u->want_b ? NULL : u->want_a ? u->other_base + (lead - u->lead_base) : lead;
}

#endif
