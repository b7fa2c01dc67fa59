/*
** autograd.c — recording nodes and running them backwards.
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/autograd.h"
#include "ops/elementwise.h"
#include "core/core.h"
#include "core/profile.h"
#include "core/trace.h"

static bool grad_enabled = true;
static int suspended;                 /* > 0 while an op's forward or a backward runs */
static bool in_backward;
static dm_node **tape;
static size_t tape_len, tape_cap;
static uint64_t epoch = 1;            /* 0 marks tensors no recorded op produced (leaves) */
static uint64_t last_epoch = 1;       /* epochs are never reused, nested tapes' included */
static dm_node *pending;              /* begun, not yet committed: freed if the forward fails */
static unsigned recoveries;           /* how many errors have unwound through the core */

bool dm_grad_enabled(void) { return grad_enabled; }
void dm_set_grad_enabled(bool on) { grad_enabled = on; }
bool dm_recording(void) { return grad_enabled && suspended == 0; }
void dm_suspend_recording(void) { suspended++; }
void dm_resume_recording(void) { suspended--; }
size_t dm_tape_size(void) { return tape_len; }
uint64_t dm_tape_epoch(void) { return epoch; }

dm_node *dm_tensor_node(const dm_tensor *t) {
  return (t->node && t->node_epoch == epoch) ? t->node : NULL;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) dm_error("out of host memory for the autograd tape");
  return p;
}

static void meta_of(dm_meta *m, const dm_tensor *t) {
  m->ndim = t->ndim;
  memcpy(m->shape, t->shape, sizeof m->shape);
  m->dtype = t->dtype;
  m->device = t->device;
}

static void node_free(dm_node *n) {
  if (n->op->free_ctx && n->ctx.op) n->op->free_ctx(&n->ctx);   /* committed nodes only */
  for (int i = 0; i < n->n_saved; i++) dm_release(n->saved[i]);
  for (int i = 0; i < n->n_out; i++) dm_release(n->gout[i]);
  for (int i = 0; i < n->n_in; i++) dm_release(n->in_leaf[i]);
  free(n->in_meta);
  free(n->needs);
  free(n->in_node);
  free(n->in_out);
  free(n->in_leaf);
  free(n);
}

dm_node *dm_node_begin(dm_ctx *c) {
  const dm_op *op = c->op;
  if (pending) { node_free(pending); pending = NULL; }
  for (int i = 0; i < c->n_in; i++) {
    dm_tensor *t = c->in[i];
    if (t && t->requires_grad && t->node_epoch != 0 && !dm_tensor_node(t) && !(i < 32 && ((op->nondiff >> i) & 1)))
      dm_error("%s: input %d came from a graph that backward() or dm.autograd.clear() already "
               "freed; use :detach() to take it as a constant", op->name, i + 1);
  }
  dm_node *n = xcalloc(1, sizeof *n);
  pending = n;
  n->op = op;
  n->n_in = c->n_in;
  n->n_out = op->n_out;
  n->in_meta = xcalloc((size_t)c->n_in, sizeof *n->in_meta);
  n->in_node = xcalloc((size_t)c->n_in, sizeof *n->in_node);
  n->in_out = xcalloc((size_t)c->n_in, sizeof *n->in_out);
  n->in_leaf = xcalloc((size_t)c->n_in, sizeof *n->in_leaf);
  n->needs = xcalloc((size_t)c->n_in, sizeof *n->needs);
  for (int i = 0; i < c->n_in; i++) {
    dm_tensor *t = c->in[i];
    if (!t) continue;
    meta_of(&n->in_meta[i], t);
    if (!t->requires_grad || (i < 32 && ((op->nondiff >> i) & 1))) continue;
    n->needs[i] = true;
    dm_node *prod = dm_tensor_node(t);
    if (prod) { n->in_node[i] = prod; n->in_out[i] = t->node_out; }
    else { n->in_leaf[i] = t; dm_retain(t); }
  }
  return n;
}

void dm_node_commit(dm_node *n, dm_ctx *c) {
  n->ctx = *c;
  n->ctx.node = n;
  memset(n->ctx.in, 0, sizeof n->ctx.in);     /* inputs are not kept: save what backward needs */
  for (int i = 0; i < n->n_out; i++) {
    dm_tensor *o = c->out[i];
    meta_of(&n->out_meta[i], o);
    if (!dm_dtype_is_float(o->dtype)) continue;
    o->requires_grad = true;
    o->node = n;
    o->node_epoch = epoch;
    o->node_out = i;
  }
  if (tape_len == tape_cap) {
    size_t cap = tape_cap ? tape_cap * 2 : 256;
    dm_node **t = realloc(tape, cap * sizeof *t);
    if (!t) dm_error("out of host memory for the autograd tape");
    tape = t;
    tape_cap = cap;
  }
  n->index = tape_len;
  tape[tape_len++] = n;
  pending = NULL;
}

