/*
** vm/lua/ckpt.c — checkpoint I/O for Lua: safetensors files (core.ckpt_save_tensors,
** ckpt_load_tensors), and the few file calls that the library needs and Lua lacks,
** named for what they do (core.file_checksum, xxh64, write_file, mkdirs, fsync_dir,
** listdir, remove_tree, file_kind, read_fifo, write_output).
** Errors go through dm_error, so they point at the user's line rather than
** at the library's wrapper.
*/
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "lua/bind.h"
#include "io/ckpt.h"
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

/* a string key or value without embedded NUL bytes (the core takes C strings) */
static const char *check_cstring(lua_State *L, int idx, const char *path, const char *what) {
  size_t len;
  const char *s = lua_tolstring(L, idx, &len);
  if (strlen(s) != len) dm_error("%s: %s '%s' contains a NUL byte", path, what, s);
  return s;
}

/* how many keys the table at idx has; each must be a string */
static int count_string_keys(lua_State *L, int idx, const char *path, const char *what) {
  int n = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    if (lua_type(L, -2) != LUA_TSTRING)
      dm_error("%s: %s must be strings, got a %s key", path, what, luaL_typename(L, -2));
    n++;
    lua_pop(L, 1);
  }
  return n;
}

/* core.ckpt_save_tensors(path, {name = tensor, ...}, {key = "value", ...} or nil) */
/* core.ckpt_save_tensors(path, {name = tensor}, metadata?, as?): as = {name = "F8_E4M3"}, the file
** dtype of those tensors (u8 codes) */
static int c_save_tensors(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_settop(L, 4);
  if (lua_isnil(L, 3)) { lua_newtable(L); lua_replace(L, 3); }
  luaL_checktype(L, 3, LUA_TTABLE);
  if (!lua_isnil(L, 4)) luaL_checktype(L, 4, LUA_TTABLE);
  DM_ENTER(L);
  int n = count_string_keys(L, 2, path, "tensor names");
  int nmeta = count_string_keys(L, 3, path, "metadata keys");
  /* arrays as userdata: collected by Lua whatever happens next */
  const char **names = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n + 1), 0);
  dm_tensor **tensors = lua_newuserdatauv(L, sizeof(dm_tensor *) * (size_t)(n + 1), 0);
  const char **keys = lua_newuserdatauv(L, sizeof(char *) * (size_t)(nmeta + 1), 0);
  const char **values = lua_newuserdatauv(L, sizeof(char *) * (size_t)(nmeta + 1), 0);
  const char **as = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n + 1), 0);
  bool any_as = false;
  int i = 0;
  lua_pushnil(L);
  while (lua_next(L, 2)) {   /* the keys stay alive in the table while the core runs */
    names[i] = check_cstring(L, -2, path, "tensor name");
    as[i] = NULL;
    if (!lua_isnil(L, 4)) {
      lua_pushvalue(L, -2);
      if (lua_gettable(L, 4) == LUA_TSTRING) { as[i] = lua_tostring(L, -1); any_as = true; }  /* kept by table 4 */
      lua_pop(L, 1);
    }
    dm_tensor **box = luaL_testudata(L, -1, DM_TENSOR_MT);
    if (!box) dm_error("%s: '%s' is a %s, not a tensor", path, names[i], luaL_typename(L, -1));
    if (!*box) dm_error("%s: tensor '%s' was freed", path, names[i]);
    tensors[i++] = *box;
    lua_pop(L, 1);
  }
  i = 0;
  lua_pushnil(L);
  while (lua_next(L, 3)) {
    keys[i] = check_cstring(L, -2, path, "metadata key");
    if (lua_type(L, -1) != LUA_TSTRING)
      dm_error("%s: metadata value of '%s' must be a string, got a %s", path, keys[i], luaL_typename(L, -1));
    size_t len;
    values[i] = lua_tolstring(L, -1, &len);
    if (strlen(values[i]) != len) dm_error("%s: metadata value of '%s' contains a NUL byte", path, keys[i]);
    i++;
    lua_pop(L, 1);
  }
  dm_safetensors_write_as(path, n, names, tensors, any_as ? as : NULL, nmeta, keys, values);
  return 0;
}

#define LOADED_MT "dormouse.safetensors"

static int loaded_gc(lua_State *L) {
  dm_safetensors **box = luaL_checkudata(L, 1, LOADED_MT);
  dm_safetensors_free(*box);
  *box = NULL;
  return 0;
}

/* core.ckpt_load_tensors(path) → {name = tensor, ...}, {key = "value", ...} */
static int c_load_tensors(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_settop(L, 1);
  /* the file's contents sit in a collected box until every tensor is handed over */
  dm_safetensors **box = lua_newuserdatauv(L, sizeof *box, 0);
  *box = NULL;
  if (luaL_newmetatable(L, LOADED_MT)) { lua_pushcfunction(L, loaded_gc); lua_setfield(L, -2, "__gc"); }
  lua_setmetatable(L, -2);
  DM_ENTER(L);
  dm_safetensors *st = *box = dm_safetensors_read(path);
  lua_createtable(L, 0, st->n);
  for (int i = 0; i < st->n; i++) {
    dm_lua_push(L, st->tensors[i]);
    st->tensors[i] = NULL;              /* the userdata holds the reference now */
    lua_setfield(L, -2, st->names[i]);
  }
  lua_createtable(L, 0, st->nmeta);
  for (int i = 0; i < st->nmeta; i++) {
    lua_pushstring(L, st->meta_values[i]);
    lua_setfield(L, -2, st->meta_keys[i]);
  }
  dm_safetensors_free(st);
  *box = NULL;
  return 2;
}

