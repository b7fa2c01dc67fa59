/*
** code8.h — 8-bit codes for the Adam moments (optim.adamw_moments and
** optim.engram_moments = "8bit"), the
** same bits on the CPU and on a GPU (a header CUDA code includes as is).
**
** A tensor's moment is kept in blocks of DM_CODE8_BLOCK elements: one f32
** scale a block (the largest magnitude in it) and one byte an element, the
** element's value over the scale as a small float:
**   unsigned (the second moment's square root, >= 0): 4 exponent bits and
**     4 mantissa bits, x = 2^(e-15) (1 + f/16) for e >= 1, 2^-14 f/16 for
**     e = 0; 1.0 is the largest code used (e = 15, f = 0);
**   signed (the first moment): a sign bit, 4 exponent bits and 3 mantissa
**     bits, the same form with f/8.
** So the codes' steps are 1/16 (unsigned) or 1/8 (signed) of a value's
** power of two, down to 2^-14 of its block's largest value. Encoding rounds
** stochastically between the two neighbouring codes, up with the
** probability of the value's place between them, from 32 random bits: the
** mean of a code is the value itself, so the moments' small steps are kept
** on average instead of rounded away every step. Decoding and encoding are
** exact float arithmetic and integer operations: every backend agrees.
*/
#ifndef DM_CODE8_H
#define DM_CODE8_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include "core/philox.h"      /* DM_HD */

#define DM_CODE8_BLOCK 256

/* the blocks of a tensor of n elements */
DM_HD int64_t dm_code8_blocks(int64_t n) { return (n + DM_CODE8_BLOCK - 1) / DM_CODE8_BLOCK; }

/* the magnitude of a code's low 8 - (signed) bits, mantissa bits mbits */
DM_HD float dm_code8_magnitude(uint32_t c, int mbits) {
  uint32_t e = c >> mbits, f = c & ((1u << mbits) - 1);
  float frac = (float)f / (float)(1u << mbits);
  return e ? ldexpf(1.0f + frac, (int)e - 15) : ldexpf(frac, -14);
}

DM_HD float dm_code8_unsigned(uint8_t c) { return dm_code8_magnitude(c, 4); }

DM_HD float dm_code8_signed(uint8_t c) {
  float m = dm_code8_magnitude(c & 0x7fu, 3);
  return (c & 0x80u) ? -m : m;
}

/* the code of x in [0, 1] (clamped) with mbits mantissa bits, rounded stochastically by r */
DM_HD uint32_t dm_code8_encode_magnitude(float x, int mbits, uint32_t r) {
  const uint32_t one = 15u << mbits;                       /* 1.0: e = 15, f = 0 */
  if (!(x > 0)) return 0;                                  /* 0, and NaN as 0 */
  if (x >= 1) return one;
  if (x < 0x1p-14f) {                                      /* the subnormal codes: steps of 2^-14 / 2^mbits */
    float q = ldexpf(x, 14 + mbits);                       /* exact: a power of two */
    float fl = floorf(q);
    float u = (float)(r >> 8) * 0x1p-24f;                  /* [0, 1) */
    return (uint32_t)fl + (u < q - fl ? 1u : 0u);
  }
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const int drop = 23 - mbits;
  uint32_t e = ((u >> 23) & 0xffu) - 127u + 15u;          /* 1 .. 14 */
  uint32_t f = (u & 0x7fffffu) >> drop, rest = u & ((1u << drop) - 1);
  uint32_t c = (e << mbits) | f;
  return c + ((r & ((1u << drop) - 1)) < rest ? 1u : 0u);  /* a carry steps into the next exponent */
}

DM_HD uint8_t dm_code8_encode_unsigned(float x, uint32_t r) { return (uint8_t)dm_code8_encode_magnitude(x, 4, r); }

DM_HD uint8_t dm_code8_encode_signed(float x, uint32_t r) {
  uint32_t c = dm_code8_encode_magnitude(x < 0 ? -x : x, 3, r);
  return (uint8_t)(c | (x < 0 && c ? 0x80u : 0u));
}

/* 1 / scale as the encoders take it (0 for an all-zero block): in double, so that every backend
** rounds it alike whatever its float division does */
DM_HD float dm_code8_inverse(float scale) { return scale > 0 ? (float)(1.0 / (double)scale) : 0.0f; }

#endif