void dm_save(dm_ctx *c, dm_tensor *t) {
  dm_node *n = c->node;
  if (!n) return;
  if (n->n_saved == DM_MAXSAVED) dm_error("%s: saves more than %d tensors", c->op->name, DM_MAXSAVED);
  dm_retain(t);
  n->saved_version[n->n_saved] = t->storage->version;
  n->saved[n->n_saved++] = t;
}

dm_tensor *dm_saved(dm_ctx *c, int i) { return c->node->saved[i]; }
dm_tensor *dm_saved_opt(dm_ctx *c, int i) { return i < c->node->n_saved ? c->node->saved[i] : NULL; }
bool dm_needs_grad(dm_ctx *c, int i) { return c->node->needs[i]; }
int dm_in_ndim(dm_ctx *c, int i) { return c->node->in_meta[i].ndim; }
const int64_t *dm_in_shape(dm_ctx *c, int i) { return c->node->in_meta[i].shape; }
dm_dtype dm_in_dtype(dm_ctx *c, int i) { return c->node->in_meta[i].dtype; }
bool dm_in_leaf(dm_ctx *c, int i) { return c->node->in_node[i] == NULL; }

void dm_tape_clear(void) {
  for (size_t i = 0; i < tape_len; i++) node_free(tape[i]);
  tape_len = 0;
  epoch = ++last_epoch;
}

/* ---- nested tapes --------------------------------------------------------------------------- */

/* The outer tapes while a nested one records (a backward that recomputes, dm_recompute). */
#define MAX_NESTED 8
static struct outer {
  dm_node **tape;
  size_t len, cap;
  uint64_t epoch;
  int suspended;
  bool in_backward, grad_enabled;
  dm_tensor *held[DM_MAXSAVED + 1];   /* what the nested tape's user hands over (dm_tape_own) */
  int n_held;
} outers[MAX_NESTED];
static int nested;

void dm_tape_push(void) {
  if (nested == MAX_NESTED) dm_error("autograd: more than %d nested tapes (checkpoints within checkpoints)", MAX_NESTED);
  outers[nested++] = (struct outer){tape, tape_len, tape_cap, epoch, suspended, in_backward, grad_enabled, {0}, 0};
  tape = NULL;
  tape_len = tape_cap = 0;
  epoch = ++last_epoch;
  suspended = 0;
  in_backward = false;
  grad_enabled = true;
}

void dm_tape_pop(void) {
  if (nested == 0) dm_error("autograd: no nested tape to leave");
  dm_tape_clear();
  free(tape);
  struct outer *o = &outers[--nested];
  tape = o->tape;
  tape_len = o->len;
  tape_cap = o->cap;
  epoch = o->epoch;
  suspended = o->suspended;
  in_backward = o->in_backward;
  grad_enabled = o->grad_enabled;
  for (int i = 0; i < o->n_held; i++) dm_release(o->held[i]);
  o->n_held = 0;
}

void dm_tape_own(dm_tensor *t) {
  if (nested == 0 || outers[nested - 1].n_held == DM_MAXSAVED + 1) {
    dm_release(t);
    dm_error("autograd: %s", nested ? "a nested tape holds too many tensors" : "no nested tape to hold a tensor");
  }
  outers[nested - 1].held[outers[nested - 1].n_held++] = t;
}

int dm_tape_depth(void) { return nested; }

/* acc += g, taking ownership of g */
/* A gradient met again is added in place when nothing else can see the sum's
** first term (its only holder is this slot, its memory its own): a bank's
** gradient of a GiB then costs one more buffer at the peak, not two. */
static bool writable(const dm_tensor *acc, dm_dtype dtype) {
  return acc->refs == 1 && acc->storage->refs == 1 && dm_is_contiguous(acc) && acc->dtype == dtype &&
         !acc->requires_grad;
}

static bool sole_owner(const dm_tensor *acc, const dm_tensor *g) {
  return writable(acc, g->dtype) && acc->storage != g->storage;
}

