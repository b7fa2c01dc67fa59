/*
** vm/lua/state.c — a Lua 5.4 state as the dormouse binary runs one: the standard
** libraries, LPeg and the core preloaded, and the library's lua/ folder under
** root first on package.path (after LUA_PATH's entries when the user set one).
** The binary (main.c) and the fuzz targets (tests/fuzz) make theirs here.
*/
#include <stdbool.h>
#include <stdlib.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "lua/bind.h"

int luaopen_lpeg(lua_State *L);

static void set_path(lua_State *L, const char *root) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "path");
  const char *path = lua_tostring(L, -1);
  bool user_first = getenv("LUA_PATH_5_4") || getenv("LUA_PATH");
  if (user_first) lua_pushfstring(L, "%s;%s/lua/?.lua;%s/lua/?/init.lua", path, root, root);
  else lua_pushfstring(L, "%s/lua/?.lua;%s/lua/?/init.lua;%s", root, root, path);
  lua_setfield(L, -3, "path");
  lua_pop(L, 2);
}

lua_State *dm_lua_new_state(const char *root) {
  lua_State *L = luaL_newstate();
  if (!L) return NULL;
  luaL_openlibs(L);
  luaL_requiref(L, "lpeg", luaopen_lpeg, 0);
  lua_pop(L, 1);
  dm_lua_open_core(L);
  set_path(L, root);
  return L;
}
