/*
** sround.h — stochastic rounding of f32 to bf16, the same bits on the CPU
** and on a GPU (a header CUDA code includes as is).
**
** A value between two bf16 neighbours rounds up with probability equal to
** its distance from the lower one over their gap: the 16 bits that bf16
** drops are compared with 16 random bits. Its expectation is the f32 value
** itself, so a sum of many small terms kept in bf16 (a momentum buffer
** taking mu·buf + g a step) does not stall where round-to-nearest would
** drop every term under half a gap. The random bits of one element come
** from Philox keyed by a caller's salt and member index, counted by step
** and element: a resumed run rounds as the uninterrupted one did.
*/
#ifndef DM_SROUND_H
#define DM_SROUND_H

#include <string.h>
#include "core/philox.h"

/* bf16 bits of v: up with probability (its low 16 bits) / 2^16, from the low 16 bits of r;
** NaN (quietened) and the infinities as round-to-nearest gives them */
DM_HD uint16_t dm_bf16_stochastic(float v, uint32_t r) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u)
    return (uint16_t)((u >> 16) | ((u & 0x007fffffu) ? 0x0040u : 0u));
  return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

/* the random bits of element e of member `member` at step `step` (salt: the caller's key) */
DM_HD uint32_t dm_sround_bits(uint32_t salt, uint32_t member, int64_t step, int64_t e) {
  uint32_t r[4];
  uint64_t c = (uint64_t)e / 4, s = (uint64_t)step;
  dm_philox(salt, member, (uint32_t)c, (uint32_t)(c >> 32), (uint32_t)s, (uint32_t)(s >> 32), r);
  return r[e % 4];
}

#endif
