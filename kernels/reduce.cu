/*
** reduce.cu — reductions, softmax and their backwards on CUDA.
**
** As on the CPU (vm/cpu/reduce.c), a kernel sees the input's shape split
** into outer dims, which are kept, and inner dims, which are reduced; a
** reduced operand (the output, in keepdim form) has size 1 on the inner
** dims. A plan (rplan) holds both groups coalesced, with every operand's
** element strides.
**
** reduce: a group of G threads (1, a warp or a block of 256) takes one
** output position, its threads stride through the reduced elements, and the
** group combines their partial results in a fixed tree: deterministic from
** run to run. G = 1 suits many short or strided reductions (consecutive
** threads read consecutive columns), a block suits long ones. When there
** are too few outputs to fill the GPU, the reduced range is also split over
** blockIdx.y and a second kernel combines the pieces in order. Sums and
** norms accumulate in double, integer sums in int64 (exact), as on the CPU;
** max and min keep the first position on ties and the first NaN.
**
** softmax, log_softmax and logsumexp over a contiguous dim of a float
** tensor take row kernels (see "rows" below: a warp per short row, a block
** streaming each long one, 16-byte loads) computing in float (double for
** f64). Other dims take a generic kernel, one thread per row. reduce_bwd is
** elementwise over the input's shape (the output's gradient broadcast over
** the reduced dims), except for max and min, whose gradient goes to the
** chosen position only.
*/
#include "common.cuh"
extern "C" {
#include "ops/reduce.h"
}

#define RMAXOPS 3

struct rplan {
  int nouter, ninner;
  int64_t oshape[DM_MAXDIM], ishape[DM_MAXDIM];
  int64_t ostr[RMAXOPS][DM_MAXDIM], istr[RMAXOPS][DM_MAXDIM];   /* element strides */
  int64_t n_outer, n_inner;
};


/* full: the tensor whose shape is walked; mask: its reduced dims; t[k] may be NULL */
static void rplan_make(rplan *P, const dm_tensor *full, unsigned mask, int nops, const dm_tensor *const *t) {
  memset(P, 0, sizeof *P);
  for (int d = 0; d < full->ndim; d++) {
    bool in = (mask >> d) & 1;
    int slot = in ? P->ninner++ : P->nouter++;
    (in ? P->ishape : P->oshape)[slot] = full->shape[d];
    for (int k = 0; k < nops; k++)
      (in ? P->istr : P->ostr)[k][slot] = (!t[k] || t[k]->shape[d] == 1) ? 0 : t[k]->strides[d];
  }
  P->nouter = dm_coalesce(P->nouter, P->oshape, nops, P->ostr);
  P->ninner = dm_coalesce(P->ninner, P->ishape, nops, P->istr);
  if (P->ninner == 0) { P->ninner = 1; P->ishape[0] = 1; }
  P->n_outer = 1;
  for (int d = 0; d < P->nouter; d++) P->n_outer *= P->oshape[d];
  P->n_inner = 1;
  for (int d = 0; d < P->ninner; d++) P->n_inner *= P->ishape[d];
}

/* the dims where a reduced operand has size 1 and the full one has not */
static unsigned reduced_mask(const dm_tensor *full, const dm_tensor *red) {
  unsigned mask = 0;
  for (int d = 0; d < full->ndim; d++)
    if (red->shape[d] == 1 && full->shape[d] != 1) mask |= 1u << d;
  return mask;
}

template <int N>
__device__ __forceinline__ void outer_off(const rplan &P, int64_t pos, int64_t (&off)[N]) {
#pragma unroll
  for (int k = 0; k < N; k++) off[k] = 0;
  if (P.nouter == 1) {                          /* the common case: no division */
#pragma unroll
    for (int k = 0; k < N; k++) off[k] = pos * P.ostr[k][0];
    return;
  }
  for (int d = P.nouter - 1; d >= 0; d--) {
    int64_t s = P.oshape[d], q = pos / s, r = pos - q * s;
    pos = q;
#pragma unroll
    for (int k = 0; k < N; k++) off[k] += r * P.ostr[k][d];
  }
}

/* operand k's offset of the j-th reduced element (row-major over the inner dims) */
__device__ __forceinline__ int64_t inner_off(const rplan &P, int k, int64_t j) {
  int64_t off = 0;
  for (int d = P.ninner - 1; d > 0; d--) {
    int64_t s = P.ishape[d], q = j / s;
    off += (j - q * s) * P.istr[k][d];
    j = q;
  }
  return off + j * P.istr[k][0];
}

/* ---- the accumulator of the generic reduction ------------------------------------------ */

struct racc {
  double s, m;           /* sum (of exp(x - m) for logsumexp); best value or running max */
  long long is;          /* integer sum */
  long long i;           /* position of the best value, -1 before any */
};

__device__ __forceinline__ racc racc_init(int kind) {
  racc a;
  a.s = 0;
  a.m = kind == R_LOGSUMEXP ? -INFINITY : 0;
  a.is = 0;
  a.i = -1;
  return a;
}

/* v replaces m: strictly better, or a NaN against a number (a NaN stays) */
__device__ __forceinline__ bool better(double v, double m, bool max) {
  return (max ? v > m : v < m) || (v != v && m == m);
}

__device__ __forceinline__ void lse_add(racc &a, double v) {
  if (a.m != a.m) return;                        /* a NaN stays, over +inf too */
  if (v != v) { a.m = v; return; }
  if (a.m == INFINITY || v == -INFINITY) return;
  if (v > a.m) {
    a.s = a.s * exp(a.m - v) + 1;
    a.m = v;
  } else a.s += exp(v - a.m);
}

template <int DT>
__device__ __forceinline__ void racc_add(int kind, racc &a, typename dt<DT>::S raw, long long k, double p) {
  constexpr bool INT = DT == DM_I32 || DT == DM_I64 || DT == DM_U8;
  double v = (double)dt<DT>::load(raw);
  switch (kind) {
  case R_SUM: case R_MEAN:
    if constexpr (INT) a.is += (long long)raw;
    else a.s += v;
    break;
  case R_MAX: case R_ARGMAX:
    if (a.i < 0 || better(v, a.m, true)) { a.m = v; a.i = k; }
    break;
  case R_MIN: case R_ARGMIN:
    if (a.i < 0 || better(v, a.m, false)) { a.m = v; a.i = k; }
    break;
  case R_LOGSUMEXP: lse_add(a, v); break;
  case R_NORM: a.s += p == 2 ? v * v : p == 1 ? fabs(v) : pow(fabs(v), p); break;
  }
}

