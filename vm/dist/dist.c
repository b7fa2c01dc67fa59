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
#include <time.h>
#include "core/core.h"
#include "dist/dist.h"

typedef void *handle;                   /* MPI_Comm, MPI_Datatype, MPI_Op: pointers in Open MPI */
#define IN_PLACE ((void *)1)            /* Open MPI's MPI_IN_PLACE */
#define CHUNK ((int64_t)1 << 30)        /* MPI counts are ints: larger buffers go in pieces */

/* The collectives are started non-blocking and waited on with a deadline: a rank that stops
** answering without dying (a dead one mpirun reports) ends the job instead of hanging it. */
static struct {
  int (*init)(int *, char ***);
  int (*finalize)(void);
  int (*comm_rank)(handle, int *);
  int (*comm_size)(handle, int *);
  int (*iallreduce)(const void *, void *, int, handle, handle, handle, handle *);
  int (*iallgather)(const void *, int, handle, void *, int, handle, handle, handle *);
  int (*iallgatherv)(const void *, int, handle, void *, const int *, const int *, handle, handle, handle *);
  int (*ibarrier)(handle, handle *);
  int (*test)(handle *, int *, void *);
  int (*abort)(handle, int);
  handle world, f64, f32, i64, i32, byte, sum;
} mpi;

static int rank, size = 1;
static bool started, finalized;
static double timeout_s = DM_DIST_TIMEOUT_S;

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
  *(void **)&mpi.iallreduce = need(lib, "MPI_Iallreduce");
  *(void **)&mpi.iallgather = need(lib, "MPI_Iallgather");
  *(void **)&mpi.iallgatherv = need(lib, "MPI_Iallgatherv");
  *(void **)&mpi.ibarrier = need(lib, "MPI_Ibarrier");
  *(void **)&mpi.test = need(lib, "MPI_Test");
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

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* waits for the collective a call started (rc its return, *req its request, both set before this
** runs: the call is made first, as its own statement); past the deadline the job ends, naming this rank and the collective */
static void wait_for(int rc, handle *req, const char *what) {
  check(rc, what);
  double deadline = now_s() + timeout_s;
  for (int done = 0;;) {
    check(mpi.test(req, &done, NULL), what);
    if (done) return;
    if (now_s() > deadline) {
      fprintf(stderr, "dormouse: dist: rank %d of %d waited %.0f s for %s: another rank stopped answering; "
              "the job ends (DORMOUSE_DIST_TIMEOUT sets the wait in seconds)\n", rank, size, timeout_s, what);
      fflush(stderr);
      mpi.abort(mpi.world, 1);
    }
    nanosleep(&(struct timespec){0, 50000}, NULL);
  }
}

void dm_dist_init(void) {
  if (started) return;
  size = env_int("OMPI_COMM_WORLD_SIZE", 1);
  rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  const char *t = getenv("DORMOUSE_DIST_TIMEOUT");
  if (t && *t) {
    timeout_s = atof(t);
    if (!(timeout_s > 0)) dm_error("dist: DORMOUSE_DIST_TIMEOUT must be a number of seconds > 0, got '%s'", t);
  }
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
    handle req = NULL;
    int rc = mpi.iallreduce(IN_PLACE, (char *)buf + (size_t)at * es, (int)m, t, mpi.sum, mpi.world, &req);
    wait_for(rc, &req, "a sum over the ranks");
  }
}

void dm_dist_gather(const void *send, int64_t bytes, void *out) {
  if (bytes < 0 || bytes > INT32_MAX) dm_error("dist: a gather of %lld bytes a rank (at most 2^31 - 1)", (long long)bytes);
  if (size == 1) { memcpy(out, send, (size_t)bytes); return; }
  handle req = NULL;
  int rc = mpi.iallgather(send, (int)bytes, mpi.byte, out, (int)bytes, mpi.byte, mpi.world, &req);
  wait_for(rc, &req, "a gather from the ranks");
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
    handle req = NULL;
    int rc = mpi.iallgatherv(send, counts[rank], mpi.byte, out, counts, displs, mpi.byte, mpi.world, &req);
    wait_for(rc, &req, "a gather from the ranks");
    free(counts); free(displs);
    return;
  }
  free(counts); free(displs);
}

void dm_dist_barrier(void) {
  if (size == 1) return;
  handle req = NULL;
  int rc = mpi.ibarrier(mpi.world, &req);
  wait_for(rc, &req, "the other ranks at a barrier");
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
