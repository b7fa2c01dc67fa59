/*
** quant.cu — the low-bit formats on CUDA (vm/ops/quant.h has the contract and
** the rounding, shared with the CPU and the oracle): quantize gives a group
** of lanes a block of elements, its statistics by shuffles, then its
** values, in double as on the CPU; quant_encode finds the blocks' scales the
** same way first, then writes each byte of codes; quant_decode reads one
** element a thread.
*/
#include <cuda_fp8.h>
#include "common.cuh"
extern "C" {
#include "ops/quant.h"
#include "ops/moe.h"
}

template <int DT> using S_ = typename dt<DT>::S;
template <int DT> using C_ = typename dt<DT>::C;

/* A group of W lanes (a power of two up to 32, within a warp) takes one block of elements: lane i
** reads elements i, i + W, ... and the group's statistics meet by shuffles, so a warp reads runs of
** consecutive elements (the rows' blocks lie end to end). A lane takes up to 4 of a block's
** elements (blocks up to 32; W = 8 for 32), so that a block's shuffles are few. The double sum of
** up to 32 float magnitudes is exact in any order while they span less than 2^24, so the scales
** are then the CPU's, bit for bit (beyond that, or from f64 input, they agree to the sum's
** rounding). amax carries a NaN on (the max below keeps it), so the NaN flag needs no shuffle. */
struct block_stat {
  double amax, sum;
  bool nan;
};

template <typename V> __device__ __forceinline__ V nan_max(V a, V b) { return b != b || b > a ? b : a; }

template <int DT, int W>
__device__ __forceinline__ block_stat group_stat(const S_<DT> *x, int64_t at, int64_t len, int lane) {
  double amax = 0, sum = 0;
  for (int64_t i = lane; i < len; i += W) {
    double a = fabs((double)dt<DT>::load(x[at + i]));
    amax = nan_max(amax, a);
    sum += a;
  }
  for (int o = W / 2; o > 0; o /= 2) {
    amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o, W));
    sum += __shfl_xor_sync(0xffffffffu, sum, o, W);
  }
  return {amax, sum, amax != amax};
}

/* the block a group takes, and where it lies: its first element and its length */
struct block_at {
  int64_t at, len;
};
__device__ __forceinline__ block_at block_of(int64_t j, int64_t n, int64_t block, int64_t blocks_per_row) {
  int64_t row = j / blocks_per_row, b = (j % blocks_per_row) * block;
  return {row * n + b, n - b < block ? n - b : block};
}

/* The groups' loop: a warp takes 32 / W consecutive blocks a trip (block j for the group its lane
** is in), and its trips are the same for all its lanes, as the shuffles need; a group past the end
** takes a block of no elements. */
#define DM_GROUP_LOOP(j, n_blocks, W)                                                                    \
  for (int64_t base_ = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32 * (32 / (W)),              \
               j = base_ + (threadIdx.x % 32) / (W);                                                   \
       base_ < (n_blocks); base_ += (int64_t)gridDim.x * blockDim.x / 32 * (32 / (W)),                 \
               j = base_ + (threadIdx.x % 32) / (W))

template <int DT, int W>
__global__ void quantize_k(S_<DT> *y, const S_<DT> *x, int64_t n, int64_t block, int64_t blocks_per_row,
                           int64_t n_blocks, int format) {
  int lane = threadIdx.x % W;
  DM_GROUP_LOOP(j, n_blocks, W) {
    block_at b = block_of(j, n, block, blocks_per_row);
    if (j >= n_blocks) b.len = 0;
    block_stat st = group_stat<DT, W>(x, b.at, b.len, lane);
    double s = dm_quant_scale(format, st.amax, b.len ? st.sum / (double)b.len : 0);
    for (int64_t i = lane; i < b.len; i += W) {
      double v = st.nan ? (double)NAN : s > 0 ? dm_quant_value(format, (double)dt<DT>::load(x[b.at + i]), s) : 0.0;
      y[b.at + i] = dt<DT>::store(v);
    }
  }
}