/* b's elements come from anywhere in the range: positions settle the ties */
__device__ __forceinline__ racc pick(racc a, racc b, bool max) {
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  bool an = a.m != a.m, bn = b.m != b.m;
  if (an || bn) return an && bn ? (b.i < a.i ? b : a) : an ? a : b;
  if (max ? b.m > a.m : b.m < a.m) return b;
  return a.m == b.m && b.i < a.i ? b : a;
}

__device__ __forceinline__ racc combine(int kind, racc a, racc b) {
  switch (kind) {
  case R_MAX: case R_ARGMAX: return pick(a, b, true);
  case R_MIN: case R_ARGMIN: return pick(a, b, false);
  case R_LOGSUMEXP: {
    if (a.m != a.m) return a;
    if (b.m != b.m) return b;
    double m = a.m > b.m ? a.m : b.m;
    if (m == -INFINITY) return a;
    if (m == INFINITY) { a.m = m; a.s = 1; return a; }
    a.s = a.s * exp(a.m - m) + b.s * exp(b.m - m);
    a.m = m;
    return a;
  }
  default:
    a.s += b.s;
    a.is += b.is;
    return a;
  }
}

__device__ __forceinline__ racc shfl_down(racc a, int o) {
  a.s = __shfl_down_sync(DM_FULL_MASK, a.s, o);
  a.m = __shfl_down_sync(DM_FULL_MASK, a.m, o);
  a.is = __shfl_down_sync(DM_FULL_MASK, a.is, o);
  a.i = __shfl_down_sync(DM_FULL_MASK, a.i, o);
  return a;
}

/* the group's result, in its first thread; G is 1, 32 or the block */
__device__ racc group_reduce(int kind, racc a, int G, racc *smem) {
  if (G == 1) return a;
  for (int o = 16; o > 0; o >>= 1) a = combine(kind, a, shfl_down(a, o));
  if (G == 32) return a;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();                               /* smem may hold the last position's partials */
  if (lane == 0) smem[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < (int)(blockDim.x / 32) ? smem[lane] : racc_init(kind);
    for (int o = 16; o > 0; o >>= 1) a = combine(kind, a, shfl_down(a, o));
  }
  return a;
}

/* the output at one position; xo: the position's first input element */
template <int DT>
__device__ void finish(int kind, racc a, const typename dt<DT>::S *xo, const rplan &P, void *out, int64_t oo,
                       int64_t *idx, int64_t io, double p, int64_t base) {
  typedef typename dt<DT>::S S;
  constexpr bool INT = DT == DM_I32 || DT == DM_I64 || DT == DM_U8;
  if (idx) idx[io] = a.i + base;
  if (!out) return;
  double v;
  switch (kind) {
  case R_SUM:
    if constexpr (INT) { ((int64_t *)out)[oo] = a.is; return; }
    v = a.s;
    break;
  case R_MEAN: v = a.s / (double)P.n_inner; break;          /* 0/0: NaN for an empty mean */
  case R_LOGSUMEXP: v = isfinite(a.m) ? a.m + log(a.s) : a.m; break;
  case R_NORM: v = p == 2 ? sqrt(a.s) : p == 1 ? a.s : pow(a.s, 1 / p); break;
  default:                                                   /* max, min: the element itself */
    if (a.i >= 0) ((S *)out)[oo] = xo[inner_off(P, 0, a.i)];
    return;
  }
  ((S *)out)[oo] = dt<DT>::store(v);
}

/* operands of P: 0 x, 1 out, 2 idx; `split` pieces of the range, over blockIdx.y */
template <int DT>
__global__ void reduce_k(int kind, const typename dt<DT>::S *x, void *out, int64_t *idx, rplan P, double p,
                         int64_t base, int G, int split, racc *part) {
  __shared__ racc smem[32];
  const int lane = threadIdx.x % G, groups = blockDim.x / G, grp = threadIdx.x / G;
  const int64_t chunk = (P.n_inner + split - 1) / split, k0 = (int64_t)blockIdx.y * chunk;
  const int64_t k1 = k0 + chunk < P.n_inner ? k0 + chunk : P.n_inner;
  for (int64_t pos = (int64_t)blockIdx.x * groups + grp; pos < P.n_outer; pos += (int64_t)gridDim.x * groups) {
    int64_t off[3];
    outer_off<3>(P, pos, off);
    racc a = racc_init(kind);
    for (int64_t k = k0 + lane; k < k1; k += G) racc_add<DT>(kind, a, x[off[0] + inner_off(P, 0, k)], k, p);
    a = group_reduce(kind, a, G, smem);
    if (lane != 0) continue;
    if (split > 1) part[pos * split + blockIdx.y] = a;
    else finish<DT>(kind, a, x + off[0], P, out, off[1], idx, off[2], p, base);
  }
}

template <int DT>
__global__ void reduce_join_k(int kind, const typename dt<DT>::S *x, void *out, int64_t *idx, rplan P, double p,
                              int64_t base, int split, const racc *part) {
  DM_GRID_LOOP(pos, P.n_outer) {
    racc a = part[pos * split];
    for (int s = 1; s < split; s++) a = combine(kind, a, part[pos * split + s]);
    int64_t off[3];
    outer_off<3>(P, pos, off);
    finish<DT>(kind, a, x + off[0], P, out, off[1], idx, off[2], p, base);
  }
}

/* The same join for many partials an output (split >= REDUCE_BLOCK_JOIN), a block an output: each
** thread combines a contiguous run of the partials in order, then thread 0 the runs in order. One
** thread walking 1,024 partials in turn took 277 us for a full sum at [8192, 2048]. */
#define REDUCE_BLOCK_JOIN 64

