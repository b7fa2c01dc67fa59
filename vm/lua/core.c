/*
** vm/lua/core.c — the module `dormouse.core`: calling ops, creating tensors,
** grad mode, the generator, memory statistics.
*/
#include <stdio.h>
#include <string.h>
#include "lua/bind.h"
#include "core/core.h"
#include "core/autograd.h"
#include "core/alloc.h"

/* A binding's error about its arguments, located at the user's line like a core error. */
#define FAIL(L, ...) do { DM_ENTER(L); dm_error(__VA_ARGS__); } while (0)

/* ---- calling an op ----------------------------------------------------------------------- */

/* upvalue cache: name → light userdata of the dm_op */
static const dm_op *check_op(lua_State *L, int idx) {
  if (lua_islightuserdata(L, idx)) return lua_touserdata(L, idx);
  const char *name = luaL_checkstring(L, idx);
  const dm_op *op = dm_op_find(name);
  if (!op) luaL_error(L, "unknown op '%s'", name);
  return op;
}

/* An enum attribute given by name: its declaration (op->attrs) lists the words, and the word's place
** in that list is its value. Anything else is an error naming the words. */
static double spelled_attr(lua_State *L, const dm_op *op, int i, const char *word) {
  const dm_attr_decl *d;
  int n = dm_op_attr_decls(op, &d);
  if (i >= n || !d[i].words)
    FAIL(L, "%s: attribute %d takes a number, not the name '%s'", op->name, i + 1, word);
  int value = dm_attr_word(&d[i], word, strlen(word));
  if (value < 0)
    FAIL(L, "%s: %.*s must be one of %.*s, got '%s'", op->name, d[i].name_len, d[i].name, d[i].words_len, d[i].words, word);
  return value;
}

static void read_attrs(lua_State *L, int idx, const dm_op *op, dm_attrs *a) {
  memset(a, 0, sizeof *a);
  if (lua_isnoneornil(L, idx)) return;
  luaL_checktype(L, idx, LUA_TTABLE);
  int n = (int)luaL_len(L, idx);
  if (n > DM_MAXATTR) luaL_error(L, "%s: at most %d attributes", op->name, DM_MAXATTR);
  for (int i = 0; i < n; i++) {
    int t = lua_geti(L, idx, i + 1);
    if (t == LUA_TBOOLEAN) a->v[i] = lua_toboolean(L, -1);
    else if (t == LUA_TNUMBER) a->v[i] = lua_tonumber(L, -1);
    else if (t == LUA_TSTRING) a->v[i] = spelled_attr(L, op, i, lua_tostring(L, -1));
    else luaL_error(L, "%s: attribute %d must be a number, boolean or spelling, got %s", op->name, i + 1,
                    luaL_typename(L, -1));
    lua_pop(L, 1);
  }
  a->nv = n;
  if (lua_getfield(L, idx, "list") == LUA_TTABLE) a->nlist = dm_lua_shape_signed(L, lua_gettop(L), a->list);
  lua_pop(L, 1);
}

/* core.call(op, t1, ..., tn, attrs) or core.call(op, {t1, ...}, attrs) for a variadic op */
static int c_call(lua_State *L) {
  const dm_op *op = check_op(L, 1);
  dm_tensor *in[DM_MAXIN];
  int n_in, attrs_at;
  if (op->n_in < 0) {
    luaL_checktype(L, 2, LUA_TTABLE);
    n_in = (int)luaL_len(L, 2);
    if (n_in < 1 || n_in > DM_MAXIN)
      FAIL(L, "%s: takes 1 to %d tensors, got %d", op->name, DM_MAXIN, n_in);
    for (int i = 0; i < n_in; i++) {
      lua_geti(L, 2, i + 1);
      if (!dm_lua_is(L, -1))
        FAIL(L, "%s: element %d of the list is a %s, not a tensor", op->name, i + 1,
                          luaL_typename(L, -1));
      in[i] = dm_lua_check(L, -1);
      lua_pop(L, 1);
    }
    attrs_at = 3;
  } else {
    n_in = op->n_in;
    for (int i = 0; i < n_in; i++) {
      int at = i + 2;
      if (lua_isnoneornil(L, at) && ((op->optional >> i) & 1)) { in[i] = NULL; continue; }
      if (!dm_lua_is(L, at))
        FAIL(L, "%s: input %d must be a tensor, got %s", op->name, i + 1, luaL_typename(L, at));
      in[i] = dm_lua_check(L, at);
    }
    attrs_at = n_in + 2;
  }
  dm_attrs a;
  read_attrs(L, attrs_at, op, &a);
  DM_ENTER(L);
  dm_tensor *out[DM_MAXOUT];
  dm_call(op, n_in, in, &a, out);
  for (int i = 0; i < op->n_out; i++) dm_lua_push(L, out[i]);
  return op->n_out;
}

