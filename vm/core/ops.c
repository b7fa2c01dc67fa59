/*
** ops.c — the op table, the call path and the kernel table.
*/
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/ops.h"
#include "core/autograd.h"
#include "core/profile.h"
#include "core/trace.h"
#include "core/attrs.h"

#define DM_MAXKERNELS 1024

static dm_op *ops[DM_MAXOPS];
static int nops;

void dm_op_register(dm_op *op, const char *file) {
  op->family = dm_profile_family_of(file);
  if (nops == DM_MAXOPS) dm_error("too many ops (raise DM_MAXOPS in vm/core/ops.h)");
  if (dm_op_find(op->name)) dm_error("op '%s' is registered twice", op->name);
  op->id = nops;
  ops[nops++] = op;
  dm_attr_parse(op);
}

const dm_op *dm_op_find(const char *name) {
  for (int i = 0; i < nops; i++) if (strcmp(ops[i]->name, name) == 0) return ops[i];
  return NULL;
}

const dm_op *dm_op_get(const char *name) {
  const dm_op *op = dm_op_find(name);
  if (!op) dm_error("unknown op '%s'", name);
  return op;
}

int dm_op_count(void) { return nops; }
const dm_op *dm_op_at(int i) { return ops[i]; }

void dm_check_float(const char *op, const char *what, const dm_tensor *t) {
  if (!dm_dtype_is_float(t->dtype))
    dm_error("%s: %s must be a float tensor, got %s", op, what, dm_dtype_name(t->dtype));
}

int64_t dm_int_attr(const char *op, const char *what, double v) {
  if (v != floor(v) || fabs(v) > 9e15) dm_error("%s: %s must be an integer, got %g", op, what, v);
  return (int64_t)v;
}

void dm_check_scalar(const char *op, const char *what, const dm_tensor *t, dm_dtype dt, dm_device dev) {
  dm_check_live(t);
  if (t->dtype != dt || dm_numel(t) != 1 || !dm_is_contiguous(t) || t->device != dev)
    dm_error("%s: %s must be one contiguous %s element on %s, got %s [%lld] on %s", op, what, dm_dtype_name(dt),
             dm_device_name(dev), dm_dtype_name(t->dtype), (long long)dm_numel(t), dm_device_name(t->device));
}

dm_tensor *dm_new_grad(dm_ctx *c, int i, dm_device dev) {
  return dm_tensor_new(dev, dm_in_dtype(c, i), dm_in_ndim(c, i), dm_in_shape(c, i));
}

dm_dtype dm_attr_dtype(const dm_ctx *c, int i) {
  double v = i < c->a.nv ? c->a.v[i] : -1;
  if (!(v >= 0 && v < DM_NDTYPE) || v != (int)v) dm_error("%s: %g is not a dtype", c->op->name, v);
  return (dm_dtype)(int)v;
}

dm_attrs dm_attrs_of(int n, const double *v) {
  dm_attrs a;
  memset(&a, 0, sizeof a);
  for (int i = 0; i < n && i < DM_MAXATTR; i++) a.v[i] = v[i];
  a.nv = n < DM_MAXATTR ? n : DM_MAXATTR;
  return a;
}

dm_attrs dm_attrs_list(int n, const int64_t *list) {
  dm_attrs a;
  memset(&a, 0, sizeof a);
  a.nlist = n < DM_MAXDIM ? n : DM_MAXDIM;
  for (int i = 0; i < a.nlist; i++) a.list[i] = list[i];
  return a;
}

static void check_inputs(const dm_op *op, int n_in, dm_tensor *const *in) {
  if (op->n_in >= 0 ? n_in != op->n_in : (n_in < 1 || n_in > DM_MAXIN))
    dm_error("%s: expected %d tensor inputs, got %d", op->name, op->n_in, n_in);
  const dm_tensor *first = NULL;
  for (int i = 0; i < n_in; i++) {
    if (!in[i]) {
      if (i < 32 && (op->optional >> i) & 1) continue;
      dm_error("%s: input %d is missing", op->name, i + 1);
    }
    dm_check_live(in[i]);
    if (first) dm_check_device_equal(op->name, first, in[i]);
    else first = in[i];
  }
}

