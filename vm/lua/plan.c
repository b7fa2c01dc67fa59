/*
** vm/lua/plan.c — the meta device's trace, for dormouse plan (lua/dormouse/plan.lua):
**
**   core.meta_trace_reset()        number the meta allocations from 1 again (and mark)
**   core.meta_trace_mark()         the peaks start again from now
**   core.meta_trace()              → {allocs, current, peak, peak_at, blocks, blocks_peak, last}
**   core.meta_watch(at, groups)    at meta allocation number `at`, sort the live bytes by
**                                  what holds them (below); at = 0 drops the watch
**   core.meta_watch_result()       → {at, current, last, where, parts = {{name, kind, bytes}, ...}},
**                                  or nil when the watch has not fired
**   core.cuda_block_size(n)        → the bytes a request of n takes in the CUDA allocator
**   core.gemm_workspace()          → the bytes of cuBLASLt's workspace (ops/matmul.h)
**   core.plan_card(card)           meta tensors stand for tensors on this card, and the ops
**                                  charge the CUDA kernels' scratch to the trace (below);
**                                  nil ends it. card: {sm_count = n, smem_optin = bytes}
**
** The CUDA kernels take scratch from the device allocator inside a call and give
** it back before they return (dm_scratch in kernels/). With a card set, an op on
** the meta device hands what its kernel would take to the trace, sized by the
** same function the kernel sizes it with (core/alloc.h dm_plan_scratch), as an
** allocation given back at once: the trace's peak holds it only where it is live.
**
** groups: a list of {name = "parameters", tensors = {...}, grads = true|nil}.
** A storage counts once, for the first holder that reaches it: the groups in
** their order (with grads = true, the tensors' .grad instead of the tensors;
** kind "group"), then the tape in its order: the tensors each op saved for
** its backward (kind "saved", named by the op), the gradients of leaves no
** group holds ("leaf gradients"), those leaves themselves ("leaves"), the
** gradients of op outputs on their way back ("flowing"). The rest of the live
** bytes is "other": tensors the step still holds (Lua's, a backward's
** intermediates) and the allocation being made, unless that is a kernel's
** scratch: then it is apart, after "other", kind "scratch", named "what (where)".
** `where` names the ops open when it is made ("backward of recompute >
** recompute of kda"), `last` its size.
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lua/bind.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "ops/matmul.h"
#include "core/profile.h"

#define MAX_GROUPS 16
#define MAX_PARTS 256

typedef struct part { const char *name; const char *kind; int64_t bytes; } part;

typedef struct group { char *name; bool grads; dm_tensor **tensors; int n; } group;

static struct {
  group groups[MAX_GROUPS];
  int n_groups;
  uint64_t at;
  bool fired;
  dm_meta_trace trace;            /* as it was when the watch fired */
  part parts[MAX_PARTS];
  int n_parts;
  char where[512];                /* the ops open at the watched allocation (profile.h) */
  char scratch[160];              /* the name of the scratch part (its label lasts only while it is made) */
} W;

/* ---- storages counted once: an open-addressing set of pointers --------------------------------- */

static const dm_storage **seen;
static size_t seen_cap, seen_used;

static size_t slot_of(const void *p, size_t cap) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 17) & (cap - 1);
}

static bool seen_add(const dm_storage *s);

static void seen_grow(void) {
  const dm_storage **old = seen;
  size_t old_cap = seen_cap;
  seen_cap = seen_cap ? 2 * seen_cap : 4096;
  seen = calloc(seen_cap, sizeof *seen);
  if (!seen) dm_error("out of host memory for the memory plan");
  seen_used = 0;
  for (size_t i = 0; i < old_cap; i++) if (old[i]) seen_add(old[i]);
  free(old);
}

/* false when s was there already */
static bool seen_add(const dm_storage *s) {
  if (2 * (seen_used + 1) > seen_cap) seen_grow();
  size_t i = slot_of(s, seen_cap);
  for (; seen[i]; i = (i + 1) & (seen_cap - 1)) if (seen[i] == s) return false;
  seen[i] = s;
  seen_used++;
  return true;
}

static void seen_clear(void) {
  if (seen) memset(seen, 0, seen_cap * sizeof *seen);
  seen_used = 0;
}

/* ---- sorting the live bytes --------------------------------------------------------------------- */

