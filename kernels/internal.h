/*
** internal.h — what the files of kernels/ share: the stream, error checks,
** device facts and the record of errors found on the device. C, so that
** runtime.c, alloc.c and gemm.c (host code only) and the .cu files (inside
** extern "C") include the same declarations.
*/
#ifndef DM_KERNELS_INTERNAL_H
#define DM_KERNELS_INTERNAL_H

#include <cuda_runtime_api.h>
#include "core/cuda.h"

/* the one stream every launch, copy and product goes to (starts CUDA) */
cudaStream_t dm_cuda_stream(void);
int dm_cuda_sm_count(void);

/* a failed CUDA call: raises "cuda: CALL failed at FILE:LINE: <error string>" */
#if defined(__GNUC__)
__attribute__((noreturn))
#endif
void dm_cuda_fail(int err, const char *call, const char *file, int line);
#define DM_CU(call) do {                                                        \
    cudaError_t dm_cu_err_ = (call);                                            \
    if (dm_cu_err_ != cudaSuccess) dm_cuda_fail((int)dm_cu_err_, #call, __FILE__, __LINE__); \
  } while (0)

/* after a launch: checks cudaGetLastError in debug builds and with
** DM_DEBUG >= 2; DM_DEBUG >= 3 also waits for the kernel, so a fault is
** reported at the launch that caused it */
void dm_cuda_launched(const char *file, int line);
#define DM_CU_LAUNCHED() dm_cuda_launched(__FILE__, __LINE__)

/* Errors a kernel finds after its launch was queued (indices out of range).
** The first one is written to host memory the device can reach; the host
** reads it at the next synchronisation point and raises it there. */
typedef struct dm_device_error {
  int flag;                    /* 0: none; set by the first error */
  int what;                    /* dm_cuda_name_id() of the op */
  long long value, size, base;
} dm_device_error;
dm_device_error *dm_cuda_device_error(void);    /* the device's pointer to it */
int dm_cuda_name_id(const char *what);          /* a small id for an op name */
const char *dm_cuda_name_of(int id);
/* the recorded error, cleared; false when there is none (the stream must be synchronised) */
bool dm_cuda_take_device_error(dm_device_error *got);
/* wait for the stream and raise what the device recorded meanwhile */
void dm_cuda_sync_point(void);

/* x [.., m, k] @ w[n, k]^T for a few rows (kernels/rows_product.cu): true if it ran, false where it
** does not fit (then cuBLASLt takes the product) */
bool dm_cuda_rows_product(struct dm_tensor *out, const struct dm_tensor *a, const struct dm_tensor *b, bool ta,
                          bool tb);

#endif
