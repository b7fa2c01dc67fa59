/*
** autograd.h — the tape.
**
** While grad mode is on, every op call with an input that needs a gradient
** appends a node to the tape. dm_backward() walks the tape from the loss's
** node back to the start, accumulating gradients, then frees the whole tape
** and the activations its nodes saved: after a backward the memory of the
** step is returned, whatever the garbage collector does. dm_tape_clear()
** does the same for a step that ends without a backward.
*/
#ifndef DM_AUTOGRAD_H
#define DM_AUTOGRAD_H

#include "core/ops.h"

typedef struct dm_meta {
  int ndim;
  int64_t shape[DM_MAXDIM];
  dm_dtype dtype;
  dm_device device;
} dm_meta;

typedef struct dm_node {
  const dm_op *op;
  dm_ctx ctx;                         /* attrs; in[] is cleared once recorded */
  int n_in, n_out;
  dm_meta *in_meta;                   /* n_in entries */
  dm_meta out_meta[DM_MAXOUT];
  bool *needs;                        /* input i needs a gradient */
  struct dm_node **in_node;           /* producer of input i on the tape, or NULL */
  int *in_out;                        /* which output of that producer */
  dm_tensor **in_leaf;                /* input i is a leaf needing a gradient: held here */
  dm_tensor *gout[DM_MAXOUT];         /* gradients of the outputs, accumulated */
  dm_tensor *saved[DM_MAXSAVED];
  uint32_t saved_version[DM_MAXSAVED];
  int n_saved;
  size_t index;                       /* position on the tape */
} dm_node;

/* grad mode as the user set it (dm.no_grad flips it off for a call) */
bool dm_grad_enabled(void);
void dm_set_grad_enabled(bool on);
/* recording happens when grad mode is on and no op is running */
bool dm_recording(void);
void dm_suspend_recording(void);
void dm_resume_recording(void);

/* used by dm_call */
dm_node *dm_node_begin(dm_ctx *c);
void dm_node_commit(dm_node *n, dm_ctx *c);

/* the node of a tensor, or NULL if it has none or the tape was cleared since */
dm_node *dm_tensor_node(const dm_tensor *t);

/* backward from a tensor; grad may be NULL for a one-element tensor */
void dm_backward(dm_tensor *root, dm_tensor *grad);
void dm_tape_clear(void);
size_t dm_tape_size(void);
uint64_t dm_tape_epoch(void);

/* A nested tape: dm_tape_push() sets the current tape aside and records on an
** empty one (grad mode on, recording resumed, a new epoch), as a backward that
** recomputes a stretch (dm.recompute) needs; dm_tape_pop() frees what the
** nested tape still holds and brings the outer one back. dm_tape_depth() is
** how many are set aside (> 0 while a recompute runs). */
void dm_tape_push(void);
void dm_tape_pop(void);
/* The nested tape takes over t's reference: released when it is left, by
** dm_tape_pop or by an error (the recomputation's leaves and output). */
void dm_tape_own(dm_tensor *t);
int dm_tape_depth(void);

/* after an error unwinds through the core: restore the recording state */
void dm_autograd_recover(void);
/* How many times dm_autograd_recover has run: code that calls back into Lua
** (dm_recompute) sees from it that an error was raised and caught there. */
unsigned dm_autograd_recoveries(void);

/* What the tape holds, for memory accounting (dormouse plan): fn is called for
** each node's saved tensors, the gradients of its outputs accumulated so far,
** and the leaves it will accumulate into, with the node's op name; the tapes
** a recomputation set aside are visited too. */
typedef enum { DM_TAPE_SAVED, DM_TAPE_GOUT, DM_TAPE_LEAF } dm_tape_hold;
typedef void (*dm_tape_visit_fn)(void *ud, const char *op, dm_tape_hold what, dm_tensor *t);
void dm_tape_visit(dm_tape_visit_fn fn, void *ud);

#endif
