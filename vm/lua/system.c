/*
** vm/lua/system.c — what the machine has, for a run's pre-flight, and the dtypes' sizes and kinds:
**
**   core.disk_free(path)      -> bytes free to this user on path's filesystem, or nil, why
**   core.memory_available()   -> bytes of host memory available (MemAvailable), or nil
**   core.dtype_size(name)     -> bytes an element of that dtype takes (vm/core/dm.h's fact)
**   core.float_dtypes()       -> {name = true, ...}: the floating-point dtypes (the same table's)
**   core.pid()                -> this process's id
**   core.same_file(a, b)      -> whether two paths name one file
*/
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <unistd.h>
#include "lua/bind.h"
#include "core/dm.h"

static int c_disk_free(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct statvfs s;
  if (statvfs(path, &s) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  lua_pushinteger(L, (lua_Integer)s.f_bavail * (lua_Integer)s.f_frsize);
  return 1;
}

static int c_memory_available(lua_State *L) {
  FILE *f = fopen("/proc/meminfo", "r");
  long long kb = -1;
  char line[256];
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
  if (f) fclose(f);
  if (kb < 0) lua_pushnil(L);
  else lua_pushinteger(L, (lua_Integer)kb * 1024);
  return 1;
}

static int c_dtype_size(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  int t = dm_dtype_from_name(name);
  if (t < 0) return luaL_error(L, "dtype_size: unknown dtype '%s'", name);
  lua_pushinteger(L, (lua_Integer)dm_dtype_size((dm_dtype)t));
  return 1;
}

/* core.float_dtypes() -> {name = true, ...}: the dtypes that hold floating-point values (dtype.c's fact) */
static int c_float_dtypes(lua_State *L) {
  lua_createtable(L, 0, DM_NDTYPE);
  for (int i = 0; i < DM_NDTYPE; i++) {
    if (!dm_dtype_is_float((dm_dtype)i)) continue;
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, dm_dtype_name((dm_dtype)i));
  }
  return 1;
}

static int c_pid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

/* core.same_file(a, b) → true when both paths exist and name one file (the same device and inode) */
static int c_same_file(lua_State *L) {
  struct stat sa, sb;
  bool same = stat(luaL_checkstring(L, 1), &sa) == 0 && stat(luaL_checkstring(L, 2), &sb) == 0 &&
              sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  lua_pushboolean(L, same);
  return 1;
}

static const luaL_Reg funcs[] = {{"disk_free", c_disk_free}, {"memory_available", c_memory_available},
                                 {"dtype_size", c_dtype_size}, {"float_dtypes", c_float_dtypes}, {"pid", c_pid},
                                 {"same_file", c_same_file},
                                 {NULL, NULL}};
DM_LUA_FUNCS(funcs)
