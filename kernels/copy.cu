/*
** copy.cu — fill, copy (any dtype pair, strided, broadcast), copy_cross
** (host <-> device), arange and the Philox draws, for CUDA tensors.
**
** A copy between tensors of one dtype moves bits: one cudaMemcpyAsync when
** both are contiguous, else a strided kernel by element size. A cast takes
** a vectorised kernel for contiguous float pairs and a generic strided one
** (load as double, store as dm_store does) for everything else.
**
** copy_cross moves contiguous bytes only: a strided or broadcast source is
** first made contiguous on its own side, a cast or a strided destination is
** done on the destination's side after the transfer. A copy to the host
** waits for the stream (it is a synchronisation point).
*/
#include "common.cuh"
extern "C" {
#include "core/philox.h"
#include "core/creation.h"
}


/* ---- fill ------------------------------------------------------------------------------ */

template <int ES>
__global__ void fill_flat(typename bits<ES>::T *p, typename bits<ES>::T v, int64_t n) {
  typedef typename bits<ES>::T E;
  constexpr int V = 16 / ES;
  int64_t nv = n / V;
  dm_vec<E, V> w;
#pragma unroll
  for (int j = 0; j < V; j++) w.v[j] = v;
  DM_GRID_LOOP(i, nv) ((dm_vec<E, V> *)p)[i] = w;
  DM_GRID_LOOP(i, n - nv * V) p[nv * V + i] = v;
}

template <int ES>
__global__ void fill_strided(typename bits<ES>::T *p, typename bits<ES>::T v, dm_layout L, int64_t n) {
  DM_GRID_LOOP(i, n) {
    int64_t off[1];
    dm_offsets<1>(L, i, off);
    p[off[0]] = v;
  }
}

static bool same_bytes(const unsigned char *b, size_t n) {
  for (size_t i = 1; i < n; i++) if (b[i] != b[0]) return false;
  return true;
}

static void cuda_fill(dm_tensor *t, double v) {
  int64_t n = dm_numel(t);
  if (n == 0) return;
  size_t es = dm_dtype_size(t->dtype);
  unsigned char one[8] = {0};
  dm_store(t->dtype, one, v);                    /* the element's bits, as the CPU rounds them */
  dm_layout L;
  const dm_tensor *ops[1] = {t};
  dm_layout_make(&L, t->ndim, t->shape, 1, ops);
  void *p = dm_data(t);
  if (dm_layout_flat(&L, 1) && L.st[0][0] == 1 && same_bytes(one, es)) {
    DM_CU(cudaMemsetAsync(p, one[0], (size_t)n * es, dm_cuda_stream()));
    return;
  }
  dm_dispatch_size(es, [&](auto size) {
    constexpr int ES = decltype(size)::value;
    typedef typename bits<ES>::T E;
    E bitsv;
    memcpy(&bitsv, one, ES);
    if (dm_layout_flat(&L, 1) && L.st[0][0] == 1 && dm_aligned(p, 16))
      DM_LAUNCH(fill_flat<ES>, n / (16 / ES) + 1, (E *)p, bitsv, n);
    else
      DM_LAUNCH(fill_strided<ES>, n, (E *)p, bitsv, L, n);
  });
}

/* ---- copy ------------------------------------------------------------------------------- */

template <int ES>
__global__ void copy_bits(typename bits<ES>::T *d, const typename bits<ES>::T *s, dm_layout L, int64_t n) {
  DM_GRID_LOOP(i, n) {
    int64_t off[2];
    dm_offsets<2>(L, i, off);
    d[off[0]] = s[off[1]];
  }
}