template <int DT>
__global__ void reduce_join_block_k(int kind, const typename dt<DT>::S *x, void *out, int64_t *idx, rplan P,
                                    double p, int64_t base, int split, const racc *part) {
  __shared__ racc runs[DM_THREADS];
  const int per = (split + (int)blockDim.x - 1) / (int)blockDim.x, nrun = (split + per - 1) / per;
  for (int64_t pos = blockIdx.x; pos < P.n_outer; pos += gridDim.x) {
    const int s0 = (int)threadIdx.x * per, s1 = s0 + per < split ? s0 + per : split;
    racc a = racc_init(kind);
    for (int s = s0; s < s1; s++) a = s == s0 ? part[pos * split + s] : combine(kind, a, part[pos * split + s]);
    __syncthreads();                               /* runs may hold the last position's */
    if (s0 < s1) runs[threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
      a = runs[0];
      for (int r = 1; r < nrun; r++) a = combine(kind, a, runs[r]);
      int64_t off[3];
      outer_off<3>(P, pos, off);
      finish<DT>(kind, a, x + off[0], P, out, off[1], idx, off[2], p, base);
    }
  }
}

static bool row_lse(const rplan *P, const dm_tensor *x, dm_tensor *out);

static void cuda_reduce(int kind, dm_tensor *out, dm_tensor *idx, const dm_tensor *x, double p, int64_t base) {
  rplan P;
  const dm_tensor *t[3] = {x, out, idx};
  rplan_make(&P, x, reduced_mask(x, out ? out : idx), 3, t);
  if (P.n_outer == 0) return;
  if (kind == R_LOGSUMEXP && row_lse(&P, x, out)) return;
  int sm = dm_cuda_sm_count();
  bool unit = P.ninner == 1 && P.istr[0][0] == 1;
  int G = P.n_inner <= 32 || (!unit && P.n_outer >= 4096) ? 1 : P.n_inner >= 4096 ? DM_THREADS : 32;
  int groups = DM_THREADS / G;
  int64_t want = (int64_t)sm * 2048, have = P.n_outer * G, split = 1;
  if (have < want / 2) {                      /* too few outputs: split their ranges too */
    split = (want + have - 1) / have;
    int64_t most = P.n_inner / ((int64_t)G * 64);
    if (split > most) split = most;
    if (split > 1024) split = 1024;
    if (split < 1) split = 1;
  }
  int64_t bx = (P.n_outer + groups - 1) / groups, cap = (int64_t)sm * 32;
  dim3 grid((unsigned)(bx < cap ? bx : cap), (unsigned)split);
  racc *part = split > 1 ? (racc *)dm_alloc(DM_CUDA, sizeof(racc) * (size_t)(P.n_outer * split)) : NULL;
  void *po = out ? dm_data(out) : NULL;
  int64_t *pi = idx ? (int64_t *)dm_data(idx) : NULL;
  dm_dispatch_all(x->dtype, "reduce", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    const S *px = (const S *)dm_data(x);
    reduce_k<DT><<<grid, DM_THREADS, 0, dm_cuda_stream()>>>(kind, px, po, pi, P, p, base, G, (int)split, part);
    DM_CU_LAUNCHED();
    if (split >= REDUCE_BLOCK_JOIN) {
      int64_t nb = P.n_outer < cap ? P.n_outer : cap;
      reduce_join_block_k<DT><<<(unsigned)nb, DM_THREADS, 0, dm_cuda_stream()>>>(kind, px, po, pi, P, p, base,
                                                                                (int)split, part);
      DM_CU_LAUNCHED();
    } else if (split > 1) {
      DM_LAUNCH(reduce_join_k<DT>, P.n_outer, kind, px, po, pi, P, p, base, (int)split, part);
    }
  });
  if (part) dm_free(DM_CUDA, part, sizeof(racc) * (size_t)(P.n_outer * split));   /* stream-ordered */
}

/* ---- backward of the reductions -------------------------------------------------------- */

/* sum, mean, logsumexp, norm: elementwise over gx; L: gx, g, y, x (g and y broadcast) */
template <int DT>
__global__ void reduce_bwd_k(int kind, typename dt<DT>::S *gx, const typename dt<DT>::S *pg,
                             const typename dt<DT>::S *py, const typename dt<DT>::S *px, dm_layout L, int64_t n,
                             double scale, double p) {
  typedef typename dt<DT>::C T;
  DM_GRID_LOOP(i, n) {
    int64_t off[4];
    dm_offsets<4>(L, i, off);
    double g = (double)dt<DT>::load(pg[off[1]]) * scale, v = g;
    if (kind == R_LOGSUMEXP) {
      T e = exp(dt<DT>::load(px[off[3]]) - dt<DT>::load(py[off[2]]));
      v = g * (double)e;
    } else if (kind == R_NORM) {
      /* d|x|_p/dx = sign(x) (|x| / y)^(p-1); zero at x = 0 and for a zero norm */
      double xv = dt<DT>::load(px[off[3]]), y = dt<DT>::load(py[off[2]]), r = fabs(xv) / y;
      v = xv == 0 || y == 0 ? 0 : g * copysign(p == 1 ? 1 : p == 2 ? r : pow(r, p - 1), xv);
    }
    gx[off[0]] = dt<DT>::store(v);
  }
}

/* max, min: g goes to the chosen position of each output (gx is zero elsewhere); P: gx, g, idx */
template <int DT>
__global__ void reduce_bwd_pick_k(typename dt<DT>::S *gx, const typename dt<DT>::S *pg, const int64_t *pi,
                                  rplan P, int64_t base) {
  DM_GRID_LOOP(pos, P.n_outer) {
    int64_t off[3];
    outer_off<3>(P, pos, off);
    int64_t k = pi[off[2]] - base;
    if (k >= 0 && k < P.n_inner) gx[off[0] + inner_off(P, 0, k)] = pg[off[1]];
  }
}

