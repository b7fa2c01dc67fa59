/*
** fuse.h — fused elementwise ops: one expression over named inputs,
** evaluated in one pass (dm.fuse in Lua, lua/dormouse/fuse.lua).
**
** Lua parses the expression, derives its backward symbolically and hands
** the C side a dm_fused: the forward and the gradients as small postfix
** programs (the CPU evaluates them in double, a chunk of a row at a time)
** and, in a CUDA build, the CUDA source of the same two computations
** (kernels/nvrtc.c compiles it with NVRTC the first time a dtype needs it).
** The op "fuse" takes the inputs (variadic) and the fused op's id as its
** attribute; its backward runs the gradient program for every input that
** needs a gradient, in one kernel, then sums each down to its input's shape.
**
** A dm_fused lives as long as the process (the tape may hold its id):
** dm.fuse makes one per distinct expression.
*/
#ifndef DM_FUSE_H
#define DM_FUSE_H

#include "core/ops.h"

#define DM_FUSE_MAXIN 8                        /* the backward saves every input (at most DM_MAXSAVED) */
#define DM_FUSE_MAXOPS (2 * DM_FUSE_MAXIN + 1)  /* the backward: 8 gradients, 8 inputs and g */

/* postfix instructions over a stack of values; arg is the operand where one is needed */
#define DM_FUSE_OPCODES(X) \
  X(INPUT)   /* push input arg (the backward's g is input n_in) */ \
  X(CONST)   /* push arg */ \
  X(NEG) X(ADD) X(SUB) X(MUL) X(DIV) \
  X(POW)     /* x ^ arg */ \
  X(LT) X(LE) X(GT) X(GE) X(EQ) X(NE)   /* 0 or 1 */ \
  X(WHERE)   /* c, x, y -> c != 0 ? x : y */ \
  X(UNARY)   /* f(x) for the unary kind arg (elementwise.h) */ \
  X(DUNARY)  /* f'(x) for the unary kind arg */

#define DM_FOP_(name) DM_FOP_##name,
enum { DM_FUSE_OPCODES(DM_FOP_) DM_NFOP };
#undef DM_FOP_

typedef struct dm_fprog {
  int n;               /* instructions; 0: the value is 0 (an input the expression does not depend on) */
  int depth;           /* the stack it needs */
  int *op;
  double *arg;
} dm_fprog;

enum { DM_FUSE_FWD, DM_FUSE_BWD };

typedef struct dm_fused {
  int id;
  char *expr;                        /* for messages */
  int n_in;
  dm_fprog prog[2][DM_FUSE_MAXIN];   /* [FWD][0]: the output; [BWD][i]: g * d out / d input i */
  int n_out[2];                      /* 1 and n_in */
  unsigned bwd_reads;                /* bit i: the backward reads input i (the forward saves it) */
  char *source[2];                   /* CUDA source of each direction (NULL: none given) */
  void *kernels[2][DM_NDTYPE][2];    /* compiled on first use (kernels/nvrtc.c): flat, strided */
} dm_fused;

/* a new fused op (the programs and sources are copied; a source may be NULL); its id */
int dm_fused_new(const char *expr, int n_in, const dm_fprog *fwd, const dm_fprog *bwd, const char *src_fwd,
                 const char *src_bwd);
dm_fused *dm_fused_get(int id);      /* raises when unknown */
/* the op "fuse" on the inputs of fused op id */
dm_tensor *dm_fused_call(int id, int n, dm_tensor *const *in);

/* The kernel "fuse": program direction dir of f over the inputs, broadcast to
** the outputs' shape (every output has it, contiguous); out[k] NULL: skipped. */
typedef void (*dm_fuse_k)(dm_fused *f, int dir, dm_tensor *const *out, int n_in, dm_tensor *const *in);

/* The operands of a fused kernel over one shape, dims merged where every
** operand steps through them as one (element strides; 0 where broadcast). */
typedef struct dm_fuse_layout {
  int ndim;
  int64_t shape[DM_MAXDIM];
  int64_t st[DM_FUSE_MAXOPS][DM_MAXDIM];
} dm_fuse_layout;

/* operands t[0..nops-1] (NULL: stride 0) right-aligned against shape */
void dm_fuse_layout_make(dm_fuse_layout *L, int ndim, const int64_t *shape, int nops, dm_tensor *const *t);

/* The CUDA text every fused kernel starts with: element types chosen by
** DM_DTYPE (defined before it), and the unary functions dm_NAME(x) and
** their derivatives dm_d_NAME(x, y) stringized from elementwise.h's table. */
const char *dm_fuse_cuda_prelude(void);

#ifdef DM_HAVE_CUDA
/* kernels/nvrtc.c: the kernel `name` of CUDA source compiled with NVRTC for
** this device (or found in the disk cache) and loaded, as a handle for
** cudaLaunchKernel; `what` names the caller in errors (NVRTC's log too) */
void *dm_nvrtc_kernel(const char *source, const char *name, const char *what);
/* compile only, for an architecture named as NVRTC takes it ("sm_90a"); needs no device */
void dm_nvrtc_check(const char *source, const char *arch, const char *what);
#endif

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(fuse, dm_fuse_k)

#endif
