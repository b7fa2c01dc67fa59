/*
** prims.h — the scratch of the device primitives that several op families share (kernels/model.cuh):
** the deterministic column sums and the stable bucket sort. The kernels size theirs with these, and
** the ops hand the same to a plan (core/alloc.h); bytes throughout.
*/
#ifndef DM_PRIMS_H
#define DM_PRIMS_H

#include <stdint.h>

/* the column sums' partials (kernels/model.cuh dm_colsum: rmsnorm's gain, the conv's weights,
** Engram's): DM_COLSUM_PER_SM blocks an SM wanted, at least DM_COLSUM_MIN_ROWS rows a chunk */
#define DM_COLSUM_PER_SM 8
#define DM_COLSUM_MIN_ROWS 64

static inline int64_t dm_colsum_chunks(int64_t rows, int64_t cols, int64_t sm_count) {
  const int64_t want = sm_count * DM_COLSUM_PER_SM / ((cols + 31) / 32);
  const int64_t most = (rows + DM_COLSUM_MIN_ROWS - 1) / DM_COLSUM_MIN_ROWS;
  int64_t n = want < most ? want : most;
  if (n > 65535) n = 65535;
  return n < 1 ? 1 : n;
}
/* f64 partial sums, a row of cols a chunk */
static inline int64_t dm_colsum_scratch(int64_t rows, int64_t cols, int64_t sm_count) {
  return cols > 0 ? 8 * dm_colsum_chunks(rows, cols, sm_count) * cols : 0;
}

/* dm_bucket_sort: keys a block, and a row of nb counters a block */
#define DM_BS_CHUNK 256
static inline int64_t dm_bucket_sort_scratch(int64_t n, int64_t nb) {
  return n > 0 ? 8 * ((n + DM_BS_CHUNK - 1) / DM_BS_CHUNK) * nb : 0;
}

/* dm_radix_sort (kernels/model.cuh): its 256 buckets' offsets, then one pass's counters at a time */
static inline int64_t dm_radix_sort_offsets(void) { return 8 * 257; }
static inline int64_t dm_radix_sort_scratch(int64_t n) { return dm_radix_sort_offsets() + dm_bucket_sort_scratch(n, 256); }

#endif
