/*
** vm/lua/engram.c — the Engram family's C functions in `dormouse.core`: the
** table layout as a Lua table, the sparse Adam step, and host tables as
** userdata (a box holding the dm_hostable, NULL once closed; __gc and
** __close free it). lua/dormouse/ops/engram.lua wraps them.
*/
#include "lua/bind.h"
#include "ops/engram.h"
#include "data/hostable.h"

#define HOSTABLE_MT "dormouse.HostTable"

/* ---- the layout ----------------------------------------------------------------------------- */

static void set_int(lua_State *L, const char *k, int64_t v) {
  lua_pushinteger(L, v);
  lua_setfield(L, -2, k);
}

/* core.engram_layout({orders}, heads, rows) → the layout (offsets count rows from 0) */
static int c_engram_layout(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  int64_t orders[DM_ENGRAM_MAXORDER], heads = luaL_checkinteger(L, 2), rows = luaL_checkinteger(L, 3);
  DM_ENTER(L);
  if (n < 1 || n > DM_ENGRAM_MAXORDER) dm_error("engram layout: 1 to %d orders, got %d", DM_ENGRAM_MAXORDER, n);
  for (int i = 0; i < n; i++) {
    lua_geti(L, 1, i + 1);
    int ok;
    orders[i] = lua_tointegerx(L, -1, &ok);
    if (!ok) dm_error("engram layout: order %d must be an integer, got %s", i + 1, luaL_typename(L, -1));
    lua_pop(L, 1);
  }
  dm_engram_layout lay;
  dm_engram_layout_make(&lay, n, orders, heads, rows);
  lua_createtable(L, 0, 10);
  lua_createtable(L, lay.norders, 0);
  for (int i = 0; i < lay.norders; i++) { lua_pushinteger(L, lay.orders[i]); lua_rawseti(L, -2, i + 1); }
  lua_setfield(L, -2, "orders");
  set_int(L, "heads", lay.heads);
  set_int(L, "rows", lay.rows);
  set_int(L, "total_rows", lay.total_rows);
  set_int(L, "max_order", lay.max_order);
  set_int(L, "n_sub", lay.nsub);
  lua_createtable(L, lay.nsub, 0);                     /* sub */
  lua_createtable(L, lay.nsub, 0);                     /* offsets */
  lua_createtable(L, lay.nsub, 0);                     /* sizes */
  lua_createtable(L, lay.nsub, 0);                     /* primes */
  for (int s = 0, np = 0; s < lay.nsub; s++) {
    const dm_engram_sub *u = &lay.sub[s];
    lua_createtable(L, 0, 5);
    set_int(L, "order", u->order);
    set_int(L, "head", u->head + 1);
    lua_pushboolean(L, u->direct);
    lua_setfield(L, -2, "direct");
    set_int(L, "offset", u->offset);
    set_int(L, "size", u->size);
    lua_rawseti(L, -5, s + 1);
    lua_pushinteger(L, u->offset); lua_rawseti(L, -4, s + 1);
    lua_pushinteger(L, u->size); lua_rawseti(L, -3, s + 1);
    if (!u->direct) { lua_pushinteger(L, u->size); lua_rawseti(L, -2, ++np); }
  }
  lua_setfield(L, -5, "primes");
  lua_setfield(L, -4, "sizes");
  lua_setfield(L, -3, "offsets");
  lua_setfield(L, -2, "sub");
  return 1;
}

/* core.engram_adam(table, m, v, rows, grads, n, lr, beta1, beta2, eps, step) */
static int c_engram_adam(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1), *m = dm_lua_check(L, 2), *v = dm_lua_check(L, 3);
  dm_tensor *rows = dm_lua_check(L, 4), *grads = dm_lua_check(L, 5);
  int64_t n = luaL_checkinteger(L, 6), step = luaL_checkinteger(L, 11);
  double lr = luaL_checknumber(L, 7), b1 = luaL_checknumber(L, 8), b2 = luaL_checknumber(L, 9);
  double eps = luaL_checknumber(L, 10);
  DM_ENTER(L);
  dm_engram_adam(t, m, v, rows, grads, n, lr, b1, b2, eps, step);
  return 0;
}

/* the 8-bit moments of a table from the Lua table at idx: {m =, m_scale =, v =, v_scale =, salt =} */
static dm_engram_8bit arg_8bit(lua_State *L, int idx) {
  luaL_checktype(L, idx, LUA_TTABLE);
  dm_engram_8bit m8;
  dm_tensor **slots[4] = {&m8.m, &m8.m_scale, &m8.v, &m8.v_scale};
  const char *names[4] = {"m", "m_scale", "v", "v_scale"};
  for (int k = 0; k < 4; k++) {
    lua_getfield(L, idx, names[k]);
    *slots[k] = dm_lua_check(L, -1);
    lua_pop(L, 1);
  }
  lua_getfield(L, idx, "salt");
  m8.salt = (uint32_t)luaL_optinteger(L, -1, 0);
  lua_pop(L, 1);
  return m8;
}

/* core.engram_adam_8bit(table, m8, rows, grads, n, lr, beta1, beta2, eps, step) */
static int c_engram_adam_8bit(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1), *rows = dm_lua_check(L, 3), *grads = dm_lua_check(L, 4);
  dm_engram_8bit m8 = arg_8bit(L, 2);
  int64_t n = luaL_checkinteger(L, 5), step = luaL_checkinteger(L, 10);
  double lr = luaL_checknumber(L, 6), b1 = luaL_checknumber(L, 7), b2 = luaL_checknumber(L, 8);
  double eps = luaL_checknumber(L, 9);
  DM_ENTER(L);
  dm_engram_adam_8bit(t, &m8, rows, grads, n, lr, b1, b2, eps, step);
  return 0;
}

/* core.engram_adam_8bit_at(table, m8, rows, grads, n_at, beta1, beta2, eps, lr_at, step_at[, sumsq_at]) */
static int c_engram_adam_8bit_at(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1), *rows = dm_lua_check(L, 3), *grads = dm_lua_check(L, 4);
  dm_engram_8bit m8 = arg_8bit(L, 2);
  dm_tensor *n_at = lua_isnil(L, 5) ? NULL : dm_lua_check(L, 5);       /* nil: every row */
  dm_tensor *lr_at = dm_lua_check(L, 9), *step_at = dm_lua_check(L, 10);
  dm_tensor *sumsq_at = lua_isnoneornil(L, 11) ? NULL : dm_lua_check(L, 11);
  double b1 = luaL_checknumber(L, 6), b2 = luaL_checknumber(L, 7), eps = luaL_checknumber(L, 8);
  DM_ENTER(L);
  dm_engram_adam_8bit_at(t, &m8, rows, grads, n_at, b1, b2, eps, lr_at, step_at, sumsq_at);
  return 0;
}

/* ---- host tables ------------------------------------------------------------------------------ */

static dm_hostable *check_hostable(lua_State *L, int idx) {
  void **box = luaL_checkudata(L, idx, HOSTABLE_MT);
  if (!*box) {
    DM_ENTER(L);
    dm_error("the host table is closed");
  }
  return *box;
}

static int close_hostable(lua_State *L) {
  void **box = luaL_checkudata(L, 1, HOSTABLE_MT);
  dm_hostable_free(*box);
  *box = NULL;
  return 0;
}

static void push_metatable(lua_State *L) {
  if (luaL_newmetatable(L, HOSTABLE_MT)) {
    lua_pushcfunction(L, close_hostable);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, close_hostable);
    lua_setfield(L, -2, "__close");
  }
}

static int c_hostable_metatable(lua_State *L) {
  push_metatable(L);
  return 1;
}

/* core.hostable_new(table, m, v, threads, device): threads 0 = the online cores, at most 8 */
static int c_hostable_new(lua_State *L) {
  dm_tensor *t = dm_lua_check(L, 1), *m = dm_lua_check(L, 2), *v = dm_lua_check(L, 3);
  dm_hostable_opts o = {.threads = (int)luaL_optinteger(L, 4, 1), .device = dm_lua_device(L, 5, DM_CPU)};
  void **box = lua_newuserdatauv(L, sizeof *box, 0);     /* boxed first: an error leaks nothing */
  *box = NULL;
  push_metatable(L);
  lua_setmetatable(L, -2);
  DM_ENTER(L);
  *box = dm_hostable_new(t, m, v, &o);
  return 1;
}

