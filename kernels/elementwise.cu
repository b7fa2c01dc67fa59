/*
** elementwise.cu — unary, binary and where kernels and their backwards on
** CUDA, expanding the formula tables of vm/ops/elementwise.h as the CPU does.
**
** Forwards have two paths. When every operand is contiguous (or a broadcast
** scalar) and 16-byte aligned, a thread moves 16 bytes of each operand per
** step (8 bf16, 4 f32) and the switch over kinds sits outside the loop.
** Otherwise one generic kernel maps each output element to its operands'
** offsets (dm_offsets). Backwards take the generic path; it has no division
** left when the operands are contiguous.
**
** bf16 and f16 compute in float, integers (binary ops only) in double.
*/
#include "common.cuh"
extern "C" {
#include "ops/elementwise.h"
}

/* ---- one element: the formulas, switch inside ---------------------------------------------- */

#define UNARY_F_(ID, nm, f, df, saves, diff) case DM_UNARY_##ID: return (T)(f);
#define UNARY_DF_(ID, nm, f, df, saves, diff) case DM_UNARY_##ID: return (T)(df);
#define BINARY_F_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return (T)(f);
#define BINARY_DA_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return (T)(da);
#define BINARY_DB_(ID, nm, f, da, db, cmp) case DM_BINARY_##ID: return (T)(db);

template <typename T> __device__ __forceinline__ T unary_f(int kind, T x, T p, T q) {
  switch (kind) { DM_UNARY_OPS(UNARY_F_) }
  return 0;
}
template <typename T> __device__ __forceinline__ T unary_df(int kind, T x, T y, T p, T q) {
  switch (kind) { DM_UNARY_OPS(UNARY_DF_) }
  return 0;
}
template <typename T> __device__ __forceinline__ T binary_f(int kind, T a, T b, T p) {
  switch (kind) { DM_BINARY_OPS(BINARY_F_) }
  return 0;
}
template <typename T> __device__ __forceinline__ T binary_da(int kind, T g, T a, T b) {
  const T p = 1;
  switch (kind) { DM_BINARY_OPS(BINARY_DA_) }
  return 0;
}
template <typename T> __device__ __forceinline__ T binary_db(int kind, T g, T a, T b) {
  const T p = 1;
  switch (kind) { DM_BINARY_OPS(BINARY_DB_) }
  return 0;
}

#define IS_CMP_(ID, nm, f, da, db, cmp) cmp,
static const bool binary_is_cmp[DM_NBINARY] = { DM_BINARY_OPS(IS_CMP_) };

/* the output of a binary kind: the operands' type, or u8 for comparisons */
template <int DT, bool CMP> struct out_of {
  typedef typename dt<DT>::S O;
  template <typename X> static __device__ __forceinline__ O put(X v) {
    return dt<DT>::store((typename dt<DT>::C)v);
  }
};
template <int DT> struct out_of<DT, true> {
  typedef uint8_t O;
  template <typename X> static __device__ __forceinline__ O put(X v) { return (uint8_t)(v != 0); }
};

/* ---- unary ------------------------------------------------------------------------------- */

#define UNARY_FLAT_(ID, nm, f, df, saves, diff)                                              \
  case DM_UNARY_##ID:                                                                         \
    DM_GRID_LOOP(v, nv) {                                                                     \
      dm_vec<S, V> in = ((const dm_vec<S, V> *)px)[v], o;                                     \
      for (int j = 0; j < V; j++) {                                                           \
        T x = dt<DT>::load(in.v[j]);                                                          \
        o.v[j] = dt<DT>::store((T)(f));                                                       \
      }                                                                                       \
      ((dm_vec<S, V> *)po)[v] = o;                                                            \
    }                                                                                         \
    break;

template <int DT>
__global__ void unary_flat(int kind, typename dt<DT>::S *po, const typename dt<DT>::S *px, int64_t n,
                           double pp, double qq) {
  typedef typename dt<DT>::S S;
  typedef typename dt<DT>::C T;
  constexpr int V = 16 / sizeof(S);
  const T p = (T)pp, q = (T)qq;
  const int64_t nv = n / V;
  switch (kind) { DM_UNARY_OPS(UNARY_FLAT_) }
  DM_GRID_LOOP(i, n - nv * V) {
    int64_t e = nv * V + i;
    po[e] = dt<DT>::store(unary_f<T>(kind, dt<DT>::load(px[e]), p, q));
  }
}