/* lanes a block: 4 for blocks up to 16 (nvfp4's), 8 up to 32 (the others'), a warp beyond;
** DM_BY_LANES runs its body with W set */
static int group_lanes(int64_t block) { return block <= 16 ? 4 : block <= 32 ? 8 : 32; }
#define DM_BY_LANES(block, ...)                                                                      \
  do {                                                                                               \
    switch (group_lanes(block)) {                                                                    \
    case 4: { constexpr int W = 4; __VA_ARGS__; } break;                                             \
    case 8: { constexpr int W = 8; __VA_ARGS__; } break;                                             \
    default: { constexpr int W = 32; __VA_ARGS__; } break;                                           \
    }                                                                                                \
  } while (0)

/* a launch of `groups` groups of W lanes */
#define DM_GROUP_LAUNCH(kernel, groups, W, ...) do {                                                 \
    kernel<<<dm_grid((groups) * (W)), DM_THREADS, 0, dm_cuda_stream()>>>(__VA_ARGS__);                \
    DM_CU_LAUNCHED();                                                                                \
  } while (0)

static void cuda_quantize(dm_tensor *y, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], per_row = (n + block - 1) / block, n_blocks = total / n * per_row;
  dm_dispatch_float(x->dtype, "quantize", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    DM_BY_LANES(block, DM_GROUP_LAUNCH((quantize_k<DT, W>), n_blocks, W, (S_<DT> *)dm_data(y),
                                       (const S_<DT> *)dm_data(x), n, block, per_row, n_blocks, format));
  });
}

/* the codes: first each block's scale (a group a block, as quantize), then each byte of codes (one
** thread a byte, its elements' scales read back from the first pass: blocks need not align with bytes) */
template <int DT, int W>
__global__ void encode_scales_k(float *sf32, uint8_t *s8, const S_<DT> *x, int64_t n, int64_t block,
                                int64_t blocks_per_row, int64_t n_blocks, int format) {
  int lane = threadIdx.x % W;
  DM_GROUP_LOOP(j, n_blocks, W) {
    block_at b = block_of(j, n, block, blocks_per_row);
    if (j >= n_blocks) b.len = 0;
    block_stat st = group_stat<DT, W>(x, b.at, b.len, lane);
    if (lane != 0 || j >= n_blocks) continue;
    double sc = st.nan ? (double)NAN : dm_quant_scale(format, st.amax, st.sum / (double)b.len);
    if (s8) s8[j] = (uint8_t)(sc != sc ? 0x7F : dm_e4m3_code(sc));
    else sf32[j] = (float)sc;
  }
}

__device__ __forceinline__ double scale_at(const float *sf32, const uint8_t *s8, int64_t k) {
  return s8 ? dm_e4m3_value(s8[k]) : (double)sf32[k];
}

template <int DT>
__global__ void encode_codes_k(uint8_t *codes, const float *sf32, const uint8_t *s8, const S_<DT> *x, int64_t n,
                               int64_t block, int64_t blocks_per_row, int64_t row_bytes, int64_t n_bytes, int format) {
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  DM_GRID_LOOP(q, n_bytes) {
    int64_t row = q / row_bytes, first = (q % row_bytes) * per;
    unsigned byte = 0;
    for (int e = 0; e < per && first + e < n; e++) {
      int64_t j = first + e;
      double sc = scale_at(sf32, s8, row * blocks_per_row + j / block);
      unsigned code = sc != sc ? 0 : dm_quant_code(format, (double)dt<DT>::load(x[row * n + j]), sc);
      byte |= code << (bits * e);
    }
    codes[q] = (uint8_t)byte;
  }
}

