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

/* core.trace_read() → {{name, kind, inputs, outputs}, ...}: the hashes as 16 hex digits
** (a mark has neither; a tensor has outputs only) */
static int t_read(lua_State *L) {
  int64_t n;
  const dm_trace_entry *e = dm_trace_entries(&n);
  lua_createtable(L, (int)n, 0);
  for (int64_t i = 0; i < n; i++) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e[i].name); lua_setfield(L, -2, "name");
    lua_pushstring(L, kind_names[e[i].kind]); lua_setfield(L, -2, "kind");
    if (e[i].kind == DM_TRACE_FORWARD || e[i].kind == DM_TRACE_BACKWARD) {
      push_hash(L, e[i].in);
      lua_setfield(L, -2, "inputs");
    }
    if (e[i].kind != DM_TRACE_MARK) {
      push_hash(L, e[i].out);
      lua_setfield(L, -2, "outputs");
    }
    lua_rawseti(L, -2, (lua_Integer)(i + 1));
  }
  return 1;
}

static const luaL_Reg funcs[] = {
  {"trace_start", t_start},   {"trace_stop", t_stop}, {"trace_on", t_on}, {"trace_mark", t_mark},
  {"trace_tensor", t_tensor}, {"trace_read", t_read}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
