/*
** ops.h — the op table, the call path and the kernel table.
**
** An op is a registered dm_op: a name, its tensor inputs and outputs, up to
** DM_MAXATTR numeric attributes and one list attribute (declared with their
** kinds and defaults in its .attrs: dm_attr_decl), a forward and a backward. Every op family lives in its own vm/ops/<family>.c file and registers
** its ops at start-up with DM_REGISTER_OPS; nothing else needs editing to
** add one. dm_call() checks the inputs, runs the forward, and when grad
** mode is on and an input needs a gradient, records a node on the tape.
**
** Forwards never loop over elements themselves: they check shapes, make the
** outputs and call a kernel found in the kernel table by (name, device). The
** CPU kernels live in vm/cpu/, the CUDA ones in kernels/; each registers
** itself with DM_REGISTER_KERNELS. Backwards are written with other ops (or
** a dedicated backward kernel), so they run on every device that has the
** kernels.
*/
#ifndef DM_OPS_H
#define DM_OPS_H

#include <stdbool.h>
#include "core/tensor.h"

#define DM_MAXIN 64      /* inputs of one call (cat takes many) */
#define DM_MAXOUT 4
#define DM_MAXATTR 8
#define DM_MAXOPS 512    /* ops in the table */
#define DM_MAXSAVED 16

typedef struct dm_attrs {
  double v[DM_MAXATTR];
  int nv;                        /* how many of v were given (ops may default the rest) */
  int nlist;                     /* a list attribute: shapes, dims */
  int64_t list[DM_MAXDIM];
} dm_attrs;

/* An op's attributes as its descriptor declares them (.attrs), comma-separated, each
**   name[:kind][=word|word...][~default][@lua]        or, last,   list=name[:kind]
** kind says what Lua passes (C reads a double either way): none, a number; int; bool (0 or 1); dim
** (Lua's 1-based dim of the first input, negative from the end, passed 0-based); newdim (the place of a
** new dim among n: 1..n+1, or negative); pos (a 1-based position, passed 0-based); dtype (a dtype's
** name, passed as its code). "=words": an enum, its value the word's place from 0. "~default": the
** value dm_call gives it when the call leaves it out (a word for an enum, true/false, inf, -inf); an
** attribute without one is required. "@v": Lua passes v and takes no such argument (base@1: Lua
** counts positions from 1). "list=name": the list attribute (a shape, dims of kind dim), after the
** numeric ones. The descriptor is the one place that states an attribute's kind and default:
** dm_call fills the defaults in, core.ops() gives the declarations to Lua, whose functions
** (lua/dormouse/ops/generated.lua) and editor lines come from them. */
enum { DM_ATTR_NUMBER, DM_ATTR_INT, DM_ATTR_BOOL, DM_ATTR_DIM, DM_ATTR_NEWDIM, DM_ATTR_POS, DM_ATTR_DTYPE,
       DM_ATTR_NKIND };
typedef struct dm_attr_decl {
  const char *name; int name_len;    /* in the descriptor's string */
  int kind;                          /* DM_ATTR_* */
  const char *words; int words_len;  /* an enum's spellings "a|b|c" (NULL: not an enum) */
  bool list;                         /* the list attribute (no place in dm_attrs.v) */
  bool has_default; double dflt;
  bool fixed; double fixed_value;    /* "@v" */
} dm_attr_decl;
extern const char *const dm_attr_kind_names[DM_ATTR_NKIND];   /* "number", "int", ... */

typedef struct dm_ctx dm_ctx;
typedef void (*dm_forward_fn)(dm_ctx *c);
/* gout[i] is the gradient of output i (never NULL: missing ones are zeros);
** set gin[i] (an owned reference) for every input with dm_needs_grad(c, i). */
typedef void (*dm_backward_fn)(dm_ctx *c, dm_tensor *const *gout, dm_tensor **gin);
/* a one-input op's backward that adds its input's gradient into acc in place
** (acc: the gradient met so far, of the input's dtype and shape, held by no one
** else); it saves the op's gradient as a whole tensor at the peak */
typedef void (*dm_backward_into_fn)(dm_ctx *c, dm_tensor *const *gout, dm_tensor *acc);

