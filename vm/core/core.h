/*
** core.h — the C API over the op table: what backwards, tests and the
** bindings call. Each function is a thin wrapper over dm_call (so it
** records on the tape when grad mode is on and it is called from outside
** an op) and returns an owned reference. Dims are 0-based here; the Lua
** layer turns the user's 1-based dims into these.
*/
#ifndef DM_CORE_H
#define DM_CORE_H

#include "core/ops.h"

/* creation (creation.c): no autograd */
dm_tensor *dm_empty(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape);
dm_tensor *dm_zeros(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape);
dm_tensor *dm_full(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape, double v);
dm_tensor *dm_arange(dm_device dev, dm_dtype dt, double start, double stop, double step);
/* Philox-4x32-10 draws: element i of a draw at counter offset o uses counter
** o + i/4, lane i%4. Without an explicit seed the global generator is used
** and advanced. */
dm_tensor *dm_rand(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape);
dm_tensor *dm_randn(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape);
dm_tensor *dm_rand_at(dm_device dev, dm_dtype dt, int ndim, const int64_t *shape,
                      uint64_t seed, uint64_t offset, bool normal);
void dm_manual_seed(uint64_t seed);
void dm_rng_state(uint64_t *seed, uint64_t *offset);
void dm_rng_set_state(uint64_t seed, uint64_t offset);
/* take n numbers' worth of counters from the global generator; returns the start offset */
uint64_t dm_rng_advance(int64_t n);

/* in-place writes (creation.c): no autograd, bump the version */
void dm_fill(dm_tensor *t, double v);
void dm_copy_(dm_tensor *dst, const dm_tensor *src);   /* broadcast, cast, cross-device */
dm_tensor *dm_clone(const dm_tensor *t);               /* contiguous copy, no autograd */
dm_tensor *dm_to_device(const dm_tensor *t, dm_device dev);   /* no autograd */

/* elementwise (vm/ops/elementwise.c) */
dm_tensor *dm_add(dm_tensor *a, dm_tensor *b);
dm_tensor *dm_sub(dm_tensor *a, dm_tensor *b);
dm_tensor *dm_mul(dm_tensor *a, dm_tensor *b);
dm_tensor *dm_div(dm_tensor *a, dm_tensor *b);
dm_tensor *dm_neg(dm_tensor *a);
dm_tensor *dm_affine(dm_tensor *a, double scale, double shift);   /* scale * a + shift */
dm_tensor *dm_unary(const char *op, dm_tensor *a);                /* "exp", "silu", ... */
dm_tensor *dm_where(dm_tensor *cond, dm_tensor *a, dm_tensor *b);

/* reductions (vm/ops/reduce.c); dim < 0 reduces over every dim */
dm_tensor *dm_sum(dm_tensor *a, int dim, bool keepdim);
dm_tensor *dm_mean(dm_tensor *a, int dim, bool keepdim);
/* sum a down to a shape it was broadcast from (the backward of broadcasting) */
dm_tensor *dm_sum_to(dm_tensor *a, int ndim, const int64_t *shape);

/* shapes and views (vm/ops/shape.c) */
dm_tensor *dm_reshape(dm_tensor *a, int ndim, const int64_t *shape);
dm_tensor *dm_permute(dm_tensor *a, const int64_t *perm);
dm_tensor *dm_transpose(dm_tensor *a, int d0, int d1);
dm_tensor *dm_narrow(dm_tensor *a, int dim, int64_t start, int64_t len);
dm_tensor *dm_expand(dm_tensor *a, int ndim, const int64_t *shape);
dm_tensor *dm_contiguous(dm_tensor *a);
dm_tensor *dm_cast(dm_tensor *a, dm_dtype dt);

/* matrix products (vm/ops/matmul.c): [..., m, k] x [..., k, n], batch dims broadcast */
dm_tensor *dm_matmul(dm_tensor *a, dm_tensor *b, bool transpose_a, bool transpose_b);

#endif
