/*
** vm/lua/data.c — corpora, loaders and n-gram baselines as userdata in
** `dormouse.core`. Each userdata is a box holding one C object (NULL once
** closed); __gc and __close release it, so a corpus's mapped or inflated
** bytes go back on close or collection. lua/dormouse/data.lua checks the
** options and sets each metatable's __index.
*/
#include <stdlib.h>
#include "lua/bind.h"
#include "data/data.h"
#include "data/files.h"
#include "data/ngram.h"
#include "data/zframes.h"

#define CORPUS_MT "dormouse.Corpus"
#define ZWRITER_MT "dormouse.ZWriter"
#define LOADER_MT "dormouse.Loader"
#define NGRAM_MT "dormouse.NGram"

/* the object in a box, or a Lua error when it was closed */
static void *checked(lua_State *L, int idx, const char *mt, const char *what) {
  void **box = luaL_checkudata(L, idx, mt);
  if (!*box) {
    DM_ENTER(L);
    dm_error("the %s is closed", what);
  }
  return *box;
}

static dm_corpus *check_corpus(lua_State *L, int idx) { return checked(L, idx, CORPUS_MT, "corpus"); }
static dm_loader *check_loader(lua_State *L, int idx) { return checked(L, idx, LOADER_MT, "loader"); }
static dm_ngram *check_ngram(lua_State *L, int idx) { return checked(L, idx, NGRAM_MT, "n-gram model"); }

static int close_corpus(lua_State *L) {
  void **box = luaL_checkudata(L, 1, CORPUS_MT);
  dm_corpus_release(*box);
  *box = NULL;
  return 0;
}

static int close_loader(lua_State *L) {
  void **box = luaL_checkudata(L, 1, LOADER_MT);
  dm_loader_free(*box);
  *box = NULL;
  return 0;
}

static int close_ngram(lua_State *L) {
  void **box = luaL_checkudata(L, 1, NGRAM_MT);
  dm_ngram_free(*box);
  *box = NULL;
  return 0;
}

static int close_zwriter(lua_State *L) {          /* a writer never closed leaves nothing on disk */
  void **box = luaL_checkudata(L, 1, ZWRITER_MT);
  dm_zwriter_abort(*box);
  *box = NULL;
  return 0;
}

static void push_metatable(lua_State *L, const char *name, lua_CFunction close) {
  if (luaL_newmetatable(L, name)) {
    lua_pushcfunction(L, close);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, close);
    lua_setfield(L, -2, "__close");
  }
}

/* an empty box with its metatable, made before the object so an error leaks nothing */
static void **new_box(lua_State *L, const char *mt, lua_CFunction close) {
  void **box = lua_newuserdatauv(L, sizeof *box, 0);
  *box = NULL;
  push_metatable(L, mt, close);
  lua_setmetatable(L, -2);
  return box;
}

/* core.data_metatable("corpus" | "loader" | "ngram") */
static int c_metatable(lua_State *L) {
  static const char *const kinds[] = {"corpus", "loader", "ngram", NULL};
  switch (luaL_checkoption(L, 1, NULL, kinds)) {
    case 0: push_metatable(L, CORPUS_MT, close_corpus); break;
    case 1: push_metatable(L, LOADER_MT, close_loader); break;
    default: push_metatable(L, NGRAM_MT, close_ngram); break;
  }
  return 1;
}

/* ---- the corpus ----------------------------------------------------------------------------- */

/* the strings of the list at idx, in a userdata the collector frees (the list keeps them alive) */
static const char **string_list(lua_State *L, int idx, int *n) {
  *n = (int)luaL_len(L, idx);
  const char **v = lua_newuserdatauv(L, sizeof *v * (size_t)(*n > 0 ? *n : 1), 0);
  for (int i = 0; i < *n; i++) {
    lua_geti(L, idx, i + 1);
    v[i] = luaL_checkstring(L, -1);
    lua_pop(L, 1);
  }
  return v;
}