/* the Lua function an op's descriptor gives it (lua/dormouse/ops/generated.lua writes it and its
** editor lines from the descriptor: no Lua file of its own) */
enum {
  DM_LUA_OWN,                    /* none, or one written by hand in lua/dormouse/ops/<family>.lua */
  DM_LUA_FN,                     /* dm.<name>(inputs..., attributes...) */
  DM_LUA_METHOD,                 /* that, and the tensor method x:<name>(...) on the first input */
};

typedef struct dm_op {
  const char *name;
  const char *doc;               /* one line, shown by --list and help() */
  int n_in;                      /* -1: variadic (1..DM_MAXIN) */
  int n_out;
  const char *attrs;             /* "dim,keepdim": names of the numeric attributes, for docs */
  unsigned optional;             /* bit i: input i may be NULL */
  unsigned nondiff;              /* bit i: input i takes no gradient (indices, conditions) */
  int kind;                      /* for families that share one forward */
  dm_forward_fn forward;
  dm_backward_fn backward;       /* NULL: not differentiable */
  int id;                        /* set at registration */
  const char *family;            /* set at registration: the registering file ("kda") */
  void (*free_ctx)(dm_ctx *c);   /* optional: releases what the forward kept in attrs (a node is freed) */
  dm_backward_into_fn backward_into;   /* optional, one-input ops: see dm_backward_into_fn */
  const char *args;              /* the inputs by name, each with its shape: "x [E, m, n], row [E, m, 1]" */
  int lua;                       /* DM_LUA_*: how Lua calls it */
} dm_op;

/* what a forward and a backward see */
struct dm_ctx {
  const dm_op *op;
  int n_in;
  dm_tensor *in[DM_MAXIN];       /* borrowed; NULL for an absent optional input */
  dm_tensor *out[DM_MAXOUT];     /* the forward sets these (owned references) */
  dm_attrs a;
  struct dm_node *node;          /* NULL when the call is not recorded */
};

void dm_op_register(dm_op *op, const char *file);
const dm_op *dm_op_find(const char *name);          /* NULL when unknown */
const dm_op *dm_op_get(const char *name);           /* raises when unknown */
int dm_op_count(void);
const dm_op *dm_op_at(int i);

/* run an op: out[] receives owned references */
void dm_call(const dm_op *op, int n_in, dm_tensor *const *in, const dm_attrs *a, dm_tensor **out);
/* the common single-output case; attrs may be NULL */
dm_tensor *dm_call1(const char *name, int n_in, dm_tensor *const *in, const dm_attrs *a);

/* inside a forward: keep a tensor for backward (no-op when not recording) */
void dm_save(dm_ctx *c, dm_tensor *t);
/* inside a backward */
dm_tensor *dm_saved(dm_ctx *c, int i);
dm_tensor *dm_saved_opt(dm_ctx *c, int i);  /* saved tensor i, or NULL when the forward saved fewer */
bool dm_needs_grad(dm_ctx *c, int i);
int dm_in_ndim(dm_ctx *c, int i);
const int64_t *dm_in_shape(dm_ctx *c, int i);
dm_dtype dm_in_dtype(dm_ctx *c, int i);
bool dm_in_leaf(dm_ctx *c, int i);           /* input i is a leaf (no op of the tape made it) */

/* shared checks and helpers of forwards and backwards */
void dm_check_float(const char *op, const char *what, const dm_tensor *t);  /* "op: what must be a float tensor" */
/* t is one contiguous element of dtype dt on dev (a per-step scalar in device memory) */
void dm_check_scalar(const char *op, const char *what, const dm_tensor *t, dm_dtype dt, dm_device dev);
dm_tensor *dm_new_grad(dm_ctx *c, int i, dm_device dev);   /* uninitialised, shaped and typed like input i */
/* v as an integer, or "op: what must be an integer, got v" */
int64_t dm_int_attr(const char *op, const char *what, double v);

/* attribute helpers */
/* op's declared attributes (parsed at registration); returns how many, the list attribute last */
int dm_op_attr_decls(const dm_op *op, const dm_attr_decl **decls);
/* attribute i of the call: given, or its declared default (dm_call fills those in); an error naming it
** when the call left out an attribute that has no default */
double dm_attr(const dm_ctx *c, int i);
/* the place of word among decl's spellings, or -1 */
int dm_attr_word(const dm_attr_decl *decl, const char *word, size_t len);
dm_attrs dm_attrs_of(int n, const double *v);
dm_attrs dm_attrs_list(int n, const int64_t *list);
/* attribute i of the call as a dtype (its dm_dtype value), or "op: ... is not a dtype" */
dm_dtype dm_attr_dtype(const dm_ctx *c, int i);

