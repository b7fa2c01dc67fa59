/*
** lua_repl.c — line editing for the REPL: readline with a persistent history.
*/
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <readline/readline.h>
#include <readline/history.h>
#include "lua_tensor.h"

/* core.readline(prompt) → the line, or nil at end of input */
static int r_readline(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  char *line = readline(prompt);
  if (!line) return 0;
  lua_pushstring(L, line);
  free(line);
  return 1;
}

static int r_add_history(lua_State *L) {
  add_history(luaL_checkstring(L, 1));
  return 0;
}

static int r_read_history(lua_State *L) {
  lua_pushboolean(L, read_history(luaL_checkstring(L, 1)) == 0);
  return 1;
}

/* append this session's lines and keep the file to `max` lines */
static int r_write_history(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int max = (int)luaL_optinteger(L, 2, 1000);
  stifle_history(max);
  lua_pushboolean(L, write_history(path) == 0);
  return 1;
}

static int r_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 0)));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"readline", r_readline}, {"add_history", r_add_history}, {"read_history", r_read_history},
  {"write_history", r_write_history}, {"isatty", r_isatty}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
