/*
** runtime.c — the CUDA device, its stream, error checks and timing.
**
** Started lazily by the first call that needs the device. Device 0 is used
** (choose another with CUDA_VISIBLE_DEVICES); a rank of an mpirun job takes
** the device of its number on its host (OMPI_COMM_WORLD_LOCAL_RANK), modulo
** the devices it sees. Everything goes to one
** non-blocking stream created here, so launches run in the order they were
** made and memory freed by the host is reusable by the next launch (the
** allocator relies on that).
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "internal.h"

static int state;                 /* 0: not tried, 1: ready, -1: unavailable */
static char reason[256];
static cudaStream_t stream;
static dm_cuda_info info;
static dm_device_error *err_host, *err_dev;
static cudaEvent_t timer_ev[2];
static bool tf32;

/* the path from kernels/ on, so messages name files as the repository does */
static const char *short_path(const char *file) {
  const char *k = strstr(file, "kernels/");
  return k ? k : file;
}

static bool start(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n == 0) e = cudaErrorNoDevice;
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");       /* a job's ranks on one host: one device each */
  int device = e == cudaSuccess && local && atoi(local) > 0 ? atoi(local) % n : 0;
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  struct cudaDeviceProp p;
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&p, device);
  if (e == cudaSuccess) e = cudaHostAlloc((void **)&err_host, sizeof *err_host, cudaHostAllocMapped);
  if (e == cudaSuccess) e = cudaHostGetDevicePointer((void **)&err_dev, err_host, 0);
  if (e == cudaSuccess) e = cudaEventCreate(&timer_ev[0]);
  if (e == cudaSuccess) e = cudaEventCreate(&timer_ev[1]);
  if (e != cudaSuccess) {
    snprintf(reason, sizeof reason, "%s", cudaGetErrorString(e));
    cudaGetLastError();
    return false;
  }
  memset(err_host, 0, sizeof *err_host);
  snprintf(info.name, sizeof info.name, "%s", p.name);
  info.major = p.major;
  info.minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.total_memory = (int64_t)p.totalGlobalMem;
  cudaRuntimeGetVersion(&info.runtime_version);
  cudaDriverGetVersion(&info.driver_version);
  return true;
}

bool dm_cuda_available(void) {
  if (state == 0) state = start() ? 1 : -1;
  return state > 0;
}

const char *dm_cuda_unavailable_reason(void) {
  return dm_cuda_available() ? "" : reason;
}

void dm_cuda_init(void) {
  if (!dm_cuda_available()) dm_error("cuda: no CUDA device is available (%s)", reason);
}

cudaStream_t dm_cuda_stream(void) {
  if (state <= 0) dm_cuda_init();
  return stream;
}

int dm_cuda_sm_count(void) {
  dm_cuda_init();
  return info.sm_count;
}

dm_cuda_info dm_cuda_device_info(void) {
  dm_cuda_init();
  return info;
}

void dm_cuda_fail(int err, const char *call, const char *file, int line) {
  cudaGetLastError();             /* clear it, when it is not sticky */
  dm_error("cuda: %s failed at %s:%d: %s", call, short_path(file), line,
           cudaGetErrorString((cudaError_t)err));
}

void dm_cuda_launched(const char *file, int line) {
  static int level = -1;
  if (level < 0) {
#ifdef DM_CUDA_DEBUG
    level = dm_debug_level() > 2 ? dm_debug_level() : 2;
#else
    level = dm_debug_level();
#endif
  }
  if (level < 2) return;
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && level >= 3) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) dm_cuda_fail((int)e, "a kernel launch", file, line);
}

/* ---- errors found on the device ------------------------------------------------ */

#define MAX_NAMES 64
static const char *names[MAX_NAMES];
static int n_names;

int dm_cuda_name_id(const char *what) {
  for (int i = 0; i < n_names; i++) if (names[i] == what || strcmp(names[i], what) == 0) return i;
  if (n_names == MAX_NAMES) return MAX_NAMES - 1;
  names[n_names] = what;
  return n_names++;
}

dm_device_error *dm_cuda_device_error(void) {
  dm_cuda_init();
  return err_dev;
}

const char *dm_cuda_name_of(int id) { return id >= 0 && id < n_names ? names[id] : "index"; }

bool dm_cuda_take_device_error(dm_device_error *got) {
  volatile dm_device_error *r = err_host;
  if (!r || !r->flag) return false;
  got->flag = r->flag;
  got->what = r->what;
  got->value = r->value;
  got->size = r->size;
  got->base = r->base;
  r->flag = 0;
  return true;
}

void dm_cuda_sync_point(void) {
  DM_CU(cudaStreamSynchronize(dm_cuda_stream()));
  /* a launch that failed to start leaves its error here until someone asks */
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) dm_cuda_fail((int)e, "an earlier kernel launch", __FILE__, __LINE__);
  dm_device_error got;
  if (!dm_cuda_take_device_error(&got)) return;
  dm_error("%s: index %lld is out of range for a dim of size %lld (indices count from %lld); found on "
           "the GPU after the op was queued, so its output is not valid (DM_DEBUG=1 checks at the op)",
           dm_cuda_name_of(got.what), got.value, got.size, got.base);
}

void dm_cuda_synchronize(void) {
  dm_cuda_init();
  dm_cuda_sync_point();
}

/* ---- settings and timing ----------------------------------------------------------- */

void dm_cuda_set_tf32(bool on) { tf32 = on; }
bool dm_cuda_tf32(void) { return tf32; }

void dm_cuda_timer_start(void) {
  DM_CU(cudaEventRecord(timer_ev[0], dm_cuda_stream()));
}

double dm_cuda_timer_stop(void) {
  float ms = 0;
  DM_CU(cudaEventRecord(timer_ev[1], dm_cuda_stream()));
  DM_CU(cudaEventSynchronize(timer_ev[1]));
  DM_CU(cudaEventElapsedTime(&ms, timer_ev[0], timer_ev[1]));
  dm_cuda_sync_point();
  return ms;
}

/* the profiler's events: created as needed, reused after a clear */
static cudaEvent_t *marks;
static int nmarks, made_marks, cap_marks;

int dm_cuda_mark(void) {
  if (nmarks == made_marks) {
    if (made_marks == cap_marks) {
      int cap = cap_marks ? 2 * cap_marks : 4096;
      cudaEvent_t *m = realloc(marks, sizeof(cudaEvent_t) * (size_t)cap);
      if (!m) dm_error("cuda: out of host memory for %d profiler events", cap);
      marks = m;
      cap_marks = cap;
    }
    DM_CU(cudaEventCreate(&marks[made_marks]));
    made_marks++;
  }
  DM_CU(cudaEventRecord(marks[nmarks], dm_cuda_stream()));
  return nmarks++;
}

double dm_cuda_mark_elapsed(int start, int stop) {
  float ms = 0;
  DM_CU(cudaEventElapsedTime(&ms, marks[start], marks[stop]));
  return ms;
}

void dm_cuda_marks_clear(void) { nmarks = 0; }