/* contiguous float pairs, V elements a step (V * the larger size = 16 bytes) */
template <int DO, int DI>
__global__ void cast_flat(typename dt<DO>::S *d, const typename dt<DI>::S *s, int64_t n) {
  typedef typename dt<DO>::S SO;
  typedef typename dt<DI>::S SI;
  constexpr int V = 16 / (sizeof(SO) > sizeof(SI) ? sizeof(SO) : sizeof(SI));
  int64_t nv = n / V;
  DM_GRID_LOOP(i, nv) {
    dm_vec<SI, V> a = ((const dm_vec<SI, V> *)s)[i];
    dm_vec<SO, V> b;
#pragma unroll
    for (int j = 0; j < V; j++) b.v[j] = dt<DO>::store(dt<DI>::load(a.v[j]));
    ((dm_vec<SO, V> *)d)[i] = b;
  }
  DM_GRID_LOOP(i, n - nv * V) d[nv * V + i] = dt<DO>::store(dt<DI>::load(s[nv * V + i]));
}

/* any pair, any strides: through double, as dm_load / dm_store */
__global__ void cast_any(int dto, char *d, size_t eso, int dti, const char *s, size_t esi, dm_layout L,
                         int64_t n) {
  DM_GRID_LOOP(i, n) {
    int64_t off[2];
    dm_offsets<2>(L, i, off);
    dm_store_any(dto, d + off[0] * (int64_t)eso, dm_load_any(dti, s + off[1] * (int64_t)esi));
  }
}

static bool launch_cast_flat(dm_dtype to, void *d, dm_dtype from, const void *s, int64_t n) {
  if (!dm_dtype_is_float(to) || !dm_dtype_is_float(from) || !dm_aligned(d, 16) || !dm_aligned(s, 16))
    return false;
  dm_dispatch_float(to, "copy", [&](auto o) {
    dm_dispatch_float(from, "copy", [&](auto i) {
      constexpr int DO = decltype(o)::value, DI = decltype(i)::value;
      auto kernel = cast_flat<DO, DI>;
      DM_LAUNCH(kernel, n / 2 + 1, (typename dt<DO>::S *)d, (const typename dt<DI>::S *)s, n);
    });
  });
  return true;
}

static void copy_direct(dm_tensor *dst, const dm_tensor *src) {
  int64_t n = dm_numel(dst);
  if (n == 0) return;
  dm_layout L;
  const dm_tensor *ops[2] = {dst, src};
  dm_layout_make(&L, dst->ndim, dst->shape, 2, ops);
  void *d = dm_data(dst);
  const void *s = dm_data(src);
  bool flat = dm_layout_flat(&L, 2) && L.st[0][0] == 1 && L.st[1][0] == 1;
  if (dst->dtype == src->dtype) {
    size_t es = dm_dtype_size(dst->dtype);
    if (flat) {
      DM_CU(cudaMemcpyAsync(d, s, (size_t)n * es, cudaMemcpyDeviceToDevice, dm_cuda_stream()));
      return;
    }
    dm_dispatch_size(es, [&](auto size) {
      constexpr int ES = decltype(size)::value;
      typedef typename bits<ES>::T E;
      DM_LAUNCH(copy_bits<ES>, n, (E *)d, (const E *)s, L, n);
    });
    return;
  }
  if (flat && launch_cast_flat(dst->dtype, d, src->dtype, s, n)) return;
  DM_LAUNCH(cast_any, n, (int)dst->dtype, (char *)d, dm_dtype_size(dst->dtype), (int)src->dtype,
            (const char *)s, dm_dtype_size(src->dtype), L, n);
}

/* dst may overlap src (a view of the same storage): then through a temporary, as on the CPU */
static void cuda_copy(dm_tensor *dst, const dm_tensor *src) {
  if (dst->storage == src->storage && dst != src) {
    dm_tensor *tmp = dm_tensor_like(src);
    copy_direct(tmp, src);
    copy_direct(dst, tmp);
    dm_release(tmp);
    return;
  }
  copy_direct(dst, src);
}

/* ---- copy_cross ------------------------------------------------------------------------------ */

static size_t nbytes_of(const dm_tensor *t) { return (size_t)dm_numel(t) * dm_dtype_size(t->dtype); }

/* dst takes src's bytes as they are */
static bool plain_transfer(const dm_tensor *dst, const dm_tensor *src) {
  return dst->dtype == src->dtype && dm_same_shape(dst, src) && dm_is_contiguous(dst) && dm_is_contiguous(src);
}