template <int DT>
__global__ void unary_strided(int kind, typename dt<DT>::S *po, const typename dt<DT>::S *px, dm_layout L,
                              int64_t n, double pp, double qq) {
  typedef typename dt<DT>::C T;
  const T p = (T)pp, q = (T)qq;
  DM_GRID_LOOP(i, n) {
    int64_t off[2];
    dm_offsets<2>(L, i, off);
    po[off[0]] = dt<DT>::store(unary_f<T>(kind, dt<DT>::load(px[off[1]]), p, q));
  }
}

static void cuda_unary(int kind, dm_tensor *out, const dm_tensor *x, const dm_attrs *a) {
  int64_t n = dm_numel(out);
  if (n == 0) return;
  dm_layout L;
  const dm_tensor *ops[2] = {out, x};
  dm_layout_make(&L, out->ndim, out->shape, 2, ops);
  bool flat = dm_layout_flat(&L, 2) && L.st[0][0] == 1 && L.st[1][0] == 1 &&
              dm_aligned(dm_data(out), 16) && dm_aligned(dm_data(x), 16);
  dm_dispatch_float(x->dtype, "unary", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    S *po = (S *)dm_data(out);
    const S *px = (const S *)dm_data(x);
    if (flat) DM_LAUNCH(unary_flat<DT>, n / (16 / sizeof(S)) + 1, kind, po, px, n, a->v[0], a->v[1]);
    else DM_LAUNCH(unary_strided<DT>, n, kind, po, px, L, n, a->v[0], a->v[1]);
  });
}

/* gin = gout * f'(x, y) */
template <int DT>
__global__ void unary_bwd_k(int kind, typename dt<DT>::S *gi, const typename dt<DT>::S *go,
                            const typename dt<DT>::S *px, const typename dt<DT>::S *py, dm_layout L, int64_t n,
                            double pp, double qq) {
  typedef typename dt<DT>::C T;
  const T p = (T)pp, q = (T)qq;
  DM_GRID_LOOP(i, n) {
    int64_t off[4];
    dm_offsets<4>(L, i, off);
    T x = dt<DT>::load(px[off[2]]), y = dt<DT>::load(py[off[3]]);
    gi[off[0]] = dt<DT>::store(dt<DT>::load(go[off[1]]) * unary_df<T>(kind, x, y, p, q));
  }
}

static void cuda_unary_bwd(int kind, dm_tensor *gin, const dm_tensor *gout, const dm_tensor *x,
                           const dm_tensor *y, const dm_attrs *a) {
  int64_t n = dm_numel(gin);
  if (n == 0) return;
  /* a missing operand is walked as gout: its values are never used */
  const dm_tensor *ops[4] = {gin, gout, x ? x : gout, y ? y : gout};
  dm_layout L;
  dm_layout_make(&L, gin->ndim, gin->shape, 4, ops);
  dm_dispatch_float(gin->dtype, "unary_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    DM_LAUNCH(unary_bwd_k<DT>, n, kind, (S *)dm_data(gin), (const S *)dm_data(ops[1]),
              (const S *)dm_data(ops[2]), (const S *)dm_data(ops[3]), L, n, a->v[0], a->v[1]);
  });
}

/* ---- binary ------------------------------------------------------------------------------ */