static void accumulate(dm_tensor **acc, dm_tensor *g) {
  if (!*acc) { *acc = g; return; }
  if (sole_owner(*acc, g)) {
    dm_add_(*acc, g, 1.0);
    dm_release(g);
    return;
  }
  dm_tensor *sum = dm_add(*acc, g);
  dm_release(*acc);
  dm_release(g);
  *acc = sum;
}

/* A leaf's .grad may come in a narrower dtype than the leaf's (a cast that keeps its gradient in the
** compute dtype); before a second gradient is added it is widened to the leaf's dtype. */
static void widen_leaf_grad(dm_tensor *leaf) {
  if (!leaf->grad || leaf->grad->dtype == leaf->dtype) return;
  dm_tensor *wide = dm_cast(leaf->grad, leaf->dtype);
  dm_release(leaf->grad);
  leaf->grad = wide;
}

/* A leaf's .grad must be its own memory: the optimiser updates it in place; a second gradient is
** added in the leaf's dtype. */
static void accumulate_leaf(dm_tensor *leaf, dm_tensor *g) {
  widen_leaf_grad(leaf);
  if (leaf->grad && g->dtype != leaf->dtype) {
    dm_tensor *gw = dm_cast(g, leaf->dtype);
    dm_release(g);
    g = gw;
  }
  if (!leaf->grad && (g->refs > 1 || !dm_is_contiguous(g) || g->storage->refs > 1)) {
    dm_tensor *own = dm_clone(g);
    dm_release(g);
    g = own;
  }
  accumulate(&leaf->grad, g);
}

/* Every gradient a backward gave is checked before any is used; on a fault
** they are all released first, so the error leaves nothing behind. */
static void check_grads(const dm_node *n, dm_tensor **gin) {
  char msg[400] = "", a[128], b[128];
  for (int i = 0; i < n->n_in && !msg[0]; i++) {
    const dm_meta *m = &n->in_meta[i];
    if (!n->needs[i]) continue;
    if (!gin[i]) snprintf(msg, sizeof msg, "backward of %s gave no gradient for input %d", n->op->name, i + 1);
    else if (gin[i]->ndim != m->ndim || memcmp(gin[i]->shape, m->shape, sizeof(int64_t) * (size_t)m->ndim) != 0)
      snprintf(msg, sizeof msg, "backward of %s: gradient %s for input %d of shape %s", n->op->name,
               dm_tensor_shape_str(gin[i], a, sizeof a), i + 1, dm_shape_str(b, sizeof b, m->ndim, m->shape));
  }
  if (!msg[0]) return;
  for (int i = 0; i < n->n_in; i++) dm_release(gin[i]);
  dm_error("%s", msg);
}

/* the gradient a one-input node's backward_into may add to in place, or NULL */
static dm_tensor *accumulated_into(const dm_node *n) {
  if (!n->op->backward_into || n->n_in != 1 || !n->needs[0]) return NULL;
  if (!n->in_node[0]) widen_leaf_grad(n->in_leaf[0]);      /* added into in place: in the leaf's dtype */
  dm_tensor *acc = n->in_node[0] ? n->in_node[0]->gout[n->in_out[0]] : n->in_leaf[0]->grad;
  const dm_meta *m = &n->in_meta[0];
  if (!acc || !writable(acc, m->dtype) || acc->ndim != m->ndim ||
      memcmp(acc->shape, m->shape, sizeof(int64_t) * (size_t)m->ndim) != 0) return NULL;
  return acc;
}

