/*
** vm/lua/sample.c — the byte draw on the logits' device for Lua:
**
**   core.sample_bytes(out, logits, seeds, counts, temperature, top_p[, offset])
**
** out [B] u8 or i64 receives row b's byte of logits [B, V] f32, drawn with
** row b's seed and uniform number counts[b] + offset (vm/ops/sample.h).
*/
#include "lua/bind.h"
#include "ops/sample.h"

static int c_sample_bytes(lua_State *L) {
  dm_tensor *out = dm_lua_check(L, 1), *logits = dm_lua_check(L, 2);
  dm_tensor *seeds = dm_lua_check(L, 3), *counts = dm_lua_check(L, 4);
  dm_sample_hp hp = {.temperature = luaL_checknumber(L, 5), .top_p = luaL_checknumber(L, 6),
                     .offset = luaL_optinteger(L, 7, 0)};
  DM_ENTER(L);
  dm_sample_bytes(out, logits, seeds, counts, &hp);
  return 0;
}

static const luaL_Reg funcs[] = {
  {"sample_bytes", c_sample_bytes},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
