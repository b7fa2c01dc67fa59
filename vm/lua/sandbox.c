/*
** vm/lua/sandbox.c — running a program under limits, for the verifiers'
** sandbox (lua/dormouse/sandbox.lua puts bubblewrap in front of the program).
**
**   core.run_limited(argv, {seconds = 2, output = 65536, memory = bytes, processes = 64,
**                           file_size = bytes, uid = 65534, info_fd = 3})
**     → {status = exit status (128 + signal), stdout = ..., stderr = ..., timed_out = bool,
**        output_over = bool, seconds = wall time[, info = what the child wrote to info_fd]}
**
** The child gets its own session (so the whole group can be killed), stdin
** /dev/null, no descriptor of the parent's past 2 (but info_fd: a pipe there,
** read once it has ended; bwrap --info-fd names the sandbox's first process),
** and its limits before exec: RLIMIT_AS (memory), RLIMIT_FSIZE (a file's
** size), RLIMIT_CPU (seconds + 1), no core files. With `uid` (only when this
** process is root) it drops to that user and group, and only then takes
** RLIMIT_NPROC (`processes`: it counts a user's every process and thread, so
** under the caller's own user it is not set). argv[1] is an absolute path (no
** PATH search; no shell ever sees the vector). The parent reads stdout and
** stderr until both close, keeping at most `output` bytes of each; past the
** wall-clock `seconds` or the output cap it kills the child's process group
** (SIGKILL) and says which; a program that closes both and goes on has the
** rest of its time. The call raises only before the fork, or when the exit
** status cannot be had. With info_fd, this process is a child subreaper while
** the child runs: a process of the child's that outlives it (bwrap's first
** process in its PID namespace, which ends after bwrap has) becomes this
** process's child, for wait_gone to reap, instead of the system's init's (which
** may reap late: its zombies would count against the user's RLIMIT_NPROC, and
** a later sandbox could not fork).
**
**   core.wait_gone(pid, seconds) → true once the process has ended (a child of this process: reaped;
**                                  another: gone or a zombie); false after `seconds` if it still runs
**   core.make_temp_dir(prefix)   → a new folder $TMPDIR/prefixXXXXXX (mkdtemp), mode 0755: others
**                                  may read it (the sandbox's user reads the program from it)
*/
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

#define ARGS_MAX 128

typedef struct {
  double seconds;
  lua_Integer output, memory, processes, file_size, uid;
  int info_fd;                                   /* a descriptor number the child writes its info to, or -1 */
} dm_limits;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static lua_Integer opt_int(lua_State *L, const char *key, lua_Integer dflt) {
  lua_getfield(L, 2, key);
  lua_Integer v = lua_isnil(L, -1) ? dflt : luaL_checkinteger(L, -1);
  lua_pop(L, 1);
  return v;
}

static void read_limits(lua_State *L, dm_limits *lim) {
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_getfield(L, 2, "seconds");
  lim->seconds = lua_isnil(L, -1) ? 2.0 : luaL_checknumber(L, -1);
  lua_pop(L, 1);
  lim->output = opt_int(L, "output", 65536);
  lim->memory = opt_int(L, "memory", 0);
  lim->processes = opt_int(L, "processes", 0);
  lim->file_size = opt_int(L, "file_size", 0);
  lim->uid = opt_int(L, "uid", -1);
  lim->info_fd = (int)opt_int(L, "info_fd", -1);
  if (lim->seconds <= 0 || lim->output < 1) luaL_error(L, "run_limited: seconds and output must be positive");
}

static void set_limit(int resource, lua_Integer v) {
  if (v <= 0) return;
  struct rlimit r = {(rlim_t)v, (rlim_t)v};
  setrlimit(resource, &r);
}