static void cuda_reduce_bwd(int kind, dm_tensor *gx, const dm_tensor *g, const dm_tensor *y, const dm_tensor *idx,
                            const dm_tensor *x, double p, int64_t base) {
  int64_t n = dm_numel(gx);
  if (n == 0) return;
  unsigned mask = reduced_mask(gx, g);
  if (kind == R_MAX || kind == R_MIN) {
    dm_fill(gx, 0);
    rplan P;
    const dm_tensor *t[3] = {gx, g, idx};
    rplan_make(&P, gx, mask, 3, t);
    dm_dispatch_float(gx->dtype, "reduce_bwd", [&](auto d) {
      constexpr int DT = decltype(d)::value;
      typedef typename dt<DT>::S S;
      DM_LAUNCH(reduce_bwd_pick_k<DT>, P.n_outer, (S *)dm_data(gx), (const S *)dm_data(g),
                (const int64_t *)dm_data(idx), P, base);
    });
    return;
  }
  int64_t count = 1;
  for (int d = 0; d < gx->ndim; d++) if ((mask >> d) & 1) count *= gx->shape[d];
  double scale = kind == R_MEAN ? 1.0 / (double)count : 1.0;
  const dm_tensor *ops[4] = {gx, g, y ? y : g, x ? x : g};
  dm_layout L;
  dm_layout_make(&L, gx->ndim, gx->shape, 4, ops);
  dm_dispatch_float(gx->dtype, "reduce_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    DM_LAUNCH(reduce_bwd_k<DT>, n, kind, (S *)dm_data(gx), (const S *)dm_data(ops[1]), (const S *)dm_data(ops[2]),
              (const S *)dm_data(ops[3]), L, n, scale, p);
  });
}

/* ---- rows: softmax, log_softmax, logsumexp --------------------------------------------------
** Short rows (up to 512 elements): a warp holds R rows at once in registers,
** E elements a lane, read once, so several loads are in flight per lane.
** Longer rows stream: a block per row keeps an online max and sum of exp
** per thread (U vectors in flight per step), combines them once, then
** writes the outputs in a second pass over the row, which finds it in L2
** (logsumexp needs no second pass). exp is the fast one (ex2.approx) for
** float: within a few ulps where it matters, the terms near the row's max. */

#define ROW_THREADS_MAX 1024

/* the larger, or a NaN when either is one (one instruction for float, sm_80 on) */
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double max_nan(double a, double b) { return b > a || b != b ? b : a; }

/* e^x: ex2.approx of x log2(e) for float (results under 2^-126 flush to 0) */
__device__ __forceinline__ float fast_exp(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}
__device__ __forceinline__ double fast_exp(double x) { return exp(x); }

/* the row's max or sum in every thread of the row; tpr is a warp or the block */
template <typename T, bool MAX>
__device__ __forceinline__ T row_all(T v, int tpr, T *red) {
  for (int o = 16; o > 0; o >>= 1) {
    T w = __shfl_xor_sync(DM_FULL_MASK, v, o);
    v = MAX ? max_nan(v, w) : v + w;
  }
  if (tpr == 32) return v;
  int warp = threadIdx.x / 32;
  __syncthreads();                  /* red may hold the last reduction's values */
  if (threadIdx.x % 32 == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < tpr / 32; w++) v = MAX ? max_nan(v, red[w]) : v + red[w];
  return v;
}

/* a thread's E elements of a row, V at a time: element (j * tpr + lane) * V + u, or pad past the end */
template <int DT, int V, int E>
__device__ __forceinline__ void load_row(const typename dt<DT>::S *r, int64_t L, int tpr, int lane,
                                         typename dt<DT>::C (&v)[E], typename dt<DT>::C pad) {
  typedef typename dt<DT>::S S;
#pragma unroll
  for (int j = 0; j < E / V; j++) {
    int64_t e = ((int64_t)j * tpr + lane) * V;
    if (V > 1 && e < L) {               /* L is a multiple of V on this path */
      dm_vec<S, V> w = *(const dm_vec<S, V> *)(r + e);
#pragma unroll
      for (int u = 0; u < V; u++) v[j * V + u] = dt<DT>::load(w.v[u]);
    } else {
#pragma unroll
      for (int u = 0; u < V; u++) v[j * V + u] = e + u < L ? dt<DT>::load(r[e + u]) : pad;
    }
  }
}

template <int DT, int V, int E>
__device__ __forceinline__ void store_row(typename dt<DT>::S *r, int64_t L, int tpr, int lane,
                                          const typename dt<DT>::C (&v)[E]) {
  typedef typename dt<DT>::S S;
#pragma unroll
  for (int j = 0; j < E / V; j++) {
    int64_t e = ((int64_t)j * tpr + lane) * V;
    if (V > 1 && e < L) {
      dm_vec<S, V> w;
#pragma unroll
      for (int u = 0; u < V; u++) w.v[u] = dt<DT>::store(v[j * V + u]);
      *(dm_vec<S, V> *)(r + e) = w;
    } else {
#pragma unroll
      for (int u = 0; u < V; u++) if (e + u < L) r[e + u] = dt<DT>::store(v[j * V + u]);
    }
  }
}

enum { ROW_SOFTMAX, ROW_LOG_SOFTMAX, ROW_LOGSUMEXP };