/* the kernel table. A kernel is declared once, in its family's header, by its name and its type:
** DM_KERNEL_TYPE(moe_route, dm_moe_route_k). Lookups (DM_KERNEL(moe_route, dev)) and registrations
** (DM_KERNEL_ENTRY(moe_route, cuda_route)) name it and take the type from there: a backend's function
** of another signature does not compile (tests/c/kernel_types.c), and a name nothing declares neither. */
typedef void (*dm_kernel_fn)(void);
void dm_kernel_register(const char *name, dm_device dev, dm_kernel_fn fn);
dm_kernel_fn dm_kernel_find(const char *name, dm_device dev);    /* NULL when absent */
dm_kernel_fn dm_kernel_get(const char *name, dm_device dev);     /* raises when absent */

#define DM_KERNEL_TYPE(name, type) typedef type dm_ktype_##name;

/* a table's entry: the declared name and a function of the declared type, checked by the compiler
** in a constant expression (the tables are filled before the constructors that register them run).
** The C++ form needs <type_traits> before this header (kernels/common.cuh includes it for the .cu
** files, which include this one inside extern "C"). */
#ifdef __cplusplus
#define DM_KERNEL_ENTRY(name, fn) {#name, (dm_kernel_fn)(std::integral_constant<dm_ktype_##name, fn>::value)}
#else
#define DM_KERNEL_ENTRY(name, fn) {#name, _Generic((fn), dm_ktype_##name: (dm_kernel_fn)(fn))}
#endif

/* a kernel looked up once per call site and device; NULL on the meta device, where nothing runs (a
** plan's ops shape their outputs and call no kernel) */
#define DM_KERNEL(name, dev) __extension__ ({                             \
    static dm_kernel_fn dm_kcache_[DM_NDEVICE];                           \
    dm_device dm_kdev_ = (dev);                                           \
    if (!dm_kcache_[dm_kdev_]) dm_kcache_[dm_kdev_] = dm_kernel_get(#name, dm_kdev_); \
    (dm_ktype_##name)dm_kcache_[dm_kdev_]; })

/* kernel `name` run on dev with the arguments that follow; on the meta device, nothing (its arguments
** are not evaluated there: one with an effect is taken into a variable first) */
#define DM_RUN(name, dev, ...) do {                                       \
    dm_device dm_rdev_ = (dev);                                           \
    if (dm_rdev_ != DM_META) DM_KERNEL(name, dm_rdev_)(__VA_ARGS__);      \
  } while (0)

/* an optional kernel, looked up once per call site and device: NULL when the backend has none */
#define DM_KERNEL_OPT(name, dev) __extension__ ({                         \
    static dm_kernel_fn dm_kcache_[DM_NDEVICE];                           \
    static bool dm_klooked_[DM_NDEVICE];                                  \
    dm_device dm_kdev_ = (dev);                                           \
    if (!dm_klooked_[dm_kdev_]) {                                         \
      dm_kcache_[dm_kdev_] = dm_kernel_find(#name, dm_kdev_);             \
      dm_klooked_[dm_kdev_] = true;                                       \
    }                                                                     \
    (dm_ktype_##name)dm_kcache_[dm_kdev_]; })

/* an optional kernel looked up now (NULL when the backend has none) */
#define DM_KERNEL_FIND(name, dev) ((dm_ktype_##name)dm_kernel_find(#name, (dev)))

#define DM_REGISTER_OPS(table)                                            \
  __attribute__((constructor)) static void dm_register_ops_(void) {       \
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)         \
      dm_op_register(&table[i], __FILE__);                                \
  }

typedef struct dm_kernel_entry { const char *name; dm_kernel_fn fn; } dm_kernel_entry;
#define DM_REGISTER_KERNELS(dev, table)                                   \
  __attribute__((constructor)) static void dm_register_kernels_(void) {   \
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)         \
      dm_kernel_register(table[i].name, dev, table[i].fn);                \
  }

#endif