static dm_tensor *contiguous_on_own_side(const dm_tensor *t) {
  if (dm_is_contiguous(t)) { dm_retain((dm_tensor *)t); return (dm_tensor *)t; }
  return dm_clone(t);
}

static void cuda_copy_cross(dm_tensor *dst, const dm_tensor *src) {
  cudaStream_t stream = dm_cuda_stream();
  if (src->device == DM_CPU) {                                   /* host to device */
    dm_tensor *hs = contiguous_on_own_side(src);
    if (plain_transfer(dst, hs)) {
      if (nbytes_of(hs))
        DM_CU(cudaMemcpyAsync(dm_data(dst), dm_data(hs), nbytes_of(hs), cudaMemcpyHostToDevice, stream));
    } else {
      dm_tensor *ds = dm_tensor_new(DM_CUDA, hs->dtype, hs->ndim, hs->shape);
      if (nbytes_of(hs))
        DM_CU(cudaMemcpyAsync(dm_data(ds), dm_data(hs), nbytes_of(hs), cudaMemcpyHostToDevice, stream));
      cuda_copy(dst, ds);
      dm_release(ds);
    }
    /* a pageable source is staged before cudaMemcpyAsync returns: hs may go now */
    dm_release(hs);
    return;
  }
  dm_tensor *ds = contiguous_on_own_side(src);                   /* device to host */
  if (plain_transfer(dst, ds)) {
    if (nbytes_of(ds))
      DM_CU(cudaMemcpyAsync(dm_data(dst), dm_data(ds), nbytes_of(ds), cudaMemcpyDeviceToHost, stream));
    DM_CU(cudaStreamSynchronize(stream));
  } else {
    dm_tensor *hs = dm_tensor_new(DM_CPU, ds->dtype, ds->ndim, ds->shape);
    if (nbytes_of(ds))
      DM_CU(cudaMemcpyAsync(dm_data(hs), dm_data(ds), nbytes_of(ds), cudaMemcpyDeviceToHost, stream));
    DM_CU(cudaStreamSynchronize(stream));
    DM_RUN(copy, DM_CPU, dst, hs);
    dm_release(hs);
  }
  dm_release(ds);
  dm_cuda_sync_point();             /* raises what the device found meanwhile */
}

/* ---- arange and random draws -------------------------------------------------------------- */

__global__ void arange_k(int t, char *p, size_t es, double start, double step, int64_t n) {
  DM_GRID_LOOP(i, n) dm_store_any(t, p + i * (int64_t)es, start + (double)i * step);
}

static void cuda_arange(dm_tensor *t, double start, double step) {
  int64_t n = dm_numel(t);
  if (n) DM_LAUNCH(arange_k, n, (int)t->dtype, (char *)dm_data(t), dm_dtype_size(t->dtype), start, step, n);
}

/* element i as on the CPU: vm/core/philox.h is the same code on both sides */
__global__ void philox_k(int t, char *p, size_t es, uint64_t seed, uint64_t offset, bool normal, int64_t n) {
  DM_GRID_LOOP(i, n) {
    float v = normal ? dm_philox_normal_at(seed, offset, (uint64_t)i) : dm_philox_uniform_at(seed, offset, (uint64_t)i);
    dm_store_any(t, p + i * (int64_t)es, v);
  }
}

static void cuda_philox(dm_tensor *t, uint64_t seed, uint64_t offset, bool normal) {
  int64_t n = dm_numel(t);
  if (n) DM_LAUNCH(philox_k, n, (int)t->dtype, (char *)dm_data(t), dm_dtype_size(t->dtype), seed, offset, normal, n);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(fill, cuda_fill),
  DM_KERNEL_ENTRY(copy, cuda_copy),
  DM_KERNEL_ENTRY(copy_cross, cuda_copy_cross),
  DM_KERNEL_ENTRY(arange, cuda_arange),
  DM_KERNEL_ENTRY(philox, cuda_philox),
};
DM_CUDA_KERNELS(kernels)
