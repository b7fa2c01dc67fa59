/* dtype conversions and the Philox generator */
#include <math.h>
#include "check.h"
#include "core/philox.h"

static void bf16_rounding(void) {
  CHECK(dm_f32_to_bf16(1.0f) == 0x3f80);
  /* 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0) */
  CHECK(dm_f32_to_bf16(1.00390625f) == 0x3f80);
  /* 1 + 3*2^-8 is halfway too: rounds up to the even 1 + 2^-6 */
  CHECK(dm_f32_to_bf16(1.01171875f) == 0x3f82);
  CHECK(dm_f32_to_bf16(1.0039064f) == 0x3f81);
  CHECK(isnan(dm_bf16_to_f32(dm_f32_to_bf16(NAN))));
  CHECK(dm_bf16_to_f32(dm_f32_to_bf16(-2.5f)) == -2.5f);
  CHECK(isinf(dm_bf16_to_f32(dm_f32_to_bf16(INFINITY))));
}

static void f16_rounding(void) {
  CHECK(dm_f32_to_f16(1.0f) == 0x3c00);
  CHECK(dm_f32_to_f16(65504.0f) == 0x7bff);
  CHECK(dm_f32_to_f16(65520.0f) == 0x7c00);            /* rounds to inf */
  CHECK(dm_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00);  /* tie to even */
  CHECK(dm_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02);  /* tie to even, up */
  CHECK(dm_f16_to_f32(0x0001) == ldexpf(1, -24));      /* smallest subnormal */
  CHECK(dm_f32_to_f16(ldexpf(1, -25)) == 0);           /* half of it: tie to even (0) */
  CHECK(dm_f32_to_f16(ldexpf(1.5f, -25)) == 1);
  CHECK(dm_f32_to_f16(ldexpf(3, -25)) == 2);           /* 1.5 ulp: tie to even (2) */
  for (int i = 0; i < 0x7c00; i++)                     /* every finite half round-trips */
    if (dm_f32_to_f16(dm_f16_to_f32((uint16_t)i)) != i) { CHECK(!"f16 round trip"); break; }
  CHECK(isnan(dm_f16_to_f32(dm_f32_to_f16(NAN))));
}

static void philox_vectors(void) {
  /* Random123's known-answer tests for philox4x32_10 */
  uint32_t r[4];
  dm_philox(0, 0, 0, 0, 0, 0, r);
  CHECK(r[0] == 0x6627e8d5u && r[1] == 0xe169c58du && r[2] == 0xbc57ac4cu && r[3] == 0x9b00dbd8u);
  dm_philox(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, r);
  CHECK(r[0] == 0x408f276du && r[1] == 0x41c83b0eu && r[2] == 0xa20bc7c6u && r[3] == 0x6d5451fdu);
  dm_philox(0xa4093822u, 0x299f31d0u, 0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, r);
  CHECK(r[0] == 0xd16cfe09u && r[1] == 0x94fdccebu && r[2] == 0x5001e420u && r[3] == 0x24126ea1u);
}

static void philox_moments(void) {
  double s = 0, s2 = 0, u = 0;
  int n = 200000;
  for (int i = 0; i < n; i++) {
    double z = dm_philox_normal_at(7, 0, (uint64_t)i);
    s += z; s2 += z * z;
    u += dm_philox_uniform_at(7, 0, (uint64_t)i);
  }
  CHECK(fabs(s / n) < 0.01);
  CHECK(fabs(s2 / n - 1) < 0.02);
  CHECK(fabs(u / n - 0.5) < 0.005);
}

static void names(void) {
  CHECK(dm_dtype_from_name("bf16") == DM_BF16);
  CHECK(dm_dtype_from_name("float") == -1);
  CHECK(dm_device_from_name("cuda") == DM_CUDA);
  CHECK(dm_dtype_size(DM_I64) == 8);
}

int main(void) {
  check_begin();
  bf16_rounding();
  f16_rounding();
  philox_vectors();
  philox_moments();
  names();
  return check_end();
}