/* In the child, between fork and exec: only async-signal-safe calls. Every descriptor past 2 is
** closed but info_fd: a file the parent holds open (a run's log) must not reach the program. */
static void child(const char **argv, const dm_limits *lim, int out, int err, int info) {
  setsid();
  int null = open("/dev/null", O_RDONLY);
  if (null < 0 || dup2(null, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) _exit(126);
  if (info >= 0) {                                 /* dup2 onto itself keeps close-on-exec: clear it */
    if (info == lim->info_fd ? fcntl(info, F_SETFD, 0) < 0 : dup2(info, lim->info_fd) < 0) _exit(126);
    if (lim->info_fd > 3) close_range(3, (unsigned)lim->info_fd - 1, 0);
    close_range((unsigned)lim->info_fd + 1, ~0U, 0);
  } else {
    close_range(3, ~0U, 0);
  }
  set_limit(RLIMIT_AS, lim->memory);
  set_limit(RLIMIT_FSIZE, lim->file_size);
  set_limit(RLIMIT_CPU, (lua_Integer)lim->seconds + 1);
  struct rlimit none = {0, 0};
  setrlimit(RLIMIT_CORE, &none);
  if (lim->uid >= 0 && geteuid() == 0) {
    gid_t gid = (gid_t)lim->uid;
    if (setgroups(1, &gid) != 0 || setgid(gid) != 0 || setuid((uid_t)lim->uid) != 0) _exit(126);
    /* only under a user of its own: the limit counts every process and thread of the user */
    set_limit(RLIMIT_NPROC, lim->processes);
  }
  execv(argv[0], (char *const *)argv);             /* (execvp's PATH search is not async-signal-safe) */
  _exit(127);
}

/* A stream read into a buffer of `cap` bytes: more is read and dropped, and flagged */
typedef struct {
  int fd, open;
  char *text;
  lua_Integer kept;
} dm_stream;

static void drain(dm_stream *s, lua_Integer cap, int *over) {
  char chunk[16384];
  ssize_t got = read(s->fd, chunk, sizeof chunk);
  if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) { s->open = 0; return; }
  if (got < 0) return;
  lua_Integer room = cap - s->kept, take = got < room ? got : room;
  if (take > 0) { memcpy(s->text + s->kept, chunk, (size_t)take); s->kept += take; }
  if (got > take) *over = 1;
}

static void kill_group(pid_t pid) { kill(-pid, SIGKILL); kill(pid, SIGKILL); }

static void close_pipe(int p[2]) {
  for (int i = 0; i < 2; i++) if (p[i] >= 0) close(p[i]);
}