/* P's operands: 0 x, 1 y (the output, one element a row for logsumexp).
** A warp takes R rows at a time, E elements of each a lane. */
template <int DT, int V, int E, int R>
__global__ void __launch_bounds__(DM_THREADS, 4)
softmax_rows(int mode, typename dt<DT>::S *y, const typename dt<DT>::S *x, rplan P, int tpr) {
  typedef typename dt<DT>::C T;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t L = P.n_inner;
  for (int64_t row0 = ((int64_t)blockIdx.x * warps + threadIdx.x / 32) * R; row0 < P.n_outer;
       row0 += (int64_t)gridDim.x * warps * R) {
    int64_t off[R][2];
    T v[R][E], m[R], s[R];
#pragma unroll
    for (int r = 0; r < R; r++) {             /* every load first: R rows in flight */
      if (row0 + r < P.n_outer) {
        outer_off<2>(P, row0 + r, off[r]);
        load_row<DT, V, E>(x + off[r][0], L, 32, lane, v[r], -INFINITY);
      } else
        for (int i = 0; i < E; i++) v[r][i] = -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      m[r] = -INFINITY;
      for (int i = 0; i < E; i++) m[r] = max_nan(m[r], v[r][i]);
    }
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; r++) m[r] = max_nan(m[r], __shfl_xor_sync(DM_FULL_MASK, m[r], o));
#pragma unroll
    for (int r = 0; r < R; r++) {
      s[r] = 0;
      for (int i = 0; i < E; i++) {
        T e = fast_exp(v[r][i] - m[r]);        /* 0 for the padding */
        s[r] += e;
        if (mode == ROW_SOFTMAX) v[r][i] = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; r++) s[r] += __shfl_xor_sync(DM_FULL_MASK, s[r], o);
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (row0 + r >= P.n_outer) continue;
      if (mode == ROW_LOGSUMEXP) {
        if (lane == 0) y[off[r][1]] = dt<DT>::store(isfinite(m[r]) ? m[r] + log(s[r]) : m[r]);
        continue;
      }
      T logs = log(s[r]), scale = 1 / s[r];
      for (int i = 0; i < E; i++) v[r][i] = mode == ROW_SOFTMAX ? v[r][i] * scale : (v[r][i] - m[r]) - logs;
      store_row<DT, V, E>(y + off[r][1], L, 32, lane, v[r]);
    }
  }
}

/* Rows of at most 64 vectors: a warp takes R rows at a time and keeps them
** as loaded (NV 16-byte vectors of each a lane, so R * NV loads in flight),
** converting on each use; softmax computes exp twice rather than hold floats. */
template <int DT, int V, int NV, int R>
__global__ void __launch_bounds__(DM_THREADS, 4)
softmax_warp_rows(int mode, typename dt<DT>::S *y, const typename dt<DT>::S *x, rplan P) {
  typedef typename dt<DT>::C T;
  typedef typename dt<DT>::S S;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int L = (int)P.n_inner;
  for (int64_t row0 = ((int64_t)blockIdx.x * warps + threadIdx.x / 32) * R; row0 < P.n_outer;
       row0 += (int64_t)gridDim.x * warps * R) {
    dm_vec<S, V> w[R][NV];
    T m[R], s[R];
#pragma unroll
    for (int r = 0; r < R; r++) {               /* every load first */
      int64_t off[2] = {0, 0};
      if (row0 + r < P.n_outer) outer_off<2>(P, row0 + r, off);
#pragma unroll
      for (int j = 0; j < NV; j++) {
        int e = (j * 32 + lane) * V;
        if (row0 + r < P.n_outer && e < L) w[r][j] = *(const dm_vec<S, V> *)(x + off[0] + e);
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      m[r] = -INFINITY;
#pragma unroll
      for (int j = 0; j < NV; j++)
        if (row0 + r < P.n_outer && (j * 32 + lane) * V < L)
          for (int k = 0; k < V; k++) m[r] = max_nan(m[r], dt<DT>::load(w[r][j].v[k]));
    }
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; r++) m[r] = max_nan(m[r], __shfl_xor_sync(DM_FULL_MASK, m[r], o));
#pragma unroll
    for (int r = 0; r < R; r++) {
      s[r] = 0;
#pragma unroll
      for (int j = 0; j < NV; j++)
        if (row0 + r < P.n_outer && (j * 32 + lane) * V < L)
          for (int k = 0; k < V; k++) s[r] += fast_exp(dt<DT>::load(w[r][j].v[k]) - m[r]);
    }
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < R; r++) s[r] += __shfl_xor_sync(DM_FULL_MASK, s[r], o);
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (row0 + r >= P.n_outer) continue;
      int64_t off[2];                           /* again: cheaper than holding it */
      outer_off<2>(P, row0 + r, off);
      if (mode == ROW_LOGSUMEXP) {
        if (lane == 0) y[off[1]] = dt<DT>::store(isfinite(m[r]) ? m[r] + log(s[r]) : m[r]);
        continue;
      }
      T logs = log(s[r]), scale = 1 / s[r];
#pragma unroll
      for (int j = 0; j < NV; j++) {
        int e = (j * 32 + lane) * V;
        if (e >= L) continue;
        dm_vec<S, V> o;
        for (int k = 0; k < V; k++) {
          T v = dt<DT>::load(w[r][j].v[k]);
          o.v[k] = dt<DT>::store(mode == ROW_SOFTMAX ? fast_exp(v - m[r]) * scale : (v - m[r]) - logs);
        }
        *(dm_vec<S, V> *)(y + off[1] + e) = o;
      }
    }
  }
}

/* logsumexp of short rows, each `xs` elements after the last: G = 8 lanes a
** row (three shuffles a reduction), NV = 4 vectors a lane, one row a group and
** no loop. Rows this short are bound by latency, not bandwidth: with few
** registers (45) a wave holds many rows, and each lane's loads are all in
** flight at once. ([32768, 256] bf16 on an H200: 80% of the copy bandwidth in
** graph replays, against 44% for a warp a row with four rows a warp.) */
template <int DT, int V, int G, int NV>
__global__ void __launch_bounds__(DM_THREADS, 4)
lse_rows_short(typename dt<DT>::S *y, const typename dt<DT>::S *x, int64_t n, int L, int64_t xs, int64_t ys) {
  typedef typename dt<DT>::C T;
  typedef typename dt<DT>::S S;
  const int lane = threadIdx.x % G;
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G;
  const bool valid = row < n;                   /* the others stay for the shuffles */
  const S *xr = x + (valid ? row : 0) * xs;
  dm_vec<S, V> w[NV];
#pragma unroll
  for (int j = 0; j < NV; j++)
    if (valid && (j * G + lane) * V < L) w[j] = *(const dm_vec<S, V> *)(xr + (j * G + lane) * V);
  T m = -INFINITY, s = 0;
#pragma unroll
  for (int j = 0; j < NV; j++)
    if (valid && (j * G + lane) * V < L)
#pragma unroll
      for (int k = 0; k < V; k++) m = max_nan(m, dt<DT>::load(w[j].v[k]));
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(DM_FULL_MASK, m, o));
#pragma unroll
  for (int j = 0; j < NV; j++)
    if (valid && (j * G + lane) * V < L)
