/*
** vm/lua/vendor.c — files embedded in the binary at build time (cmake/vendor.cmake):
** the report's chart library. core.vendor(name) → its bytes, or nil when the
** build has none of that name (configured offline, or -DDM_VENDOR=OFF).
*/
#include <string.h>
#include "lua/bind.h"
#include "lua/vendor.h"

static int v_vendor(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  for (const dm_vendor_file *f = dm_vendor_files; f->name; f++)
    if (strcmp(f->name, name) == 0) {
      lua_pushlstring(L, f->data, f->size);
      return 1;
    }
  lua_pushnil(L);
  return 1;
}

static const luaL_Reg funcs[] = {{"vendor", v_vendor}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
