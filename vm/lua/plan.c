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
**   core.meta_scratch(list)        the device scratch of ops (below); nil or {} clears it
**
** list: {{op = "kda", phase = "backward", bytes = n, what = "...", where = "..."}, ...}.
** The CUDA kernels take scratch from the device allocator inside an op and give
** it back before the op returns (dm_scratch in kernels/); the meta device's
** kernels take none. So while an op of that name runs on the meta device, its
** forward ("forward": also when a recompute runs it again) or its backward,
** `bytes` are held as a meta allocation of their own (profile.h's hooks), at
** any depth: the trace's peak holds a scratch only where it is live. Of two
** entries for one op and phase the first counts.
**
** groups: a list of {name = "parameters", tensors = {...}, grads = true|nil}.
** A storage counts once, for the first holder that reaches it: the groups in
** their order (with grads = true, the tensors' .grad instead of the tensors;
** kind "group"), then the tape in its order: the tensors each op saved for
** its backward (kind "saved", named by the op), the gradients of leaves no
** group holds ("leaf gradients"), those leaves themselves ("leaves"), the
** gradients of op outputs on their way back ("flowing"). The rest of the live
** bytes is "other": tensors the step still holds (Lua's, a backward's
** intermediates) and the allocation being made. The scratch of the ops open
** at that moment is apart, after "other": kind "scratch", named "what (where)".
** `where` names the ops open when it is made ("backward of recompute >
** recompute of kda"), `last` its size.
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lua/bind.h"
#include "core/alloc.h"
#include "core/autograd.h"
#include "core/profile.h"

#define MAX_GROUPS 16
#define MAX_PARTS 256
#define MAX_SCRATCH 32

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
  char scratch[MAX_SCRATCH][160]; /* the names of the scratch parts (the rules may be gone when read) */
} W;

/* ---- the ops' scratch: a meta allocation while the op runs -------------------------------------- */

typedef struct scratch_rule {
  char *op, *label;               /* the op's name; "what (where)" */
  int phase;                      /* DM_PHASE_FORWARD or DM_PHASE_BACKWARD */
  int64_t bytes;
  int live;                       /* calls of the op open now, each holding `bytes` */
  void *at;                       /* what the meta allocator handed out (it never reads it back) */
} scratch_rule;

static struct {
  scratch_rule rules[MAX_SCRATCH];
  int n;
  int open;                       /* scratch allocations live now, over all rules */
} S;

static void scratch_open(const char *name, int phase, dm_device dev, void **slot) {
  if (dev != DM_META) return;
  if (phase == DM_PHASE_RECOMPUTE) phase = DM_PHASE_FORWARD;      /* the forward's kernels run again */
  for (int i = 0; i < S.n; i++) {
    scratch_rule *r = &S.rules[i];
    if (r->phase != phase || strcmp(r->op, name) != 0) continue;
    /* live before it is made: a watch firing at this very allocation sorts it as scratch */
    r->live++;
    S.open++;
    *slot = r;
    r->at = dm_alloc(DM_META, (size_t)r->bytes);
    return;
  }
}

static void scratch_close(void *slot) {
  scratch_rule *r = slot;
  r->live--;
  S.open--;
  dm_free(DM_META, r->at, (size_t)r->bytes);
}

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
  int64_t sorted = 0;
  for (int i = 0; i < W.n_parts; i++) sorted += W.parts[i].bytes;
  for (int i = 0; i < S.n; i++) sorted += S.rules[i].live * S.rules[i].bytes;
  part_of("other", OTHER)->bytes = W.trace.current - sorted;
  for (int i = 0; i < S.n; i++) {
    if (!S.rules[i].live) continue;
    snprintf(W.scratch[i], sizeof W.scratch[i], "%s", S.rules[i].label);
    part_of(W.scratch[i], SCRATCH)->bytes += S.rules[i].live * S.rules[i].bytes;
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

static void scratch_clear(void) {
  for (int i = 0; i < S.n; i++) { free(S.rules[i].op); free(S.rules[i].label); }
  S.n = 0;
  dm_profile_set_hooks(NULL, NULL);
}

/* list[i]'s fields on the stack (op, phase, bytes, what, where: 6 slots with the entry), checked */
typedef struct rule_fields { const char *op, *what, *where; int phase; int64_t bytes; } rule_fields;

static rule_fields rule_at(lua_State *L, int i) {
  lua_geti(L, 1, i);
  if (!lua_istable(L, -1)) luaL_error(L, "meta_scratch: entry %d must be a table", i);
  lua_getfield(L, -1, "op");
  lua_getfield(L, -2, "phase");
  lua_getfield(L, -3, "bytes");
  lua_getfield(L, -4, "what");
  lua_getfield(L, -5, "where");
  rule_fields f = {lua_tostring(L, -5), lua_tostring(L, -2), lua_tostring(L, -1), -1, 0};
  const char *phase = lua_tostring(L, -4);
  int isnum;
  lua_Integer bytes = lua_tointegerx(L, -3, &isnum);
  if (!f.op) luaL_error(L, "meta_scratch: entry %d has no op name", i);
  if (phase && !strcmp(phase, "forward")) f.phase = DM_PHASE_FORWARD;
  if (phase && !strcmp(phase, "backward")) f.phase = DM_PHASE_BACKWARD;
  if (f.phase < 0) luaL_error(L, "meta_scratch: entry %d (%s): phase must be 'forward' or 'backward'", i, f.op);
  if (!isnum || bytes < 0) luaL_error(L, "meta_scratch: entry %d (%s): bytes must be an integer >= 0", i, f.op);
  f.bytes = bytes;
  if (!f.what) f.what = "kernel scratch";
  if (!f.where) f.where = "";
  return f;
}

/* list[i] into S.rules, counted in S.n once its strings are held (scratch_clear frees them) */
static void add_rule(lua_State *L, int i) {
  rule_fields f = rule_at(L, i);
  size_t nl = strlen(f.what) + strlen(f.where) + 4;
  char *op = malloc(strlen(f.op) + 1), *label = malloc(nl);
  if (!op || !label) { free(op); free(label); luaL_error(L, "meta_scratch: out of host memory"); }
  strcpy(op, f.op);
  snprintf(label, nl, *f.where ? "%s (%s)" : "%s", f.what, f.where);
  S.rules[S.n++] = (scratch_rule){op, label, f.phase, f.bytes, 0, NULL};
  lua_pop(L, 6);
}

static int p_scratch(lua_State *L) {
  if (S.open > 0) return luaL_error(L, "meta_scratch: an op holding scratch is still open");
  scratch_clear();
  if (lua_isnoneornil(L, 1)) return 0;
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n > MAX_SCRATCH) return luaL_error(L, "meta_scratch: at most %d entries, got %d", MAX_SCRATCH, n);
  for (int i = 1; i <= n; i++) { rule_at(L, i); lua_pop(L, 6); }      /* all checked before any is kept */
  for (int i = 1; i <= n; i++) add_rule(L, i);
  if (S.n > 0) dm_profile_set_hooks(scratch_open, scratch_close);
  return 0;
}

static const luaL_Reg funcs[] = {
  {"meta_trace_reset", p_reset}, {"meta_trace_mark", p_mark}, {"meta_trace", p_trace},
  {"meta_watch", p_watch}, {"meta_watch_result", p_result},
  {"cuda_block_size", p_block_size}, {"meta_scratch", p_scratch}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