#pragma unroll
      for (int k = 0; k < V; k++) s += fast_exp(dt<DT>::load(w[j].v[k]) - m);
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(DM_FULL_MASK, s, o);
  if (valid && lane == 0) y[row * ys] = dt<DT>::store(isfinite(m) ? m + log(s) : m);
}

/* (m, s): a max and the sum of exp(v - m), merged */
template <typename T> __device__ __forceinline__ void online_merge(T &m, T &s, T m2, T s2) {
  T mm = max_nan(m, m2);
  if (mm == -INFINITY) return;                  /* both empty */
  s = (m == -INFINITY ? 0 : s * fast_exp(m - mm)) + (m2 == -INFINITY ? 0 : s2 * fast_exp(m2 - mm));
  m = mm;
}

/* the block's (m, s) in every thread */
template <typename T> __device__ __forceinline__ void block_merge(T &m, T &s, T *red_m, T *red_s) {
  for (int o = 16; o > 0; o >>= 1) {
    T m2 = __shfl_xor_sync(DM_FULL_MASK, m, o), s2 = __shfl_xor_sync(DM_FULL_MASK, s, o);
    online_merge(m, s, m2, s2);
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (warps == 1) return;
  __syncthreads();                              /* red_* may hold the last row's values */
  if (lane == 0) { red_m[warp] = m; red_s[warp] = s; }
  __syncthreads();
  m = lane < warps ? red_m[lane] : (T)-INFINITY;
  s = lane < warps ? red_s[lane] : (T)0;
  for (int o = 16; o > 0; o >>= 1) {
    T m2 = __shfl_xor_sync(DM_FULL_MASK, m, o), s2 = __shfl_xor_sync(DM_FULL_MASK, s, o);
    online_merge(m, s, m2, s2);
  }
}

#define ROW_UNROLL 4

/* rows streamed by a block each: an online max and sum, then (softmax) the outputs */
template <int DT, int V>
__global__ void __launch_bounds__(DM_THREADS, 4)
softmax_long(int mode, typename dt<DT>::S *y, const typename dt<DT>::S *x, rplan P) {
  typedef typename dt<DT>::C T;
  typedef typename dt<DT>::S S;
  __shared__ T red_m[32], red_s[32];
  const int L = (int)P.n_inner, step = blockDim.x * V;
  for (int64_t row = blockIdx.x; row < P.n_outer; row += gridDim.x) {
    int64_t off[2];
    outer_off<2>(P, row, off);
    const S *xr = x + off[0];
    T m = -INFINITY, s = 0;
    for (int base = threadIdx.x * V; base < L; base += step * ROW_UNROLL) {
      dm_vec<S, V> w[ROW_UNROLL];               /* ROW_UNROLL loads in flight, kept as loaded */
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; u++)
        if (base + u * step < L) w[u] = *(const dm_vec<S, V> *)(xr + base + u * step);
      T mv = -INFINITY;
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; u++)
        if (base + u * step < L)
          for (int k = 0; k < V; k++) mv = max_nan(mv, dt<DT>::load(w[u].v[k]));
      if (mv > m || mv != mv) {                 /* a new max (a NaN sticks through fast_exp) */
        s = m == -INFINITY ? 0 : s * fast_exp(m - mv);
        m = mv;
      }
      if (m == -INFINITY) continue;             /* nothing but -inf yet */
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; u++)
        if (base + u * step < L)
          for (int k = 0; k < V; k++) s += fast_exp(dt<DT>::load(w[u].v[k]) - m);
    }
    block_merge(m, s, red_m, red_s);
    if (mode == ROW_LOGSUMEXP) {
      if (threadIdx.x == 0) y[off[1]] = dt<DT>::store(isfinite(m) ? m + log(s) : m);
      continue;
    }
    T logs = log(s), scale = 1 / s;
    S *yr = y + off[1];
    for (int base = threadIdx.x * V; base < L; base += step * ROW_UNROLL) {
      dm_vec<S, V> w[ROW_UNROLL];
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; u++)
        if (base + u * step < L) w[u] = *(const dm_vec<S, V> *)(xr + base + u * step);
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; u++) {
        if (base + u * step >= L) continue;
        for (int k = 0; k < V; k++) {
          T v = dt<DT>::load(w[u].v[k]);
          w[u].v[k] = dt<DT>::store(mode == ROW_SOFTMAX ? fast_exp(v - m) * scale : (v - m) - logs);
        }
        *(dm_vec<S, V> *)(yr + base + u * step) = w[u];
      }
    }
  }
}

/* softmax: gx = y (g - sum(g y)); log_softmax: gx = g - exp(y) sum(g). P: gx, g, y */
template <int DT, int V, int E>
__global__ void __launch_bounds__(ROW_THREADS_MAX)
softmax_bwd_rows(int lg, typename dt<DT>::S *gx, const typename dt<DT>::S *g, const typename dt<DT>::S *y,
                 rplan P, int tpr) {
  typedef typename dt<DT>::C T;
  __shared__ double red[32];       /* g - sum(g y) cancels when one y is near 1: the sum in double */
  const int per_block = blockDim.x / tpr, lane = threadIdx.x % tpr;
  const int64_t L = P.n_inner;
  for (int64_t row = (int64_t)blockIdx.x * per_block + threadIdx.x / tpr; row < P.n_outer;
       row += (int64_t)gridDim.x * per_block) {
    int64_t off[3];
    outer_off<3>(P, row, off);
    T gv[E], yv[E];
    load_row<DT, V, E>(g + off[1], L, tpr, lane, gv, 0);
    load_row<DT, V, E>(y + off[2], L, tpr, lane, yv, 0);
    double dot = 0;
#pragma unroll
    for (int i = 0; i < E; i++) dot += lg ? (double)gv[i] : (double)gv[i] * yv[i];
    dot = row_all<double, false>(dot, tpr, red);
#pragma unroll
    for (int i = 0; i < E; i++)
      gv[i] = lg ? (T)(gv[i] - fast_exp(yv[i]) * (T)dot) : (T)(yv[i] * ((double)gv[i] - dot));
    store_row<DT, V, E>(gx + off[0], L, tpr, lane, gv);
  }
}

