/*
** vm/lua/recompute.c — core.recompute(fn, t1, ..., tn): fn(t1, ..., tn) as
** one recomputed stretch (vm/ops/recompute.c); lua/dormouse/recompute.lua
** makes it dm.recompute. core.recomputing() is true while a backward runs
** a recomputed function again.
**
** The function runs in the Lua thread that made the recompute (the main
** thread, for training): a backward must not run in a coroutine that
** outlives it.
*/
#include <stdlib.h>
#include <string.h>
#include "lua/bind.h"
#include "ops/recompute.h"
#include "core/autograd.h"

typedef struct lua_fn { lua_State *L; int ref; } lua_fn;

static dm_tensor *run_lua(void *ud, int n, dm_tensor *const *in, char *err, size_t nerr) {
  lua_fn *f = ud;
  lua_State *L = f->L;
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, f->ref);
  for (int i = 0; i < n; i++) {
    dm_retain(in[i]);
    dm_lua_push(L, in[i]);
  }
  if (lua_pcall(L, n, 1, 0) != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    snprintf(err, nerr, "%s", msg ? msg : "recompute: the function raised a non-string error");
    lua_settop(L, top);
    dm_lua_enter(L);
    return NULL;
  }
  dm_tensor **box = luaL_testudata(L, -1, DM_TENSOR_MT);
  dm_tensor *out = box && *box && (*box)->storage ? *box : NULL;
  if (out) dm_retain(out);
  else snprintf(err, nerr, "recompute: the function must return one live tensor, got %s", luaL_typename(L, -1));
  lua_settop(L, top);
  dm_lua_enter(L);         /* the core's errors raise in this thread again */
  return out;
}

static void release_lua(void *ud) {
  lua_fn *f = ud;
  luaL_unref(f->L, LUA_REGISTRYINDEX, f->ref);
  free(f);
}

/* core.recompute(fn, t1, ..., tn) → the output tensor */
static int c_recompute(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  int n = lua_gettop(L) - 1;
  DM_ENTER(L);
  dm_tensor *in[DM_MAXSAVED];
  if (n < 1 || n > DM_MAXSAVED)        /* the node saves each input */
    return luaL_error(L, "recompute: takes 1 to %d tensors after the function, got %d", DM_MAXSAVED, n);
  for (int i = 0; i < n; i++) in[i] = dm_lua_check(L, i + 2);
  lua_fn *f = malloc(sizeof *f);
  if (!f) return luaL_error(L, "recompute: out of host memory");
  lua_pushvalue(L, 1);
  f->L = L;
  f->ref = luaL_ref(L, LUA_REGISTRYINDEX);
  dm_recompute_fn fn = {run_lua, release_lua, f};
  dm_lua_push(L, dm_recompute(&fn, n, in));
  return 1;
}

/* core.recomputing() → true while a recomputed function runs again in a backward */
static int c_recomputing(lua_State *L) {
  lua_pushboolean(L, dm_tape_depth() > 0);
  return 1;
}

static const luaL_Reg funcs[] = {{"recompute", c_recompute}, {"recomputing", c_recomputing}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
