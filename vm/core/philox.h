/*
** philox.h — Philox-4x32-10 (Salmon et al., SC'11), the counter-based
** generator behind every random tensor. The same (key, counter) gives the
** same four words on the CPU and on a GPU, so both backends draw the same
** numbers. Written as a header so CUDA code can include it as is.
*/
#ifndef DM_PHILOX_H
#define DM_PHILOX_H

#include <stdint.h>
#include <math.h>

#include "core/hd.h"

DM_HD void dm_philox(uint32_t key0, uint32_t key1, uint32_t c0, uint32_t c1, uint32_t c2,
                     uint32_t c3, uint32_t out[4]) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)M0 * c0, p1 = (uint64_t)M1 * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c1 ^ key0, n2 = hi0 ^ c3 ^ key1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    key0 += W0; key1 += W1;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* a uniform float in (0, 1]: 24 random bits, never 0 so log() is safe */
DM_HD float dm_philox_unit(uint32_t x) { return ((float)(x >> 8) + 1.0f) * (1.0f / 16777216.0f); }

/* Element i of a draw at counter offset `offset`: counter offset + i/4, lane i%4.
** Normals come in Box–Muller pairs: lanes (0,1) and (2,3) of one counter. */
DM_HD float dm_philox_uniform_at(uint64_t seed, uint64_t offset, uint64_t i) {
  uint32_t r[4];
  uint64_t c = offset + i / 4;
  dm_philox((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)c, (uint32_t)(c >> 32), 0, 0, r);
  return dm_philox_unit(r[i % 4]) - (1.0f / 16777216.0f);   /* [0, 1) */
}

DM_HD float dm_philox_normal_at(uint64_t seed, uint64_t offset, uint64_t i) {
  uint32_t r[4];
  uint64_t c = offset + i / 4;
  dm_philox((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)c, (uint32_t)(c >> 32), 0, 0, r);
  int pair = (int)(i % 4) / 2;
  float u1 = dm_philox_unit(r[2 * pair]), u2 = dm_philox_unit(r[2 * pair + 1]);
  float rad = sqrtf(-2.0f * logf(u1)), theta = 6.2831853071795864f * u2;
  return (i % 2) ? rad * sinf(theta) : rad * cosf(theta);
}

#endif
