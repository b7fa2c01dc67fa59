/*
** bind.h — what the binding files share: the tensor userdata and the
** way a core error becomes a Lua error.
*/
#ifndef DM_LUA_BIND_H
#define DM_LUA_BIND_H

#include <lua.h>
#include <lauxlib.h>
#include "core/tensor.h"

#define DM_TENSOR_MT "dormouse.Tensor"

/* Every binding function that may reach dm_error starts with DM_ENTER(L): a
** core error then raises a Lua error in that Lua thread. */
void dm_lua_enter(lua_State *L);
#define DM_ENTER(L) dm_lua_enter(L)

void dm_lua_push(lua_State *L, dm_tensor *t);        /* takes over the reference */
dm_tensor *dm_lua_check(lua_State *L, int idx);      /* a live tensor, or an argument error */
/* the tensors of the Lua array at idx (*n of them), in a userdata left on the stack that holds the
** array; a hole, another value or a freed tensor raises, naming fn and what */
dm_tensor **dm_lua_tensor_list(lua_State *L, int idx, const char *fn, const char *what, int *n);
dm_tensor *dm_lua_opt(lua_State *L, int idx);        /* nil gives NULL */
bool dm_lua_is(lua_State *L, int idx);

/* shape tables: {4, 8} → ndim; raises naming the argument */
int dm_lua_shape(lua_State *L, int idx, int64_t *shape);
int dm_lua_shape_signed(lua_State *L, int idx, int64_t *list);   /* -1 allowed */
void dm_lua_push_shape(lua_State *L, int ndim, const int64_t *shape);
dm_dtype dm_lua_dtype(lua_State *L, int idx, dm_dtype dflt);
dm_device dm_lua_device(lua_State *L, int idx, dm_device dflt);

/* A binding file adds its functions to `dormouse.core` with
** DM_LUA_FUNCS(table); no other file needs editing. */
void dm_lua_register_funcs(const luaL_Reg *funcs);
#define DM_LUA_FUNCS(table)                                               \
  __attribute__((constructor)) static void dm_lua_register_(void) {       \
    dm_lua_register_funcs(table);                                         \
  }

void dm_lua_open_tensor(lua_State *L);     /* fills the module table on the stack top */
void dm_lua_open_core(lua_State *L);
/* a state with the standard libraries, LPeg, the core and root/lua on package.path (NULL: no memory) */
lua_State *dm_lua_new_state(const char *root);
int dm_lua_tostring(lua_State *L);

#endif
