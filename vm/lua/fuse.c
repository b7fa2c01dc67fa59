/*
** vm/lua/fuse.c — the C side of dm.fuse in `dormouse.core` (fuse_*), which
** lua/dormouse/fuse.lua drives: it parses, differentiates and generates, and
** hands the programs and sources over here once per expression.
*/
#include <string.h>
#include "lua/bind.h"
#include "ops/elementwise.h"
#include "ops/fuse.h"

/* a program from a flat table {op1, arg1, op2, arg2, ...}, its arrays on the Lua stack */
static dm_fprog check_prog(lua_State *L, int idx, const char *what) {
  luaL_checktype(L, idx, LUA_TTABLE);
  int n2 = (int)luaL_len(L, idx);
  if (n2 % 2) luaL_error(L, "fuse_new: %s has an odd length %d", what, n2);
  dm_fprog p = {.n = n2 / 2};
  p.op = lua_newuserdatauv(L, sizeof(int) * (size_t)(p.n + 1), 0);
  p.arg = lua_newuserdatauv(L, sizeof(double) * (size_t)(p.n + 1), 0);
  for (int i = 0; i < p.n; i++) {
    lua_geti(L, idx, 2 * i + 1);
    lua_geti(L, idx, 2 * i + 2);
    if (!lua_isinteger(L, -2) || !lua_isnumber(L, -1))
      luaL_error(L, "fuse_new: %s: instruction %d is not an integer opcode and a number", what, i + 1);
    p.op[i] = (int)lua_tointeger(L, -2);
    p.arg[i] = lua_tonumber(L, -1);
    lua_pop(L, 2);
  }
  return p;
}

/* core.fuse_new(expr, n_in, fwd, {bwd_1, ..., bwd_n}, src_fwd, src_bwd) → id */
static int c_fuse_new(lua_State *L) {
  const char *expr = luaL_checkstring(L, 1);
  int n_in = (int)luaL_checkinteger(L, 2);
  luaL_checktype(L, 4, LUA_TTABLE);
  const char *src_fwd = luaL_optstring(L, 5, NULL), *src_bwd = luaL_optstring(L, 6, NULL);
  luaL_argcheck(L, n_in >= 1 && n_in <= DM_FUSE_MAXIN, 2, "1 to 8 inputs");
  luaL_argcheck(L, luaL_len(L, 4) == n_in, 4, "one backward program per input");
  dm_fprog fwd = check_prog(L, 3, "the forward program"), bwd[DM_FUSE_MAXIN];
  for (int i = 0; i < n_in; i++) {
    lua_geti(L, 4, i + 1);
    bwd[i] = check_prog(L, lua_gettop(L), "a backward program");
  }
  DM_ENTER(L);
  lua_pushinteger(L, dm_fused_new(expr, n_in, &fwd, bwd, src_fwd, src_bwd));
  return 1;
}

/* core.fuse_codes() → opcodes by name, unary kinds by name */
#define OPNAME_(name) #name,
#define KIND_(ID, nm, ...) nm,
static int c_fuse_codes(lua_State *L) {
  static const char *opnames[] = { DM_FUSE_OPCODES(OPNAME_) };
  static const char *kinds[] = { DM_UNARY_OPS(KIND_) };
  lua_createtable(L, 0, DM_NFOP);
  for (int i = 0; i < DM_NFOP; i++) { lua_pushinteger(L, i); lua_setfield(L, -2, opnames[i]); }
  lua_createtable(L, 0, DM_NUNARY);
  for (int i = 0; i < DM_NUNARY; i++) { lua_pushinteger(L, i); lua_setfield(L, -2, kinds[i]); }
  return 2;
}

static int c_fuse_cuda_prelude(lua_State *L) {
  lua_pushstring(L, dm_fuse_cuda_prelude());
  return 1;
}

/* core.nvrtc_compile(source, kernel_name) → true: compiles (or finds in the cache) and
** loads CUDA source, for the GPU checks; a compile error raises with NVRTC's log */
static int c_nvrtc_compile(lua_State *L) {
  const char *src = luaL_checkstring(L, 1), *name = luaL_checkstring(L, 2);
  DM_ENTER(L);
#ifdef DM_HAVE_CUDA
  dm_nvrtc_kernel(src, name, "nvrtc_compile");
  lua_pushboolean(L, 1);
  return 1;
#else
  (void)src; (void)name;
  dm_error("nvrtc_compile: this build has no CUDA backend");
#endif
}

/* core.nvrtc_check(source, arch) → true: compiles for arch ("sm_90a") without a device, a
** compile error raising with NVRTC's log; nil and why in a build without CUDA */
static int c_nvrtc_check(lua_State *L) {
  const char *src = luaL_checkstring(L, 1), *arch = luaL_optstring(L, 2, "sm_90a");
#ifdef DM_HAVE_CUDA
  DM_ENTER(L);
  dm_nvrtc_check(src, arch, "nvrtc_check");
  lua_pushboolean(L, 1);
  return 1;
#else
  (void)src; (void)arch;
  lua_pushnil(L);
  lua_pushstring(L, "this build has no CUDA backend");
  return 2;
#endif
}

static const luaL_Reg funcs[] = {
  {"fuse_new", c_fuse_new}, {"fuse_codes", c_fuse_codes}, {"fuse_cuda_prelude", c_fuse_cuda_prelude},
  {"nvrtc_compile", c_nvrtc_compile}, {"nvrtc_check", c_nvrtc_check},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
