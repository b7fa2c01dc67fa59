/*
** vm/lua/counters.c — what the ops count of their own choices, for the log line:
**
**   core.kda_passes()   -> chunked, recurrent   kda's forward passes by path since the start
*/
#include "lua/bind.h"
#include "ops/kda.h"

static int c_kda_passes(lua_State *L) {
  dm_kda_pass_counts n = dm_kda_passes();
  lua_pushinteger(L, (lua_Integer)n.chunked);
  lua_pushinteger(L, (lua_Integer)n.recurrent);
  return 2;
}

static const luaL_Reg funcs[] = {{"kda_passes", c_kda_passes}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