static void cuda_quant_encode(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, int format, int64_t block) {
  int64_t total = dm_numel(x);
  if (total == 0) return;
  int64_t n = x->shape[x->ndim - 1], rows = total / n;
  int64_t bpr = scales->shape[scales->ndim - 1], row_bytes = codes->shape[codes->ndim - 1];
  float *sf32 = scales->dtype == DM_F32 ? (float *)dm_data(scales) : NULL;
  uint8_t *s8 = scales->dtype == DM_U8 ? (uint8_t *)dm_data(scales) : NULL;
  dm_dispatch_float(x->dtype, "quant_encode", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *xp = (const S_<DT> *)dm_data(x);
    DM_BY_LANES(block, DM_GROUP_LAUNCH((encode_scales_k<DT, W>), rows * bpr, W, sf32, s8, xp, n, block, bpr,
                                       rows * bpr, format));
    DM_LAUNCH(encode_codes_k<DT>, rows * row_bytes, (uint8_t *)dm_data(codes), sf32, s8, xp, n, block, bpr,
              row_bytes, rows * row_bytes, format);
  });
}

__global__ void decode_k(float *y, const uint8_t *codes, const float *sf32, const uint8_t *s8, int64_t n,
                         int64_t block, int64_t blocks_per_row, int64_t row_bytes, int64_t total, int format) {
  int per = dm_quant_per_byte(format), bits = dm_quant_code_bits(format);
  unsigned mask = (1u << bits) - 1;
  DM_GRID_LOOP(i, total) {
    int64_t row = i / n, j = i % n;
    double sc = scale_at(sf32, s8, row * blocks_per_row + j / block);
    unsigned code = (codes[row * row_bytes + j / per] >> (bits * (j % per))) & mask;
    y[i] = (float)dm_quant_code_value(format, code, sc);
  }
}

static void cuda_quant_decode(dm_tensor *y, const dm_tensor *codes, const dm_tensor *scales, int format,
                              int64_t block) {
  int64_t total = dm_numel(y);
  if (total == 0) return;
  int64_t n = y->shape[y->ndim - 1];
  const float *sf32 = scales->dtype == DM_F32 ? (const float *)dm_data(scales) : NULL;
  const uint8_t *s8 = scales->dtype == DM_U8 ? (const uint8_t *)dm_data(scales) : NULL;
  DM_LAUNCH(decode_k, total, (float *)dm_data(y), (const uint8_t *)dm_data(codes), sf32, s8, n, block,
            scales->shape[scales->ndim - 1], codes->shape[codes->ndim - 1], total, format);
}

/* ---- LittleBit's binary factors: w = row * sign(x) * col, and its backward -------------------
** Rows (e, i) of n elements lie end to end. A group of W lanes takes a row (W = 32 for long rows,
** fewer for short ones, so that a warp takes several), its lanes along it in vectors of V elements
** (16 bytes) where the row's elements are aligned to them, one element a lane before and after
** (a row of odd n starts anywhere). The column sums by tiles of 64 columns (two a lane) x 8
** groups of rows. Values and sums in the compute type (f32, double for f64). */

/* 16 bytes of S, as V of them */
template <typename S, int V> struct alignas(16) lb_vec { S v[V]; };
template <typename S, int V> __device__ __forceinline__ lb_vec<S, V> lb_load(const S *p) {
  lb_vec<S, V> r;
  if constexpr (V * sizeof(S) == 16) *(uint4 *)r.v = __ldg((const uint4 *)p);
  else for (int k = 0; k < V; k++) r.v[k] = p[k];
  return r;
}
template <typename S, int V> __device__ __forceinline__ void lb_store(S *p, const lb_vec<S, V> &r) {
  if constexpr (V * sizeof(S) == 16) *(uint4 *)p = *(const uint4 *)r.v;
  else for (int k = 0; k < V; k++) p[k] = r.v[k];
}

/* A lane's share of the row at .. at + len (at counted from a 16-byte aligned base): one(j) for
** each element j of the row before the first aligned one and after the last, vec(j) for each
** aligned vector of V, its first element j. */
template <int V, int W, typename One, typename Vec>
__device__ __forceinline__ void lb_row(int64_t at, int64_t len, int lane, One one, Vec vec) {
  const int64_t head = min(len, (int64_t)((V - at % V) % V)), nv = (len - head) / V;
  for (int64_t j = lane; j < head; j += W) one(j);
  for (int64_t q = lane; q < nv; q += W) vec(head + q * V);
  for (int64_t j = head + nv * V + lane; j < len; j += W) one(j);
}