#define BINARY_FLAT_(ID, nm, f, da, db, cmp)                                                  \
  case DM_BINARY_##ID:                                                                         \
    if ((cmp) == CMP) DM_GRID_LOOP(v, nv) {                                                    \
      dm_vec<S, V> va, vb;                                                                     \
      dm_vec<O, V> o;                                                                          \
      if (sa) for (int j = 0; j < V; j++) va.v[j] = pa[0];                                     \
      else va = ((const dm_vec<S, V> *)pa)[v];                                                 \
      if (sb) for (int j = 0; j < V; j++) vb.v[j] = pb[0];                                     \
      else vb = ((const dm_vec<S, V> *)pb)[v];                                                 \
      for (int j = 0; j < V; j++) {                                                            \
        T a = dt<DT>::load(va.v[j]), b = dt<DT>::load(vb.v[j]);                                \
        o.v[j] = OUT::put(f);                                                                  \
      }                                                                                        \
      ((dm_vec<O, V> *)po)[v] = o;                                                             \
    }                                                                                          \
    break;

/* sa, sb: that operand is one value broadcast over the output */
template <int DT, bool CMP>
__global__ void binary_flat(int kind, void *po_, const typename dt<DT>::S *pa, const typename dt<DT>::S *pb,
                            bool sa, bool sb, int64_t n, double pp) {
  typedef typename dt<DT>::S S;
  typedef typename dt<DT>::C T;
  typedef out_of<DT, CMP> OUT;
  typedef typename OUT::O O;
  constexpr int V = 16 / sizeof(S);
  O *po = (O *)po_;
  const T p = (T)pp;
  const int64_t nv = n / V;
  switch (kind) { DM_BINARY_OPS(BINARY_FLAT_) }
  DM_GRID_LOOP(i, n - nv * V) {
    int64_t e = nv * V + i;
    po[e] = OUT::put(binary_f<T>(kind, dt<DT>::load(pa[sa ? 0 : e]), dt<DT>::load(pb[sb ? 0 : e]), p));
  }
}

template <int DT, bool CMP>
__global__ void binary_strided(int kind, void *po_, const typename dt<DT>::S *pa, const typename dt<DT>::S *pb,
                               dm_layout L, int64_t n, double pp) {
  typedef typename dt<DT>::C T;
  typedef out_of<DT, CMP> OUT;
  typename OUT::O *po = (typename OUT::O *)po_;
  const T p = (T)pp;
  DM_GRID_LOOP(i, n) {
    int64_t off[3];
    dm_offsets<3>(L, i, off);
    po[off[0]] = OUT::put(binary_f<T>(kind, dt<DT>::load(pa[off[1]]), dt<DT>::load(pb[off[2]]), p));
  }
}

/* out may be a or b itself (the in-place helpers): each element is read before it is written */
static void cuda_binary(int kind, dm_tensor *out, const dm_tensor *a, const dm_tensor *b, double p) {
  int64_t n = dm_numel(out);
  if (n == 0) return;
  dm_layout L;
  const dm_tensor *ops[3] = {out, a, b};
  dm_layout_make(&L, out->ndim, out->shape, 3, ops);
  size_t es = dm_dtype_size(a->dtype), vbytes = 16 / es * dm_dtype_size(out->dtype);
  bool sa = L.st[1][0] == 0, sb = L.st[2][0] == 0;
  bool flat = dm_layout_flat(&L, 3) && L.st[0][0] == 1 && dm_aligned(dm_data(out), vbytes) &&
              (sa || dm_aligned(dm_data(a), 16)) && (sb || dm_aligned(dm_data(b), 16));
  bool cmp = binary_is_cmp[kind];
  dm_dispatch_all(a->dtype, "binary", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    const S *pa = (const S *)dm_data(a), *pb = (const S *)dm_data(b);
    void *po = dm_data(out);
    if (flat) {
      auto k = cmp ? binary_flat<DT, true> : binary_flat<DT, false>;
      DM_LAUNCH(k, n / (16 / sizeof(S)) + 1, kind, po, pa, pb, sa, sb, n, p);
    } else {
      auto k = cmp ? binary_strided<DT, true> : binary_strided<DT, false>;
      DM_LAUNCH(k, n, kind, po, pa, pb, L, n, p);
    }
  });
}

