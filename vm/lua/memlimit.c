/*
** vm/lua/memlimit.c — a ceiling on the memory Lua may take while untrusted text
** runs (a checkpoint's meta.lua): the state's allocator is wrapped for the span,
** counting what is allocated and freed from the moment the limit is set; an
** allocation past the limit fails, and Lua raises "not enough memory" in the
** code that asked (a table literal's "s .. s" doubled 34 times once took 12 GB).
** The wrapper passes every call to the allocator it replaced, so blocks made
** before, during and after the span are all freed by the same one.
**
**   core.memory_limit(bytes)   from now on, at most `bytes` more than now
**   core.memory_limit(nil)     the allocator as before
*/
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

typedef struct {
  lua_Alloc inner;
  void *inner_ud;
  long long used;     /* bytes allocated less bytes freed since the limit was set (may go below 0) */
  long long limit;
} memlimit;

static memlimit span;  /* one span at a time: the readers that set it run to their end */
static int active;

static void *limited_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  memlimit *m = ud;
  long long was = ptr ? (long long)osize : 0;
  if (nsize > 0 && m->used - was + (long long)nsize > m->limit) return NULL;  /* past it: Lua's error */
  void *out = m->inner(m->inner_ud, ptr, osize, nsize);
  if (nsize == 0 || out) m->used += (long long)nsize - was;
  return out;
}

static int c_memory_limit(lua_State *L) {
  if (lua_isnoneornil(L, 1)) {
    if (active) {
      lua_setallocf(L, span.inner, span.inner_ud);
      active = 0;
    }
    return 0;
  }
  lua_Integer bytes = luaL_checkinteger(L, 1);
  luaL_argcheck(L, bytes > 0, 1, "the limit must be a positive number of bytes");
  if (active) return luaL_error(L, "memory_limit: a limit is set already");
  span.inner = lua_getallocf(L, &span.inner_ud);
  span.used = 0;
  span.limit = bytes;
  lua_setallocf(L, limited_alloc, &span);
  active = 1;
  return 0;
}

static const luaL_Reg funcs[] = {{"memory_limit", c_memory_limit}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
