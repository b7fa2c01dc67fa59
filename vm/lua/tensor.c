/*
** vm/lua/tensor.c — the tensor userdata: its metatable, properties, the
** methods that need C, and the error bridge from the core to Lua.
*/
#include <stdarg.h>
#include <string.h>
#include <stdio.h>
#include <math.h>
#include "lua/bind.h"
#include "core/core.h"
#include "core/autograd.h"
#include "core/alloc.h"

/* ---- errors ---------------------------------------------------------------------- */

static lua_State *current;

/* A chunk of the library: lua/dormouse/... in the source tree or installed
** (share/dormouse/lua/dormouse/...). A user's folder that happens to be
** called dormouse is not one. */
static bool in_library(const char *source) {
  if (*source == '@') source++;
  for (const char *p = strstr(source, "lua/dormouse/"); p; p = strstr(p + 1, "lua/dormouse/"))
    if (p == source || p[-1] == '/') return true;
  return false;
}

/* The error names the first caller outside the dormouse library: a user's
** model file, not the wrapper that called the core. (A user's frame that
** tail-called the library is gone from the stack; its caller is named.) */
static void where(lua_State *L) {
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar); level++) {
    lua_getinfo(L, "Sl", &ar);
    if (ar.currentline > 0 && !in_library(ar.source)) {
      lua_pushfstring(L, "%s:%d: ", ar.short_src, ar.currentline);
      return;
    }
  }
  lua_pushliteral(L, "");      /* only the library and C on the stack: a location would mislead */
}

static void raise_lua(const char *msg, void *ud) {
  lua_State *L = current;
  where(L);
  lua_pushstring(L, msg);
  lua_concat(L, 2);
  lua_error(L);
}

void dm_lua_enter(lua_State *L) {
  current = L;
  dm_set_error_handler(raise_lua, NULL);
}

/* A binding's own error (a wrong argument, a freed tensor), located like a
** core error at the user's line rather than at the library line that called. */
static int raisef(lua_State *L, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  current = L;
  raise_lua(msg, NULL);
  return 0;
}

/* core.error(msg): the library's own errors, located at the user's line too */
static int c_error(lua_State *L) {
  luaL_checkstring(L, 1);
  where(L);
  lua_pushvalue(L, 1);
  lua_concat(L, 2);
  return lua_error(L);
}

/* ---- the userdata ------------------------------------------------------------------ */

/* ---- scopes ---------------------------------------------------------------------------------
** dm.scope(fn) runs a step: every tensor handed to Lua inside it is dropped
** when it ends, except the values fn returns. Dropping releases the Lua
** reference at once, so memory that nothing else holds (the tape, a
** parameter's .grad) returns without waiting for the garbage collector. A
** dropped tensor that Lua still reaches raises "tensor was freed" on use.
** The scopes live in the registry as a stack of arrays of userdata. */

static dm_tensor **check_box(lua_State *L, int idx);

static int scope_depth;
static const char *SCOPES = "dormouse.scopes";

static void scope_record(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  lua_getfield(L, LUA_REGISTRYINDEX, SCOPES);
  lua_geti(L, -1, scope_depth);
  lua_pushvalue(L, idx);
  lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
  lua_pop(L, 2);
}

void dm_lua_push(lua_State *L, dm_tensor *t) {
  dm_tensor **box = lua_newuserdatauv(L, sizeof *box, 0);
  *box = t;
  luaL_setmetatable(L, DM_TENSOR_MT);
  if (scope_depth > 0) scope_record(L, -1);
}

static int c_scope_begin(lua_State *L) {
  lua_getfield(L, LUA_REGISTRYINDEX, SCOPES);
  lua_newtable(L);
  lua_rawseti(L, -2, ++scope_depth);
  lua_pushinteger(L, scope_depth);
  return 1;
}

static void mark_kept(lua_State *L, int idx, int keep, int depth) {
  if (luaL_testudata(L, idx, DM_TENSOR_MT)) {
    lua_pushvalue(L, idx);
    lua_pushboolean(L, 1);
    lua_rawset(L, keep);
  } else if (lua_type(L, idx) == LUA_TTABLE && depth < 2) {   /* tensors in returned tables */
    lua_pushnil(L);
    while (lua_next(L, idx)) { mark_kept(L, lua_gettop(L), keep, depth + 1); lua_pop(L, 1); }
  }
}