/* lanes a row: enough for one vector each, a power of two up to a warp */
static int lb_lanes(int64_t n, int v) {
  int w = 1;
  while (w < 32 && (int64_t)w * v < n) w *= 2;
  return w;
}

template <int DT, int V, int W>
__global__ void littlebit_k(S_<DT> *w, const S_<DT> *x, const S_<DT> *row, const S_<DT> *col, int64_t m, int64_t n,
                            int64_t rows) {
  typedef S_<DT> S;
  typedef C_<DT> C;
  const int lane = threadIdx.x % W;
  DM_GROUP_LOOP(ei, rows, W) {
    if (ei >= rows) continue;
    const S *c = col + ei / m * n;
    const int64_t at = ei * n;
    const C r = dt<DT>::load(row[ei]);
    auto one = [&](int64_t j) { w[at + j] = dt<DT>::store(r * (C)dm_sign(dt<DT>::load(x[at + j])) * dt<DT>::load(c[j])); };
    auto vec = [&](int64_t j) {
      lb_vec<S, V> xv = lb_load<S, V>(x + at + j), out;
#pragma unroll
      for (int k = 0; k < V; k++)
        out.v[k] = dt<DT>::store(r * (C)dm_sign(dt<DT>::load(xv.v[k])) * dt<DT>::load(c[j + k]));
      lb_store<S, V>(w + at + j, out);
    };
    lb_row<V, W>(at, n, lane, one, vec);
  }
}

/* gx along the row, and its sum of g sign(x) col by shuffles within the group */
template <int DT, int V, int W>
__global__ void littlebit_rows_k(S_<DT> *gx, S_<DT> *grow, const S_<DT> *g, const S_<DT> *x, const S_<DT> *row,
                                 const S_<DT> *col, int64_t m, int64_t n, int64_t rows) {
  typedef S_<DT> S;
  typedef C_<DT> C;
  const int lane = threadIdx.x % W;
  DM_GROUP_LOOP(ei, rows, W) {
    const bool live = ei < rows;           /* a group past the end sums nothing, for the shuffles */
    const S *c = col + (live ? ei / m * n : 0);
    const int64_t at = live ? ei * n : 0;
    const C r = live ? dt<DT>::load(row[ei]) : (C)0;
    C sum = 0;
    auto one = [&](int64_t j) {
      const C gv = dt<DT>::load(g[at + j]), cv = dt<DT>::load(c[j]);
      if (gx) gx[at + j] = dt<DT>::store(gv * r * cv);
      sum += gv * (C)dm_sign(dt<DT>::load(x[at + j])) * cv;
    };
    auto vec = [&](int64_t j) {
      lb_vec<S, V> gv = lb_load<S, V>(g + at + j), xv = lb_load<S, V>(x + at + j), out;
#pragma unroll
      for (int k = 0; k < V; k++) {
        const C gk = dt<DT>::load(gv.v[k]), ck = dt<DT>::load(c[j + k]);
        out.v[k] = dt<DT>::store(gk * r * ck);
        sum += gk * (C)dm_sign(dt<DT>::load(xv.v[k])) * ck;
      }
      if (gx) lb_store<S, V>(gx + at + j, out);
    };
    lb_row<V, W>(at, live ? n : 0, lane, one, vec);
    for (int o = W / 2; o > 0; o /= 2) sum += __shfl_xor_sync(DM_FULL_MASK, sum, o, W);
    if (grow && live && lane == 0) grow[ei] = dt<DT>::store(sum);
  }
}

