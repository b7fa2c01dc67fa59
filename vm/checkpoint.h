/*
** checkpoint.h — activation checkpointing (vm/ops_checkpoint.c has the
** whole story): a stretch of ops recomputed in backward instead of kept.
*/
#ifndef DM_CHECKPOINT_H
#define DM_CHECKPOINT_H

#include "tensor.h"

typedef struct dm_checkpoint_fn {
  /* the stretch: an owned float tensor from the n inputs (run twice: forward, backward),
  ** or NULL with the reason in err (it must not raise) */
  dm_tensor *(*run)(void *ud, int n, dm_tensor *const *in, char *err, size_t nerr);
  void (*release)(void *ud);        /* when no backward will need it any more; may be NULL */
  void *ud;
} dm_checkpoint_fn;

/* fn(in) with the stretch's activations dropped; fn->release is called in every case */
dm_tensor *dm_checkpoint(const dm_checkpoint_fn *fn, int n, dm_tensor *const *in);

/* A function registered for good: the op "checkpoint" called with attribute
** slot = the number returned (the op's test case does this); never released. */
int dm_checkpoint_register(const dm_checkpoint_fn *fn);

#endif
