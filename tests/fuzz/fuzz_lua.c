/*
** fuzz_lua.c — libFuzzer targets for the readers written in Lua: the input is
** handed to tests/fuzz/targets.lua's function FUZZ_TARGET (meta: a
** checkpoint's meta.lua; config: --set arguments resolved into a config).
** Lua errors are refusals and fine; a crash, a hang or a leak is a bug.
**
** The Lua VM itself is not instrumented (a packaged static library), so
** libFuzzer would see no coverage of the Lua code it drives: a line hook
** counts each (previous line, line) edge of the Lua code run into libFuzzer's
** extra counters, which it reads as coverage.
*/
#include <stdint.h>
#include <stdlib.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

#define STR2(x) #x
#define STR(x) STR2(x)

static lua_State *L;
static int target_ref;

#define NCOUNTERS (1 << 16)
__attribute__((section("__libfuzzer_extra_counters"))) static uint8_t lua_edges[NCOUNTERS];
static uintptr_t last_line;

static void on_line(lua_State *S, lua_Debug *ar) {
  lua_getinfo(S, "S", ar);
  uintptr_t here = (uintptr_t)ar->source * 2654435761u + (uintptr_t)ar->currentline;
  uint8_t *c = &lua_edges[(here ^ (last_line >> 1)) % NCOUNTERS];
  if (*c < 255) (*c)++;
  last_line = here;
}

static void setup(void) {
  const char *root = getenv("DORMOUSE_HOME") ? getenv("DORMOUSE_HOME") : DM_SOURCE_DIR;
  L = dm_lua_new_state(root);
  if (!L) abort();
  lua_pushfstring(L, "%s/tests/fuzz/targets.lua", root);
  if (luaL_dofile(L, lua_tostring(L, -1)) != LUA_OK) abort();      /* the targets must load */
  lua_getfield(L, -1, STR(FUZZ_TARGET));
  if (!lua_isfunction(L, -1)) abort();
  target_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_settop(L, 0);
  lua_sethook(L, on_line, LUA_MASKLINE, 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) setup();
  last_line = 0;
  lua_rawgeti(L, LUA_REGISTRYINDEX, target_ref);
  lua_pushlstring(L, (const char *)data, size);
  lua_pcall(L, 1, 0, 0);                             /* a refusal is an error value: dropped */
  lua_settop(L, 0);
  lua_gc(L, LUA_GCCOLLECT);                          /* what one input made goes before the next */
  return 0;
}