static bool wants_node(const dm_op *op, int n_in, dm_tensor *const *in) {
  if (!op->backward || !dm_recording()) return false;
  for (int i = 0; i < n_in; i++)
    if (in[i] && in[i]->requires_grad && !(i < 32 && ((op->nondiff >> i) & 1))) return true;
  return false;
}

/* where a call runs, for the profiler: its first input's device */
static dm_device call_device(int n_in, dm_tensor *const *in) {
  for (int i = 0; i < n_in; i++)
    if (in[i]) return in[i]->device;
  return DM_CPU;
}

void dm_call(const dm_op *op, int n_in, dm_tensor *const *in, const dm_attrs *a, dm_tensor **out) {
  check_inputs(op, n_in, in);
  dm_ctx c;
  c.op = op;
  c.n_in = n_in;
  memcpy(c.in, in, sizeof(dm_tensor *) * (size_t)n_in);
  memset(c.out, 0, sizeof c.out);
  if (a) c.a = *a; else memset(&c.a, 0, sizeof c.a);
  dm_attr_fill(op, &c.a);
  c.node = wants_node(op, n_in, in) ? dm_node_begin(&c) : NULL;
  uint64_t in_hash = 0;
  bool traced = dm_trace_enter(n_in, in, &c.a, &in_hash);
  dm_suspend_recording();
  dm_profile_push(op->name, op->family, DM_PHASE_FORWARD, call_device(n_in, in));
  op->forward(&c);
  dm_profile_pop();
  dm_resume_recording();
  for (int i = 0; i < op->n_out; i++)
    if (!c.out[i]) dm_error("%s: the forward did not set output %d", op->name, i + 1);
  dm_trace_leave(traced, op->name, DM_TRACE_FORWARD, in_hash, op->n_out, c.out);
  if (c.node) dm_node_commit(c.node, &c);
  memcpy(out, c.out, sizeof(dm_tensor *) * (size_t)op->n_out);
}

dm_tensor *dm_call1(const char *name, int n_in, dm_tensor *const *in, const dm_attrs *a) {
  dm_tensor *out[DM_MAXOUT];
  const dm_op *op = dm_op_get(name);
  dm_call(op, n_in, in, a, out);
  for (int i = 1; i < op->n_out; i++) dm_release(out[i]);
  return out[0];
}

/* the kernel table */

static struct { const char *name; dm_device dev; dm_kernel_fn fn; } kernels[DM_MAXKERNELS];
static int nkernels;

void dm_kernel_register(const char *name, dm_device dev, dm_kernel_fn fn) {
  for (int i = 0; i < nkernels; i++)
    if (kernels[i].dev == dev && strcmp(kernels[i].name, name) == 0) { kernels[i].fn = fn; return; }
  if (nkernels == DM_MAXKERNELS) dm_error("too many kernels (raise DM_MAXKERNELS in vm/core/ops.c)");
  kernels[nkernels].name = name;
  kernels[nkernels].dev = dev;
  kernels[nkernels].fn = fn;
  nkernels++;
}

dm_kernel_fn dm_kernel_find(const char *name, dm_device dev) {
  for (int i = 0; i < nkernels; i++)
    if (kernels[i].dev == dev && strcmp(kernels[i].name, name) == 0) return kernels[i].fn;
  return NULL;
}

/* On the meta device no kernel runs: outputs get their shapes from the forward
** and no values, so a whole model runs to count its memory. DM_RUN skips the
** call there, and a kernel held in a variable is NULL. */
dm_kernel_fn dm_kernel_get(const char *name, dm_device dev) {
  if (dev == DM_META) return NULL;
  dm_kernel_fn fn = dm_kernel_find(name, dev);
  if (!fn) dm_error("no %s kernel for '%s' in this build", dm_device_name(dev), name);
  return fn;
}