static int c_op(lua_State *L) {
  lua_pushlightuserdata(L, (void *)check_op(L, 1));
  return 1;
}

/* An op's attributes from their declarations (vm/core/ops.h, dm_attr_decl): attr_names, the names in
** order (the list attribute last); spellings, {name = {word, ...}} for each enum attribute, its words in
** the enum's order; attr_decls, {name =, kind =, default =, fixed =, list =, words =} for each: kind one
** of "number", "int", "bool", "dim", "newdim", "pos", "dtype"; default (as the op receives it) and
** fixed (what Lua always passes) numbers or nil. */
static void push_attrs(lua_State *L, const dm_op *op) {
  const dm_attr_decl *d;
  int n = dm_op_attr_decls(op, &d);
  lua_createtable(L, n, 0);                          /* attr_names */
  lua_newtable(L);                                   /* spellings */
  lua_createtable(L, n, 0);                          /* attr_decls */
  for (int i = 0; i < n; i++) {
    lua_pushlstring(L, d[i].name, (size_t)d[i].name_len);
    lua_rawseti(L, -4, i + 1);
    lua_createtable(L, 0, 6);
    lua_pushlstring(L, d[i].name, (size_t)d[i].name_len); lua_setfield(L, -2, "name");
    lua_pushstring(L, dm_attr_kind_names[d[i].kind]); lua_setfield(L, -2, "kind");
    if (d[i].has_default) { lua_pushnumber(L, d[i].dflt); lua_setfield(L, -2, "default"); }
    if (d[i].fixed) { lua_pushnumber(L, d[i].fixed_value); lua_setfield(L, -2, "fixed"); }
    lua_pushboolean(L, d[i].list); lua_setfield(L, -2, "list");
    if (d[i].words) {
      lua_newtable(L);
      int k = 0;
      for (const char *w = d[i].words, *end = w + d[i].words_len; w <= end;) {
        const char *bar = memchr(w, '|', (size_t)(end - w)), *w_end = bar ? bar : end;
        lua_pushlstring(L, w, (size_t)(w_end - w));
        lua_rawseti(L, -2, ++k);
        w = w_end + 1;
      }
      lua_pushvalue(L, -1);
      lua_setfield(L, -3, "words");
      lua_pushlstring(L, d[i].name, (size_t)d[i].name_len);
      lua_insert(L, -2);
      lua_rawset(L, -5);                             /* spellings[name] = words */
    }
    lua_rawseti(L, -2, i + 1);
  }
}

