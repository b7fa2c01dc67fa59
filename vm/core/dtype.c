/*
** dtype.c — sizes, names and scalar conversions of the element types.
*/
#include <string.h>
#include <math.h>
#include "core/dm.h"

static const struct { const char *name; size_t size; bool isfloat; } dtypes[DM_NDTYPE] = {
  [DM_F32]  = {"f32", 4, true},  [DM_F64] = {"f64", 8, true},
  [DM_BF16] = {"bf16", 2, true}, [DM_F16] = {"f16", 2, true},
  [DM_I32]  = {"i32", 4, false}, [DM_I64] = {"i64", 8, false},
  [DM_U8]   = {"u8", 1, false},
};

static const char *devices[DM_NDEVICE] = {"cpu", "cuda", "meta"};

size_t dm_dtype_size(dm_dtype t) { return dtypes[t].size; }
const char *dm_dtype_name(dm_dtype t) { return dtypes[t].name; }
bool dm_dtype_is_float(dm_dtype t) { return dtypes[t].isfloat; }
const char *dm_device_name(dm_device d) { return devices[d]; }

int dm_dtype_from_name(const char *name) {
  for (int i = 0; i < DM_NDTYPE; i++)
    if (strcmp(name, dtypes[i].name) == 0) return i;
  return -1;
}

int dm_device_from_name(const char *name) {
  for (int i = 0; i < DM_NDEVICE; i++)
    if (strcmp(name, devices[i]) == 0) return i;
  return -1;
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t dm_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);   /* keep it a quiet NaN */
  u += 0x7fff + ((u >> 16) & 1);                        /* round to nearest even */
  return (uint16_t)(u >> 16);
}

float dm_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* IEEE binary16, round to nearest even, with subnormals and overflow to inf */
uint16_t dm_f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t absu = u & 0x7fffffff;
  if (absu >= 0x7f800000)                               /* inf or NaN */
    return sign | 0x7c00 | (absu > 0x7f800000 ? 0x200 : 0);
  if (absu >= 0x477ff000) return sign | 0x7c00;         /* rounds past 65504 */
  if (absu < 0x38800000) {                              /* subnormal or zero */
    if (absu < 0x33000000) return sign;                 /* below half the smallest */
    int e = (int)(absu >> 23);
    uint32_t mant = (absu & 0x7fffff) | 0x800000;
    int shift = 126 - e;                                /* value / 2^-24, in 14..24 bits */
    uint32_t half = mant >> (shift);
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return sign | (uint16_t)half;
  }
  uint32_t r = absu + 0xfff + ((absu >> 13) & 1);       /* round mantissa to 10 bits */
  return sign | (uint16_t)((r - 0x38000000) >> 13);
}

float dm_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    float v = ldexpf((float)m, -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000 | (m << 13));
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

double dm_load(dm_dtype t, const void *p) {
  switch (t) {
  case DM_F32: return *(const float *)p;
  case DM_F64: return *(const double *)p;
  case DM_BF16: return dm_bf16_to_f32(*(const uint16_t *)p);
  case DM_F16: return dm_f16_to_f32(*(const uint16_t *)p);
  case DM_I32: return *(const int32_t *)p;
  case DM_I64: return (double)*(const int64_t *)p;
  case DM_U8: return *(const uint8_t *)p;
  default: return 0;
  }
}

/* Integer stores truncate toward zero, as a C cast does; out-of-range values
** saturate rather than invoke undefined behaviour. */
static double clampd(double v, double lo, double hi) {
  return isnan(v) ? 0 : v < lo ? lo : v > hi ? hi : v;
}

void dm_store(dm_dtype t, void *p, double v) {
  switch (t) {
  case DM_F32: *(float *)p = (float)v; break;
  case DM_F64: *(double *)p = v; break;
  case DM_BF16: *(uint16_t *)p = dm_f32_to_bf16((float)v); break;
  case DM_F16: *(uint16_t *)p = dm_f32_to_f16((float)v); break;
  case DM_I32: *(int32_t *)p = (int32_t)clampd(v, -2147483648.0, 2147483647.0); break;
  case DM_I64: *(int64_t *)p = (int64_t)clampd(v, -9.2233720368547748e18, 9.2233720368547748e18); break;
  case DM_U8: *(uint8_t *)p = (uint8_t)clampd(v, 0, 255); break;
  default: break;
  }
}