template <int DT, int V>
__global__ void __launch_bounds__(ROW_THREADS_MAX)
softmax_bwd_long(int lg, typename dt<DT>::S *gx, const typename dt<DT>::S *g, const typename dt<DT>::S *y,
                 rplan P) {
  typedef typename dt<DT>::C T;
  __shared__ double red[32];
  const int64_t L = P.n_inner, step = (int64_t)blockDim.x * V;
  for (int64_t row = blockIdx.x; row < P.n_outer; row += gridDim.x) {
    int64_t off[3];
    outer_off<3>(P, row, off);
    double dot = 0;
    for (int64_t e = (int64_t)threadIdx.x * V; e < L; e += step)
      for (int u = 0; u < V; u++) {
        T gv = dt<DT>::load(g[off[1] + e + u]);
        dot += lg ? (double)gv : (double)gv * dt<DT>::load(y[off[2] + e + u]);
      }
    dot = row_all<double, false>(dot, blockDim.x, red);
    for (int64_t e = (int64_t)threadIdx.x * V; e < L; e += step)
      for (int u = 0; u < V; u++) {
        T gv = dt<DT>::load(g[off[1] + e + u]), yv = dt<DT>::load(y[off[2] + e + u]);
        gx[off[0] + e + u] = dt<DT>::store(lg ? (T)(gv - fast_exp(yv) * (T)dot) : (T)(yv * ((double)gv - dot)));
      }
  }
}

/* every operand's rows contiguous */
static bool rows_unit(const rplan *P, int nops) {
  if (P->ninner != 1 || P->n_inner == 0) return false;
  for (int k = 0; k < nops; k++) if (P->istr[k][0] != 1) return false;
  return true;
}

/* and, for 16-byte loads, a whole number of vectors a row, each row aligned */
static bool rows_vector(const rplan *P, int nops, const void *const *base, size_t es, bool out_row) {
  int64_t v = 16 / (int64_t)es;
  if (P->n_inner % v) return false;
  for (int k = 0; k < nops; k++) {
    if (k == 1 && !out_row) continue;           /* logsumexp's output is one element a row */
    if (!dm_aligned(base[k], 16)) return false;
    for (int d = 0; d < P->nouter; d++) if (P->ostr[k][d] % v) return false;
  }
  return true;
}

/* threads a row and elements a thread (8, or 16 when emax allows) for rows of L; false past 1024 threads */
static bool row_shape(int64_t L, int emax, int *tpr, int *e) {
  for (int t = 32; t <= ROW_THREADS_MAX; t *= 2)
    for (int k = 8; k <= emax; k *= 2)
      if ((int64_t)t * k >= L) { *tpr = t; *e = k; return true; }
  return false;
}

static void launch(const void *kernel, int threads, int64_t blocks, const void *const *args) {
  int64_t cap = (int64_t)dm_cuda_sm_count() * 64;
  DM_CU(cudaLaunchKernel(kernel, dim3((unsigned)(blocks < cap ? blocks : cap)), dim3(threads), (void **)args, 0,
                         dm_cuda_stream()));
  DM_CU_LAUNCHED();
}

/* tpr threads a row: a block of 256 holds several rows of a warp each */
static void launch_rows(const void *kernel, int tpr, int64_t rows, const void *const *args) {
  int threads = tpr > 32 ? tpr : DM_THREADS, per_block = threads / tpr;
  launch(kernel, threads, (rows + per_block - 1) / per_block, args);
}

/* softmax (modes 0, 1) or logsumexp (2) over contiguous rows; false when the rows do not suit */
static bool softmax_rows_launch(int mode, const rplan *P, const dm_tensor *x, void *y) {
  if (!dm_dtype_is_float(x->dtype) || !rows_unit(P, mode == ROW_LOGSUMEXP ? 1 : 2) || P->n_inner > INT_MAX)
    return false;
  const void *base[2] = {dm_data(x), y};
  bool vec = rows_vector(P, 2, base, dm_dtype_size(x->dtype), mode != ROW_LOGSUMEXP);
  const void *px = dm_data(x);
  rplan plan = *P;
  int64_t L = P->n_inner;
  dm_dispatch_float(x->dtype, "softmax", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    constexpr int V = 16 / sizeof(typename dt<DT>::S);
    int tpr = 32;
    const void *args[] = {&mode, &y, &px, &plan, &tpr};
    /* logsumexp keeps nothing for a second pass: rows as loaded, many at once. (For
    ** softmax, holding exp in floats measured faster than computing it twice.) */
    if (mode == ROW_LOGSUMEXP && vec && L <= 32 * V && P->nouter == 1) {
      constexpr int G = 8;                      /* lse_rows_short<DT, V, G, 4> covers 32 vectors */
      int64_t n = P->n_outer, xs = P->ostr[0][0], ys = P->ostr[1][0];
      int len = (int)L;
      const void *a[] = {&y, &px, &n, &len, &xs, &ys};
      DM_CU(cudaLaunchKernel((const void *)lse_rows_short<DT, V, G, 4>,
                             dim3((unsigned)((n * G + DM_THREADS - 1) / DM_THREADS)), dim3(DM_THREADS), (void **)a,
                             0, dm_cuda_stream()));
      DM_CU_LAUNCHED();
      return;
    }
    if (mode == ROW_LOGSUMEXP && vec && L <= 32 * V) {
      launch((const void *)softmax_warp_rows<DT, V, 1, 4>, DM_THREADS, (P->n_outer + 31) / 32, args);
      return;
    }
    if (mode == ROW_LOGSUMEXP && vec && L <= 64 * V) {
      launch((const void *)softmax_warp_rows<DT, V, 2, 2>, DM_THREADS, (P->n_outer + 15) / 16, args);
      return;
    }
    if (L <= 512) {                 /* a warp a row, several rows at once */
      const void *k;
      int rows_per_block = DM_THREADS / 32;
      if (L <= 256 && mode == ROW_LOGSUMEXP) {  /* (rows of odd lengths) */
        k = (const void *)softmax_rows<DT, 1, 8, 4>;
        rows_per_block *= 4;
      } else if (L <= 256 && vec) {           /* one row a warp: more warps in flight (83% of the
                                                ** copy for [32768, 256] bf16, against 76% for two) */
        k = (const void *)softmax_rows<DT, V, 8, 1>;
      } else if (L <= 256) {
        k = (const void *)softmax_rows<DT, 1, 8, 2>;
        rows_per_block *= 2;
      } else
        k = vec ? (const void *)softmax_rows<DT, V, 16, 1> : (const void *)softmax_rows<DT, 1, 16, 1>;
      launch(k, DM_THREADS, (P->n_outer + rows_per_block - 1) / rows_per_block, args);
      return;
    }
    /* a block a row, at least two steps of ROW_UNROLL vectors a thread */
    int64_t per = (vec ? V : 1) * ROW_UNROLL, threads = 32;
    while (threads < DM_THREADS && threads * per * 2 < L) threads *= 2;
    launch(vec ? (const void *)softmax_long<DT, V> : (const void *)softmax_long<DT, 1>, (int)threads, P->n_outer,
           args);
  });
  return true;
}

