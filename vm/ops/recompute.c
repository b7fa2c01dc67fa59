/*
** vm/ops/recompute.c — activation checkpointing: the op "recompute".
**
** dm_recompute(fn, inputs) computes fn(inputs) without recording it: the
** tape gets one node, which saves only the inputs. Its backward runs fn
** again on leaves that share the inputs' memory, recording on a nested tape
** (autograd.h), and back-propagates the output's gradient through that: the
** inputs' gradients come back to the outer tape, and the parameters fn reads
** get theirs in their .grad as in any backward. A stretch's activations
** then live only while its backward runs, for the price of its forward run
** twice. fn must compute the same thing both times (no random draws that
** differ; state it keeps must not count the second run: dm_tape_depth() > 0
** says it is the recomputation).
**
** The function travels as a slot number in the node's attributes; the slot
** is released with the node (free_ctx), so a tape cleared without a
** backward leaves nothing behind.
*/
#include <stdio.h>
#include <string.h>
#include "core/core.h"
#include "core/autograd.h"
#include "ops/recompute.h"

#define MAX_SLOTS 1024

static dm_recompute_fn slots[MAX_SLOTS];
static bool used[MAX_SLOTS], kept[MAX_SLOTS];      /* kept: registered for good */

static int slot_take(const dm_recompute_fn *fn) {
  for (int i = 0; i < MAX_SLOTS; i++)
    if (!used[i]) {
      used[i] = true;
      slots[i] = *fn;
      return i;
    }
  if (fn->release) fn->release(fn->ud);
  dm_error("recompute: more than %d recomputed stretches on the tape at once", MAX_SLOTS);
}

static void slot_free(int i) {
  if (i < 0 || i >= MAX_SLOTS || !used[i] || kept[i]) return;
  used[i] = false;
  if (slots[i].release) slots[i].release(slots[i].ud);
}

/* the stretch's output; on a failure the slot is released first when `own`
** (the forward of an unrecorded call; a recorded node releases it itself) */
static dm_tensor *run_slot(int i, int n, dm_tensor *const *in, bool own) {
  char err[512] = "";
  if (i < 0 || i >= MAX_SLOTS || !used[i]) dm_error("recompute: no function in slot %d", i);
  unsigned recovered = dm_autograd_recoveries();
  dm_tensor *out = slots[i].run(slots[i].ud, n, in, err, sizeof err);
  if (out && dm_autograd_recoveries() != recovered) {
    /* an error of the core raised and caught inside fn (pcall) has already reset
    ** the recording state (this node, the nested tapes): nothing can go on */
    snprintf(err, sizeof err, "recompute: the function caught an error of the core (pcall) and went on; "
             "a recomputed function must let such errors through");
    dm_release(out);
    out = NULL;
  }
  if (out && !dm_dtype_is_float(out->dtype)) {
    snprintf(err, sizeof err, "recompute: the function must return a float tensor, got %s", dm_dtype_name(out->dtype));
    dm_release(out);
    out = NULL;
  }
  if (!out) {
    if (own) slot_free(i);
    dm_error("%s", err[0] ? err : "recompute: the function returned no tensor");
  }
  return out;
}

static void recompute_forward(dm_ctx *c) {
  int slot = (int)c->a.v[0];
  dm_tensor *out = run_slot(slot, c->n_in, c->in, true);
  /* the node's output is a tensor of its own: fn may return one it did not make
  ** (an input, a parameter), which the commit must not mark as this node's */
  c->out[0] = dm_tensor_view(out, out->ndim, out->shape, out->strides, out->offset);
  dm_release(out);
  for (int i = 0; i < c->n_in; i++) dm_save(c, c->in[i]);
  if (!c->node) slot_free(slot);      /* not recorded: no backward will call it */
}

/* a leaf sharing t's memory, needing a gradient when the node's input did */
static dm_tensor *leaf_of(dm_ctx *c, int i, dm_tensor *t) {
  dm_tensor *v = dm_tensor_view(t, t->ndim, t->shape, t->strides, t->offset);
  v->requires_grad = dm_needs_grad(c, i);
  return v;
}

static void recompute_backward(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin) {
  int n = c->n_in, slot = (int)c->a.v[0];
  dm_tensor *leaves[DM_MAXIN];
  dm_tape_push();
  for (int i = 0; i < n; i++) {           /* the nested tape owns them: an error releases them too */
    leaves[i] = leaf_of(c, i, dm_saved(c, i));
    dm_tape_own(leaves[i]);
  }
  dm_tensor *out = run_slot(slot, n, leaves, false);
  dm_tape_own(out);
  if (out->requires_grad) dm_backward(out, gout[0]);
  for (int i = 0; i < n; i++)
    if (dm_needs_grad(c, i)) {            /* the leaf's gradient moves to gin (Lua may still hold the leaf) */
      gin[i] = leaves[i]->grad ? leaves[i]->grad
                               : dm_zeros(leaves[i]->device, leaves[i]->dtype, leaves[i]->ndim, leaves[i]->shape);
      leaves[i]->grad = NULL;
    }
  dm_tape_pop();
}

static void recompute_free(dm_ctx *c) { slot_free((int)c->a.v[0]); }

static dm_op ops[] = {
  {.name = "recompute", .doc = "fn(inputs) recomputed in backward instead of kept (activation checkpointing)",
   .n_in = -1, .n_out = 1, .attrs = "slot", .forward = recompute_forward, .backward = recompute_backward,
   .free_ctx = recompute_free},
};
DM_REGISTER_OPS(ops)

/* What dm_call would refuse before the forward runs, checked before a slot is
** taken: an error there would leave the slot (and fn) held for good. */
static void check_args(const dm_recompute_fn *fn, int n, dm_tensor *const *in) {
  char err[256] = "";
  if (n < 1 || n > DM_MAXSAVED) snprintf(err, sizeof err, "recompute: takes 1 to %d tensors, got %d", DM_MAXSAVED, n);
  for (int i = 0; i < n && !err[0]; i++) {
    if (!in[i] || !in[i]->storage) snprintf(err, sizeof err, "recompute: input %d is missing or freed", i + 1);
    else if (in[i]->device != in[0]->device)
      snprintf(err, sizeof err, "recompute: input %d is on %s, input 1 on %s", i + 1, dm_device_name(in[i]->device),
               dm_device_name(in[0]->device));
    else if (dm_recording() && in[i]->requires_grad && in[i]->node_epoch != 0 && !dm_tensor_node(in[i]))
      snprintf(err, sizeof err, "recompute: input %d came from a graph that backward() or dm.autograd.clear() "
               "already freed; use :detach() to take it as a constant", i + 1);
  }
  if (!err[0]) return;
  if (fn->release) fn->release(fn->ud);
  dm_error("%s", err);
}

dm_tensor *dm_recompute(const dm_recompute_fn *fn, int n, dm_tensor *const *in) {
  check_args(fn, n, in);
  int slot = slot_take(fn);
  dm_attrs a = dm_attrs_of(1, (double[]){(double)slot});
  dm_tensor *out[DM_MAXOUT];
  dm_call(dm_op_get("recompute"), n, in, &a, out);
  return out[0];
}

int dm_recompute_register(const dm_recompute_fn *fn) {
  int slot = slot_take(fn);
  kept[slot] = true;
  return slot;
}
