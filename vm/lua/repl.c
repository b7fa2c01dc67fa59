/*
** vm/lua/repl.c — line editing for the REPL: readline, its history appended
** line by line, completion from the session's names, and Ctrl-C that never
** ends the session: at the prompt it drops the line being typed; while a
** line runs it stops that line with the error "interrupted" (a hook at the
** next Lua instruction, as lua.c does); a second Ctrl-C before the hook
** fires (a long call in C) ends the process, as without the handler.
**
**   core.readline(prompt)              the line; nil at end of input; false when Ctrl-C dropped it
**   core.add_history(line [, path [, max]])   to this session's history, and appended at once to
**                                      path's file, kept to its last max lines; a chunk of
**                                      several lines is one entry, in the file too
**   core.read_history(path)
**   core.repl_interrupts(on)           Ctrl-C as above while on (the calling state's main thread)
**   core.set_completer(fn)             fn(word) -> the completions of the word before the cursor
**   core.isatty(fd)
*/
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <readline/readline.h>
#include <readline/history.h>
#include "lua/bind.h"

static lua_State *repl_L;                    /* the main thread Ctrl-C stops, while interrupts are on */
static volatile sig_atomic_t reading;        /* inside readline */
static volatile sig_atomic_t dropped;        /* Ctrl-C at the prompt */
static volatile sig_atomic_t stopping;       /* Ctrl-C while a line runs, the hook not yet fired */
static struct sigaction before_int;
static int completer = LUA_NOREF;

static void stop_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  stopping = 0;
  lua_pushliteral(L, "interrupted");         /* no position: where the hook fired says nothing */
  lua_error(L);
}

