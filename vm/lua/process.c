/*
** vm/lua/process.c — running a program without a shell: its argument vector goes
** to posix_spawnp as it is, so no string of the caller's is ever parsed as a
** command line.
**
**   core.run_program({"bible", "-l0", ...})   → its stdout, its exit status
**                                               (nil, "not found" when there is no such program)
** stdin and stderr are /dev/null.
**
**   core.spawn_program({...}, log_path)      → its pid: started, not waited for; its stdout
**                                               and stderr go to log_path (made, or emptied)
**   core.wait_program()                      → the pid and exit status of a child that ended
**                                               (waits for one); nil, "no child" when none is
**                                               left, nil, "interrupted" when a signal came
**   core.signal_program(pid, "SIGTERM")      → sends it (SIGINT or SIGTERM); true when sent
** An exit status is the program's own, or 128 + the signal that ended it.
**
**   core.lock_file(path)                     → a held lock's descriptor: flock on path (made when
**                                               absent) with this process's pid written in it; nil,
**                                               the holder's pid when another holds it. The kernel
**                                               lets it go when the process ends, kill -9 too.
**   core.unlock_file(fd)                     → lets it go
*/
#define _GNU_SOURCE     /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

extern char **environ;

#define ARGS_MAX 64

/* The argument vector in the table at index 1, NULL-terminated; its strings live as long as the table. */
static void read_argv(lua_State *L, const char *what, const char **argv) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n < 1 || n >= ARGS_MAX) luaL_error(L, "%s: 1 to %d arguments, got %d", what, ARGS_MAX - 1, n);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);
    argv[i] = luaL_checkstring(L, -1);
    lua_pop(L, 1);
  }
  argv[n] = NULL;
}

static int exit_status(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int c_run_program(lua_State *L) {
  const char *argv[ARGS_MAX];
  read_argv(L, "run_program", argv);
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
  lua_pushinteger(L, exit_status(status));
  return 2;
}

static int c_spawn_program(lua_State *L) {
  const char *argv[ARGS_MAX];
  read_argv(L, "spawn_program", argv);
  const char *log_path = luaL_checkstring(L, 2);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return luaL_error(L, "spawn_program: %s: %s", argv[0], strerror(rc));
  lua_pushinteger(L, pid);
  return 1;
}

static int c_wait_program(lua_State *L) {
  int status = 0;
  pid_t pid = waitpid(-1, &status, 0);
  if (pid < 0) {                                     /* a signal came (handlers held), or no child is left */
    lua_pushnil(L);
    lua_pushstring(L, errno == EINTR ? "interrupted" : "no child");
    return 2;
  }
  lua_pushinteger(L, pid);
  lua_pushinteger(L, exit_status(status));
  return 2;
}

static int c_signal_program(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  const char *name = luaL_checkstring(L, 2);
  int sig = strcmp(name, "SIGINT") == 0 ? SIGINT : strcmp(name, "SIGTERM") == 0 ? SIGTERM : 0;
  if (!sig) return luaL_error(L, "signal_program: SIGINT or SIGTERM, got '%s'", name);
  lua_pushboolean(L, kill(pid, sig) == 0);
  return 1;
}

static int c_lock_file(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return luaL_error(L, "%s: cannot open the lock: %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    char buf[32] = {0};
    ssize_t got = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    if (e != EWOULDBLOCK) return luaL_error(L, "%s: cannot lock: %s", path, strerror(e));
    lua_pushnil(L);
    lua_pushinteger(L, got > 0 ? strtoll(buf, NULL, 10) : 0);
    return 2;
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%lld\n", (long long)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
    int e = errno;
    close(fd);
    return luaL_error(L, "%s: cannot write the lock's pid: %s", path, strerror(e));
  }
  lua_pushinteger(L, fd);
  return 1;
}

static int c_unlock_file(lua_State *L) {
  close((int)luaL_checkinteger(L, 1));
  return 0;
}

static const luaL_Reg funcs[] = {{"run_program", c_run_program}, {"spawn_program", c_spawn_program},
                                 {"wait_program", c_wait_program}, {"signal_program", c_signal_program},
                                 {"lock_file", c_lock_file}, {"unlock_file", c_unlock_file},
                                 {NULL, NULL}};
DM_LUA_FUNCS(funcs)