static part *part_of(const char *name, const char *kind) {
  for (int i = 0; i < W.n_parts; i++)
    if (W.parts[i].kind == kind && strcmp(W.parts[i].name, name) == 0) return &W.parts[i];
  if (W.n_parts == MAX_PARTS) return &W.parts[MAX_PARTS - 1];     /* (more ops than any model has) */
  part *p = &W.parts[W.n_parts++];
  p->name = name;
  p->kind = kind;
  p->bytes = 0;
  return p;
}

static const char *GROUP = "group", *SAVED = "saved", *TAPE = "tape", *OTHER = "other", *SCRATCH = "scratch";

/* t's storage to part (name, kind), unless counted already */
static void count(const dm_tensor *t, const char *name, const char *kind) {
  if (!t || !t->storage || t->device != DM_META) return;
  if (seen_add(t->storage)) part_of(name, kind)->bytes += (int64_t)t->storage->nbytes;
}

static void count_tape(void *ud, const char *op, dm_tape_hold what, dm_tensor *t) {
  (void)ud;
  if (what == DM_TAPE_SAVED) count(t, op, SAVED);
  else if (what == DM_TAPE_GOUT) count(t, "flowing", TAPE);
}

static void count_leaves(void *ud, const char *op, dm_tape_hold what, dm_tensor *t) {
  (void)ud; (void)op;
  if (what == DM_TAPE_LEAF) { count(t->grad, "leaf gradients", TAPE); count(t, "leaves", TAPE); }
}

static void on_watch(void *ud) {
  (void)ud;
  W.trace = dm_meta_trace_get();
  dm_profile_where(W.where, sizeof W.where);
  W.n_parts = 0;
  seen_clear();
  for (int g = 0; g < W.n_groups; g++) {
    part_of(W.groups[g].name, GROUP);            /* every group has its line, even when empty */
    for (int i = 0; i < W.groups[g].n; i++) {
      const dm_tensor *t = W.groups[g].tensors[i];
      count(W.groups[g].grads ? t->grad : t, W.groups[g].name, GROUP);
    }
  }
  dm_tape_visit(count_tape, NULL);
  dm_tape_visit(count_leaves, NULL);
  int64_t sorted = 0, scratch = 0;
  for (int i = 0; i < W.n_parts; i++) sorted += W.parts[i].bytes;
  const char *what = dm_plan_scratch_now(&scratch);
  part_of("other", OTHER)->bytes = W.trace.current - sorted - (what ? scratch : 0);
  if (what) {
    snprintf(W.scratch, sizeof W.scratch, "%s", what);
    part_of(W.scratch, SCRATCH)->bytes = scratch;
  }
  W.fired = true;
  dm_meta_watch(0, NULL, NULL);
}

/* ---- the bindings ---------------------------------------------------------------------------------- */

static void watch_clear(void) {
  dm_meta_watch(0, NULL, NULL);
  for (int g = 0; g < W.n_groups; g++) {
    for (int i = 0; i < W.groups[g].n; i++) dm_release(W.groups[g].tensors[i]);
    free(W.groups[g].tensors);
    free(W.groups[g].name);
  }
  W.n_groups = 0;
  W.fired = false;
  W.at = 0;
}

static int p_reset(lua_State *L) { (void)L; dm_meta_trace_reset(); return 0; }
static int p_mark(lua_State *L) { (void)L; dm_meta_trace_mark(); return 0; }

static void push_trace(lua_State *L, const dm_meta_trace *t) {
  lua_createtable(L, 0, 7);
  lua_pushinteger(L, (lua_Integer)t->allocs); lua_setfield(L, -2, "allocs");
  lua_pushinteger(L, t->current); lua_setfield(L, -2, "current");
  lua_pushinteger(L, t->peak); lua_setfield(L, -2, "peak");
  lua_pushinteger(L, (lua_Integer)t->peak_at); lua_setfield(L, -2, "peak_at");
  lua_pushinteger(L, t->blocks); lua_setfield(L, -2, "blocks");
  lua_pushinteger(L, t->blocks_peak); lua_setfield(L, -2, "blocks_peak");
  lua_pushinteger(L, t->last); lua_setfield(L, -2, "last");
}

static int p_trace(lua_State *L) {
  dm_meta_trace t = dm_meta_trace_get();
  push_trace(L, &t);
  return 1;
}

