/*
** fuzz_lua.c — libFuzzer targets for the readers written in Lua: the input is
** handed to tests/fuzz/targets.lua's function FUZZ_TARGET (meta: a
** checkpoint's meta.lua; config: --set arguments resolved into a config).
** Lua errors are refusals and fine; a crash, a hang or a leak is a bug, and so
** is an input that makes the reader hold more than FUZZ_LUA_LIMIT bytes of Lua
** memory at once (the readers bound memory before they use it: meta.lua's
** reader once let ("x"):rep(1.5e9) through): the Lua allocator is wrapped to
** count, and an input over the limit aborts with its size.
**
** The Lua VM itself is not instrumented (a packaged static library), so
** libFuzzer would see no coverage of the Lua code it drives: a line hook
** counts each (previous line, line) edge of the Lua code run into libFuzzer's
** extra counters, which it reads as coverage.
*/
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

#define STR2(x) #x
#define STR(x) STR2(x)

static lua_State *L;
static int target_ref;

/* above what the state held before the input: the meta reader's own 256 MB ceiling and the input's */
#define FUZZ_LUA_LIMIT ((size_t)320 << 20)

static lua_Alloc base_alloc;
static void *base_ud;
static size_t held, peak;

/* the state's allocator, counting what Lua holds and its peak since the input began */
static void *counting_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud;
  void *out = base_alloc(base_ud, ptr, osize, nsize);
  if (nsize == 0 || out) {
    if (ptr) held -= osize;
    held += nsize;
    if (held > peak) peak = held;
  }
  return out;
}

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
  lua_gc(L, LUA_GCCOLLECT);
  held = (size_t)lua_gc(L, LUA_GCCOUNT) * 1024 + (size_t)lua_gc(L, LUA_GCCOUNTB);
  base_alloc = lua_getallocf(L, &base_ud);
  lua_setallocf(L, counting_alloc, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) setup();
  last_line = 0;
  size_t before = held;
  peak = held;
  lua_rawgeti(L, LUA_REGISTRYINDEX, target_ref);
  lua_pushlstring(L, (const char *)data, size);
  lua_pcall(L, 1, 0, 0);                             /* a refusal is an error value: dropped */
  lua_settop(L, 0);
  lua_gc(L, LUA_GCCOLLECT);                          /* what one input made goes before the next */
  if (peak - before > FUZZ_LUA_LIMIT) {
    fprintf(stderr, "fuzz_lua: an input of %zu bytes made the reader hold %zu MB of Lua memory (limit %zu MB)\n",
            size, (peak - before) >> 20, FUZZ_LUA_LIMIT >> 20);
    abort();
  }
  return 0;
}
