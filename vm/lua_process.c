/*
** lua_process.c — running a program without a shell: its argument vector goes
** to posix_spawnp as it is, so no string of the caller's is ever parsed as a
** command line.
**
**   core.run_program({"bible", "-l0", ...})   → its stdout, its exit status
**                                               (nil, "not found" when there is no such program)
** stdin and stderr are /dev/null.
*/
#define _GNU_SOURCE     /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua_tensor.h"

extern char **environ;

#define ARGS_MAX 64

static int c_run_program(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n < 1 || n >= ARGS_MAX) return luaL_error(L, "run_program: 1 to %d arguments, got %d", ARGS_MAX - 1, n);
  const char *argv[ARGS_MAX];
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);
    argv[i] = luaL_checkstring(L, -1);       /* kept alive by the table */
    lua_pop(L, 1);
  }
  argv[n] = NULL;
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return luaL_error(L, "run_program: pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  if (rc != 0) {
    close(out[0]);
    lua_pushnil(L);
    lua_pushstring(L, rc == ENOENT ? "not found" : strerror(rc));
    return 2;
  }
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  char chunk[65536];
  for (ssize_t got; (got = read(out[0], chunk, sizeof chunk)) != 0;) {
    if (got < 0) { if (errno == EINTR) continue; break; }
    luaL_addlstring(&b, chunk, (size_t)got);
  }
  close(out[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  luaL_pushresult(&b);
  lua_pushinteger(L, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  return 2;
}

static const luaL_Reg funcs[] = {{"run_program", c_run_program}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