/* groups[g] (1-based) into W.groups, its tensors retained; counted in W.n_groups before
** its tensors are read, so an error leaves it for watch_clear to free */
static void read_group(lua_State *L, int g) {
  lua_geti(L, 2, g);
  if (!lua_istable(L, -1)) luaL_error(L, "meta_watch: group %d must be a table", g);
  lua_getfield(L, -1, "name");
  const char *name = lua_tostring(L, -1);
  if (!name) luaL_error(L, "meta_watch: group %d has no name", g);
  lua_getfield(L, -2, "grads");
  bool grads = lua_toboolean(L, -1);
  lua_getfield(L, -3, "tensors");
  if (!lua_istable(L, -1)) luaL_error(L, "meta_watch: group '%s' has no tensor list", name);
  int n = (int)luaL_len(L, -1);
  dm_tensor **ts = calloc((size_t)(n > 0 ? n : 1), sizeof *ts);
  char *copy = malloc(strlen(name) + 1);
  if (!ts || !copy) { free(ts); free(copy); luaL_error(L, "meta_watch: out of host memory"); }
  strcpy(copy, name);
  group *out = &W.groups[W.n_groups++];
  *out = (group){copy, grads, ts, 0};
  for (int i = 1; i <= n; i++) {
    lua_geti(L, -1, i);
    dm_tensor **box = luaL_testudata(L, -1, DM_TENSOR_MT);
    if (box && *box) { dm_retain(*box); ts[out->n++] = *box; }
    lua_pop(L, 1);
    if (!box) luaL_error(L, "meta_watch: group '%s' entry %d is not a tensor", name, i);
  }
  lua_pop(L, 4);
}

static int p_watch(lua_State *L) {
  lua_Integer at = luaL_checkinteger(L, 1);
  watch_clear();
  if (at <= 0) return 0;
  luaL_checktype(L, 2, LUA_TTABLE);
  int n = (int)luaL_len(L, 2);
  if (n > MAX_GROUPS) return luaL_error(L, "meta_watch: at most %d groups, got %d", MAX_GROUPS, n);
  for (int g = 1; g <= n; g++) read_group(L, g);
  W.at = (uint64_t)at;
  dm_meta_watch(W.at, on_watch, NULL);
  return 0;
}

static int p_result(lua_State *L) {
  if (!W.fired) { lua_pushnil(L); return 1; }
  push_trace(L, &W.trace);
  lua_pushinteger(L, (lua_Integer)W.at); lua_setfield(L, -2, "at");
  lua_pushstring(L, W.where); lua_setfield(L, -2, "where");
  lua_createtable(L, W.n_parts, 0);
  for (int i = 0; i < W.n_parts; i++) {
    lua_createtable(L, 0, 3);
    lua_pushstring(L, W.parts[i].name); lua_setfield(L, -2, "name");
    lua_pushstring(L, W.parts[i].kind); lua_setfield(L, -2, "kind");
    lua_pushinteger(L, W.parts[i].bytes); lua_setfield(L, -2, "bytes");
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "parts");
  watch_clear();
  return 1;
}

static int p_block_size(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  luaL_argcheck(L, n >= 0, 1, "a size in bytes must be >= 0");
  lua_pushinteger(L, (lua_Integer)dm_cuda_block_size((size_t)n));
  return 1;
}

static lua_Integer card_field(lua_State *L, const char *key) {
  lua_getfield(L, 1, key);
  int isnum;
  lua_Integer v = lua_tointegerx(L, -1, &isnum);
  if (!isnum || v <= 0) luaL_error(L, "plan_card: %s must be an integer > 0", key);
  lua_pop(L, 1);
  return v;
}

static int p_card(lua_State *L) {
  if (lua_isnoneornil(L, 1)) { dm_plan_begin(NULL); return 0; }
  luaL_checktype(L, 1, LUA_TTABLE);
  dm_plan_card card = {card_field(L, "sm_count"), card_field(L, "smem_optin")};
  dm_plan_begin(&card);
  return 0;
}

static int c_gemm_workspace(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)DM_GEMM_WORKSPACE);
  return 1;
}

static const luaL_Reg funcs[] = {
  {"gemm_workspace", c_gemm_workspace},
  {"meta_trace_reset", p_reset}, {"meta_trace_mark", p_mark}, {"meta_trace", p_trace},
  {"meta_watch", p_watch}, {"meta_watch_result", p_result},
  {"cuda_block_size", p_block_size}, {"plan_card", p_card}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
