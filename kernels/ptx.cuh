/*
** ptx.cuh — the tensor-core kernels' primitives, in one place: asynchronous
** copies to shared memory (cp.async), ldmatrix, and the mma.sync shapes the
** kernels use (m16n8k16 in bf16 or f16, m16n8k8 in tf32), all with f32
** accumulators, and the multistage pipeline the expert kernels load by.
** sm_80 and later; the kernels that include it are built for sm_90a.
*/
#ifndef DM_PTX_CUH
#define DM_PTX_CUH

#include <stdint.h>

__device__ __forceinline__ uint32_t dm_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes to shared memory, asynchronously, of which `bytes` from src (the rest zeros) */
__device__ __forceinline__ void dm_cp_async16(void *dst, const void *src, int bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dm_smem_addr(dst)), "l"(src), "r"(bytes));
}
/* 4 bytes likewise (through L1: cp.async.cg takes 16 only), of which `bytes` (0 or 4) from src */
__device__ __forceinline__ void dm_cp_async4(void *dst, const void *src, int bytes = 4) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dm_smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void dm_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* wait until at most N committed groups are in flight */
template <int N> __device__ __forceinline__ void dm_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void dm_cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* The multistage cp.async pipeline over n items, STAGES deep: load(i) issues item i's copies
** (STAGES - 1 items ahead), body(i) runs once every thread's copies of item i have landed (after
** a barrier, so that body may read what other threads copied). Each step commits a group,
** empty when nothing is left to load, so the wait's count stays exact. The caller waits for the
** last groups if it reuses the stages' memory (dm_cp_wait<0>). A body returns to go on. */
template <int STAGES, typename Load, typename Body>
__device__ __forceinline__ void dm_cp_pipeline(int n, Load &&load, Body &&body) {
  static_assert(STAGES >= 2, "a pipeline of at least two stages");
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < n) load(s);
    dm_cp_commit();
  }
  for (int i = 0; i < n; i++) {
    dm_cp_wait<STAGES - 2>();
    __syncthreads();
    if (i + STAGES - 1 < n) load(i + STAGES - 1);
    dm_cp_commit();
    body(i);
  }
}

/* four 8 x 8 b16 matrices from shared memory (each lane gives one row's address), and transposed */
__device__ __forceinline__ void dm_ldsm(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(dm_smem_addr(p)));
}
__device__ __forceinline__ void dm_ldsm_t(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(dm_smem_addr(p)));
}

/* c += a b: a 16 x 16, b 16 x 8 (b0, b1), c 16 x 8 in f32; BF16 true: bf16 operands, else f16 */
template <bool BF16>
__device__ __forceinline__ void dm_mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x rounded to tf32 (to nearest, ties away), as the bits of a float with the low 13 bits zero */
__device__ __forceinline__ uint32_t dm_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

/* c += a b: a 16 x 8, b 8 x 8, c 16 x 8, tf32 operands (the bits of floats, the low 13 zero) */
__device__ __forceinline__ void dm_mma1688_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif
