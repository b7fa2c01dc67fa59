/*
** vm/lua/optim.c — the optimisers' update math for Lua (lua/dormouse/optim/):
**
**   core.clip_grad_norm(params, max_norm)        → norm, finite
**   core.adamw_step(params, ms, vs, hp)          hp: lr beta1 beta2 eps weight_decay step
**   core.adamw_8bit_step(params, m, m_scale, r, r_scale, hp)   the same with 8-bit moments (hp.salt)
**   core.code8_pack(codes, scales, values, signed[, salt[, block]]) / core.code8_unpack(values, codes, scales, signed[, block])
**   core.muon_step(params, bufs, hp)             hp: lr momentum nesterov weight_decay
**                                                    ns_steps coeffs ns_dtype [clip] [normalize]
**                                                    [momentum_sround sround_salt step step_at]
**                                                    [scales: a tensor or false a parameter]
**   core.newton_schulz(x, steps, coeffs, dtype)  → the orthogonalised x
**   core.clip_grads_async(grads, max_norm, sumsq) the norm kept on the device
**   core.clip_scale(grads, max_norm, sumsq)      scale by a sum of squares made before
**   core.optim_tick(step, sumsq)                 step += 1 when sumsq is finite
**   core.engram_adam_at(table, m, v, rows, grads, n_at, beta1, beta2, eps, lr_at, step_at, sumsq_at)
**                                                the Engram tables' sparse Adam from device scalars
**                                                (n_at nil: every row of rows)
**
** hp may also name one-element tensors on the parameters' device that the
** kernels read when they run (so a captured graph replays with new
** values): lr_at (f64), step_at (i64: AdamW, Muon's stochastic rounding) and sumsq_at (f64: a
** non-finite sum skips the update).
**
** Gradients are read from each parameter's .grad (nil skips it). Lists are
** Lua arrays; their C copies live in userdata on the stack, so an error
** leaves nothing behind.
*/
#include <string.h>
#include "lua/bind.h"
#include "ops/optim.h"
#include "ops/engram.h"
#include "core/code8.h"

/* each parameter's gradient (NULL where it has none) */
static dm_tensor **grad_list(lua_State *L, dm_tensor *const *params, int n) {
  dm_tensor **g = lua_newuserdatauv(L, sizeof *g * (size_t)(n > 0 ? n : 1), 0);
  for (int i = 0; i < n; i++) g[i] = params[i]->grad;
  return g;
}

static void same_length(const char *fn, const char *what, int n, int m) {
  if (n != m) dm_error("%s: %d parameters but %d %s", fn, n, m, what);
}

/* hp[key], a number that must be there */
static double number_field(lua_State *L, int hp, const char *fn, const char *key) {
  lua_getfield(L, hp, key);
  int ok;
  double v = lua_tonumberx(L, -1, &ok);
  if (!ok) dm_error("%s: hp.%s must be a number, got %s", fn, key, luaL_typename(L, -1));
  lua_pop(L, 1);
  return v;
}

/* hp[key] when present, else dflt */
static double number_field_or(lua_State *L, int hp, const char *fn, const char *key, double dflt) {
  lua_getfield(L, hp, key);
  bool absent = lua_isnil(L, -1);
  lua_pop(L, 1);
  return absent ? dflt : number_field(L, hp, fn, key);
}

/* the memory of hp[key], a one-element tensor of dtype dt, or NULL when absent */
static const void *scalar_field(lua_State *L, int hp, const char *fn, const char *key, dm_dtype dt,
                                dm_tensor *const *params, int n) {
  lua_getfield(L, hp, key);
  if (lua_isnil(L, -1)) { lua_pop(L, 1); return NULL; }
  dm_tensor **box = luaL_testudata(L, -1, DM_TENSOR_MT);
  if (!box || !*box || !(*box)->storage) dm_error("%s: hp.%s must be a live tensor, got %s", fn, key, luaL_typename(L, -1));
  const dm_tensor *t = *box;
  lua_pop(L, 1);
  if (t->dtype != dt || dm_numel(t) != 1)
    dm_error("%s: hp.%s must be one %s element, got %s [%lld]", fn, key, dm_dtype_name(dt), dm_dtype_name(t->dtype),
             (long long)dm_numel(t));
  if (n > 0 && t->device != params[0]->device)
    dm_error("%s: hp.%s is on %s but the parameters are on %s", fn, key, dm_device_name(t->device),
             dm_device_name(params[0]->device));
  return dm_data(t);       /* the tensor stays alive: the caller's Lua table holds it */
}

