/*
** moe.cuh — what the routed-expert kernels' files share (vm/ops/moe.h has the layout):
** the element types, the expert tiles laid out from the offsets, the experts' dimensions, and the
** tensor-core kernels' entry points.
**
**   moe_route.cu    routing, the sort by expert, the offsets check, combine, capacity, counters,
**                   balancing
**   moe_experts.cu  the expert products' entry points; the FMA tiles (any float dtype) and the
**                   few-rows kernels of decoding
**   moe_tc.cu       the expert products on tensor cores (bf16, f16; fp8 banks)
**
** Nothing waits for the host: per-expert offsets live in device memory and every launch is sized by
** N * k and E alone. Sums run in a fixed order and nothing adds floats with atomics: the same bits on
** every run. A bad index (an expert id, perm or inv value out of range) is recorded as index.cu does
** and raised at the next synchronisation; its row is skipped. Bad offsets likewise (moe_check_offsets;
** with DM_DEBUG >= 1 it waits and raises the CPU's message at the op).
*/
#ifndef DM_MOE_CUH
#define DM_MOE_CUH

#include <stdlib.h>
#include "model.cuh"
#include "ptx.cuh"
#include <cuda_fp16.h>
#include <cuda_fp8.h>
extern "C" {
#include "ops/moe.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

static inline int name_id(const char *what) { return dm_cuda_name_id(what); }

typedef uint16_t u16;

/* ---- the expert tiles --------------------------------------------------------------------------------- */

/* tiles[x] = the first tile of expert x (x = 0..E), TM rows a tile */
static __global__ void tiles_k(int64_t *tiles, const int64_t *off, int64_t e, int64_t tm) {
  DM_GRID_LOOP(x, e) {
    int64_t n = off[x + 1] - off[x];
    tiles[x] = n > 0 ? (n + tm - 1) / tm : 0;
  }
}

/* map[t] = the expert of tile t, for t < tiles[e] and t < cap (bad offsets may ask for more tiles than
** the grids launch; the check reports them) */
static __global__ void tile_map_k(int64_t *map, const int64_t *tiles, int64_t e, int64_t cap) {
  DM_GRID_LOOP(x, e) {
    for (int64_t t = tiles[x]; t < tiles[x + 1] && t < cap; t++) map[t] = x;
  }
}

/* tiles [E + 1] from the offsets, then the map from tile to expert after them (device memory, no host
** sync; room for every tile the launches' grids allow, ceil(rows / tm) + e) */
static inline int64_t *make_tiles(const int64_t *off, int64_t e, int64_t tm, int64_t rows, size_t *nbytes) {
  int64_t cap = (rows + tm - 1) / tm + e;
  *nbytes = (size_t)dm_moe_tiles_scratch(e, rows, tm);      /* e + 1 firsts, then cap tiles' experts */
  int64_t *tiles = (int64_t *)dm_scratch(*nbytes);
  if (e > 0) DM_LAUNCH(tiles_k, e, tiles, off, e, tm);
  dm_scan(tiles, tiles, e);
  if (e > 0) DM_LAUNCH(tile_map_k, e, tiles + e + 1, tiles, e, cap);
  return tiles;
}

/* tile bi: its expert, first sorted row and row count; false when there is none. The expert comes from
** the map in one read (a binary search over the tiles took ten dependent reads a block). */
__device__ __forceinline__ bool tile_at(const int64_t *tiles, const int64_t *off, int64_t e, int64_t tm,
                                        int64_t rows, int64_t bi, int64_t *x, int64_t *row0, int64_t *nrows) {
  if (bi >= tiles[e]) return false;
  int64_t xe = tiles[e + 1 + bi];
  *x = xe;
  *row0 = off[xe] + (bi - tiles[xe]) * tm;
  int64_t left = off[xe + 1] - *row0;
  if (left > rows - *row0) left = rows - *row0;     /* offsets past N * k were recorded by the check */
  *nrows = left < tm ? left : tm;
  return *row0 >= 0 && *nrows > 0;
}

/* this block's tile */
__device__ __forceinline__ bool tile_of(const int64_t *tiles, const int64_t *off, int64_t e, int64_t tm,
                                        int64_t rows, int64_t *x, int64_t *row0, int64_t *nrows) {
  return tile_at(tiles, off, e, tm, rows, blockIdx.x, x, row0, nrows);
}

struct moe_dims {
  int64_t e, d, r, f, k, rows;
  int64_t chunk;                          /* DC: the summed dim's chunk in shared memory */
  dm_device_error *err;                   /* a perm value out of range is recorded under `what` */
  int what;
};

__device__ __forceinline__ float sigm(float x) { return 1 / (1 + expf(-x)); }
__device__ __forceinline__ double sigm(double x) { return 1 / (1 + exp(-x)); }

/* ---- moe_tc.cu: the expert products on tensor cores ---- */

/* the plan's path (dm_moe_tc_path: shapes, DM_MOE_FMA) and the n pointers 16-byte aligned (NULL: absent) */
bool dm_moe_tc_fits(dm_dtype t, const moe_dims &M, const void *const *ptrs, int n);
/* moe_experts and its backward there (u bf16 or f16; fp8 banks in bf16) */
void dm_moe_tc_forward(dm_tensor *y_rows, dm_tensor *z_rows, const dm_tensor *u, const dm_tensor *perm,
                       const dm_tensor *offsets, const dm_moe_bank *bank, const moe_dims &M);
void dm_moe_tc_backward(dm_tensor *gx_rows, const dm_moe_grads *g, const dm_tensor *gy_rows, const dm_tensor *z_rows,
                        const dm_tensor *u, const dm_tensor *perm, const dm_tensor *offsets, const dm_moe_bank *bank,
                        const moe_dims &M);

#endif