static void push_hex64(lua_State *L, uint64_t h) {
  char buf[17];
  snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  lua_pushstring(L, buf);
}

/* core.file_checksum(path) → the file's XXH64 as 16 hex digits, its size in bytes */
static int c_checksum(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  DM_ENTER(L);
  int64_t size;
  push_hex64(L, dm_file_checksum(path, &size));
  lua_pushinteger(L, size);
  return 2;
}

/* core.xxh64(string [, seed]) → 16 hex digits */
static int c_xxh64(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  push_hex64(L, dm_xxh64(s, n, (uint64_t)luaL_optinteger(L, 2, 0)));
  return 1;
}

/* (path, text) from the stack, handed to a writer */
static int write_with(lua_State *L, void (*writer)(const char *, const void *, size_t)) {
  size_t n;
  const char *path = luaL_checkstring(L, 1);
  const char *data = luaL_checklstring(L, 2, &n);
  DM_ENTER(L);
  writer(path, data, n);
  return 0;
}

/* core.write_file(path, text): written to path.tmp, fsynced, renamed */
static int c_write_file(lua_State *L) { return write_with(L, dm_write_file_atomic); }

/* core.write_output(path, text): a file a user named for output (dm_write_output: "-" is stdout) */
static int c_write_output(lua_State *L) { return write_with(L, dm_write_output); }

/* core.file_kind(path) -> "file", "missing", or what else is there ("a FIFO", "a directory", "a device",
** "a socket"), by stat, which never blocks: a FIFO without a writer would hang whoever opens it */
static int c_file_kind(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct stat sb;
  if (stat(path, &sb) != 0) lua_pushstring(L, errno == ENOENT ? "missing" : strerror(errno));
  else if (S_ISREG(sb.st_mode)) lua_pushstring(L, "file");
  else lua_pushstring(L, S_ISFIFO(sb.st_mode) ? "a FIFO" : S_ISDIR(sb.st_mode) ? "a directory" :
                         S_ISSOCK(sb.st_mode) ? "a socket" : "a device");
  return 1;
}

/* core.read_fifo(path, wait_ms) -> its whole text, or nil and why: a FIFO is read only once its
** writer shows (bytes, or its end) within wait_ms; one nobody writes would wait forever */
static int c_read_fifo(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int wait_ms = (int)luaL_checkinteger(L, 2);
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) { lua_pushnil(L); lua_pushstring(L, strerror(errno)); return 2; }
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int ready = poll(&p, 1, wait_ms);
  if (ready <= 0) {
    close(fd);
    lua_pushnil(L);
    lua_pushfstring(L, ready == 0 ? "a FIFO nothing was written to in %d ms (no writer?)" : "poll failed",
                    wait_ms);
    return 2;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);   /* the writer is there: read to its end */
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  for (;;) {
    char *dst = luaL_prepbuffer(&b);
    ssize_t n = read(fd, dst, LUAL_BUFFERSIZE);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) { int e = errno; close(fd); return luaL_error(L, "%s: read failed: %s", path, strerror(e)); }
    if (n == 0) break;
    luaL_addsize(&b, (size_t)n);
  }
  close(fd);
  luaL_pushresult(&b);
  return 1;
}

static int c_mkdirs(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  DM_ENTER(L);
  dm_mkdirs(path);
  return 0;
}

static int c_remove_tree(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  DM_ENTER(L);
  dm_remove_tree(path);
  return 0;
}

static int c_fsync_dir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  DM_ENTER(L);
  dm_fsync_dir(path);
  return 0;
}

/* core.listdir(path) → the entry names (without . and .., unsorted), or nil, message */
static int c_listdir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_newtable(L);                     /* made before opendir: nothing can raise while it is open */
  DIR *d = opendir(path);
  if (!d) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    lua_pushstring(L, e->d_name);      /* could raise only when Lua is out of memory */
    lua_rawseti(L, -2, ++n);
  }
  closedir(d);
  return 1;
}

static const luaL_Reg funcs[] = {
  {"ckpt_save_tensors", c_save_tensors}, {"ckpt_load_tensors", c_load_tensors},
  {"file_checksum", c_checksum}, {"xxh64", c_xxh64}, {"write_file", c_write_file},
  {"write_output", c_write_output}, {"file_kind", c_file_kind}, {"read_fifo", c_read_fifo},
  {"mkdirs", c_mkdirs}, {"fsync_dir", c_fsync_dir}, {"listdir", c_listdir},
  {"remove_tree", c_remove_tree},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