/* a block a tile of 64 columns of one expert: 8 groups of rows, each lane down two neighbouring
** columns of every 8th row (a warp reads 64 neighbouring elements of a row, two rows in flight),
** the groups summed in shared memory */
constexpr int LB_GROUPS = 8, LB_TILE = 64;
template <int DT>
__global__ void __launch_bounds__(32 * LB_GROUPS) littlebit_cols_k(S_<DT> *gcol, const S_<DT> *g, const S_<DT> *x,
                                                                    const S_<DT> *row, int64_t m, int64_t n,
                                                                    int64_t tiles) {
  typedef C_<DT> C;
  __shared__ C part[LB_GROUPS][LB_TILE + 1];
  const int lane = threadIdx.x % 32, group = threadIdx.x / 32;
  const int64_t per_expert = (n + LB_TILE - 1) / LB_TILE;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t e = t / per_expert, j = t % per_expert * LB_TILE + 2 * lane;
    const int cols = j + 1 < n ? 2 : j < n ? 1 : 0;
    C sum[2] = {0, 0};
    auto add = [&](int64_t i) {
      const int64_t at = (e * m + i) * n + j;
      const C r = dt<DT>::load(row[e * m + i]);
#pragma unroll
      for (int k = 0; k < 2; k++)
        if (k < cols) sum[k] += dt<DT>::load(g[at + k]) * (C)dm_sign(dt<DT>::load(x[at + k])) * r;
    };
    int64_t i = group;
    for (; i + LB_GROUPS < m; i += 2 * LB_GROUPS) { add(i); add(i + LB_GROUPS); }
    if (i < m) add(i);
    part[group][2 * lane] = sum[0];
    part[group][2 * lane + 1] = sum[1];
    __syncthreads();
    for (int c = threadIdx.x; c < LB_TILE; c += blockDim.x) {
      const int64_t jc = t % per_expert * LB_TILE + c;
      if (jc >= n) continue;
      C total = 0;
      for (int k = 0; k < LB_GROUPS; k++) total += part[k][c];
      gcol[e * n + jc] = dt<DT>::store(total);
    }
    __syncthreads();
  }
}

/* the vector a kernel takes: 16 bytes where every pointer it streams is aligned to them */
static bool lb_aligned(const void *a, const void *b, const void *c) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) == 0;
}

/* run body with V and W set: 16-byte vectors when aligned, W lanes a row */
#define LB_SHAPED(DT, aligned, n, ...)                                                                \
  do {                                                                                                \
    constexpr int V16 = (int)(16 / sizeof(S_<DT>));                                                   \
    auto go_ = [&](auto v_) {                                                                         \
      constexpr int V = decltype(v_)::value;                                                          \
      switch (lb_lanes(n, V)) {                                                                       \
      case 1: { constexpr int W = 1; __VA_ARGS__; } break;                                            \
      case 2: { constexpr int W = 2; __VA_ARGS__; } break;                                            \
      case 4: { constexpr int W = 4; __VA_ARGS__; } break;                                            \
      case 8: { constexpr int W = 8; __VA_ARGS__; } break;                                            \
      case 16: { constexpr int W = 16; __VA_ARGS__; } break;                                          \
      default: { constexpr int W = 32; __VA_ARGS__; } break;                                          \
      }                                                                                               \
    };                                                                                                \
    if (aligned) go_(std::integral_constant<int, V16>{});                                             \
    else go_(std::integral_constant<int, 1>{});                                                       \
  } while (0)

static void cuda_littlebit(dm_tensor *w, const dm_tensor *x, const dm_tensor *row, const dm_tensor *col) {
  int64_t rows = x->shape[0] * x->shape[1], m = x->shape[1], n = x->shape[2];
  if (dm_numel(x) == 0) return;
  dm_dispatch_float(x->dtype, "littlebit", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const bool aligned = lb_aligned(dm_data(w), dm_data(x), NULL);
    LB_SHAPED(DT, aligned, n, DM_GROUP_LAUNCH((littlebit_k<DT, V, W>), rows, W, (S_<DT> *)dm_data(w),
                                              (const S_<DT> *)dm_data(x), (const S_<DT> *)dm_data(row),
                                              (const S_<DT> *)dm_data(col), m, n, rows));
  });
}

