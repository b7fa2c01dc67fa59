/*
** dist.c — a data-parallel job over Open MPI, loaded at run time. See dist.h.
**
** Open MPI's handles (MPI_COMM_WORLD, MPI_DOUBLE, MPI_SUM, ...) are the
** addresses of its global objects (ompi_mpi_comm_world, ...), so dlsym finds
** them as it finds the functions, and no MPI header is needed to build.
** The library is opened RTLD_GLOBAL: the components Open MPI loads in turn
** resolve their symbols against it.
*/
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core.h"
#include "dist/dist.h"

typedef void *handle;                   /* MPI_Comm, MPI_Datatype, MPI_Op: pointers in Open MPI */
#define IN_PLACE ((void *)1)            /* Open MPI's MPI_IN_PLACE */
#define CHUNK ((int64_t)1 << 30)        /* MPI counts are ints: larger buffers go in pieces */

static struct {
  int (*init)(int *, char ***);
  int (*finalize)(void);
  int (*comm_rank)(handle, int *);
  int (*comm_size)(handle, int *);
  int (*allreduce)(const void *, void *, int, handle, handle, handle);
  int (*allgather)(const void *, int, handle, void *, int, handle, handle);
  int (*allgatherv)(const void *, int, handle, void *, const int *, const int *, handle, handle);
  int (*barrier)(handle);
  int (*abort)(handle, int);
  handle world, f64, f32, i64, i32, byte, sum;
} mpi;

static int rank, size = 1;
static bool started, finalized;

static int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

static void *need(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) dm_error("dist: Open MPI's library has no %s (is it Open MPI 4 or later?)", name);
  return p;
}

static void load(void) {
  void *lib = dlopen("libmpi.so.40", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) lib = dlopen("libmpi.so", RTLD_NOW | RTLD_GLOBAL);
  if (!lib)
    dm_error("dist: this job has %d processes, but Open MPI's library (libmpi.so.40) cannot be loaded: %s; "
             "install Open MPI (Debian: apt-get install openmpi-bin)", size, dlerror());
  *(void **)&mpi.init = need(lib, "MPI_Init");
  *(void **)&mpi.finalize = need(lib, "MPI_Finalize");
  *(void **)&mpi.comm_rank = need(lib, "MPI_Comm_rank");
  *(void **)&mpi.comm_size = need(lib, "MPI_Comm_size");
  *(void **)&mpi.allreduce = need(lib, "MPI_Allreduce");
  *(void **)&mpi.allgather = need(lib, "MPI_Allgather");
  *(void **)&mpi.allgatherv = need(lib, "MPI_Allgatherv");
  *(void **)&mpi.barrier = need(lib, "MPI_Barrier");
  *(void **)&mpi.abort = need(lib, "MPI_Abort");
  mpi.world = need(lib, "ompi_mpi_comm_world");
  mpi.f64 = need(lib, "ompi_mpi_double");
  mpi.f32 = need(lib, "ompi_mpi_float");
  mpi.i64 = need(lib, "ompi_mpi_int64_t");
  mpi.i32 = need(lib, "ompi_mpi_int");
  mpi.byte = need(lib, "ompi_mpi_byte");
  mpi.sum = need(lib, "ompi_mpi_op_sum");
}

static void check(int rc, const char *what) {
  if (rc != 0) dm_error("dist: %s failed on rank %d of %d (MPI error %d)", what, rank, size, rc);
}

void dm_dist_init(void) {
  if (started) return;
  size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  if (size < 1 || rank < 0 || rank >= size)
    dm_error("dist: mpirun's environment says rank %d of %d", rank, size);
  started = true;
  if (size == 1) return;
  load();
  check(mpi.init(NULL, NULL), "MPI_Init");
  int r, n;
  check(mpi.comm_rank(mpi.world, &r), "MPI_Comm_rank");
  check(mpi.comm_size(mpi.world, &n), "MPI_Comm_size");
  if (r != rank || n != size)
    dm_error("dist: MPI says rank %d of %d, mpirun's environment rank %d of %d", r, n, rank, size);
}

int dm_dist_rank(void) { return rank; }
int dm_dist_size(void) { return size; }

static handle type_of(dm_dtype dt) {
  switch (dt) {
    case DM_F64: return mpi.f64;
    case DM_F32: return mpi.f32;
    case DM_I64: return mpi.i64;
    case DM_I32: return mpi.i32;
    default: dm_error("dist: a sum over the ranks takes f64, f32, i64 or i32, got %s", dm_dtype_name(dt));
  }
  return NULL;
}

void dm_dist_sum(void *buf, int64_t n, dm_dtype dt) {
  if (size == 1 || n == 0) return;
  handle t = type_of(dt);
  size_t es = dm_dtype_size(dt);
  for (int64_t at = 0; at < n; at += CHUNK) {
    int64_t m = n - at < CHUNK ? n - at : CHUNK;
    check(mpi.allreduce(IN_PLACE, (char *)buf + (size_t)at * es, (int)m, t, mpi.sum, mpi.world), "a sum");
  }
}

void dm_dist_gather(const void *send, int64_t bytes, void *out) {
  if (bytes < 0 || bytes > INT32_MAX) dm_error("dist: a gather of %lld bytes a rank (at most 2^31 - 1)", (long long)bytes);
  if (size == 1) { memcpy(out, send, (size_t)bytes); return; }
  check(mpi.allgather(send, (int)bytes, mpi.byte, out, (int)bytes, mpi.byte, mpi.world), "a gather");
}

void dm_dist_gatherv(const void *send, const int64_t *sizes, void *out) {
  int *counts = malloc(sizeof *counts * (size_t)size), *displs = malloc(sizeof *displs * (size_t)size);
  if (!counts || !displs) { free(counts); free(displs); dm_error("dist: out of host memory"); }
  int64_t at = 0;
  for (int r = 0; r < size; r++) {
    if (sizes[r] < 0 || at + sizes[r] > INT32_MAX) {
      free(counts); free(displs);
      dm_error("dist: a gather of %lld bytes in all (at most 2^31 - 1)", (long long)(at + sizes[r]));
    }
    counts[r] = (int)sizes[r];
    displs[r] = (int)at;
    at += sizes[r];
  }
  if (size == 1) memcpy(out, send, (size_t)sizes[0]);
  else {
    int rc = mpi.allgatherv(send, counts[rank], mpi.byte, out, counts, displs, mpi.byte, mpi.world);
    free(counts); free(displs);
    check(rc, "a gather");
    return;
  }
  free(counts); free(displs);
}

void dm_dist_barrier(void) {
  if (size > 1) check(mpi.barrier(mpi.world), "a barrier");
}

void dm_dist_abort(int code) {
  if (size > 1 && !finalized) mpi.abort(mpi.world, code);
  exit(code);
}

void dm_dist_finalize(void) {
  if (size == 1 || finalized) return;
  finalized = true;
  mpi.finalize();
}
