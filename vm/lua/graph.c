/*
** vm/lua/graph.c — CUDA graphs in `dormouse.core` (cuda_graph_*), which
** lua/dormouse/graph.lua turns into dm.cuda.graph. A graph is a userdata
** box; __gc and free() release it (and its private memory). In a build
** without CUDA the functions exist and say why they cannot work.
*/
#include "lua/bind.h"
#include "core/graph.h"

#define GRAPH_MT "dormouse.CudaGraph"

static dm_cuda_graph *check_graph(lua_State *L, int idx) {
  dm_cuda_graph **box = luaL_checkudata(L, idx, GRAPH_MT);
  if (!*box) {
    DM_ENTER(L);
    dm_error("dm.cuda.graph: the graph was freed");
  }
  return *box;
}

static int graph_free(lua_State *L) {
  dm_cuda_graph **box = luaL_checkudata(L, 1, GRAPH_MT);
  dm_cuda_graph_free(*box);
  *box = NULL;
  return 0;
}

static int c_begin(lua_State *L) {
  DM_ENTER(L);
  dm_cuda_graph_begin();
  return 0;
}

/* → the graph, a userdata */
static int c_end(lua_State *L) {
  dm_cuda_graph **box = lua_newuserdatauv(L, sizeof *box, 0);
  *box = NULL;
  if (luaL_newmetatable(L, GRAPH_MT)) {
    lua_pushcfunction(L, graph_free);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  DM_ENTER(L);
  *box = dm_cuda_graph_end();
  return 1;
}

/* → true when the capture had been invalidated by a call that waits for the device */
static int c_abort(lua_State *L) {
  lua_pushboolean(L, dm_cuda_graph_abort());
  return 1;
}

static int c_capturing(lua_State *L) {
  lua_pushboolean(L, dm_cuda_graph_capturing());
  return 1;
}

static int c_replay(lua_State *L) {
  dm_cuda_graph *g = check_graph(L, 1);
  DM_ENTER(L);
  dm_cuda_graph_replay(g);
  return 0;
}

static int c_nodes(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)dm_cuda_graph_nodes(check_graph(L, 1)));
  return 1;
}

static const luaL_Reg funcs[] = {
  {"cuda_graph_begin", c_begin}, {"cuda_graph_end", c_end}, {"cuda_graph_abort", c_abort},
  {"cuda_graph_capturing", c_capturing}, {"cuda_graph_replay", c_replay}, {"cuda_graph_nodes", c_nodes},
  {"cuda_graph_free", graph_free},
  {NULL, NULL}
};
DM_LUA_FUNCS(funcs)
