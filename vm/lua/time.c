/*
** vm/lua/time.c — a wall clock for rates and ETAs (os.clock counts CPU time,
** which loader and BLAS threads inflate).
*/
#include <time.h>
#include "lua/bind.h"

/* core.now() → seconds on the monotonic clock */
static int t_now(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + 1e-9 * (lua_Number)ts.tv_nsec);
  return 1;
}

static const luaL_Reg funcs[] = {{"now", t_now}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