static void cuda_littlebit_bwd(dm_tensor *gx, dm_tensor *grow, dm_tensor *gcol, const dm_tensor *g, const dm_tensor *x,
                               const dm_tensor *row, const dm_tensor *col) {
  int64_t E = x->shape[0], m = x->shape[1], n = x->shape[2];
  if (dm_numel(x) == 0) return;
  dm_dispatch_float(x->dtype, "littlebit_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    const S_<DT> *gp = (const S_<DT> *)dm_data(g), *xp = (const S_<DT> *)dm_data(x);
    const S_<DT> *rp = (const S_<DT> *)dm_data(row), *cp = (const S_<DT> *)dm_data(col);
    const bool aligned = lb_aligned(gp, xp, gx ? dm_data(gx) : NULL);
    if (gx || grow)
      LB_SHAPED(DT, aligned, n, DM_GROUP_LAUNCH((littlebit_rows_k<DT, V, W>), E * m, W,
                                                gx ? (S_<DT> *)dm_data(gx) : NULL,
                                                grow ? (S_<DT> *)dm_data(grow) : NULL, gp, xp, rp, cp, m, n, E * m));
    if (gcol) {
      int64_t tiles = E * ((n + LB_TILE - 1) / LB_TILE);
      littlebit_cols_k<DT><<<dm_grid(tiles * 32 * LB_GROUPS, 32 * LB_GROUPS), 32 * LB_GROUPS, 0,
                             dm_cuda_stream()>>>((S_<DT> *)dm_data(gcol), gp, xp, rp, m, n, tiles);
      DM_CU_LAUNCHED();
    }
  });
}

/* x / s as the E4M3 code of vm/ops/quant.h's rounding of the exact quotient (to nearest, ties to even,
** saturating at 448), in f32 for x of 24 bits or fewer: the quotient rounded to f32 may land on a tie of
** E4M3's grid that the exact quotient is not on (the reference's double quotient cannot: x over a 24-bit s
** is then at least 2^-48 of itself away), so the division's remainder, exact by an FMA, says on which
** side the exact quotient lies, and the quotient moves one f32 step to that side before the hardware
** conversion rounds it. A zero of either sign is code 0, as the reference's. */
__device__ __forceinline__ unsigned e4m3_code_f32(float x, float s, float q) {   /* q = RN(x / s) */
  const float rem = __fmaf_rn(-q, s, x);
  const float a = fabsf(q);
  if (rem != 0.f && a > 0.f) {
    const uint32_t bits = __float_as_uint(a);
    const bool tie = a >= 0.015625f ? (bits & 0xFFFFFu) == 0x80000u     /* half a step of 3 mantissa bits */
                                     : a * 512.f - floorf(a * 512.f) == 0.5f;   /* subnormals: steps of 2^-9 */
    if (tie) q = __uint_as_float(__float_as_uint(q) + ((rem > 0.f) == (q > 0.f) ? 1u : 0xFFFFFFFFu));
  }
  const unsigned code = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
  return (code & 0x7Fu) ? code : 0u;
}

/* n / d for 32-bit n by one high product: q = floor(n ceil(2^64 / d) / 2^64) is exact for every n and
** 1 < d < 2^32 (the magic's excess, under n / 2^64 < 2^-32 <= 1 / d, never reaches the next multiple);
** d = 1, whose magic 2^64 does not fit, is n itself */
struct div32 {
  uint64_t magic;
  uint32_t d;
  explicit div32(uint32_t divisor) : magic(divisor > 1 ? ~(uint64_t)0 / divisor + 1 : 0), d(divisor) {}
  __device__ __forceinline__ uint32_t quo(uint32_t n) const {
    return d > 1 ? (uint32_t)__umul64hi((uint64_t)n, magic) : n;
  }
};

