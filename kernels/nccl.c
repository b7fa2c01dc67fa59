/*
** nccl.c — NCCL, loaded at run time: the collectives of a data-parallel
** job's device tensors, queued on the one stream, so that they run in order
** with the kernels and a captured step (a CUDA graph) holds them.
**
** The library is found by dlopen: libnccl.so.2 on the loader's path, or the
** file DORMOUSE_NCCL_LIB names. Its handles are opaque and its enums are
** numbers fixed by its ABI, so no NCCL header is needed to build. The
** ranks agree on a communicator from one unique id that rank 0 makes and
** the caller hands to every rank (over MPI: vm/lua/dist.c).
*/
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "core/core.h"

typedef struct { char internal[DM_NCCL_ID_BYTES]; } nccl_id;   /* ncclUniqueId, passed by value */
typedef void *nccl_comm;

enum { NCCL_INT32 = 2, NCCL_INT64 = 4, NCCL_F16 = 6, NCCL_F32 = 7, NCCL_F64 = 8, NCCL_BF16 = 9 };   /* ncclDataType_t */
enum { NCCL_SUM = 0, NCCL_AVG = 4 };                                                              /* ncclRedOp_t */

static struct {
  int (*get_version)(int *);
  int (*get_unique_id)(nccl_id *);
  int (*comm_init_rank)(nccl_comm *, int, nccl_id, int);
  int (*comm_destroy)(nccl_comm);
  int (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm, cudaStream_t);
  int (*group_start)(void);
  int (*group_end)(void);
  const char *(*error_string)(int);
} nccl;

static void *lib;
static nccl_comm comm;

static void check(int rc, const char *what) {
  if (rc != 0) dm_error("nccl: %s failed: %s (NCCL error %d)", what, nccl.error_string(rc), rc);
}

static bool need(void **slot, const char *name, char *why, size_t n) {
  *slot = dlsym(lib, name);
  if (!*slot) snprintf(why, n, "NCCL's library has no %s (NCCL 2.10 or later is needed)", name);
  return *slot != NULL;
}

bool dm_cuda_nccl_load(char *why, size_t n) {
  if (lib) return true;
  if (!dm_cuda_available()) {
    snprintf(why, n, "NCCL carries cuda tensors: no CUDA device is available (%s)", dm_cuda_unavailable_reason());
    return false;
  }
  const char *on_host = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");   /* ranks on this host: a device each */
  int devices = 0;
  if (on_host && atoi(on_host) > 1 && cudaGetDeviceCount(&devices) == cudaSuccess && atoi(on_host) > devices) {
    snprintf(why, n, "NCCL takes a device a rank, and this host runs %d ranks on %d devices", atoi(on_host),
             devices);
    return false;
  }
  const char *path = getenv("DORMOUSE_NCCL_LIB");
  void *h = dlopen(path && *path ? path : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    snprintf(why, n, "NCCL's library (%s) cannot be loaded: %s; put libnccl.so.2 on LD_LIBRARY_PATH or name it "
             "in DORMOUSE_NCCL_LIB", path && *path ? path : "libnccl.so.2", dlerror());
    return false;
  }
  lib = h;
  bool ok = need((void **)&nccl.get_version, "ncclGetVersion", why, n) &&
            need((void **)&nccl.get_unique_id, "ncclGetUniqueId", why, n) &&
            need((void **)&nccl.comm_init_rank, "ncclCommInitRank", why, n) &&
            need((void **)&nccl.comm_destroy, "ncclCommDestroy", why, n) &&
            need((void **)&nccl.all_reduce, "ncclAllReduce", why, n) &&
            need((void **)&nccl.group_start, "ncclGroupStart", why, n) &&
            need((void **)&nccl.group_end, "ncclGroupEnd", why, n) &&
            need((void **)&nccl.error_string, "ncclGetErrorString", why, n);
  int version = 0;
  if (ok && (nccl.get_version(&version) != 0 || version < 21000)) {   /* 2.9 and before: 1000 a major */
    bool old = version < 10000;
    snprintf(why, n, "NCCL %d.%d is too old (2.10 or later: the mean over the ranks)",
             old ? version / 1000 : version / 10000, old ? version / 100 % 10 : version / 100 % 100);
    ok = false;
  }
  if (!ok) { dlclose(h); lib = NULL; }
  return ok;
}

int dm_cuda_nccl_version(void) {
  int v = 0;
  if (lib) nccl.get_version(&v);
  return v;
}

void dm_cuda_nccl_id(unsigned char id[DM_NCCL_ID_BYTES]) {
  if (!lib) dm_error("nccl: the library is not loaded");
  nccl_id u;
  check(nccl.get_unique_id(&u), "ncclGetUniqueId");
  memcpy(id, u.internal, DM_NCCL_ID_BYTES);
}

void dm_cuda_nccl_init(int rank, int size, const unsigned char id[DM_NCCL_ID_BYTES]) {
  if (!lib) dm_error("nccl: the library is not loaded");
  if (comm) dm_error("nccl: the communicator is already made");
  if (size < 1 || rank < 0 || rank >= size) dm_error("nccl: rank %d of %d", rank, size);
  dm_cuda_init();                                    /* on this rank's device (runtime.c) */
  nccl_id u;
  memcpy(u.internal, id, DM_NCCL_ID_BYTES);
  check(nccl.comm_init_rank(&comm, size, u, rank), "ncclCommInitRank");
}

bool dm_cuda_nccl_ready(void) { return comm != NULL; }

static int type_of(dm_dtype dt) {
  switch (dt) {
    case DM_F32: return NCCL_F32;
    case DM_F64: return NCCL_F64;
    case DM_BF16: return NCCL_BF16;
    case DM_F16: return NCCL_F16;
    case DM_I64: return NCCL_INT64;
    case DM_I32: return NCCL_INT32;
    default: dm_error("nccl: a reduction over the ranks takes f64, f32, bf16, f16, i64 or i32, got %s",
                      dm_dtype_name(dt));
  }
  return 0;
}

void dm_cuda_nccl_reduce(dm_tensor **ts, int n, bool mean) {
  if (!comm) dm_error("nccl: no communicator (dist.start_device makes it)");
  for (int i = 0; i < n; i++) {                      /* all checked before any is queued */
    dm_check_live(ts[i]);
    if (ts[i]->device != DM_CUDA || !dm_is_contiguous(ts[i]))
      dm_error("nccl: tensor %d of %d must be a contiguous cuda tensor", i + 1, n);
    if (mean && (ts[i]->dtype == DM_I64 || ts[i]->dtype == DM_I32))
      dm_error("nccl: the mean over the ranks takes a float tensor, got %s", dm_dtype_name(ts[i]->dtype));
    type_of(ts[i]->dtype);
  }
  check(nccl.group_start(), "ncclGroupStart");
  for (int i = 0; i < n; i++) {
    void *p = dm_data(ts[i]);
    int rc = nccl.all_reduce(p, p, (size_t)dm_numel(ts[i]), type_of(ts[i]->dtype), mean ? NCCL_AVG : NCCL_SUM,
                             comm, dm_cuda_stream());
    if (rc != 0) { nccl.group_end(); check(rc, "ncclAllReduce"); }
  }
  check(nccl.group_end(), "ncclGroupEnd");
  for (int i = 0; i < n; i++) dm_mark_written(ts[i]);
}

void dm_cuda_nccl_finalize(void) {
  if (!comm) return;
  dm_cuda_synchronize();
  nccl.comm_destroy(comm);
  comm = NULL;
}
