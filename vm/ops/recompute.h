/*
** recompute.h — activation checkpointing (vm/ops/recompute.c has the
** whole story): a stretch of ops recomputed in backward instead of kept.
*/
#ifndef DM_RECOMPUTE_H
#define DM_RECOMPUTE_H

#include "core/tensor.h"

typedef struct dm_recompute_fn {
  /* the stretch: an owned float tensor from the n inputs (run twice: forward, backward),
  ** or NULL with the reason in err (it must not raise) */
  dm_tensor *(*run)(void *ud, int n, dm_tensor *const *in, char *err, size_t nerr);
  void (*release)(void *ud);        /* when no backward will need it any more; may be NULL */
  void *ud;
} dm_recompute_fn;

/* fn(in) with the stretch's activations dropped; fn->release is called in every case */
dm_tensor *dm_recompute(const dm_recompute_fn *fn, int n, dm_tensor *const *in);

/* A function registered for good: the op "recompute" called with attribute
** slot = the number returned (the op's test case does this); never released. */
int dm_recompute_register(const dm_recompute_fn *fn);

#endif