/* core.corpus_open({path, ...}, eval_bytes [, {weight, ...} [, {eval path, ...}]]): without weights
** one source of all the paths, with them each path a source of its weight */
static int c_corpus_open(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int64_t eval_bytes = luaL_checkinteger(L, 2);
  bool mixed = !lua_isnoneornil(L, 3), has_eval = !lua_isnoneornil(L, 4);
  if (mixed) luaL_checktype(L, 3, LUA_TTABLE);
  if (has_eval) luaL_checktype(L, 4, LUA_TTABLE);
  int n, ne = 0;
  const char **paths = string_list(L, 1, &n);
  const char **eval_paths = has_eval ? string_list(L, 4, &ne) : NULL;
  if (mixed && luaL_len(L, 3) != n) luaL_error(L, "corpus_open: %d weights for %d paths", (int)luaL_len(L, 3), n);
  int ns = mixed ? n : 1;
  dm_source *sources = lua_newuserdatauv(L, sizeof *sources * (size_t)(ns > 0 ? ns : 1), 0);
  for (int i = 0; i < ns; i++) {
    double w = 1.0;
    if (mixed) { lua_geti(L, 3, i + 1); w = luaL_checknumber(L, -1); lua_pop(L, 1); }
    sources[i] = mixed ? (dm_source){1, &paths[i], w} : (dm_source){n, paths, 1.0};
  }
  dm_source eval = {ne, eval_paths, 1.0};
  void **box = new_box(L, CORPUS_MT, close_corpus);
  DM_ENTER(L);
  *box = dm_corpus_open_sources(ns, sources, has_eval ? &eval : NULL, eval_bytes);
  return 1;
}

/* core.corpus_sources(c) → {{begin = b, ["end"] = e, share = w}, ...}: each source's train bytes */
static int c_corpus_sources(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  lua_createtable(L, dm_corpus_nsources(c), 0);
  for (int i = 0; i < dm_corpus_nsources(c); i++) {
    int64_t begin, end;
    double share;
    dm_corpus_source(c, i, &begin, &end, &share);
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, begin); lua_setfield(L, -2, "begin");
    lua_pushinteger(L, end); lua_setfield(L, -2, "end");
    lua_pushnumber(L, share); lua_setfield(L, -2, "share");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* core.corpus_whole(c) → {{path = p, bytes = n}, ...}: the zstd files decoded whole at open */
static int c_corpus_whole(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  lua_newtable(L);
  for (int i = 0, n = 0; i < dm_corpus_nfiles(c); i++) {
    if (dm_corpus_whole(c, i) == 0) continue;
    lua_createtable(L, 0, 2);
    lua_pushstring(L, dm_corpus_file(c, i)); lua_setfield(L, -2, "path");
    lua_pushinteger(L, dm_corpus_whole(c, i)); lua_setfield(L, -2, "bytes");
    lua_rawseti(L, -2, ++n);
  }
  return 1;
}

/* core.corpus_list(path) → the files a path names (a file, a folder's files, a glob's), in order */
static int c_corpus_list(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  dm_pathlist files = {0};
  char err[DM_DATA_ERRMAX];
  if (!dm_paths_collect(path, &files, err)) {
    dm_pathlist_free(&files);
    return luaL_error(L, "%s", err);
  }
  lua_createtable(L, files.n, 0);
  for (int i = 0; i < files.n; i++) { lua_pushstring(L, files.v[i]); lua_rawseti(L, -2, i + 1); }
  dm_pathlist_free(&files);
  return 1;
}

/* ---- writing zstd files in frames ------------------------------------------------------------ */

static dm_zwriter *check_zwriter(lua_State *L) { return checked(L, 1, ZWRITER_MT, "zstd writer"); }

/* core.zwriter_open(path, frame_bytes, level) → a writer (PATH.tmp until zwriter_close) */
static int c_zwriter_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int64_t frame = luaL_checkinteger(L, 2);
  int level = (int)luaL_checkinteger(L, 3);
  void **box = new_box(L, ZWRITER_MT, close_zwriter);
  char err[DM_DATA_ERRMAX];
  *box = dm_zwriter_open(path, frame, level, err);
  if (!*box) return luaL_error(L, "%s", err);
  return 1;
}

/* core.zwriter_add_file(w, path) → the bytes written in so far */
static int c_zwriter_add_file(lua_State *L) {
  dm_zwriter *w = check_zwriter(L);
  char err[DM_DATA_ERRMAX];
  if (!dm_zwriter_add_file(w, luaL_checkstring(L, 2), err)) return luaL_error(L, "%s", err);
  lua_pushinteger(L, dm_zwriter_bytes_in(w));
  return 1;
}

/* core.zwriter_close(w) → bytes in, the file's bytes (renamed into place) */
static int c_zwriter_close(lua_State *L) {
  dm_zwriter *w = check_zwriter(L);
  void **box = lua_touserdata(L, 1);
  int64_t in = dm_zwriter_bytes_in(w), out;
  *box = NULL;                                   /* closed either way */
  char err[DM_DATA_ERRMAX];
  if (!dm_zwriter_close(w, &out, err)) return luaL_error(L, "%s", err);
  lua_pushinteger(L, in);
  lua_pushinteger(L, out);
  return 2;
}

