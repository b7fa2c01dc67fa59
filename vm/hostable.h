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
** The rows go to the device named at creation: with the CUDA backend the
** staging buffers come from the buffers pair (pinned memory) and the copy
** is a host-to-device copy (a side stream comes with the CUDA backend).
** One prefetch may be in flight at a time; the table must not be written by
** anything else while one is (take or free first). The worker and the Adam
** threads only read and write plain memory; every check runs in the
** caller's thread before they start, so they never raise.
**
** dm_hostable_gather(h, idx, ...) is prefetch + take at once.
*/
#ifndef DM_HOSTABLE_H
#define DM_HOSTABLE_H

#include "tensor.h"
#include "data.h"

typedef struct dm_hostable dm_hostable;

typedef struct dm_hostable_opts {
  int threads;                       /* host Adam threads; 0 means 1 */
  dm_device device;                  /* where take puts rows and local */
  const dm_host_buffers *buffers;    /* staging memory; NULL: malloc and free */
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

dm_hostable_counters dm_hostable_counters_of(const dm_hostable *h);
void dm_hostable_set_threads(dm_hostable *h, int threads);
int dm_hostable_threads(const dm_hostable *h);

#endif