/* ga and gb (either may be NULL) share shape and strides: both sit at the lead's offsets */
template <int DT>
__global__ void binary_bwd_k(int kind, typename dt<DT>::S *ga, typename dt<DT>::S *gb, const typename dt<DT>::S *pg,
                             const typename dt<DT>::S *pa, const typename dt<DT>::S *pb, dm_layout L, int64_t n) {
  typedef typename dt<DT>::C T;
  DM_GRID_LOOP(i, n) {
    int64_t off[4];
    dm_offsets<4>(L, i, off);
    T g = dt<DT>::load(pg[off[1]]), a = dt<DT>::load(pa[off[2]]), b = dt<DT>::load(pb[off[3]]);
    if (ga) ga[off[0]] = dt<DT>::store(binary_da<T>(kind, g, a, b));
    if (gb) gb[off[0]] = dt<DT>::store(binary_db<T>(kind, g, a, b));
  }
}

static bool same_layout(const dm_tensor *x, const dm_tensor *y) {
  return dm_same_shape(x, y) && memcmp(x->strides, y->strides, sizeof(int64_t) * (size_t)x->ndim) == 0;
}

static void cuda_binary_bwd(int kind, dm_tensor *ga, dm_tensor *gb, const dm_tensor *g, const dm_tensor *a,
                            const dm_tensor *b) {
  dm_tensor *lead = ga ? ga : gb;
  if (ga && gb && !same_layout(ga, gb))
    dm_error("elementwise backward kernel: the two gradients must share shape and strides");
  int64_t n = dm_numel(lead);
  if (n == 0) return;
  const dm_tensor *ops[4] = {lead, g, a ? a : g, b ? b : g};
  dm_layout L;
  dm_layout_make(&L, lead->ndim, lead->shape, 4, ops);
  dm_dispatch_float(lead->dtype, "binary_bwd", [&](auto d) {
    constexpr int DT = decltype(d)::value;
    typedef typename dt<DT>::S S;
    DM_LAUNCH(binary_bwd_k<DT>, n, kind, ga ? (S *)dm_data(ga) : NULL, gb ? (S *)dm_data(gb) : NULL,
              (const S *)dm_data(g), (const S *)dm_data(ops[2]), (const S *)dm_data(ops[3]), L, n);
  });
}

/* ---- where: values move as bits, so only the element size matters -------------------------- */

__device__ __forceinline__ bool cond_at(int cdt, const char *pc, size_t ces, int64_t off) {
  const char *c = pc + off * (int64_t)ces;
  return cdt == DM_U8 ? *(const uint8_t *)c != 0 : dm_load_any(cdt, c) != 0;
}

/* a u8 condition and contiguous (or scalar: sc, sa, sb) operands */
template <int ES>
__global__ void where_flat(typename bits<ES>::T *po, const uint8_t *pc, const typename bits<ES>::T *pa,
                           const typename bits<ES>::T *pb, bool sc, bool sa, bool sb, int64_t n) {
  typedef typename bits<ES>::T E;
  constexpr int V = 16 / ES;
  const int64_t nv = n / V;
  DM_GRID_LOOP(v, nv) {
    dm_vec<uint8_t, V> c;
    dm_vec<E, V> a, b, o;
    if (sc) for (int j = 0; j < V; j++) c.v[j] = pc[0];
    else c = ((const dm_vec<uint8_t, V> *)pc)[v];
    if (sa) for (int j = 0; j < V; j++) a.v[j] = pa[0];
    else a = ((const dm_vec<E, V> *)pa)[v];
    if (sb) for (int j = 0; j < V; j++) b.v[j] = pb[0];
    else b = ((const dm_vec<E, V> *)pb)[v];
    for (int j = 0; j < V; j++) o.v[j] = c.v[j] ? a.v[j] : b.v[j];
    ((dm_vec<E, V> *)po)[v] = o;
  }
  DM_GRID_LOOP(i, n - nv * V) {
    int64_t e = nv * V + i;
    po[e] = pc[sc ? 0 : e] ? pa[sa ? 0 : e] : pb[sb ? 0 : e];
  }
}

template <int ES>
__global__ void where_strided(typename bits<ES>::T *po, const char *pc, int cdt, size_t ces,
                              const typename bits<ES>::T *pa, const typename bits<ES>::T *pb, dm_layout L, int64_t n) {
  DM_GRID_LOOP(i, n) {
    int64_t off[4];
    dm_offsets<4>(L, i, off);
    po[off[0]] = cond_at(cdt, pc, ces, off[1]) ? pa[off[2]] : pb[off[3]];
  }
}