static void check_hp(lua_State *L, int idx, const char *fn) {
  if (!lua_istable(L, idx)) dm_error("%s: hyper-parameters must be a table, got %s", fn, luaL_typename(L, idx));
}

/* core.clip_grads(grads, max_norm) → norm, finite: the same over a list of gradients */
static int c_clip_grads(lua_State *L) {
  DM_ENTER(L);
  int n;
  dm_tensor **g = dm_lua_tensor_list(L, 1, "clip_grads", "grads", &n);
  bool finite;
  double norm = dm_clip_grad_norm(n, g, luaL_optnumber(L, 2, 0), &finite);
  lua_pushnumber(L, norm);
  lua_pushboolean(L, finite);
  return 2;
}

static int c_clip_grads_async(lua_State *L) {
  DM_ENTER(L);
  int n;
  dm_tensor **g = dm_lua_tensor_list(L, 1, "clip_grads_async", "grads", &n);
  dm_clip_grads_async(n, g, luaL_checknumber(L, 2), dm_lua_check(L, 3));
  return 0;
}

static int c_clip_scale(lua_State *L) {
  DM_ENTER(L);
  int n;
  dm_tensor **g = dm_lua_tensor_list(L, 1, "clip_scale", "grads", &n);
  dm_clip_scale(n, g, luaL_checknumber(L, 2), dm_lua_check(L, 3));
  return 0;
}

static int c_optim_tick(lua_State *L) {
  DM_ENTER(L);
  dm_optim_tick(dm_lua_check(L, 1), dm_lua_check(L, 2));
  return 0;
}

static int c_engram_adam_at(lua_State *L) {
  DM_ENTER(L);
  dm_tensor *n_at = lua_isnil(L, 6) ? NULL : dm_lua_check(L, 6);      /* nil: every row */
  dm_engram_adam_at(dm_lua_check(L, 1), dm_lua_check(L, 2), dm_lua_check(L, 3), dm_lua_check(L, 4),
                    dm_lua_check(L, 5), n_at, luaL_checknumber(L, 7), luaL_checknumber(L, 8),
                    luaL_checknumber(L, 9), dm_lua_check(L, 10), dm_lua_check(L, 11),
                    lua_isnoneornil(L, 12) ? NULL : dm_lua_check(L, 12));
  return 0;
}

static int c_clip_grad_norm(lua_State *L) {
  DM_ENTER(L);
  const char *fn = "clip_grad_norm";
  int n;
  dm_tensor **p = dm_lua_tensor_list(L, 1, fn, "params", &n);
  double max_norm = luaL_optnumber(L, 2, 0);
  bool finite;
  double norm = dm_clip_grad_norm(n, grad_list(L, p, n), max_norm, &finite);
  lua_pushnumber(L, norm);
  lua_pushboolean(L, finite);
  return 2;
}

/* AdamW's settings from the table at hp */
static dm_adamw_hp adamw_hp(lua_State *L, int hp, const char *fn, dm_tensor **p, int n) {
  check_hp(L, hp, fn);
  return (dm_adamw_hp){
    .lr = number_field(L, hp, fn, "lr"), .beta1 = number_field(L, hp, fn, "beta1"),
    .beta2 = number_field(L, hp, fn, "beta2"), .eps = number_field(L, hp, fn, "eps"),
    .weight_decay = number_field(L, hp, fn, "weight_decay"),
    .step = (int64_t)number_field(L, hp, fn, "step"),
    .lr_at = scalar_field(L, hp, fn, "lr_at", DM_F64, p, n),
    .step_at = scalar_field(L, hp, fn, "step_at", DM_I64, p, n),
    .sumsq_at = scalar_field(L, hp, fn, "sumsq_at", DM_F64, p, n),
  };
}

static int c_adamw_step(lua_State *L) {
  DM_ENTER(L);
  const char *fn = "adamw_step";
  int n, nm, nv;
  dm_tensor **p = dm_lua_tensor_list(L, 1, fn, "params", &n);
  dm_tensor **m = dm_lua_tensor_list(L, 2, fn, "first moments", &nm);
  dm_tensor **v = dm_lua_tensor_list(L, 3, fn, "second moments", &nv);
  same_length(fn, "first moments", n, nm);
  same_length(fn, "second moments", n, nv);
  dm_adamw_hp hp = adamw_hp(L, 4, fn, p, n);
  dm_adamw_step(n, p, grad_list(L, p, n), m, v, &hp);
  return 0;
}