/* core.scope_end(depth, ...): drop what the scope recorded except the values given */
static int c_scope_end(lua_State *L) {
  int depth = (int)luaL_checkinteger(L, 1), n = lua_gettop(L);
  if (depth != scope_depth) return luaL_error(L, "dm.scope: scopes ended out of order");
  lua_newtable(L);
  int keep = lua_gettop(L);
  for (int i = 2; i <= n; i++) mark_kept(L, i, keep, 0);
  lua_getfield(L, LUA_REGISTRYINDEX, SCOPES);
  int scopes = lua_gettop(L);
  lua_geti(L, scopes, depth);
  int list = lua_gettop(L);
  lua_Integer len = (lua_Integer)lua_rawlen(L, list);
  for (lua_Integer i = 1; i <= len; i++) {
    lua_rawgeti(L, list, i);
    lua_pushvalue(L, -1);
    if (lua_rawget(L, keep) != LUA_TNIL) {          /* kept: it now belongs to the outer scope */
      lua_pop(L, 1);
      if (depth > 1) { scope_depth--; scope_record(L, -1); scope_depth++; }
    } else {
      lua_pop(L, 1);
      dm_tensor **box = lua_touserdata(L, -1);
      dm_release(*box);
      *box = NULL;
    }
    lua_pop(L, 1);
  }
  lua_pushnil(L);
  lua_rawseti(L, scopes, depth);
  scope_depth--;
  return 0;
}

/* core.keep(t): take t out of the current scope, so it outlives it */
static int c_keep(lua_State *L) {
  check_box(L, 1);
  if (scope_depth == 0) { lua_settop(L, 1); return 1; }
  lua_getfield(L, LUA_REGISTRYINDEX, SCOPES);
  lua_geti(L, -1, scope_depth);
  lua_Integer len = (lua_Integer)lua_rawlen(L, -1);
  for (lua_Integer i = 1; i <= len; i++) {
    lua_rawgeti(L, -1, i);
    bool same = lua_rawequal(L, -1, 1);
    lua_pop(L, 1);
    if (same) {                                      /* swap-remove */
      lua_rawgeti(L, -1, len);
      lua_rawseti(L, -2, i);
      lua_pushnil(L);
      lua_rawseti(L, -2, len);
      break;
    }
  }
  lua_settop(L, 1);
  return 1;
}

bool dm_lua_is(lua_State *L, int idx) { return luaL_testudata(L, idx, DM_TENSOR_MT) != NULL; }

#define FREED_MSG "tensor was freed (by :free(), a <close> variable or the end of its dm.scope)"

/* the name of the running C function as Lua called it ("copy_"), for messages */
static const char *fname(lua_State *L) {
  lua_Debug ar;
  if (lua_getstack(L, 0, &ar) && lua_getinfo(L, "n", &ar) && ar.name) return ar.name;
  return "?";
}

static dm_tensor **check_box(lua_State *L, int idx) {     /* freed ones too */
  dm_tensor **box = luaL_testudata(L, idx, DM_TENSOR_MT);
  if (!box) raisef(L, "%s: expected a tensor, got %s", fname(L), luaL_typename(L, idx));
  return box;
}

dm_tensor **dm_lua_tensor_list(lua_State *L, int idx, const char *fn, const char *what, int *n) {
  if (!lua_istable(L, idx)) dm_error("%s: %s must be a list of tensors, got %s", fn, what, luaL_typename(L, idx));
  int len = (int)luaL_len(L, idx);
  dm_tensor **a = lua_newuserdatauv(L, sizeof *a * (size_t)(len > 0 ? len : 1), 0);
  for (int i = 0; i < len; i++) {
    lua_geti(L, idx, i + 1);
    dm_tensor **box = luaL_testudata(L, -1, DM_TENSOR_MT);
    if (!box) dm_error("%s: %s[%d] is a %s, not a tensor", fn, what, i + 1, luaL_typename(L, -1));
    if (!*box || !(*box)->storage) dm_error("%s: %s[%d] was freed", fn, what, i + 1);
    a[i] = *box;
    lua_pop(L, 1);
  }
  *n = len;
  return a;
}

dm_tensor *dm_lua_check(lua_State *L, int idx) {
  dm_tensor **box = check_box(L, idx);
  if (!*box || !(*box)->storage) raisef(L, FREED_MSG);
  return *box;
}

dm_tensor *dm_lua_opt(lua_State *L, int idx) {
  return lua_isnoneornil(L, idx) ? NULL : dm_lua_check(L, idx);
}