static void on_ctrl_c(int sig) {
  if (reading) {                             /* the read returns EINTR: read_key ends the line */
    dropped = 1;
    return;
  }
  if (stopping || !repl_L) {                 /* asked twice: the default, now */
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  stopping = 1;
  lua_sethook(repl_L, stop_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* readline's key reader: a Ctrl-C (an interrupted read) ends the line, emptied */
static int read_key(FILE *in) {
  for (;;) {
    unsigned char c;
    ssize_t n = read(fileno(in), &c, 1);
    if (n == 1) return c;
    if (n == 0) return EOF;
    if (errno != EINTR) return EOF;
    if (dropped) {
      rl_replace_line("", 0);
      return '\n';
    }
  }
}

static int r_readline(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  dropped = 0;
  reading = 1;
  char *line = readline(prompt);
  reading = 0;
  if (dropped) {
    free(line);
    dropped = 0;
    lua_pushboolean(L, 0);
    return 1;
  }
  if (!line) return 0;
  lua_pushstring(L, line);
  free(line);
  return 1;
}

/* A chunk of several lines is one history entry, in the file too: each entry is written under a
** timestamp line, and a line without one continues the entry before it (readline 8) */
static void multiline_history(void) {
  history_comment_char = '#';                    /* a timestamp is "#<seconds>" (with '\0', none is written) */
  history_write_timestamps = 1;
  history_multiline_entries = 1;
}

static int r_add_history(lua_State *L) {
  multiline_history();
  add_history(luaL_checkstring(L, 1));          /* (add_history stamps it with the time) */
  const char *path = luaL_optstring(L, 2, NULL);
  if (!path) return 0;
  int max = (int)luaL_optinteger(L, 3, 1000);
  FILE *f = fopen(path, "a");                /* append_history wants the file there */
  if (!f) return 0;
  fclose(f);
  lua_pushboolean(L, append_history(1, path) == 0 && history_truncate_file(path, max) == 0);
  return 1;
}

static int r_read_history(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  multiline_history();
  /* a file of an earlier version holds no timestamps: each of its lines is an entry, and the file is
  ** written again with a timestamp for each, so that later entries of several lines stay whole */
  FILE *f = fopen(path, "r");
  int c = f ? fgetc(f) : EOF;
  if (f) fclose(f);
  if (c == EOF || c == '#') {
    lua_pushboolean(L, read_history(path) == 0);
    return 1;
  }
  history_multiline_entries = 0;
  int ok = read_history(path) == 0;
  history_multiline_entries = 1;
  HIST_ENTRY **list = history_list();
  for (int i = 0; ok && list && list[i]; i++) {
    char *stamp = strdup("#0");
    if (!stamp) break;
    free(list[i]->timestamp);
    list[i]->timestamp = stamp;
  }
  if (ok) write_history(path);
  lua_pushboolean(L, ok);
  return 1;
}

static int r_repl_interrupts(lua_State *L) {
  if (lua_toboolean(L, 1) && !repl_L) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
    repl_L = lua_tothread(L, -1);
    lua_pop(L, 1);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_ctrl_c;               /* no SA_RESTART: readline's read is interrupted */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &before_int);
    rl_catch_signals = 0;
    rl_getc_function = read_key;
  } else if (!lua_toboolean(L, 1) && repl_L) {
    sigaction(SIGINT, &before_int, NULL);
    lua_sethook(repl_L, NULL, 0, 0);
    repl_L = NULL;
    stopping = 0;
  }
  return 0;
}

/* readline's completion: the Lua completer's list for the word before the cursor, as readline
** wants it (the common prefix first); none: readline's own (file names) */
static char *common_prefix(char **m, int n) {
  size_t len = strlen(m[0]);
  for (int i = 1; i < n; i++) {
    size_t j = 0;
    while (j < len && m[i][j] == m[0][j]) j++;
    len = j;
  }
  char *p = malloc(len + 1);
  if (!p) return NULL;
  memcpy(p, m[0], len);
  p[len] = '\0';
  return p;
}

static char **complete(const char *text, int start, int end) {
  (void)start, (void)end;
  rl_completion_append_character = '\0';       /* a file name completed in a string: no space after it */
  lua_State *L = repl_L;
  if (!L || completer == LUA_NOREF) return NULL;
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, completer);
  lua_pushstring(L, text);
  if (lua_pcall(L, 1, 1, 0) != LUA_OK || !lua_istable(L, -1)) { lua_settop(L, top); return NULL; }
  int n = (int)lua_rawlen(L, -1);
  char **m = n > 0 ? calloc((size_t)n + 2, sizeof *m) : NULL;
  for (int i = 0; m && i < n; i++) {
    lua_rawgeti(L, -1, i + 1);
    const char *s = lua_tostring(L, -1);
    m[i + 1] = strdup(s ? s : "");
    lua_pop(L, 1);
  }
  lua_settop(L, top);
  if (!m) return NULL;
  m[0] = common_prefix(m + 1, n);
  rl_attempted_completion_over = 1;
  rl_completion_append_character = '\0';
  return m;
}

static int r_set_completer(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  luaL_unref(L, LUA_REGISTRYINDEX, completer);
  lua_pushvalue(L, 1);
  completer = luaL_ref(L, LUA_REGISTRYINDEX);
  rl_attempted_completion_function = complete;
  /* not . and : (dm.ra<Tab>, x:su<Tab>), nor / (a path: readline skips a break character that
  ** opens a word, so "/tmp/x<Tab>" would complete tmp/x) */
  rl_basic_word_break_characters = " \t\n\"\\'`@$><=;|&{}()[],+-*%^~#";
  /* inside a string the word is all of it from the quote: readline's file names complete a
  ** whole path ("runs/b1/ck<Tab>", "/tmp/x<Tab>"), the completer having no name for it */
  rl_completer_quote_characters = "\"'";
  return 0;
}

static int r_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 0)));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"readline", r_readline}, {"add_history", r_add_history}, {"read_history", r_read_history},
  {"repl_interrupts", r_repl_interrupts},
  {"set_completer", r_set_completer}, {"isatty", r_isatty}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