static bool row_lse(const rplan *P, const dm_tensor *x, dm_tensor *out) {
  return out && softmax_rows_launch(ROW_LOGSUMEXP, P, x, dm_data(out));
}

/* ---- softmax along any dim: one thread per row ------------------------------------------- */

template <int DT>
__global__ void softmax_any(int lg, typename dt<DT>::S *y, const typename dt<DT>::S *x, rplan P) {
  typedef typename dt<DT>::C T;
  const int64_t L = P.n_inner, sx = P.istr[0][0], sy = P.istr[1][0];
  DM_GRID_LOOP(row, P.n_outer) {
    int64_t off[2];
    outer_off<2>(P, row, off);
    const typename dt<DT>::S *xr = x + off[0];
    T m = -INFINITY;
    for (int64_t j = 0; j < L; j++) m = max_nan(m, dt<DT>::load(xr[j * sx]));
    double s = 0;
    for (int64_t j = 0; j < L; j++) s += exp(dt<DT>::load(xr[j * sx]) - m);
    T logs = (T)log(s), scale = (T)(1 / s);
    for (int64_t j = 0; j < L; j++) {
      T v = dt<DT>::load(xr[j * sx]);
      y[off[1] + j * sy] = dt<DT>::store(lg ? (v - m) - logs : exp(v - m) * scale);
    }
  }
}

template <int DT>
__global__ void softmax_bwd_any(int lg, typename dt<DT>::S *gx, const typename dt<DT>::S *g,
                                const typename dt<DT>::S *y, rplan P) {
  typedef typename dt<DT>::C T;
  const int64_t L = P.n_inner, s0 = P.istr[0][0], s1 = P.istr[1][0], s2 = P.istr[2][0];
  DM_GRID_LOOP(row, P.n_outer) {
    int64_t off[3];
    outer_off<3>(P, row, off);
    double dot = 0;
    for (int64_t j = 0; j < L; j++) {
      T gv = dt<DT>::load(g[off[1] + j * s1]);
      dot += lg ? gv : gv * dt<DT>::load(y[off[2] + j * s2]);
    }
    for (int64_t j = 0; j < L; j++) {
      T gv = dt<DT>::load(g[off[1] + j * s1]), yv = dt<DT>::load(y[off[2] + j * s2]);
      gx[off[0] + j * s0] = dt<DT>::store(lg ? gv - exp(yv) * (T)dot : yv * (gv - (T)dot));
    }
  }
}

static unsigned dim_mask(const dm_tensor *t, int dim) { return t->ndim ? 1u << dim : 0; }

static void cuda_softmax(dm_tensor *y, const dm_tensor *x, int dim, int lg) {
  rplan P;
  const dm_tensor *t[2] = {x, y};
  rplan_make(&P, x, dim_mask(x, dim), 2, t);
  if (P.n_outer == 0 || P.n_inner == 0) return;
  if (softmax_rows_launch(lg ? ROW_LOG_SOFTMAX : ROW_SOFTMAX, &P, x, dm_data(y))) return;
  dm_dispatch_float(x->dtype, "softmax", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    DM_LAUNCH(softmax_any<DT>, P.n_outer, lg, (S *)dm_data(y), (const S *)dm_data(x), P);
  });
}

static void cuda_softmax_bwd(dm_tensor *gx, const dm_tensor *g, const dm_tensor *y, int dim, int lg) {
  rplan P;
  const dm_tensor *t[3] = {gx, g, y};
  rplan_make(&P, gx, dim_mask(gx, dim), 3, t);
  if (P.n_outer == 0 || P.n_inner == 0) return;
  const void *base[3] = {dm_data(gx), dm_data(g), dm_data(y)};
  bool rows = rows_unit(&P, 3);
  bool vec = rows && rows_vector(&P, 3, base, dm_dtype_size(gx->dtype), true);
  int tpr = 0, e = 0;
  bool regs = rows && row_shape(P.n_inner, 8, &tpr, &e);
  dm_dispatch_float(gx->dtype, "softmax_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    constexpr int V = 16 / sizeof(S);
    S *pgx = (S *)dm_data(gx);
    const S *pg = (const S *)dm_data(g), *py = (const S *)dm_data(y);
    const void *args[] = {&lg, &pgx, &pg, &py, &P, &tpr};
    if (regs)
      launch_rows(vec ? (const void *)softmax_bwd_rows<DT, V, 8> : (const void *)softmax_bwd_rows<DT, 1, 8>,
                  tpr, P.n_outer, args);
    else if (rows)
      launch(vec ? (const void *)softmax_bwd_long<DT, V> : (const void *)softmax_bwd_long<DT, 1>,
             ROW_THREADS_MAX, P.n_outer, args);
    else DM_LAUNCH(softmax_bwd_any<DT>, P.n_outer, lg, pgx, pg, py, P);
  });
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(reduce, cuda_reduce),
  DM_KERNEL_ENTRY(reduce_bwd, cuda_reduce_bwd),
  DM_KERNEL_ENTRY(softmax, cuda_softmax),
  DM_KERNEL_ENTRY(softmax_bwd, cuda_softmax_bwd),
};
DM_CUDA_KERNELS(kernels)
