/*
** hostcopy.c — what the Engram host tables (vm/data/hostable.c) ask of the CUDA
** backend: pinned staging memory, so that their copies to and from the
** device are DMA transfers that cudaMemcpyAsync queues without waiting,
** and fences (events on the stream) that tell when the device has read a
** staging buffer, before the host writes it again. Kernel-table entries
** for DM_CUDA; the types are in hostable.h.
*/
#include "internal.h"
#include "data/hostable.h"
#include "core/ops.h"

static void *pinned_alloc(size_t nbytes) {
  void *p = NULL;
  if (cudaHostAlloc(&p, nbytes, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();               /* not sticky: the caller reports "out of host memory" */
    return NULL;
  }
  return p;
}

static void pinned_free(void *p, size_t nbytes) {
  (void)nbytes;
  cudaFreeHost(p);
}

static void hostable_buffers(dm_host_buffers *hb) {
  dm_cuda_init();                     /* raises here, in the caller, when there is no device */
  hb->alloc = pinned_alloc;
  hb->free = pinned_free;
}

static void hostable_fence(void **fence) {
  if (!*fence) DM_CU(cudaEventCreateWithFlags((cudaEvent_t *)fence, cudaEventDisableTiming));
  DM_CU(cudaEventRecord((cudaEvent_t)*fence, dm_cuda_stream()));
}

static void hostable_fence_wait(void *fence) {
  if (fence) DM_CU(cudaEventSynchronize((cudaEvent_t)fence));
}

static void hostable_fence_free(void *fence) {
  if (fence) cudaEventDestroy((cudaEvent_t)fence);
}

static const dm_kernel_entry kernels[] = {
  DM_KERNEL_ENTRY(hostable_buffers, hostable_buffers),
  DM_KERNEL_ENTRY(hostable_fence, hostable_fence),
  DM_KERNEL_ENTRY(hostable_fence_wait, hostable_fence_wait),
  DM_KERNEL_ENTRY(hostable_fence_free, hostable_fence_free),
};
DM_REGISTER_KERNELS(DM_CUDA, kernels)