static int push3(lua_State *L, dm_tensor *a, dm_tensor *b, dm_tensor *c) {
  dm_lua_push(L, a);
  dm_lua_push(L, b);
  dm_lua_push(L, c);
  return 3;
}

static int c_hostable_prefetch(lua_State *L) {
  dm_hostable *h = check_hostable(L, 1);
  dm_tensor *idx = dm_lua_check(L, 2);
  DM_ENTER(L);
  dm_hostable_prefetch(h, idx);
  return 0;
}

/* core.hostable_take(h) → rows, local, unique */
static int c_hostable_take(lua_State *L) {
  dm_hostable *h = check_hostable(L, 1);
  DM_ENTER(L);
  dm_tensor *rows, *local, *unique;
  dm_hostable_take(h, &rows, &local, &unique);
  return push3(L, rows, local, unique);
}

static int c_hostable_gather(lua_State *L) {
  dm_hostable *h = check_hostable(L, 1);
  dm_tensor *idx = dm_lua_check(L, 2);
  DM_ENTER(L);
  dm_tensor *rows, *local, *unique;
  dm_hostable_gather(h, idx, &rows, &local, &unique);
  return push3(L, rows, local, unique);
}

/* core.hostable_apply(h, grads, lr, beta1, beta2, eps, step [, rows]): the rows of the last
** take, or the rows given (distinct, increasing: a step's rows over several takes) */
static int c_hostable_apply(lua_State *L) {
  dm_hostable *h = check_hostable(L, 1);
  dm_tensor *g = dm_lua_check(L, 2);
  double lr = luaL_checknumber(L, 3), b1 = luaL_checknumber(L, 4), b2 = luaL_checknumber(L, 5);
  double eps = luaL_checknumber(L, 6);
  int64_t step = luaL_checkinteger(L, 7);
  dm_tensor *rows = lua_isnoneornil(L, 8) ? NULL : dm_lua_check(L, 8);
  DM_ENTER(L);
  if (rows) dm_hostable_apply_rows(h, rows, g, lr, b1, b2, eps, step);
  else dm_hostable_apply(h, g, lr, b1, b2, eps, step);
  return 0;
}

static void set_num(lua_State *L, const char *k, double v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

static int c_hostable_counters(lua_State *L) {
  dm_hostable_counters c = dm_hostable_counters_of(check_hostable(L, 1));
  lua_createtable(L, 0, 10);
  set_int(L, "steps", c.steps);
  set_int(L, "lookups", c.lookups);
  set_int(L, "unique", c.unique);
  set_num(L, "unique_fraction", c.unique_fraction);
  set_int(L, "total_lookups", c.total_lookups);
  set_int(L, "total_unique", c.total_unique);
  set_num(L, "gather_ms", c.gather_ms);
  set_num(L, "wait_ms", c.wait_ms);
  set_num(L, "apply_ms", c.apply_ms);
  set_int(L, "thread_fallbacks", c.thread_fallbacks);
  return 1;
}

/* core.hostable_threads(h [, n]) → the thread count (after setting it) */
static int c_hostable_threads(lua_State *L) {
  dm_hostable *h = check_hostable(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    int n = (int)luaL_checkinteger(L, 2);
    DM_ENTER(L);
    dm_hostable_set_threads(h, n);
  }
  lua_pushinteger(L, dm_hostable_threads(h));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"engram_layout", c_engram_layout}, {"engram_adam", c_engram_adam},
  {"engram_adam_8bit", c_engram_adam_8bit}, {"engram_adam_8bit_at", c_engram_adam_8bit_at},
  {"hostable_metatable", c_hostable_metatable}, {"hostable_new", c_hostable_new},
  {"hostable_prefetch", c_hostable_prefetch}, {"hostable_take", c_hostable_take},
  {"hostable_gather", c_hostable_gather}, {"hostable_apply", c_hostable_apply},
  {"hostable_counters", c_hostable_counters}, {"hostable_threads", c_hostable_threads},
  {"hostable_close", close_hostable},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