/* core.corpus_sizes(c) → size, train, eval */
static int c_corpus_sizes(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  lua_pushinteger(L, dm_corpus_size(c));
  lua_pushinteger(L, dm_corpus_train_size(c));
  lua_pushinteger(L, dm_corpus_eval_size(c));
  return 3;
}

static int c_corpus_files(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  lua_createtable(L, dm_corpus_nfiles(c), 0);
  for (int i = 0; i < dm_corpus_nfiles(c); i++) {
    lua_pushstring(L, dm_corpus_file(c, i));
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* core.corpus_bytes(c, offset, n) → a string; offsets before 0 read as pad bytes 0 */
static int c_corpus_bytes(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int64_t at = luaL_checkinteger(L, 2), n = luaL_checkinteger(L, 3);
  DM_ENTER(L);
  if (n < 0 || at > dm_corpus_size(c) - n)
    dm_error("corpus: cannot read %lld bytes at offset %lld of %lld", (long long)n, (long long)at,
             (long long)dm_corpus_size(c));
  luaL_Buffer b;
  dm_corpus_read(c, at, n, (uint8_t *)luaL_buffinitsize(L, &b, (size_t)n));
  luaL_pushresultsize(&b, (size_t)n);
  return 1;
}

/* batch, seq, ctx, seed, dtype, device, first_row (nil: 0) at idx .. idx+6 */
static dm_batch_spec read_spec(lua_State *L, int idx) {
  dm_batch_spec s;
  s.first_row = luaL_optinteger(L, idx + 6, 0);
  s.batch = luaL_checkinteger(L, idx);
  s.seq = luaL_checkinteger(L, idx + 1);
  s.ctx = luaL_checkinteger(L, idx + 2);
  s.seed = (uint64_t)luaL_checkinteger(L, idx + 3);
  s.dtype = dm_lua_dtype(L, idx + 4, DM_U8);
  s.device = dm_lua_device(L, idx + 5, DM_CPU);
  return s;
}

static int push_pair(lua_State *L, dm_tensor *x, dm_tensor *prefix) {
  dm_lua_push(L, x);
  dm_lua_push(L, prefix);
  return 2;
}

/* core.corpus_batch(c, k, batch, seq, ctx, seed, dtype, device, first_row) → x, prefix */
static int c_corpus_batch(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int64_t k = luaL_checkinteger(L, 2);
  dm_batch_spec s = read_spec(L, 3);
  DM_ENTER(L);
  dm_tensor *x, *prefix;
  dm_corpus_batch(c, &s, k, &x, &prefix);
  return push_pair(L, x, prefix);
}

/* core.corpus_starts(c, k, batch, seq, ctx, seed, dtype, device, first_row) → {offset, ...}: where
** batch k's rows start in the stream */
static int c_corpus_starts(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int64_t k = luaL_checkinteger(L, 2);
  dm_batch_spec s = read_spec(L, 3);
  DM_ENTER(L);
  dm_batch_check(c, &s);
  lua_createtable(L, (int)s.batch, 0);
  for (int64_t r = 0; r < s.batch; r++) {
    lua_pushinteger(L, dm_batch_start(c, &s, k, r));
    lua_rawseti(L, -2, r + 1);
  }
  return 1;
}

/* core.corpus_eval_windows(c, n, seq, ctx, dtype, device) → x, prefix; n < 0: all */
static int c_corpus_eval_windows(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int64_t n = luaL_checkinteger(L, 2);
  dm_batch_spec s = {.batch = 1, .seq = luaL_checkinteger(L, 3), .ctx = luaL_checkinteger(L, 4),
                     .dtype = dm_lua_dtype(L, 5, DM_U8), .device = dm_lua_device(L, 6, DM_CPU)};
  DM_ENTER(L);
  dm_tensor *x, *prefix;
  dm_corpus_eval_windows(c, &s, n, &x, &prefix);
  return push_pair(L, x, prefix);
}

static int c_corpus_eval_count(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int64_t seq = luaL_checkinteger(L, 2);
  DM_ENTER(L);
  lua_pushinteger(L, dm_eval_window_count(c, seq));
  return 1;
}

/* ---- the loader ----------------------------------------------------------------------------- */

/* core.loader_new(c, batch, seq, ctx, seed, dtype, device, first_row, start, depth) */
static int c_loader_new(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  dm_batch_spec s = read_spec(L, 2);
  int64_t start = luaL_checkinteger(L, 9), depth = luaL_optinteger(L, 10, DM_LOADER_DEPTH);
  void **box = new_box(L, LOADER_MT, close_loader);
  DM_ENTER(L);
  *box = dm_loader_new(c, &s, start, depth);
  return 1;
}

/* core.loader_next(l) → x, prefix, k */
static int c_loader_next(lua_State *L) {
  dm_loader *l = check_loader(L, 1);
  DM_ENTER(L);
  dm_tensor *x, *prefix;
  int64_t k = dm_loader_next(l, &x, &prefix);
  push_pair(L, x, prefix);
  lua_pushinteger(L, k);
  return 3;
}

static int c_loader_position(lua_State *L) {
  lua_pushinteger(L, dm_loader_position(check_loader(L, 1)));
  return 1;
}

/* ---- n-gram baselines ---------------------------------------------------------------------- */

/* core.ngram_fit(c, order [, sample]) → the model fitted on the train split (sample > 0: on that
** many of its bytes, in pieces spread over it) */
static int c_ngram_fit(lua_State *L) {
  dm_corpus *c = check_corpus(L, 1);
  int order = (int)luaL_checkinteger(L, 2);
  int64_t sample = luaL_optinteger(L, 3, 0);
  void **box = new_box(L, NGRAM_MT, close_ngram);
  DM_ENTER(L);
  *box = dm_ngram_fit(c, order, sample);
  return 1;
}

/* core.ngram_pieces() → how many pieces a sampled fit counts */
static int c_ngram_pieces(lua_State *L) {
  lua_pushinteger(L, DM_NGRAM_PIECES);
  return 1;
}

/* core.ngram_bits(m, c, from, to) → total bits of bytes [from, to) */
static int c_ngram_bits(lua_State *L) {
  dm_ngram *m = check_ngram(L, 1);
  dm_corpus *c = check_corpus(L, 2);
  int64_t from = luaL_checkinteger(L, 3), to = luaL_checkinteger(L, 4);
  DM_ENTER(L);
  lua_pushnumber(L, dm_ngram_bits(m, c, from, to));
  return 1;
}

/* core.ngram_info(m) → order, {D_1, ...}, {entries_1, ...} */
static int c_ngram_info(lua_State *L) {
  dm_ngram *m = check_ngram(L, 1);
  int order = dm_ngram_order(m);
  lua_pushinteger(L, order);
  lua_createtable(L, order, 0);
  lua_createtable(L, order, 0);
  for (int n = 1; n <= order; n++) {
    lua_pushnumber(L, dm_ngram_discount(m, n));
    lua_rawseti(L, -3, n);
    lua_pushinteger(L, dm_ngram_entries(m, n));
    lua_rawseti(L, -2, n);
  }
  return 3;
}

/* core.loader_max_start() -> the largest batch number a loader starts at (DM_LOADER_MAX_START) */
static int c_loader_max_start(lua_State *L) {
  lua_pushinteger(L, DM_LOADER_MAX_START);
  return 1;
}

static const luaL_Reg funcs[] = {
  {"data_metatable", c_metatable}, {"loader_max_start", c_loader_max_start},
  {"corpus_open", c_corpus_open}, {"corpus_close", close_corpus}, {"corpus_sizes", c_corpus_sizes},
  {"corpus_files", c_corpus_files}, {"corpus_whole", c_corpus_whole}, {"corpus_list", c_corpus_list},
  {"corpus_sources", c_corpus_sources}, {"corpus_bytes", c_corpus_bytes}, {"corpus_batch", c_corpus_batch},
  {"corpus_starts", c_corpus_starts},
  {"zwriter_open", c_zwriter_open}, {"zwriter_add_file", c_zwriter_add_file}, {"zwriter_close", c_zwriter_close},
  {"corpus_eval_windows", c_corpus_eval_windows}, {"corpus_eval_count", c_corpus_eval_count},
  {"loader_new", c_loader_new}, {"loader_next", c_loader_next}, {"loader_position", c_loader_position},
  {"loader_close", close_loader},
  {"ngram_fit", c_ngram_fit}, {"ngram_pieces", c_ngram_pieces}, {"ngram_bits", c_ngram_bits}, {"ngram_info", c_ngram_info},
  {"ngram_close", close_ngram},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
