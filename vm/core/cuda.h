/*
** cuda.h — what the core and the bindings may ask of the CUDA backend
** (kernels/). Plain C: no CUDA header is needed to include it.
**
** CUDA starts lazily, at the first CUDA tensor or the first call here that
** needs the device. Without a usable device the backend says why through
** dm_cuda_unavailable_reason(), and anything that needs the device raises
** "cuda: no CUDA device is available (<the CUDA error string>)".
**
** Every launch goes to one stream, in order; ops never wait for the device.
** The host waits only where it must read device memory (a copy to the CPU,
** .item(), printing) or when asked to (dm_cuda_synchronize). An error found
** on the device after its launch was queued (an index out of range, see
** kernels/index.cu) is raised at the next of those points.
**
** A build without CUDA (-DDM_CUDA=OFF, or no nvcc) gets the inline stubs at
** the end of this file: nothing is available and everything says why.
*/
#ifndef DM_CUDA_H
#define DM_CUDA_H

#include <stdio.h>
#include "core/dm.h"

struct dm_tensor;

typedef struct dm_cuda_info {
  char name[256];
  int major, minor;          /* compute capability */
  int sm_count;
  int64_t total_memory;      /* bytes */
  int runtime_version, driver_version;
} dm_cuda_info;

#ifdef DM_HAVE_CUDA

bool dm_cuda_available(void);                /* starts CUDA on first call; never raises */
const char *dm_cuda_unavailable_reason(void);  /* why not, or "" */
void dm_cuda_init(void);                     /* raises when no device is available */
dm_cuda_info dm_cuda_device_info(void);      /* raises when no device is available */
/* wait for every queued launch; raises an error the device found meanwhile */
void dm_cuda_synchronize(void);

/* matrix products of f32 tensors through TF32 tensor cores (off by default) */
void dm_cuda_set_tf32(bool on);
bool dm_cuda_tf32(void);

/* timing with CUDA events on the stream: ms between start and stop */
void dm_cuda_timer_start(void);
double dm_cuda_timer_stop(void);
/* numbered events for the op profiler (vm/core/profile.c): dm_cuda_mark records
** one on the stream and returns its number; dm_cuda_mark_elapsed reads the
** ms between two once the device has passed them; clearing recycles them */
int dm_cuda_mark(void);
double dm_cuda_mark_elapsed(int start, int stop);
void dm_cuda_marks_clear(void);

/* benchmark baselines, in ms of device time per run: the median of `reps`
** samples, each timing 5 runs queued back to back behind an untimed one
** (so the GPU never waits for the host): a device-to-device cudaMemcpyAsync
** of nbytes, and a row-major [m, k] x [k, n] product of random data called
** through cuBLASLt directly (the algorithm chosen as dm.matmul chooses it),
** or, with classic, through cublasGemmEx with cuBLAS's default choice */
double dm_cuda_bench_copy(size_t nbytes, int reps);
double dm_cuda_bench_gemm(dm_dtype dt, int64_t m, int64_t n, int64_t k, int reps, bool classic);

/* matrix products on the device since the start, by path: a few rows against a weight
** (kernels/rows_product.cu) and cuBLASLt's (kernels/gemm.c) */
void dm_cuda_product_counts(int64_t *rows, int64_t *lt);

/* NCCL, loaded at run time (kernels/nccl.c): the collectives of a data-parallel job's device
** tensors, on the stream. dm_cuda_nccl_load finds the library (false, and why, when it cannot);
** rank 0 makes the unique id (dm_cuda_nccl_id), the caller hands it to every rank, and each
** makes the communicator with it (dm_cuda_nccl_init). dm_cuda_nccl_reduce sums (or, with mean,
** averages) each of n contiguous cuda tensors over the ranks in place, as one group. */
#define DM_NCCL_ID_BYTES 128
bool dm_cuda_nccl_load(char *why, size_t n);
int dm_cuda_nccl_version(void);                  /* 21903 for 2.19.3; 0 before the load */
void dm_cuda_nccl_id(unsigned char id[DM_NCCL_ID_BYTES]);
void dm_cuda_nccl_init(int rank, int size, const unsigned char id[DM_NCCL_ID_BYTES]);
bool dm_cuda_nccl_ready(void);
void dm_cuda_nccl_reduce(struct dm_tensor **ts, int n, bool mean);
void dm_cuda_nccl_finalize(void);

#else

static inline bool dm_cuda_available(void) { return false; }
static inline const char *dm_cuda_unavailable_reason(void) {
  return "this build has no CUDA backend: configured without nvcc or with DM_CUDA=OFF, as make test's "
         "(TEST_CUDA=AUTO builds the kernels) and the sanitizers' builds are; make builds them where nvcc is";
}
static inline void dm_cuda_init(void) { dm_error("cuda: %s", dm_cuda_unavailable_reason()); }
static inline dm_cuda_info dm_cuda_device_info(void) {
  dm_cuda_init();
  dm_cuda_info i = {{0}, 0, 0, 0, 0, 0, 0};
  return i;
}
static inline void dm_cuda_synchronize(void) { dm_cuda_init(); }
/* the setting is kept (and means nothing) so that scripts run unchanged */
static inline bool *dm_cuda_tf32_flag_(void) { static bool on; return &on; }
static inline void dm_cuda_set_tf32(bool on) { *dm_cuda_tf32_flag_() = on; }
static inline bool dm_cuda_tf32(void) { return *dm_cuda_tf32_flag_(); }
static inline void dm_cuda_timer_start(void) { dm_cuda_init(); }
static inline double dm_cuda_timer_stop(void) { dm_cuda_init(); return 0; }
static inline int dm_cuda_mark(void) { dm_cuda_init(); return 0; }
static inline double dm_cuda_mark_elapsed(int start, int stop) { (void)start; (void)stop; return 0; }
static inline void dm_cuda_marks_clear(void) {}
static inline double dm_cuda_bench_copy(size_t nbytes, int reps) {
  (void)nbytes; (void)reps; dm_cuda_init(); return 0;
}
static inline double dm_cuda_bench_gemm(dm_dtype dt, int64_t m, int64_t n, int64_t k, int reps, bool classic) {
  (void)dt; (void)m; (void)n; (void)k; (void)reps; (void)classic; dm_cuda_init(); return 0;
}
static inline void dm_cuda_product_counts(int64_t *rows, int64_t *lt) { *rows = 0; *lt = 0; }
#define DM_NCCL_ID_BYTES 128
static inline bool dm_cuda_nccl_load(char *why, size_t n) {
  snprintf(why, n, "NCCL carries cuda tensors: %s", dm_cuda_unavailable_reason());
  return false;
}
static inline int dm_cuda_nccl_version(void) { return 0; }
static inline void dm_cuda_nccl_id(unsigned char id[DM_NCCL_ID_BYTES]) { (void)id; dm_cuda_init(); }
static inline void dm_cuda_nccl_init(int rank, int size, const unsigned char id[DM_NCCL_ID_BYTES]) {
  (void)rank; (void)size; (void)id; dm_cuda_init();
}
static inline bool dm_cuda_nccl_ready(void) { return false; }
static inline void dm_cuda_nccl_reduce(struct dm_tensor **ts, int n, bool mean) {
  (void)ts; (void)n; (void)mean; dm_cuda_init();
}
static inline void dm_cuda_nccl_finalize(void) {}

#endif
#endif
