/*
** dist.h — the processes of a data-parallel job: one per GPU or CPU rank,
** launched by Open MPI's mpirun on one host or several. MPI starts the job
** (each rank learns its number and the job's size) and carries the
** collectives. Open MPI's library is loaded at run time (dlopen), and only
** in a job of more than one process: the binary needs no MPI to build, and
** a run of one process never touches it.
**
** Every collective is called by every rank in the same order with the same
** sizes; a failed one raises (dm_error) naming it. A rank that dies ends
** the job: mpirun stops the others and names it. A rank that stops
** answering without dying ends it too: each collective waits at most
** DM_DIST_TIMEOUT_S seconds (DORMOUSE_DIST_TIMEOUT in the environment sets
** it), then the waiting rank says so and aborts the job.
*/
#ifndef DM_DIST_H
#define DM_DIST_H

#include <stdbool.h>
#include <stdint.h>
#include "core/dm.h"

#define DM_DIST_TIMEOUT_S 600.0

/* Reads the job's size and this rank from mpirun's environment (OMPI_COMM_WORLD_SIZE and
** _RANK); in a job of more than one process, loads Open MPI and initialises it. Raises, naming
** what is missing, when the library cannot be loaded. Calling it again does nothing. */
void dm_dist_init(void);
int dm_dist_rank(void);                 /* 0 .. size - 1; 0 outside a job */
int dm_dist_size(void);                 /* 1 outside a job */

/* the element-wise sum over the ranks of buf's n elements (f64, f32, i64 or i32), in place */
void dm_dist_sum(void *buf, int64_t n, dm_dtype dt);
/* every rank's `bytes` bytes, one after another in rank order, into out (size * bytes) */
void dm_dist_gather(const void *send, int64_t bytes, void *out);
/* every rank's block of its own size (sizes[r] bytes from rank r, the same list on every rank),
** one after another in rank order, into out */
void dm_dist_gatherv(const void *send, const int64_t *sizes, void *out);
void dm_dist_barrier(void);
/* ends every process of the job with the exit code (a failed rank takes the others down) */
void dm_dist_abort(int code);
void dm_dist_finalize(void);

#endif