static int read_ints(lua_State *L, int idx, int64_t *out, bool allow_negative) {
  if (lua_isinteger(L, idx)) { out[0] = lua_tointeger(L, idx); return 1; }
  if (!lua_istable(L, idx))
    raisef(L, "a shape is a table of sizes such as {2, 3}, got %s", luaL_typename(L, idx));
  int n = (int)luaL_len(L, idx);
  if (n > DM_MAXDIM) raisef(L, "a shape has at most %d dims, got %d", DM_MAXDIM, n);
  for (int i = 0; i < n; i++) {
    lua_geti(L, idx, i + 1);
    int ok;
    lua_Integer v = lua_tointegerx(L, -1, &ok);
    if (!ok || (v < 0 && !allow_negative))
      raisef(L, "shape entry %d must be %s integer, got %s", i + 1, allow_negative ? "an" : "a non-negative",
             luaL_tolstring(L, -1, NULL));
    out[i] = v;
    lua_pop(L, 1);
  }
  return n;
}

int dm_lua_shape(lua_State *L, int idx, int64_t *shape) { return read_ints(L, idx, shape, false); }
int dm_lua_shape_signed(lua_State *L, int idx, int64_t *list) { return read_ints(L, idx, list, true); }

void dm_lua_push_shape(lua_State *L, int ndim, const int64_t *shape) {
  lua_createtable(L, ndim, 0);
  for (int i = 0; i < ndim; i++) { lua_pushinteger(L, shape[i]); lua_rawseti(L, -2, i + 1); }
}

/* a dtype or device name: a string, else an error naming what was given */
static const char *name_arg(lua_State *L, int idx, const char *what, const char *example) {
  if (lua_type(L, idx) != LUA_TSTRING)
    raisef(L, "%s must be a name such as \"%s\", got %s", what, example, luaL_typename(L, idx));
  return lua_tostring(L, idx);
}

dm_dtype dm_lua_dtype(lua_State *L, int idx, dm_dtype dflt) {
  if (lua_isnoneornil(L, idx)) return dflt;
  const char *name = name_arg(L, idx, "dtype", "f32");
  int dt = dm_dtype_from_name(name);
  if (dt < 0) raisef(L, "unknown dtype '%s' (f32 f64 bf16 f16 i32 i64 u8)", name);
  return (dm_dtype)dt;
}

dm_device dm_lua_device(lua_State *L, int idx, dm_device dflt) {
  if (lua_isnoneornil(L, idx)) return dflt;
  const char *name = name_arg(L, idx, "device", "cpu");
  int dev = dm_device_from_name(name);
  if (dev < 0) raisef(L, "unknown device '%s' (cpu cuda meta)", name);
  return (dm_device)dev;
}

/* ---- metamethods and properties --------------------------------------------------------- */

static int t_gc(lua_State *L) {
  dm_tensor **box = luaL_checkudata(L, 1, DM_TENSOR_MT);
  dm_release(*box);
  *box = NULL;
  return 0;
}

/* x:free(): the storage goes now, whoever else holds the tensor (the tape
** then reports it freed if backward needs it). */
static int t_free(lua_State *L) {
  dm_tensor **box = check_box(L, 1);
  if (*box) dm_tensor_free(*box);
  return 0;
}

/* <close>: this variable lets go now; the memory returns unless the tape or
** another holder still needs it (then it returns when they let go). */
static int t_close(lua_State *L) {
  dm_tensor **box = check_box(L, 1);
  dm_release(*box);
  *box = NULL;
  return 0;
}

static int t_len(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  lua_pushinteger(L, t->ndim ? t->shape[0] : 1);
  return 1;
}

static bool property(lua_State *L, dm_tensor *t, const char *key) {
  if (!strcmp(key, "dtype")) lua_pushstring(L, dm_dtype_name(t->dtype));
  else if (!strcmp(key, "device")) lua_pushstring(L, dm_device_name(t->device));
  else if (!strcmp(key, "ndim")) lua_pushinteger(L, t->ndim);
  else if (!strcmp(key, "is_leaf")) lua_pushboolean(L, t->node_epoch == 0 || !dm_tensor_node(t));
  else if (!strcmp(key, "grad")) {
    if (t->grad) { dm_retain(t->grad); dm_lua_push(L, t->grad); } else lua_pushnil(L);
  } else return false;
  return true;
}

