/*
** vm/lua/trace.c — the op trace (vm/core/trace.h) in `dormouse.core`:
** dormouse determinism finds with it the op where two runs part.
*/
#include <stdio.h>
#include "lua/bind.h"
#include "core/trace.h"

static const char *kind_names[] = {"forward", "backward", "mark", "tensor"};

/* core.trace_start() */
static int t_start(lua_State *L) {
  DM_ENTER(L);
  dm_trace_start();
  return 0;
}

/* core.trace_stop() */
static int t_stop(lua_State *L) {
  (void)L;
  dm_trace_stop();
  return 0;
}

/* core.trace_on() → whether op calls are being hashed */
static int t_on(lua_State *L) {
  lua_pushboolean(L, dm_trace_on());
  return 1;
}

/* core.trace_mark(label) */
static int t_mark(lua_State *L) {
  const char *label = luaL_checkstring(L, 1);
  DM_ENTER(L);
  dm_trace_mark(label);
  return 0;
}

/* core.trace_tensor(label, t): t's hash as an entry (a state no op wrote) */
static int t_tensor(lua_State *L) {
  const char *label = luaL_checkstring(L, 1);
  dm_tensor *t = dm_lua_check(L, 2);
  DM_ENTER(L);
  dm_trace_tensor(label, t);
  return 0;
}

static void push_hash(lua_State *L, uint64_t h) {
  char buf[20];
  snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  lua_pushstring(L, buf);
}

static void push_entry(lua_State *L, const dm_trace_entry *e) {
  lua_createtable(L, 0, 4);
  lua_pushstring(L, e->name); lua_setfield(L, -2, "name");
  lua_pushstring(L, kind_names[e->kind]); lua_setfield(L, -2, "kind");
  if (e->kind == DM_TRACE_FORWARD || e->kind == DM_TRACE_BACKWARD) {
    push_hash(L, e->in);
    lua_setfield(L, -2, "inputs");
  }
  if (e->kind != DM_TRACE_MARK) {
    push_hash(L, e->out);
    lua_setfield(L, -2, "outputs");
  }
}

/* core.trace_read([from, to, kept]) → {{name, kind, inputs, outputs}, ...}: entries from..to
** (1-based, inclusive, cut to the trace; default all) of the trace being made, or (kept) of the
** one set aside; the hashes as 16 hex digits (a mark has neither; a tensor has outputs only) */
static int t_read(lua_State *L) {
  int64_t n;
  const dm_trace_entry *e = dm_trace_entries(lua_toboolean(L, 3), &n);
  lua_Integer from = luaL_optinteger(L, 1, 1), to = luaL_optinteger(L, 2, n);
  if (from < 1) from = 1;
  if (to > n) to = n;
  lua_createtable(L, to >= from ? (int)(to - from + 1) : 0, 0);
  for (lua_Integer i = from; i <= to; i++) {
    push_entry(L, &e[i - 1]);
    lua_rawseti(L, -2, i - from + 1);
  }
  return 1;
}

/* core.trace_keep(): the trace so far set aside, an empty one begun */
static int t_keep(lua_State *L) {
  (void)L;
  dm_trace_keep();
  return 0;
}

/* core.trace_parting() → nil where the kept trace and this one are the same; else the first
** entry (1-based) where they differ and the last mark before it (nil: none) */
static int t_parting(lua_State *L) {
  int64_t mark, at = dm_trace_parting(&mark);
  if (at < 0) return 0;
  lua_pushinteger(L, (lua_Integer)(at + 1));
  if (mark < 0) lua_pushnil(L); else lua_pushinteger(L, (lua_Integer)(mark + 1));
  return 2;
}

static const luaL_Reg funcs[] = {
  {"trace_start", t_start},   {"trace_stop", t_stop}, {"trace_on", t_on}, {"trace_mark", t_mark},
  {"trace_tensor", t_tensor}, {"trace_read", t_read}, {"trace_keep", t_keep}, {"trace_parting", t_parting},
  {NULL, NULL}};
DM_LUA_FUNCS(funcs)