/* core.adamw_8bit_step(params, m, m_scale, r, r_scale, hp): hp as adamw_step's, and salt */
static int c_adamw_8bit_step(lua_State *L) {
  DM_ENTER(L);
  const char *fn = "adamw_8bit_step";
  int n, k;
  dm_tensor **p = dm_lua_tensor_list(L, 1, fn, "params", &n);
  const char *roles[4] = {"first moment codes", "first moment scales", "second moment codes",
                          "second moment scales"};
  dm_tensor **s[4];
  for (int j = 0; j < 4; j++) {
    s[j] = dm_lua_tensor_list(L, 2 + j, fn, roles[j], &k);
    same_length(fn, roles[j], n, k);
  }
  dm_adamw_hp hp = adamw_hp(L, 6, fn, p, n);
  uint32_t salt = (uint32_t)(int64_t)number_field_or(L, 6, fn, "salt", 0);
  dm_adamw_8bit_step(n, p, grad_list(L, p, n), s[0], s[1], s[2], s[3], &hp, salt);
  return 0;
}

/* core.code8_pack(codes, scales, values, signed[, salt[, block]]) and core.code8_unpack(values, codes, scales,
** signed[, block]): blocks of DM_CODE8_BLOCK values unless block says otherwise */
static int c_code8_pack(lua_State *L) {
  dm_tensor *codes = dm_lua_check(L, 1), *scales = dm_lua_check(L, 2), *values = dm_lua_check(L, 3);
  bool is_signed = lua_toboolean(L, 4);
  uint32_t salt = (uint32_t)luaL_optinteger(L, 5, 0);
  int64_t block = luaL_optinteger(L, 6, DM_CODE8_BLOCK);
  DM_ENTER(L);
  dm_code8_pack(codes, scales, values, is_signed, salt, block);
  return 0;
}

static int c_code8_unpack(lua_State *L) {
  dm_tensor *values = dm_lua_check(L, 1), *codes = dm_lua_check(L, 2), *scales = dm_lua_check(L, 3);
  bool is_signed = lua_toboolean(L, 4);
  int64_t block = luaL_optinteger(L, 5, DM_CODE8_BLOCK);
  DM_ENTER(L);
  dm_code8_unpack(values, codes, scales, is_signed, block);
  return 0;
}

static dm_ns_coeffs coeffs_arg(lua_State *L, int idx, const char *fn) {
  const char *name = lua_tostring(L, idx);
  if (name && !strcmp(name, "quintic")) return DM_NS_QUINTIC;
  if (name && !strcmp(name, "polar_express")) return DM_NS_POLAR_EXPRESS;
  dm_error("%s: Newton-Schulz coefficients must be \"quintic\" or \"polar_express\", got %s", fn,
           name ? name : luaL_typename(L, idx));
}

static dm_dtype ns_dtype_arg(lua_State *L, int idx, const char *fn) {
  const char *name = lua_tostring(L, idx);
  if (name && !strcmp(name, "f32")) return DM_F32;
  if (name && !strcmp(name, "bf16")) return DM_BF16;
  dm_error("%s: the Newton-Schulz dtype must be \"f32\" or \"bf16\", got %s", fn,
           name ? name : luaL_typename(L, idx));
}

/* Muon+'s normalisation by name: "none", "col", "row" or "colrow" */
static int normalize_arg(lua_State *L, int idx, const char *fn) {
  const char *name = lua_tostring(L, idx);
  if (name && strcmp(name, "none") == 0) return DM_MUON_NORM_NONE;
  if (name && strcmp(name, "col") == 0) return DM_MUON_NORM_COL;
  if (name && strcmp(name, "row") == 0) return DM_MUON_NORM_ROW;
  if (name && strcmp(name, "colrow") == 0) return DM_MUON_NORM_COL | DM_MUON_NORM_ROW;
  return luaL_error(L, "%s: normalize must be \"none\", \"col\", \"row\" or \"colrow\", got %s", fn,
                    name ? name : luaL_typename(L, idx));
}

