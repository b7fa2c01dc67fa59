/*
** vm/lua/cuda.c — the CUDA backend's functions in `dormouse.core` (cuda_*),
** which lua/dormouse/cuda.lua turns into the `dm.cuda` table. In a build
** without CUDA they exist too and say so (vm/core/cuda.h's stubs).
*/
#include "lua/bind.h"
#include "core/cuda.h"
#include "core/alloc.h"

/* core.cuda_is_available() → true, or false and why */
static int c_is_available(lua_State *L) {
  bool ok = dm_cuda_available();
  lua_pushboolean(L, ok);
  if (ok) return 1;
  lua_pushstring(L, dm_cuda_unavailable_reason());
  return 2;
}

/* core.cuda_info() → {name, major, minor, sm_count, total_memory, runtime_version, driver_version} */
static int c_info(lua_State *L) {
  DM_ENTER(L);
  dm_cuda_info i = dm_cuda_device_info();
  lua_createtable(L, 0, 7);
  lua_pushstring(L, i.name); lua_setfield(L, -2, "name");
  lua_pushinteger(L, i.major); lua_setfield(L, -2, "major");
  lua_pushinteger(L, i.minor); lua_setfield(L, -2, "minor");
  lua_pushinteger(L, i.sm_count); lua_setfield(L, -2, "sm_count");
  lua_pushinteger(L, i.total_memory); lua_setfield(L, -2, "total_memory");
  lua_pushinteger(L, i.runtime_version); lua_setfield(L, -2, "runtime_version");
  lua_pushinteger(L, i.driver_version); lua_setfield(L, -2, "driver_version");
  return 1;
}

static int c_synchronize(lua_State *L) {
  DM_ENTER(L);
  dm_cuda_synchronize();
  return 0;
}

static int c_empty_cache(lua_State *L) {
  DM_ENTER(L);
  dm_memory_empty_cache(DM_CUDA);
  return 0;
}

/* core.cuda_tf32([on]) → whether f32 products use TF32 (after setting it, when on is given) */
static int c_tf32(lua_State *L) {
  if (!lua_isnoneornil(L, 1)) {
    luaL_checktype(L, 1, LUA_TBOOLEAN);
    dm_cuda_set_tf32(lua_toboolean(L, 1));
  }
  lua_pushboolean(L, dm_cuda_tf32());
  return 1;
}

static int c_timer_start(lua_State *L) {
  DM_ENTER(L);
  dm_cuda_timer_start();
  return 0;
}

static int c_timer_stop(lua_State *L) {
  DM_ENTER(L);
  lua_pushnumber(L, dm_cuda_timer_stop());
  return 1;
}

/* core.cuda_bench_copy(nbytes, reps) → median ms of a device-to-device copy */
static int c_bench_copy(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1), reps = luaL_optinteger(L, 2, 20);
  luaL_argcheck(L, n > 0, 1, "the size must be positive");
  DM_ENTER(L);
  lua_pushnumber(L, dm_cuda_bench_copy((size_t)n, (int)reps));
  return 1;
}

/* core.cuda_bench_gemm(dtype, m, n, k, reps, classic) → median ms of cuBLASLt called
** directly (classic: of cublasGemmEx) */
static int c_bench_gemm(lua_State *L) {
  dm_dtype dt = dm_lua_dtype(L, 1, DM_BF16);
  lua_Integer m = luaL_checkinteger(L, 2), n = luaL_checkinteger(L, 3), k = luaL_checkinteger(L, 4);
  lua_Integer reps = luaL_optinteger(L, 5, 20);
  bool classic = lua_toboolean(L, 6);
  DM_ENTER(L);
  lua_pushnumber(L, dm_cuda_bench_gemm(dt, m, n, k, (int)reps, classic));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"cuda_is_available", c_is_available}, {"cuda_info", c_info}, {"cuda_synchronize", c_synchronize},
  {"cuda_empty_cache", c_empty_cache}, {"cuda_tf32", c_tf32},
  {"cuda_timer_start", c_timer_start}, {"cuda_timer_stop", c_timer_stop},
  {"cuda_bench_copy", c_bench_copy}, {"cuda_bench_gemm", c_bench_gemm},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
