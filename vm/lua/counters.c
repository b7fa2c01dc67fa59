/*
** vm/lua/counters.c — what the ops count of their own choices, for the log line:
**
**   core.kda_passes()     -> chunked, recurrent   kda's forward passes by path since the start
**   core.product_paths()  -> rows, cublaslt       the device's matrix products by path since the start
*/
#include "lua/bind.h"
#include "ops/kda.h"
#include "core/cuda.h"

static int c_kda_passes(lua_State *L) {
  dm_kda_pass_counts n = dm_kda_passes();
  lua_pushinteger(L, (lua_Integer)n.chunked);
  lua_pushinteger(L, (lua_Integer)n.recurrent);
  return 2;
}

static int c_product_paths(lua_State *L) {
  int64_t rows, lt;
  dm_cuda_product_counts(&rows, &lt);
  lua_pushinteger(L, (lua_Integer)rows);
  lua_pushinteger(L, (lua_Integer)lt);
  return 2;
}

static const luaL_Reg funcs[] = {{"kda_passes", c_kda_passes}, {"product_paths", c_product_paths}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
