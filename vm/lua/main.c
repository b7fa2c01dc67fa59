/*
** main.c — the `dormouse` binary: a Lua 5.4 state with LPeg and the core
** preloaded, the library found relative to the binary, and argv handed to
** lua/dormouse/cli.lua, which does the rest.
*/
#include <errno.h>
#include <limits.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "lua/bind.h"

static bool is_dir_with_cli(const char *lua_dir) {
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/dormouse/cli.lua", lua_dir);
  return access(path, R_OK) == 0;
}

/* The library's lua/ folder: $DORMOUSE_HOME/lua, then beside an installed
** binary (../share/dormouse/lua), then the source tree it was built from. */
static bool find_root(char *root, size_t n) {
  char exe[PATH_MAX], cand[PATH_MAX + 8];
  const char *home = getenv("DORMOUSE_HOME");
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  exe[len > 0 ? len : 0] = '\0';
  const char *exe_dir = len > 0 ? dirname(exe) : ".";
  const char *roots[4];
  char installed[PATH_MAX + 32], beside[PATH_MAX + 8];
  snprintf(installed, sizeof installed, "%s/../share/dormouse", exe_dir);
  snprintf(beside, sizeof beside, "%s/..", exe_dir);
  int k = 0;
  if (home) roots[k++] = home;
  roots[k++] = installed;
  roots[k++] = beside;
  roots[k++] = DM_SOURCE_DIR;
  for (int i = 0; i < k; i++) {
    snprintf(cand, sizeof cand, "%s/lua", roots[i]);
    if (is_dir_with_cli(cand)) {
      if (!realpath(roots[i], root)) snprintf(root, n, "%s", roots[i]);
      return true;
    }
  }
  return false;
}

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  luaL_traceback(L, L, msg, 1);
  return 1;
}

int main(int argc, char **argv) {
  char root[PATH_MAX];
  if (!find_root(root, sizeof root)) {
    fprintf(stderr, "dormouse: cannot find the Lua library (lua/dormouse/cli.lua); "
                    "set DORMOUSE_HOME to the folder that holds lua/\n");
    return 1;
  }
  lua_State *L = dm_lua_new_state(root);
  if (!L) { fprintf(stderr, "dormouse: cannot create a Lua state\n"); return 1; }
  lua_pushcfunction(L, traceback);
  lua_getglobal(L, "require");
  lua_pushstring(L, "dormouse.cli");
  int status = lua_pcall(L, 1, 1, 1);
  if (status == LUA_OK) {
    lua_getfield(L, -1, "main");
    lua_createtable(L, argc, 0);
    for (int i = 0; i < argc; i++) { lua_pushstring(L, argv[i]); lua_rawseti(L, -2, i); }
    lua_pushstring(L, root);
    status = lua_pcall(L, 2, 1, 1);
  }
  int code = 0;
  if (status != LUA_OK) {
    fprintf(stderr, "dormouse: %s\n", lua_tostring(L, -1));
    code = 1;
  } else code = (int)luaL_optinteger(L, -1, 0);
  lua_close(L);
  /* what went to stdout must have arrived: a full disk or a closed pipe is an error, not exit 0 */
  if (fflush(stdout) != 0 || ferror(stdout)) {
    fprintf(stderr, "dormouse: writing to standard output failed: %s\n", strerror(errno));
    if (code == 0) code = 1;
  }
  return code;
}
