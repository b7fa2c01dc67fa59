/*
** vm/lua/signal.c — a run's interrupts: while a training run holds them, SIGINT
** and SIGTERM only set a flag that the loop reads between steps (it finishes
** the step, writes a checkpoint and stops); a second signal of either kind
** ends the process at once, as without the handler.
**
**   core.signals_hold(true | false)   install the handlers / put the earlier ones back
**   core.signal_pending()             "SIGINT", "SIGTERM" or nil
*/
#include <signal.h>
#include <string.h>
#include <lua.h>
#include <lauxlib.h>
#include "lua/bind.h"

static volatile sig_atomic_t pending;
static struct sigaction before_int, before_term;
static int held;

static void on_signal(int sig) {
  if (pending) {                             /* asked twice: the default, now */
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  pending = sig;
}

static int c_signals_hold(lua_State *L) {
  int on = lua_toboolean(L, 1);
  if (on && !held) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &before_int);
    sigaction(SIGTERM, &sa, &before_term);
    pending = 0;
    held = 1;
  } else if (!on && held) {
    sigaction(SIGINT, &before_int, NULL);
    sigaction(SIGTERM, &before_term, NULL);
    held = 0;
  }
  return 0;
}

static int c_signal_pending(lua_State *L) {
  if (pending == SIGINT) lua_pushliteral(L, "SIGINT");
  else if (pending == SIGTERM) lua_pushliteral(L, "SIGTERM");
  else lua_pushnil(L);
  return 1;
}

static const luaL_Reg funcs[] = {
  {"signals_hold", c_signals_hold}, {"signal_pending", c_signal_pending}, {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