/* upvalue 1: the methods table that the Lua layer fills */
static int t_index(lua_State *L) {
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL) return 1;
  lua_pop(L, 1);
  const char *key = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : NULL;
  if (key) {
    dm_tensor *t = *check_box(L, 1);
    if (!t || !t->storage) return raisef(L, FREED_MSG);
    if (property(L, t, key)) return 1;
  }
  if (lua_type(L, 2) == LUA_TSTRING) return raisef(L, "tensor has no method or field '%s'", key);
  return raisef(L, "tensors are indexed with methods (x:narrow, x:index_select), not x[%s]",
                    luaL_tolstring(L, 2, NULL));
}

static int t_newindex(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  if (lua_type(L, 2) != LUA_TSTRING)
    return raisef(L, "tensors are indexed with methods (x:narrow, x:index_select), not x[%s]",
                  luaL_tolstring(L, 2, NULL));
  const char *key = lua_tostring(L, 2);
  DM_ENTER(L);
  if (!strcmp(key, "grad")) {
    if (!lua_isnil(L, 3) && !dm_lua_is(L, 3))
      return raisef(L, ".grad must be a tensor or nil, got %s", luaL_typename(L, 3));
    dm_tensor *g = dm_lua_opt(L, 3);
    if (g) { dm_check_shape_equal("setting .grad", t, g); dm_retain(g); }
    dm_release(t->grad);
    t->grad = g;
    return 0;
  }
  return raisef(L, "cannot set field '%s' of a tensor (only .grad can be set)", key);
}

/* ---- methods that need C ------------------------------------------------------------------ */

static int t_shape(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  dm_lua_push_shape(L, t->ndim, t->shape);
  return 1;
}

static int t_size(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  if (lua_isnoneornil(L, 2)) { dm_lua_push_shape(L, t->ndim, t->shape); return 1; }
  if (!lua_isinteger(L, 2)) return raisef(L, "size: dim must be an integer, got %s", luaL_tolstring(L, 2, NULL));
  lua_Integer given = lua_tointeger(L, 2), d = given < 0 ? given + t->ndim + 1 : given;
  if (d < 1 || d > t->ndim)
    return raisef(L, "size: dim %d is out of range for a tensor of %d dims", (int)given, t->ndim);
  lua_pushinteger(L, t->shape[d - 1]);
  return 1;
}

static int t_stride(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  dm_lua_push_shape(L, t->ndim, t->strides);
  return 1;
}

static int t_dim(lua_State *L) { lua_pushinteger(L, dm_lua_check(L, 1)->ndim); return 1; }
static int t_numel(lua_State *L) { lua_pushinteger(L, dm_numel(dm_lua_check(L, 1))); return 1; }
static int t_is_contiguous(lua_State *L) { lua_pushboolean(L, dm_is_contiguous(dm_lua_check(L, 1))); return 1; }

/* a CPU tensor with t's values: t itself (a new reference) or a copy */
static dm_tensor *on_host(dm_tensor *t) {
  if (t->device == DM_META) dm_error("a meta tensor has no values");
  if (t->device == DM_CPU) { dm_retain(t); return t; }
  return dm_to_device(t, DM_CPU);
}

static void push_number(lua_State *L, dm_dtype dt, const void *p) {
  if (dm_dtype_is_float(dt)) lua_pushnumber(L, dm_load(dt, p));
  else if (dt == DM_I64) lua_pushinteger(L, *(const int64_t *)p);
  else lua_pushinteger(L, (lua_Integer)dm_load(dt, p));
}

static int t_item(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  DM_ENTER(L);
  if (dm_numel(t) != 1) {
    char buf[128];
    return raisef(L, "item: the tensor has %d elements (shape %s); item needs exactly one",
                      (int)dm_numel(t), dm_tensor_shape_str(t, buf, sizeof buf));
  }
  dm_tensor *h = on_host(t);
  push_number(L, h->dtype, dm_data(h));
  dm_release(h);
  return 1;
}

static void push_table(lua_State *L, const dm_tensor *t, int dim, const char *p) {
  size_t es = dm_dtype_size(t->dtype);
  if (dim == t->ndim) { push_number(L, t->dtype, p); return; }
  luaL_checkstack(L, 4, "tensor nested too deeply");
  lua_createtable(L, (int)t->shape[dim], 0);
  for (int64_t i = 0; i < t->shape[dim]; i++) {
    push_table(L, t, dim + 1, p + i * t->strides[dim] * (int64_t)es);
    lua_rawseti(L, -2, i + 1);
  }
}

static int t_totable(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  DM_ENTER(L);
  dm_tensor *h = on_host(t);
  push_table(L, h, 0, dm_data(h));
  dm_release(h);
  return 1;
}