/* fp8 banks (vm/ops/moe.h): a group of eight lanes takes a block of 32, a lane four consecutive elements
** (their codes one word, rows of codes being 16-byte aligned), the block's amax by shuffles; a warp's four
** groups take consecutive blocks (consecutive memory), each value rounded to RT first, RT of 24 bits or
** fewer, in f32 (the scale amax / 448 rounds alike in f32 and through double: a quotient by 7 never ends
** on a tie). Blocks are counted in 32 bits (the host checks the count). */
template <int DT, int RT>
__global__ void bank_fp8_k(uint8_t *codes, float *scales, const S_<DT> *x, uint32_t n, uint32_t nq, div32 nb,
                           uint32_t blocks) {
  static_assert(DM_BANK_FP8_BLOCK == 32, "eight lanes of four elements a block");
  const int lane = threadIdx.x & 31;
  const uint32_t step = gridDim.x * blockDim.x / 8;
  for (uint32_t g0 = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * 4; g0 < blocks; g0 += step) {
    const uint32_t gb = g0 + lane / 8, row = nb.quo(gb), b = gb - row * nb.d, j0 = b * 32 + (lane & 7) * 4;
    const bool live = gb < blocks;
    float v[4], amax = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      v[i] = live && j0 + i < n ? (float)dt<RT>::load(dt<RT>::store(dt<DT>::load(x[(int64_t)row * n + j0 + i]))) : 0.f;
      amax = nan_max(amax, fabsf(v[i]));
    }
    for (int o = 4; o > 0; o /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o, 8));
    if (!live) continue;
    const float sc = __fdiv_rn(amax, (float)DM_E4M3_MAX);     /* NaN carried on */
    uint32_t word = 0;
    if (sc >= 1e-30f) {
      /* the quotients correctly rounded without a division: RN(x rinv) from the correctly rounded
      ** reciprocal is within an ulp, and one correction by the exact remainder rounds it correctly
      ** (Markstein), for a reciprocal that is a normal f32 */
      const float rinv = __frcp_rn(sc);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float q0 = __fmul_rn(v[i], rinv);
        word |= e4m3_code_f32(v[i], sc, __fmaf_rn(__fmaf_rn(-q0, sc, v[i]), rinv, q0)) << (8 * i);
      }
    } else if (sc > 0.f) {              /* blocks of magnitudes under 1e-27: a division each */
#pragma unroll
      for (int i = 0; i < 4; i++) word |= e4m3_code_f32(v[i], sc, __fdiv_rn(v[i], sc)) << (8 * i);
    }
    *(uint32_t *)(codes + (int64_t)row * nq + j0) = word;
    if ((lane & 7) == 0) scales[gb] = sc;
  }
}

static void cuda_bank_fp8(dm_tensor *codes, dm_tensor *scales, const dm_tensor *x, dm_dtype round_to) {
  const int64_t total = dm_numel(x);
  if (total == 0) return;
  const int64_t n = x->shape[x->ndim - 1], rows = total / n, nq = dm_bank_fp8_cols(n), nb = dm_bank_fp8_blocks(n);
  const int64_t blocks = rows * nb;
  if (blocks > UINT32_MAX / 2 || n > INT32_MAX)
    dm_error("bank_fp8: %lld blocks of 32 are over the kernel's 32-bit count", (long long)blocks);
  if (round_to == DM_F64)
    dm_error("bank_fp8: the CUDA kernel rounds values of 24 bits or fewer (bf16, f16, f32), not f64 (the CPU's "
             "takes f64)");
  dm_dispatch_float(x->dtype, "bank_fp8", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    uint8_t *cp = (uint8_t *)dm_data(codes);
    float *sp = (float *)dm_data(scales);
    const S_<DT> *xp = (const S_<DT> *)dm_data(x);
    dm_dispatch_float(round_to, "bank_fp8 (the dtype rounded to)", [&](auto r) {
      constexpr int RT = decltype(r)::value;
      if constexpr (RT != DM_F64) {
        bank_fp8_k<DT, RT><<<dm_grid(blocks * 8), DM_THREADS, 0, dm_cuda_stream()>>>(
            cp, sp, xp, (uint32_t)n, (uint32_t)nq, div32((uint32_t)nb), (uint32_t)blocks);
        DM_CU_LAUNCHED();
      }
    });
  });
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(bank_fp8, cuda_bank_fp8),
  DM_KERNEL_ENTRY(littlebit, cuda_littlebit),
  DM_KERNEL_ENTRY(littlebit_bwd, cuda_littlebit_bwd),
  DM_KERNEL_ENTRY(quantize, cuda_quantize),
  DM_KERNEL_ENTRY(quant_encode, cuda_quant_encode),
  DM_KERNEL_ENTRY(quant_decode, cuda_quant_decode),
};
DM_CUDA_KERNELS(kernels)