static int c_run_limited(lua_State *L) {
  const char *argv[ARGS_MAX];
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = (int)luaL_len(L, 1);
  if (n < 1 || n >= ARGS_MAX) return luaL_error(L, "run_limited: 1 to %d arguments, got %d", ARGS_MAX - 1, n);
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);
    argv[i] = luaL_checkstring(L, -1);
    lua_pop(L, 1);
  }
  argv[n] = NULL;
  if (argv[0][0] != '/') return luaL_error(L, "run_limited: the program must be an absolute path, got '%s'", argv[0]);
  dm_limits lim;
  read_limits(L, &lim);
  if (lim.info_fd >= 0 && lim.info_fd <= 2) return luaL_error(L, "run_limited: info_fd must be 3 or more");

  /* everything that can fail is made before the fork: nothing raises while the child runs */
  dm_stream so = {-1, 1, malloc((size_t)lim.output), 0}, se = {-1, 1, malloc((size_t)lim.output), 0};
  int out[2] = {-1, -1}, err[2] = {-1, -1}, info[2] = {-1, -1};
  if (!so.text || !se.text || pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 ||
      (lim.info_fd >= 0 && pipe2(info, O_CLOEXEC | O_NONBLOCK) != 0)) {
    int e = errno;
    free(so.text); free(se.text);
    close_pipe(out); close_pipe(err); close_pipe(info);
    return luaL_error(L, "run_limited: cannot make its buffers or pipes: %s", strerror(e));
  }
  int subreaper = 0;                           /* what it was before: restored once the child is reaped */
  if (lim.info_fd >= 0) {
    prctl(PR_GET_CHILD_SUBREAPER, &subreaper);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  double t0 = now_s();
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    if (lim.info_fd >= 0 && !subreaper) prctl(PR_SET_CHILD_SUBREAPER, 0);
    free(so.text); free(se.text);
    close_pipe(out); close_pipe(err); close_pipe(info);
    return luaL_error(L, "run_limited: fork: %s", strerror(e));
  }
  if (pid == 0) child(argv, &lim, out[1], err[1], info[1]);
  close(out[1]);
  close(err[1]);
  if (info[1] >= 0) close(info[1]);
  so.fd = out[0];
  se.fd = err[0];

  int over = 0, timed_out = 0, status = 0, reaped = 0;
  double killed_at = -1;
  while (so.open || se.open) {
    double left = lim.seconds - (now_s() - t0);
    if (killed_at < 0 && (left <= 0 || over)) { timed_out = left <= 0 && !over; kill_group(pid); killed_at = now_s(); }
    /* after a kill, a pipe that something outside the group still holds is let go within a second */
    if (killed_at >= 0 && now_s() - killed_at > 1) break;
    struct pollfd p[2] = {{so.open ? so.fd : -1, POLLIN, 0}, {se.open ? se.fd : -1, POLLIN, 0}};
    int ready = poll(p, 2, killed_at >= 0 ? 100 : (int)(left * 1000) + 1);
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    if (so.open && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) drain(&so, lim.output, &over);
    if (se.open && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) drain(&se, lim.output, &over);
  }
  close(out[0]);
  close(err[0]);
  /* both streams ended before a kill: the program may still run; it has what is left of its time */
  while (killed_at < 0 && !reaped) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) { reaped = 1; break; }
    if (w < 0 && errno != EINTR) break;
    if (now_s() - t0 >= lim.seconds) { timed_out = 1; break; }
    struct timespec pause = {0, 5 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  kill_group(pid);                                       /* what is left of the group: nothing outlives the call */
  int wait_failed = 0;
  if (!reaped) {
    pid_t w;
    while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {}
    wait_failed = w != pid;
  }
  /* the child has ended: its orphans are this process's children now, and later ones need not be */
  if (lim.info_fd >= 0 && !subreaper) prctl(PR_SET_CHILD_SUBREAPER, 0);
  char info_text[512] = {0};
  if (info[0] >= 0) {                                    /* the child has ended: what it wrote is there */
    ssize_t got = read(info[0], info_text, sizeof info_text - 1);
    if (got > 0) info_text[got] = '\0';
    close(info[0]);
  }
  double seconds = now_s() - t0;
  lua_newtable(L);
  lua_pushlstring(L, so.text, (size_t)so.kept);
  lua_setfield(L, -2, "stdout");
  lua_pushlstring(L, se.text, (size_t)se.kept);
  lua_setfield(L, -2, "stderr");
  free(so.text);
  free(se.text);
  if (wait_failed) return luaL_error(L, "run_limited: waitpid: %s (its exit status is unknown)", strerror(errno));
  lua_pushinteger(L, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  lua_setfield(L, -2, "status");
  lua_pushboolean(L, timed_out);
  lua_setfield(L, -2, "timed_out");
  lua_pushboolean(L, over);
  lua_setfield(L, -2, "output_over");
  lua_pushnumber(L, seconds);
  lua_setfield(L, -2, "seconds");
  if (info[0] >= 0) {
    lua_pushstring(L, info_text);
    lua_setfield(L, -2, "info");
  }
  return 1;
}

/* core.wait_gone(pid, seconds) → true once the process has ended (no such process, or a zombie),
** false when it still runs after `seconds`: a killed PID namespace's first process ends only after
** every other process of the namespace has */
static int c_wait_gone(lua_State *L) {
  lua_Integer pid = luaL_checkinteger(L, 1);
  double limit = luaL_checknumber(L, 2), t0 = now_s();
  if (pid <= 0) return luaL_error(L, "wait_gone: pid must be > 0, got %d", (int)pid);
  for (;;) {                                     /* a child of this process (run_limited's orphan): reap it */
    int status;
    pid_t w = waitpid((pid_t)pid, &status, WNOHANG);
    if (w == (pid_t)pid) { lua_pushboolean(L, 1); return 1; }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) break;                            /* not a child of this one: watch /proc below */
    if (now_s() - t0 > limit) { lua_pushboolean(L, 0); return 1; }
    struct timespec pause = {0, 2 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  for (;;) {
    char buf[512];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');          /* "pid (comm) S ...": the state after the name */
    if (!f || !paren || paren[1] == '\0' || paren[2] == 'Z' || paren[2] == 'X') { lua_pushboolean(L, 1); return 1; }
    if (now_s() - t0 > limit) { lua_pushboolean(L, 0); return 1; }
    struct timespec pause = {0, 10 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
}

static int c_make_temp_dir(lua_State *L) {
  const char *prefix = luaL_checkstring(L, 1), *tmp = getenv("TMPDIR");
  if (strchr(prefix, '/')) return luaL_error(L, "make_temp_dir: the prefix '%s' holds a '/'", prefix);
  lua_pushfstring(L, "%s/%sXXXXXX", tmp && *tmp ? tmp : "/tmp", prefix);
  char *path = strdup(lua_tostring(L, -1));
  if (!path || !mkdtemp(path) || chmod(path, 0755) != 0) {
    int e = errno;
    free(path);
    return luaL_error(L, "make_temp_dir: %s: %s", lua_tostring(L, -1), strerror(e));
  }
  lua_pushstring(L, path);
  free(path);
  return 1;
}

static const luaL_Reg funcs[] = {{"run_limited", c_run_limited}, {"make_temp_dir", c_make_temp_dir},
                                 {"wait_gone", c_wait_gone}, {NULL, NULL}};
DM_LUA_FUNCS(funcs)