static int t_detach(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  dm_lua_push(L, dm_tensor_view(t, t->ndim, t->shape, t->strides, t->offset));
  return 1;
}

static int t_requires_grad(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  if (lua_isnone(L, 2)) { lua_pushboolean(L, t->requires_grad); return 1; }
  bool on = lua_toboolean(L, 2);
  if (!on && dm_tensor_node(t))
    return raisef(L, "requires_grad(false) on the output of a recorded op; use :detach()");
  if (on && !dm_dtype_is_float(t->dtype))
    return raisef(L, "requires_grad: only float tensors can require grad, this one is %s",
                      dm_dtype_name(t->dtype));
  t->requires_grad = on;
  lua_settop(L, 1);
  return 1;
}

static int t_backward(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  dm_tensor *g = dm_lua_opt(L, 2);
  DM_ENTER(L);
  dm_backward(t, g);
  return 0;
}

static void check_inplace(lua_State *L, dm_tensor *t, const char *what) {
  if (t->requires_grad && dm_grad_enabled())
    raisef(L, "%s: in-place op on a tensor that requires grad; wrap it in dm.no_grad", what);
}

static int t_copy_(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1), *src = dm_lua_check(L, 2);
  DM_ENTER(L);
  check_inplace(L, t, "copy_");
  dm_copy_(t, src);
  lua_settop(L, 1);
  return 1;
}

static int t_fill_(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  if (lua_type(L, 2) != LUA_TNUMBER) return raisef(L, "fill_: value must be a number, got %s", luaL_typename(L, 2));
  double v = lua_tonumber(L, 2);
  DM_ENTER(L);
  check_inplace(L, t, "fill_");
  dm_fill(t, v);
  lua_settop(L, 1);
  return 1;
}

static int t_zero_(lua_State *L) {
  lua_settop(L, 1);
  lua_pushnumber(L, 0);
  return t_fill_(L);
}

static int t_to_device(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1);
  dm_device dev = dm_lua_device(L, 2, DM_CPU);
  DM_ENTER(L);
  if (dev == t->device) { lua_settop(L, 1); return 1; }
  dm_lua_push(L, dm_to_device(t, dev));
  return 1;
}

static int t_storage_offset(lua_State *L) {
  lua_pushinteger(L, dm_lua_check(L, 1)->offset);
  return 1;
}

static int t_is_freed(lua_State *L) {
  dm_tensor *t = *check_box(L, 1);
  lua_pushboolean(L, !t || !t->storage);
  return 1;
}

static const luaL_Reg methods[] = {
  {"shape", t_shape}, {"size", t_size}, {"stride", t_stride}, {"dim", t_dim},
  {"numel", t_numel}, {"is_contiguous", t_is_contiguous}, {"item", t_item},
  {"totable", t_totable}, {"detach", t_detach}, {"requires_grad", t_requires_grad},
  {"backward", t_backward}, {"copy_", t_copy_}, {"fill_", t_fill_}, {"zero_", t_zero_},
  {"free", t_free}, {"is_freed", t_is_freed}, {"_to_device", t_to_device},
  {"storage_offset", t_storage_offset}, {NULL, NULL}
};

void dm_lua_open_tensor(lua_State *L) {
  int module = lua_gettop(L);
  lua_newtable(L);                               /* methods */
  luaL_setfuncs(L, methods, 0);
  lua_pushvalue(L, -1);
  lua_setfield(L, module, "methods");
  luaL_newmetatable(L, DM_TENSOR_MT);
  lua_pushvalue(L, -2);
  lua_pushcclosure(L, t_index, 1);
  lua_setfield(L, -2, "__index");
  static const luaL_Reg meta[] = {
    {"__newindex", t_newindex}, {"__gc", t_gc}, {"__close", t_close}, {"__len", t_len},
    {"__tostring", dm_lua_tostring}, {NULL, NULL}
  };
  luaL_setfuncs(L, meta, 0);
  lua_pushstring(L, "Tensor");
  lua_setfield(L, -2, "__name");
  lua_setfield(L, module, "metatable");
  lua_pop(L, 1);                                 /* methods */
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, SCOPES);
  static const luaL_Reg scope_funcs[] = {
    {"scope_begin", c_scope_begin}, {"scope_end", c_scope_end}, {"keep", c_keep}, {"error", c_error},
    {NULL, NULL}
  };
  luaL_setfuncs(L, scope_funcs, 0);
}
