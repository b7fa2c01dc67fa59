/*
** vm/lua/profile.c — the op profiler (vm/core/profile.h) in `dormouse.core`, which
** lua/dormouse/profile.lua turns into dm.profile.
*/
#include <string.h>
#include "lua/bind.h"
#include "core/profile.h"

static const char *phase_names[] = {"forward", "backward", "region", "recompute"};

/* core.profile_start() */
static int p_start(lua_State *L) {
  DM_ENTER(L);
  dm_profile_start();
  return 0;
}

/* core.profile_stop() */
static int p_stop(lua_State *L) {
  (void)L;
  dm_profile_stop();
  return 0;
}

/* core.profile_on() → whether ops are being timed */
static int p_on(lua_State *L) {
  lua_pushboolean(L, dm_profile_on());
  return 1;
}

/* core.profile_push(name, family, device): open a timed region */
static int p_push(lua_State *L) {
  const char *name = luaL_checkstring(L, 1), *family = luaL_checkstring(L, 2);
  const char *device = luaL_optstring(L, 3, "cpu");
  DM_ENTER(L);
  dm_profile_push(dm_profile_intern(name), dm_profile_intern(family), DM_PHASE_REGION,
                  strcmp(device, "cuda") == 0 ? DM_CUDA : DM_CPU);
  return 0;
}

/* core.profile_pop() */
static int p_pop(lua_State *L) {
  (void)L;
  dm_profile_pop();
  return 0;
}

/* core.profile_read() → {{name, family, phase, ms, calls}, ...} */
static int p_read(lua_State *L) {
  DM_ENTER(L);
  static dm_profile_row rows[1024];
  int n = dm_profile_read(rows, 1024);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_createtable(L, 0, 5);
    lua_pushstring(L, rows[i].name); lua_setfield(L, -2, "name");
    lua_pushstring(L, rows[i].family); lua_setfield(L, -2, "family");
    lua_pushstring(L, phase_names[rows[i].phase]); lua_setfield(L, -2, "phase");
    lua_pushnumber(L, rows[i].ms); lua_setfield(L, -2, "ms");
    lua_pushinteger(L, rows[i].calls); lua_setfield(L, -2, "calls");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static const luaL_Reg funcs[] = {
  {"profile_start", p_start}, {"profile_stop", p_stop}, {"profile_push", p_push},
  {"profile_pop", p_pop},     {"profile_on", p_on},     {"profile_read", p_read}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
