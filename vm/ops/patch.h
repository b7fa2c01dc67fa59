/*
** patch.h — bytes grouped into patches by a causal rule (the ByteFlow arm,
** models/byteflow.lua; docs/arms.md).
**
** A row's first byte opens its first patch. Byte t > 0 opens a new patch
** when the current one holds max_len bytes, or when it holds at least
** min_len bytes and the byte before t is a break (breaks[x[t-1]] != 0).
** Whether t opens a patch depends on x[t-1] and on earlier bytes only: a
** byte's patch is known once the byte before it is, so a model that reads
** the finished patches before t never sees byte t or later.
**
** The row function is the rule's one statement: the CPU kernel calls it a
** row at a time, the CUDA kernel a thread a row. Its ids are 0-based rows
** of tables with a zero row first (dm.embedding reads them):
**   pool[p]  the last byte of patch p as 1 + row T + t, or 0 for a slot past the row's patches;
**   ctx[t]   the patch before byte t's own as 1 + row slots + p, or 0 in the row's first patch.
** Every patch but the last holds at least min_len bytes, so T bytes make at
** most ceil(T / min_len) patches: slots of at least that never overflow.
*/
#ifndef DM_PATCH_H
#define DM_PATCH_H

#include <stdint.h>
#include "core/ops.h"

#include "core/hd.h"

/* the most patches T bytes can make with patches of at least min_len bytes */
DM_HD int64_t dm_patch_slots(int64_t T, int64_t min_len) { return (T + min_len - 1) / min_len; }

/* row `row` of T bytes x: pool[slots] and ctx[T] as above; returns the row's patches */
DM_HD int64_t dm_patch_row(const uint8_t *x, int64_t T, const uint8_t *breaks, int64_t min_len,
                                 int64_t max_len, int64_t row, int64_t slots, int64_t *pool, int64_t *ctx) {
  int64_t start = 0, q = 0;                 /* the open patch's first byte, the patches closed */
  for (int64_t t = 0; t < T; t++) {
    const int64_t len = t - start;
    if (t > 0 && (len >= max_len || (len >= min_len && breaks[x[t - 1]]))) {
      pool[q++] = 1 + row * T + t - 1;
      start = t;
    }
    ctx[t] = q == 0 ? 0 : 1 + row * slots + q - 1;
  }
  if (T > 0) pool[q++] = 1 + row * T + T - 1;
  for (int64_t p = q; p < slots; p++) pool[p] = 0;
  return q;
}

/* the kernel: pool [B, slots], ctx [B, T], count [B] (i64, contiguous) from x [B, T] and breaks [256]
** (u8, contiguous) */
typedef void (*dm_patch_k)(dm_tensor *pool, dm_tensor *ctx, dm_tensor *count, const dm_tensor *x,
                           const dm_tensor *breaks, int64_t min_len, int64_t max_len);

/* the family's kernels by name (core/ops.h): the ops look them up, the backends register them */
DM_KERNEL_TYPE(patch_index, dm_patch_k)

#endif