static void cuda_where(dm_tensor *out, const dm_tensor *cond, const dm_tensor *a, const dm_tensor *b) {
  int64_t n = dm_numel(out);
  if (n == 0) return;
  dm_layout L;
  const dm_tensor *ops[4] = {out, cond, a, b};
  dm_layout_make(&L, out->ndim, out->shape, 4, ops);
  size_t es = dm_dtype_size(out->dtype);
  bool sc = L.st[1][0] == 0, sa = L.st[2][0] == 0, sb = L.st[3][0] == 0;
  bool flat = cond->dtype == DM_U8 && dm_layout_flat(&L, 4) && L.st[0][0] == 1 &&
              dm_aligned(dm_data(out), 16) && (sc || dm_aligned(dm_data(cond), 16 / es)) &&
              (sa || dm_aligned(dm_data(a), 16)) && (sb || dm_aligned(dm_data(b), 16));
  dm_dispatch_size(es, [&](auto size) {
    constexpr int ES = decltype(size)::value;
    typedef typename bits<ES>::T E;
    E *po = (E *)dm_data(out);
    const E *pa = (const E *)dm_data(a), *pb = (const E *)dm_data(b);
    if (flat)
      DM_LAUNCH(where_flat<ES>, n / (16 / ES) + 1, po, (const uint8_t *)dm_data(cond), pa, pb, sc, sa, sb, n);
    else
      DM_LAUNCH(where_strided<ES>, n, po, (const char *)dm_data(cond), (int)cond->dtype,
                dm_dtype_size(cond->dtype), pa, pb, L, n);
  });
}

/* ga = cond ? g : 0, gb = cond ? 0 : g (all-zero bits are 0 in every float type) */
template <int ES>
__global__ void where_bwd_k(typename bits<ES>::T *ga, typename bits<ES>::T *gb, const char *pc, int cdt,
                            size_t ces, const typename bits<ES>::T *pg, dm_layout L, int64_t n) {
  typedef typename bits<ES>::T E;
  DM_GRID_LOOP(i, n) {
    int64_t off[3];
    dm_offsets<3>(L, i, off);
    bool c = cond_at(cdt, pc, ces, off[1]);
    E g = pg[off[2]];
    if (ga) ga[off[0]] = c ? g : (E)0;
    if (gb) gb[off[0]] = c ? (E)0 : g;
  }
}

static void cuda_where_bwd(dm_tensor *ga, dm_tensor *gb, const dm_tensor *cond, const dm_tensor *g) {
  dm_tensor *lead = ga ? ga : gb;
  if (ga && gb && !same_layout(ga, gb))
    dm_error("elementwise backward kernel: the two gradients must share shape and strides");
  int64_t n = dm_numel(lead);
  if (n == 0) return;
  const dm_tensor *ops[3] = {lead, cond, g};
  dm_layout L;
  dm_layout_make(&L, lead->ndim, lead->shape, 3, ops);
  dm_dispatch_size(dm_dtype_size(g->dtype), [&](auto size) {
    constexpr int ES = decltype(size)::value;
    typedef typename bits<ES>::T E;
    DM_LAUNCH(where_bwd_k<ES>, n, ga ? (E *)dm_data(ga) : NULL, gb ? (E *)dm_data(gb) : NULL,
              (const char *)dm_data(cond), (int)cond->dtype, dm_dtype_size(cond->dtype), (const E *)dm_data(g), L, n);
  });
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(unary, cuda_unary),
  DM_KERNEL_ENTRY(unary_bwd, cuda_unary_bwd),
  DM_KERNEL_ENTRY(binary, cuda_binary),
  DM_KERNEL_ENTRY(binary_bwd, cuda_binary_bwd),
  DM_KERNEL_ENTRY(where, cuda_where),
  DM_KERNEL_ENTRY(where_bwd, cuda_where_bwd),
};
DM_CUDA_KERNELS(kernels)
