/*
** vm/lua/dist.c — a data-parallel job's collectives in `dormouse.core`
** (vm/dist/dist.h), on tensors in host memory; lua/dormouse/dist.lua moves
** device tensors through them and says what each collective is for.
**
**   core.dist_init()              -> rank, size (a job of one process: 0, 1)
**   core.dist_sum(t)              -> t: the sum over the ranks, in place (a contiguous CPU tensor)
**   core.dist_gather(t)           -> {t_0, ..., t_{size-1}}: every rank's tensor (CPU, contiguous; the
**                                    first dimension may differ, the rest and the dtype may not)
**   core.dist_barrier(), core.dist_abort(code), core.dist_finalize()
**   core.nccl_start()             -> true, NCCL's version; or false, why: the job's communicator for
**                                    device tensors (rank 0's unique id handed to every rank by a gather)
**   core.nccl_reduce(list, mean)  each cuda tensor of the list summed (mean: averaged) over the ranks in
**                                    place, on the stream, as one group (a CUDA graph captures it)
**   core.nccl_finalize()
*/
#include <stdlib.h>
#include <string.h>
#include "lua/bind.h"
#include "core/cuda.h"
#include "dist/dist.h"

static int c_dist_init(lua_State *L) {
  DM_ENTER(L);
  dm_dist_init();
  lua_pushinteger(L, dm_dist_rank());
  lua_pushinteger(L, dm_dist_size());
  return 2;
}

static dm_tensor *host_contiguous(lua_State *L, const char *what) {
  dm_tensor *t = dm_lua_check(L, 1);
  DM_ENTER(L);
  if (t->device != DM_CPU || !dm_is_contiguous(t))
    dm_error("dist: %s takes a contiguous tensor in host memory", what);
  return t;
}

static int c_dist_sum(lua_State *L) {
  dm_tensor *t = host_contiguous(L, "a sum");
  dm_dist_sum(dm_data(t), dm_numel(t), t->dtype);
  lua_settop(L, 1);
  return 1;
}

/* the rank's shape after the first dimension, the dtype and the first dimension, as int64s */
#define HEAD (2 + DM_MAXDIM)

static int c_dist_gather(lua_State *L) {
  dm_tensor *t = host_contiguous(L, "a gather");
  int size = dm_dist_size();
  if (t->ndim < 1) dm_error("dist: a gather takes a tensor of at least one dimension");
  int64_t head[HEAD] = {t->ndim, t->dtype}, *heads = malloc(sizeof *heads * HEAD * (size_t)size);
  int64_t *bytes = malloc(sizeof *bytes * (size_t)size);
  if (!heads || !bytes) { free(heads); free(bytes); dm_error("dist: out of host memory"); }
  for (int i = 0; i < t->ndim; i++) head[2 + i] = t->shape[i];
  dm_dist_gather(head, sizeof head, heads);
  int64_t total = 0, inner = dm_numel(t) / (t->shape[0] ? t->shape[0] : 1);
  for (int r = 0; r < size; r++) {
    const int64_t *h = heads + HEAD * r;
    bool same = h[0] == t->ndim && h[1] == t->dtype;
    for (int i = 1; same && i < t->ndim; i++) same = h[2 + i] == t->shape[i];
    if (!same) {
      free(heads); free(bytes);
      dm_error("dist: a gather's tensors differ beyond their first dimension (rank %d against rank %d)",
               r, dm_dist_rank());
    }
    bytes[r] = h[2] * inner * (int64_t)dm_dtype_size(t->dtype);
    total += bytes[r];
  }
  char *all = malloc(total > 0 ? (size_t)total : 1);
  if (!all) { free(heads); free(bytes); dm_error("dist: out of host memory for a gather of %lld bytes", (long long)total); }
  dm_dist_gatherv(dm_data(t), bytes, all);
  lua_createtable(L, size, 0);
  int64_t at = 0;
  for (int r = 0; r < size; r++) {
    int64_t shape[DM_MAXDIM];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = heads[HEAD * r + 2];
    dm_tensor *part = dm_tensor_new(DM_CPU, t->dtype, t->ndim, shape);
    memcpy(dm_data(part), all + at, (size_t)bytes[r]);
    at += bytes[r];
    dm_lua_push(L, part);
    lua_rawseti(L, -2, r + 1);
  }
  free(all); free(heads); free(bytes);
  return 1;
}

static int c_dist_barrier(lua_State *L) {
  DM_ENTER(L);
  dm_dist_barrier();
  return 0;
}

static int c_dist_abort(lua_State *L) {
  dm_dist_abort((int)luaL_optinteger(L, 1, 1));
  return 0;
}

static int c_dist_finalize(lua_State *L) {
  (void)L;
  dm_dist_finalize();
  return 0;
}

static int c_nccl_start(lua_State *L) {
  DM_ENTER(L);
  char why[512];
  int ok = dm_cuda_nccl_load(why, sizeof why);          /* every rank says whether it could, in the gather */
  int *oks = malloc(sizeof *oks * (size_t)dm_dist_size());
  if (!oks) dm_error("dist: out of host memory");
  dm_dist_gather(&ok, sizeof ok, oks);
  int missing = -1;
  for (int r = 0; r < dm_dist_size() && missing < 0; r++) if (!oks[r]) missing = r;
  free(oks);
  if (missing >= 0) {
    lua_pushboolean(L, 0);
    if (missing == dm_dist_rank()) lua_pushstring(L, why);
    else lua_pushfstring(L, "rank %d cannot load NCCL's library", missing);
    return 2;
  }
  unsigned char id[DM_NCCL_ID_BYTES] = {0}, *ids = malloc((size_t)DM_NCCL_ID_BYTES * (size_t)dm_dist_size());
  if (!ids) dm_error("dist: out of host memory");
  if (dm_dist_rank() == 0) dm_cuda_nccl_id(id);
  dm_dist_gather(id, DM_NCCL_ID_BYTES, ids);             /* rank 0's is the first */
  memcpy(id, ids, DM_NCCL_ID_BYTES);
  free(ids);
  dm_cuda_nccl_init(dm_dist_rank(), dm_dist_size(), id);
  lua_pushboolean(L, 1);
  lua_pushinteger(L, dm_cuda_nccl_version());
  return 2;
}

static int c_nccl_reduce(lua_State *L) {
  DM_ENTER(L);
  int n;
  dm_tensor **ts = dm_lua_tensor_list(L, 1, "nccl_reduce", "tensors", &n);
  dm_cuda_nccl_reduce(ts, n, lua_toboolean(L, 2));
  return 0;
}

static int c_nccl_finalize(lua_State *L) {
  DM_ENTER(L);
  dm_cuda_nccl_finalize();
  return 0;
}

static const luaL_Reg funcs[] = {
  {"nccl_start", c_nccl_start}, {"nccl_reduce", c_nccl_reduce}, {"nccl_finalize", c_nccl_finalize},
  {"dist_init", c_dist_init}, {"dist_sum", c_dist_sum}, {"dist_gather", c_dist_gather},
  {"dist_barrier", c_dist_barrier}, {"dist_abort", c_dist_abort}, {"dist_finalize", c_dist_finalize},
  {NULL, NULL}};
DM_LUA_FUNCS(funcs)
