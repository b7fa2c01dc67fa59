/*
** hostable.h — Engram tables in host memory (engram_ram).
**
** The table [R, de] and its Adam moments m, v live in host memory as three
** f32 CPU tensors that the caller owns too (so they are saved and loaded
** like any tensor); the host table holds a reference to each. A step:
**
**   dm_hostable_prefetch(h, idx)   while step k runs: a worker thread finds
**                                  the unique rows of step k+1's lookups idx
**                                  (engram_index's output, rows of the
**                                  physical table) and gathers them into a
**                                  staging buffer;
**   dm_hostable_take(h, ...)       at step k+1: waits for the worker and
**                                  returns rows [U, de] (the unique rows, in
**                                  increasing row order), local (idx's shape:
**                                  each lookup's position in rows) and
**                                  unique [U] (the rows' numbers, i64, CPU);
**   dm_hostable_apply(h, grads)    after the backward: grads [U, de] (the
**                                  per-unique-row sums, engram_sparse_grad's
**                                  output) update the rows of the last take
**                                  with a multi-threaded sparse Adam (the
**                                  formula of engram.h; rows are split among
**                                  the threads, so any thread count gives the
**                                  same bits). Rows of an earlier prefetch
**                                  that this update changed are refreshed in
**                                  its staging buffer, so a take always gives
**                                  what a gather after the update would.
**
** dm_hostable_apply_rows(h, rows, grads) is the same update on rows named
** by the caller (distinct, increasing: engram_unique's order), for a step
** whose gradient covers several takes (micro-batches); it refreshes the
** prefetch in flight the same way.
**
** The rows go to the device named at creation. A device backend may give
** the host tables pinned staging memory and fences (the kernels
** "hostable_buffers", "hostable_fence", "hostable_fence_wait",
** "hostable_fence_free": kernels/hostcopy.c for CUDA): take then queues
** the copies of rows and local on the device's stream without waiting for
** them, apply copies the gradients back through a pinned buffer, and a slot
** is written again (by a prefetch or a refresh) only after the stream has
** read it. Without them (the CPU) the buffers are malloc'd and the copies
** plain. One prefetch may be in flight at a time; the table must not be
** written by anything else while one is (take or free first). The worker
** and the Adam threads only read and write plain memory; every check runs
** in the caller's thread before they start, so they never raise.
**
** dm_hostable_gather(h, idx, ...) is prefetch + take at once.
*/
#ifndef DM_HOSTABLE_H
#define DM_HOSTABLE_H

#include "core/tensor.h"
#include "core/ops.h"
#include "data/data.h"

typedef struct dm_hostable dm_hostable;

typedef struct dm_hostable_opts {
  int threads;                       /* host Adam threads; 0: the online cores, at most 8 */
  dm_device device;                  /* where take puts rows and local */
  const dm_host_buffers *buffers;    /* staging memory; NULL: the device's pinned pair, else malloc */
} dm_hostable_opts;

typedef struct dm_hostable_counters {
  int64_t steps;                     /* takes so far */
  int64_t lookups, unique;           /* of the last take: lookups M, rows touched U */
  double unique_fraction;            /* U / M of the last take (0 when M is 0) */
  int64_t total_lookups, total_unique;
  double gather_ms;                  /* the last take's worker: unique + gather */
  double wait_ms;                    /* the last take: how long the caller waited for it */
  double apply_ms;                   /* the last apply: Adam + refresh */
  int64_t thread_fallbacks;          /* Adam chunks run in the caller because a thread did not start */
} dm_hostable_counters;

/* table, m, v: contiguous f32 CPU [R, de] of one shape; raises otherwise */
dm_hostable *dm_hostable_new(dm_tensor *table, dm_tensor *m, dm_tensor *v, const dm_hostable_opts *o);
void dm_hostable_free(dm_hostable *h);     /* joins a prefetch in flight; NULL is fine */

/* idx: i64 or i32 rows in 0..R-1, any shape and device (copied at once) */
void dm_hostable_prefetch(dm_hostable *h, dm_tensor *idx);
void dm_hostable_take(dm_hostable *h, dm_tensor **rows, dm_tensor **local, dm_tensor **unique);
void dm_hostable_gather(dm_hostable *h, dm_tensor *idx, dm_tensor **rows, dm_tensor **local,
                        dm_tensor **unique);
/* grads: f32 [U, de] of the last take (any device); once per take */
void dm_hostable_apply(dm_hostable *h, dm_tensor *grads, double lr, double beta1, double beta2, double eps,
                       int64_t step);

/* rows: i64 [n] distinct and increasing in 0..R-1 (any device); grads: f32 [n, de] */
void dm_hostable_apply_rows(dm_hostable *h, dm_tensor *rows, dm_tensor *grads, double lr, double beta1,
                            double beta2, double eps, int64_t step);

dm_hostable_counters dm_hostable_counters_of(const dm_hostable *h);
void dm_hostable_set_threads(dm_hostable *h, int threads);
int dm_hostable_threads(const dm_hostable *h);

/* what a device backend gives the host tables (none on the CPU). A fence marks the point of the
** device's stream after the copies queued so far; waiting on it returns once the stream has
** passed it. *fence is created on first use; waiting on or freeing NULL does nothing. */
typedef void (*dm_hostable_buffers_k)(dm_host_buffers *hb);     /* "hostable_buffers": pinned memory */
typedef void (*dm_hostable_fence_k)(void **fence);              /* "hostable_fence" */
typedef void (*dm_hostable_fence_wait_k)(void *fence);          /* "hostable_fence_wait" */
typedef void (*dm_hostable_fence_free_k)(void *fence);          /* "hostable_fence_free" */

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(hostable_buffers, dm_hostable_buffers_k)
DM_KERNEL_TYPE(hostable_fence, dm_hostable_fence_k)
DM_KERNEL_TYPE(hostable_fence_free, dm_hostable_fence_free_k)
DM_KERNEL_TYPE(hostable_fence_wait, dm_hostable_fence_wait_k)

#endif