static int c_ops(lua_State *L) {
  lua_createtable(L, dm_op_count(), 0);
  for (int i = 0; i < dm_op_count(); i++) {
    const dm_op *op = dm_op_at(i);
    lua_createtable(L, 0, 14);
    push_attrs(L, op);
    lua_setfield(L, -4, "attr_decls");
    lua_setfield(L, -3, "spellings");
    lua_setfield(L, -2, "attr_names");
    lua_pushstring(L, op->name); lua_setfield(L, -2, "name");
    lua_pushstring(L, op->doc ? op->doc : ""); lua_setfield(L, -2, "doc");
    lua_pushstring(L, op->attrs ? op->attrs : ""); lua_setfield(L, -2, "attrs");
    lua_pushinteger(L, op->n_in); lua_setfield(L, -2, "n_in");
    lua_pushinteger(L, op->n_out); lua_setfield(L, -2, "n_out");
    lua_pushboolean(L, op->backward != NULL); lua_setfield(L, -2, "differentiable");
    static const char *forms[] = {[DM_LUA_FN] = "function", [DM_LUA_METHOD] = "method"};
    if (op->lua < DM_LUA_OWN || op->lua > DM_LUA_METHOD)
      return luaL_error(L, "op %s: its lua form %d is not a DM_LUA_* value (vm/core/ops.h)", op->name, op->lua);
    if (op->lua != DM_LUA_OWN) { lua_pushstring(L, forms[op->lua]); lua_setfield(L, -2, "lua"); }
    if (op->args) { lua_pushstring(L, op->args); lua_setfield(L, -2, "args"); }
    lua_createtable(L, op->n_in > 0 ? op->n_in : 0, 0);       /* optional[i]: input i may be nil */
    for (int i = 0; i < op->n_in; i++) { lua_pushboolean(L, (op->optional >> i) & 1); lua_rawseti(L, -2, i + 1); }
    lua_setfield(L, -2, "optional");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* ---- creation ------------------------------------------------------------------------------- */

typedef struct spec { int ndim; int64_t shape[DM_MAXDIM]; dm_dtype dt; dm_device dev; } spec;

/* (shape, dtype, device) at idx, idx+1, idx+2 */
static spec read_spec(lua_State *L, int idx) {
  spec s;
  s.ndim = dm_lua_shape(L, idx, s.shape);
  s.dt = dm_lua_dtype(L, idx + 1, DM_F32);
  s.dev = dm_lua_device(L, idx + 2, DM_CPU);
  return s;
}

static int c_empty(lua_State *L) {
  spec s = read_spec(L, 1);
  DM_ENTER(L);
  dm_lua_push(L, dm_empty(s.dev, s.dt, s.ndim, s.shape));
  return 1;
}

/* core.full(shape, value, dtype, device) */
static int c_full(lua_State *L) {
  if (lua_type(L, 2) != LUA_TNUMBER) FAIL(L, "full: the value must be a number, got %s", luaL_typename(L, 2));
  double v = lua_tonumber(L, 2);
  lua_remove(L, 2);
  spec s = read_spec(L, 1);
  DM_ENTER(L);
  dm_lua_push(L, dm_full(s.dev, s.dt, s.ndim, s.shape, v));
  return 1;
}

static int c_arange(lua_State *L) {
  for (int i = 1; i <= 3; i++)
    if (lua_type(L, i) != LUA_TNUMBER)
      FAIL(L, "arange: start, stop and step must be numbers, got a %s", luaL_typename(L, i));
  double start = lua_tonumber(L, 1), stop = lua_tonumber(L, 2), step = lua_tonumber(L, 3);
  dm_dtype dt = dm_lua_dtype(L, 4, DM_F32);
  dm_device dev = dm_lua_device(L, 5, DM_CPU);
  DM_ENTER(L);
  dm_lua_push(L, dm_arange(dev, dt, start, stop, step));
  return 1;
}

/* core.rand(shape, dtype, device, normal, seed, offset): seed nil uses the global generator */
static int c_rand(lua_State *L) {
  spec s = read_spec(L, 1);
  bool normal = lua_toboolean(L, 4);
  DM_ENTER(L);
  if (lua_isnoneornil(L, 5)) {
    dm_lua_push(L, normal ? dm_randn(s.dev, s.dt, s.ndim, s.shape) : dm_rand(s.dev, s.dt, s.ndim, s.shape));
    return 1;
  }
  for (int i = 5; i <= 6; i++)
    if (!lua_isinteger(L, i) && !(i == 6 && lua_isnoneornil(L, i)))
      FAIL(L, "%s must be an integer, got %s", i == 5 ? "seed" : "offset", luaL_tolstring(L, i, NULL));
  dm_lua_push(L, dm_rand_at(s.dev, s.dt, s.ndim, s.shape, (uint64_t)lua_tointeger(L, 5),
                            (uint64_t)luaL_optinteger(L, 6, 0), normal));
  return 1;
}

/* nested tables → shape; raises on ragged input */
static int table_shape(lua_State *L, int idx, int64_t *shape) {
  int ndim = 0;
  lua_pushvalue(L, idx);
  while (lua_type(L, -1) == LUA_TTABLE) {
    if (ndim == DM_MAXDIM) FAIL(L, "tensor: nested more than %d deep", DM_MAXDIM);
    shape[ndim++] = (int64_t)luaL_len(L, -1);
    if (shape[ndim - 1] == 0) break;
    lua_geti(L, -1, 1);
    lua_remove(L, -2);
  }
  lua_pop(L, 1);
  return ndim;
}

static void fill_from(lua_State *L, int idx, dm_tensor *t, int d, int64_t *flat) {
  if (d == t->ndim) {
    if (lua_type(L, idx) != LUA_TNUMBER)
      FAIL(L, "tensor: element %d is a %s, not a number", (int)*flat + 1, luaL_typename(L, idx));
    double v = lua_tonumber(L, idx);
    dm_store(t->dtype, (char *)dm_data(t) + (*flat)++ * (int64_t)dm_dtype_size(t->dtype), v);
    return;
  }
  if (lua_type(L, idx) != LUA_TTABLE)
    FAIL(L, "tensor: ragged nested table at depth %d: expected a table of %d elements, got a %s", d + 1,
         (int)t->shape[d], luaL_typename(L, idx));
  if (luaL_len(L, idx) != t->shape[d])
    FAIL(L, "tensor: ragged nested table at depth %d: expected %d elements, got %d", d + 1,
         (int)t->shape[d], (int)luaL_len(L, idx));
  luaL_checkstack(L, 2, "tensor nested too deeply");
  for (int64_t i = 0; i < t->shape[d]; i++) {
    lua_geti(L, idx, i + 1);
    fill_from(L, lua_gettop(L), t, d + 1, flat);
    lua_pop(L, 1);
  }
}

/* core.tensor(data, dtype, device) */
/* a string's bytes as u8 [n] (a corpus sample, a prompt) */
static int tensor_of_string(lua_State *L, dm_dtype dt, dm_device dev) {
  if (dt != DM_U8) FAIL(L, "tensor: a string gives its bytes, u8; asked for %s", dm_dtype_name(dt));
  size_t n;
  const char *s = lua_tolstring(L, 1, &n);
  int64_t shape[1] = {(int64_t)n};
  DM_ENTER(L);
  dm_tensor *h = dm_empty(DM_CPU, DM_U8, 1, shape);
  dm_lua_push(L, h);
  if (n > 0) memcpy(dm_data(h), s, n);
  if (dev != DM_CPU) dm_lua_push(L, dm_to_device(h, dev));
  return 1;
}

static int c_tensor(lua_State *L) {
  if (lua_type(L, 1) != LUA_TTABLE && lua_type(L, 1) != LUA_TNUMBER && lua_type(L, 1) != LUA_TSTRING)
    FAIL(L, "tensor: takes a number, nested tables of numbers or a string, got %s", luaL_typename(L, 1));
  if (lua_type(L, 1) == LUA_TSTRING) return tensor_of_string(L, dm_lua_dtype(L, 2, DM_U8), dm_lua_device(L, 3, DM_CPU));
  dm_dtype dt = dm_lua_dtype(L, 2, DM_F32);
  dm_device dev = dm_lua_device(L, 3, DM_CPU);
  int64_t shape[DM_MAXDIM];
  int ndim = table_shape(L, 1, shape);
  DM_ENTER(L);
  dm_tensor *h = dm_empty(DM_CPU, dt, ndim, shape);
  dm_lua_push(L, h);                        /* owned by Lua while filling, in case of an error */
  int64_t flat = 0;
  fill_from(L, 1, h, 0, &flat);
  if (dev != DM_CPU) dm_lua_push(L, dm_to_device(h, dev));
  return 1;
}

/* ---- grad mode, generator, memory ---------------------------------------------------------- */

static int c_grad_enabled(lua_State *L) { lua_pushboolean(L, dm_grad_enabled()); return 1; }
static int c_set_grad_enabled(lua_State *L) { dm_set_grad_enabled(lua_toboolean(L, 1)); return 0; }
static int c_tape_size(lua_State *L) { lua_pushinteger(L, (lua_Integer)dm_tape_size()); return 1; }
static int c_tape_clear(lua_State *L) { dm_tape_clear(); return 0; }

static int c_manual_seed(lua_State *L) {
  if (!lua_isinteger(L, 1)) FAIL(L, "manual_seed: the seed must be an integer, got %s", luaL_tolstring(L, 1, NULL));
  dm_manual_seed((uint64_t)lua_tointeger(L, 1));
  return 0;
}

static int c_rng_state(lua_State *L) {
  uint64_t seed, offset;
  if (!lua_isnoneornil(L, 1)) {
    dm_rng_set_state((uint64_t)luaL_checkinteger(L, 1), (uint64_t)luaL_checkinteger(L, 2));
    return 0;
  }
  dm_rng_state(&seed, &offset);
  lua_pushinteger(L, (lua_Integer)seed);
  lua_pushinteger(L, (lua_Integer)offset);
  return 2;
}

static int c_memory(lua_State *L) {
  dm_device dev = dm_lua_device(L, 1, DM_CPU);
  dm_mem_stats st = dm_memory_stats(dev);
  lua_createtable(L, 0, 6);
  lua_pushinteger(L, st.allocated); lua_setfield(L, -2, "current");
  lua_pushinteger(L, st.allocated); lua_setfield(L, -2, "allocated");
  lua_pushinteger(L, st.peak); lua_setfield(L, -2, "peak");
  lua_pushinteger(L, st.count); lua_setfield(L, -2, "count");
  lua_pushinteger(L, st.reserved); lua_setfield(L, -2, "reserved");
  lua_pushinteger(L, st.sys_allocs); lua_setfield(L, -2, "device_allocs");
  lua_pushinteger(L, (lua_Integer)dm_tape_size()); lua_setfield(L, -2, "tape_nodes");
  return 1;
}

static int c_reset_peak(lua_State *L) { dm_memory_reset_peak(dm_lua_device(L, 1, DM_CPU)); return 0; }
static int c_empty_cache(lua_State *L) { dm_memory_empty_cache(dm_lua_device(L, 1, DM_CPU)); return 0; }

/* the dtypes' names in the order of dm_dtype (dtype.c has them), and a name's value (nil: none) */
static int c_dtype_names(lua_State *L) {
  lua_createtable(L, DM_NDTYPE, 0);
  for (int i = 0; i < DM_NDTYPE; i++) {
    lua_pushstring(L, dm_dtype_name((dm_dtype)i));
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int c_dtype_code(lua_State *L) {
  int dt = lua_type(L, 1) == LUA_TSTRING ? dm_dtype_from_name(lua_tostring(L, 1)) : -1;
  if (dt < 0) lua_pushnil(L);
  else lua_pushinteger(L, dt);
  return 1;
}

static int c_device_available(lua_State *L) {
  lua_pushboolean(L, dm_device_available(dm_lua_device(L, 1, DM_CPU)));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"call", c_call}, {"op", c_op}, {"ops", c_ops}, {"dtype_names", c_dtype_names}, {"dtype_code", c_dtype_code},
  {"empty", c_empty}, {"full", c_full}, {"arange", c_arange}, {"rand", c_rand}, {"tensor", c_tensor},
  {"grad_enabled", c_grad_enabled}, {"set_grad_enabled", c_set_grad_enabled},
  {"tape_size", c_tape_size}, {"tape_clear", c_tape_clear},
  {"manual_seed", c_manual_seed}, {"rng_state", c_rng_state},
  {"memory", c_memory}, {"reset_peak", c_reset_peak}, {"empty_cache", c_empty_cache},
  {"device_available", c_device_available},
  {NULL, NULL}
};

#define MAX_FUNC_TABLES 64
static const luaL_Reg *func_tables[MAX_FUNC_TABLES];
static int n_func_tables;

void dm_lua_register_funcs(const luaL_Reg *table) {
  if (n_func_tables < MAX_FUNC_TABLES) func_tables[n_func_tables++] = table;
}

/* every binding file's functions, with a clash caught rather than overwritten */
static void set_registered(lua_State *L) {
  if (n_func_tables == MAX_FUNC_TABLES) luaL_error(L, "too many binding tables (raise MAX_FUNC_TABLES)");
  for (int i = 0; i < n_func_tables; i++)
    for (const luaL_Reg *r = func_tables[i]; r->name; r++) {
      if (lua_getfield(L, -1, r->name) != LUA_TNIL) luaL_error(L, "dormouse.core.%s is bound twice", r->name);
      lua_pop(L, 1);
      lua_pushcfunction(L, r->func);
      lua_setfield(L, -2, r->name);
    }
}

static int open_core(lua_State *L) {
  lua_newtable(L);
  luaL_setfuncs(L, funcs, 0);
  lua_pushstring(L, DM_VERSION);
  lua_setfield(L, -2, "version");
#ifdef DM_SANITIZED
  lua_pushboolean(L, 1);           /* AddressSanitizer's allocator: host memory is its, not glibc's */
#else
  lua_pushboolean(L, 0);
#endif
  lua_setfield(L, -2, "sanitized");
  dm_lua_open_tensor(L);
  set_registered(L);
  return 1;
}

void dm_lua_open_core(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
  lua_pushcfunction(L, open_core);
  lua_setfield(L, -2, "dormouse.core");
  lua_pop(L, 1);
}