/* hp.scales: nil, or a list of n entries, each a tensor or false (none); the list lives on the Lua stack */
static dm_tensor **scales_field(lua_State *L, int hp, const char *fn, int n) {
  lua_getfield(L, hp, "scales");
  if (lua_isnil(L, -1)) { lua_pop(L, 1); return NULL; }
  if (!lua_istable(L, -1)) dm_error("%s: hp.scales must be a list, got %s", fn, luaL_typename(L, -1));
  int list = lua_gettop(L);
  dm_tensor **s = lua_newuserdatauv(L, sizeof *s * (size_t)(n > 0 ? n : 1), 0);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, list, i + 1);
    s[i] = lua_toboolean(L, -1) ? dm_lua_check(L, -1) : NULL;
    lua_pop(L, 1);
  }
  return s;
}

static int c_muon_step(lua_State *L) {
  DM_ENTER(L);
  const char *fn = "muon_step";
  int n, nb;
  dm_tensor **p = dm_lua_tensor_list(L, 1, fn, "params", &n);
  dm_tensor **b = dm_lua_tensor_list(L, 2, fn, "momentum buffers", &nb);
  same_length(fn, "momentum buffers", n, nb);
  check_hp(L, 3, fn);
  lua_getfield(L, 3, "nesterov");
  bool nesterov = lua_isnil(L, -1) || lua_toboolean(L, -1);
  lua_getfield(L, 3, "coeffs");
  dm_ns_coeffs coeffs = lua_isnil(L, -1) ? DM_NS_QUINTIC : coeffs_arg(L, -1, fn);
  lua_getfield(L, 3, "ns_dtype");
  dm_dtype dt = lua_isnil(L, -1) ? DM_F32 : ns_dtype_arg(L, -1, fn);
  lua_getfield(L, 3, "normalize");
  int normalize = lua_isnil(L, -1) ? DM_MUON_NORM_NONE : normalize_arg(L, -1, fn);
  lua_getfield(L, 3, "momentum_sround");
  bool sround = lua_toboolean(L, -1);
  lua_pop(L, 5);
  dm_muon_hp hp = {
    .normalize = normalize,
    .lr = number_field(L, 3, fn, "lr"), .momentum = number_field(L, 3, fn, "momentum"),
    .weight_decay = number_field(L, 3, fn, "weight_decay"), .nesterov = nesterov,
    .ns_steps = (int)number_field(L, 3, fn, "ns_steps"), .coeffs = coeffs, .ns_dtype = dt,
    .lr_at = scalar_field(L, 3, fn, "lr_at", DM_F64, p, n),
    .sumsq_at = scalar_field(L, 3, fn, "sumsq_at", DM_F64, p, n),
    .clip = number_field_or(L, 3, fn, "clip", 0),
    .momentum_sround = sround,
    .sround_salt = (uint32_t)(int64_t)number_field_or(L, 3, fn, "sround_salt", 0),
    .step = (int64_t)number_field_or(L, 3, fn, "step", 0),
    .step_at = scalar_field(L, 3, fn, "step_at", DM_I64, p, n),
  };
  hp.scales = scales_field(L, 3, fn, n);
  dm_muon_step(n, p, grad_list(L, p, n), b, &hp);
  return 0;
}

static int c_newton_schulz(lua_State *L) {
  DM_ENTER(L);
  const char *fn = "newton_schulz";
  dm_tensor *x = dm_lua_check(L, 1);
  int steps = (int)luaL_optinteger(L, 2, 5);
  dm_ns_coeffs coeffs = lua_isnoneornil(L, 3) ? DM_NS_QUINTIC : coeffs_arg(L, 3, fn);
  dm_dtype dt = lua_isnoneornil(L, 4) ? DM_F32 : ns_dtype_arg(L, 4, fn);
  dm_lua_push(L, dm_newton_schulz(x, steps, coeffs, dt));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"clip_grad_norm", c_clip_grad_norm}, {"clip_grads", c_clip_grads}, {"adamw_step", c_adamw_step},
  {"adamw_8bit_step", c_adamw_8bit_step}, {"code8_pack", c_code8_pack}, {"code8_unpack", c_code8_unpack},
  {"muon_step", c_muon_step}, {"newton_schulz", c_newton_schulz}, {"clip_grads_async", c_clip_grads_async},
  {"clip_scale", c_clip_scale},
  {"optim_tick", c_optim_tick}, {"engram_adam_at", c_engram_adam_at}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