static void run_node(dm_node *n) {
  for (int i = 0; i < n->n_saved; i++)
    if (!n->saved[i]->storage || n->saved[i]->storage->version != n->saved_version[i])
      dm_error("backward of %s: a tensor it saved was modified in place or freed after the forward",
               n->op->name);
  for (int i = 0; i < n->n_out; i++)
    if (!n->gout[i]) {
      const dm_meta *m = &n->out_meta[i];
      n->gout[i] = dm_zeros(m->device, m->dtype, m->ndim, m->shape);
    }
  dm_tensor *gin[DM_MAXIN] = {0};
  dm_profile_push(n->op->name, n->op->family, DM_PHASE_BACKWARD, n->out_meta[0].device);
  dm_tensor *acc = accumulated_into(n), *seen[DM_MAXOUT + 1];
  memcpy(seen, n->gout, sizeof(dm_tensor *) * (size_t)n->n_out);
  seen[n->n_out] = acc;                   /* a gradient added into in place: its value before */
  uint64_t in_hash = 0;
  bool traced = dm_trace_enter(n->n_out + (acc != NULL), seen, NULL, &in_hash);
  if (acc) {
    n->op->backward_into(&n->ctx, n->gout, acc);
    dm_trace_leave(traced, n->op->name, DM_TRACE_BACKWARD, in_hash, 1, &acc);
    dm_profile_pop();
    for (int i = 0; i < n->n_out; i++) { dm_release(n->gout[i]); n->gout[i] = NULL; }
    return;
  }
  n->op->backward(&n->ctx, n->gout, gin);
  check_grads(n, gin);
  dm_trace_leave(traced, n->op->name, DM_TRACE_BACKWARD, in_hash, n->n_in, gin);
  /* the node's own gradients go first: one passed through as it came (a same-dtype cast, a stand-in) is
  ** then its sole holder's, and a leaf takes it without a copy */
  for (int i = 0; i < n->n_out; i++) { dm_release(n->gout[i]); n->gout[i] = NULL; }
  for (int i = 0; i < n->n_in; i++) {
    if (!n->needs[i]) { dm_release(gin[i]); continue; }
    if (n->in_node[i]) accumulate(&n->in_node[i]->gout[n->in_out[i]], gin[i]);
    else accumulate_leaf(n->in_leaf[i], gin[i]);
  }
  dm_profile_pop();
}

void dm_backward(dm_tensor *root, dm_tensor *grad) {
  dm_check_live(root);
  if (!root->requires_grad)
    dm_error("backward: the tensor does not require grad (no input of its ops needed a gradient)");
  if (!grad && dm_numel(root) != 1)
    dm_error("backward: a gradient is needed for a tensor of %lld elements (only one-element "
             "tensors default to 1)", (long long)dm_numel(root));
  if (grad) { dm_check_shape_equal("backward", root, grad); dm_retain(grad); }
  else { grad = dm_zeros(root->device, root->dtype, root->ndim, root->shape); dm_fill(grad, 1.0); }
  dm_node *start = dm_tensor_node(root);
  if (!start) {
    if (root->node_epoch != 0) {
      dm_release(grad);
      dm_error("backward: the graph of this tensor was already freed by an earlier backward()");
    }
    accumulate_leaf(root, grad);
    return;
  }
  in_backward = true;
  suspended++;
  accumulate(&start->gout[root->node_out], grad);
  for (size_t i = start->index + 1; i-- > 0;) {
    dm_node *n = tape[i];
    bool any = false;
    for (int k = 0; k < n->n_out; k++) any |= n->gout[k] != NULL;
    if (any) run_node(n);
  }
  suspended--;
  in_backward = false;
  dm_tape_clear();
}

unsigned dm_autograd_recoveries(void) { return recoveries; }

/* every dm_error unwinds the recording state (error.c calls what is registered) */
__attribute__((constructor)) static void register_recovery(void) { dm_on_error_unwind(dm_autograd_recover); }

void dm_autograd_recover(void) {
  recoveries++;
  if (pending) { node_free(pending); pending = NULL; }
  while (nested > 0) dm_tape_pop();      /* an error inside a recomputation: back to the outermost tape */
  suspended = 0;
  dm_profile_recover();
  if (in_backward) { in_backward = false; dm_tape_clear(); }
}

/* For memory accounting (dormouse plan): what the tape holds, node by node in
** tape order, the node being recorded (whose forward is running) last. */
static void visit_node(const dm_node *n, dm_tape_visit_fn fn, void *ud) {
  for (int i = 0; i < n->n_saved; i++)
    if (n->saved[i]) fn(ud, n->op->name, DM_TAPE_SAVED, n->saved[i]);
  for (int i = 0; i < n->n_out; i++)
    if (n->gout[i]) fn(ud, n->op->name, DM_TAPE_GOUT, n->gout[i]);
  for (int i = 0; i < n->n_in; i++)
    if (n->in_leaf && n->in_leaf[i]) fn(ud, n->op->name, DM_TAPE_LEAF, n->in_leaf[i]);
}

void dm_tape_visit(dm_tape_visit_fn fn, void *ud) {
  for (int k = 0; k < nested; k++)                 /* the tapes set aside by a recomputation, too */
    for (size_t i = 0; i < outers[k].len; i++) visit_node(outers[k].tape[i], fn, ud);
  for (size_t i = 0; i < tape_len; i++) visit_node(tape[i], fn, ud);
  if (pending) visit_node(pending, fn, ud);
}
