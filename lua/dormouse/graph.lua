--[[
dm.cuda.graph — capture the GPU work of one call and replay it.

  local graph = require "dormouse.graph"         -- dm.cuda.graph once init.lua sets it
  local x = dm.empty({64, 512}, {device = "cuda"})      -- inputs: made before the capture
  local y = dm.empty({64, 1}, {device = "cuda"})
  local g = graph(function()
    local loss = mse(model(x), y)
    loss:backward()
    return loss                                  -- fn's results: g.outputs, and replay's
  end)
  for step = 1, n do
    x:copy_(next_x); y:copy_(next_y)             -- refresh the inputs in place
    local loss = g:replay()                      -- the same tensors, recomputed
  end
  g:free()                                       -- or let the collector do it

The capture runs fn once but queues nothing: every launch, copy and matrix
product becomes a node of the graph, with its addresses, sizes and scalars
frozen, and nothing is computed until g:replay(). A replay re-runs them all
in order, on the same stream, for about one launch's host cost. So:

  - inputs are tensors made before the capture and refreshed with x:copy_(new)
    (never replaced): the graph reads their memory, wherever Lua points;
  - what fn returns (and any tensor it made) holds the results of the last
    replay, in memory of the graph's private pool, which nothing else gets
    while the graph lives; it returns to the cache with g:free();
  - shapes, scalars and Lua control flow are those of the capture; values
    that change each step belong in device memory (the optimisers' schedule
    does this);
  - fn must not wait for the device (x:item(), x:cpu(), print(x),
    dm.cuda.synchronize()): that fails the capture, with an error saying so;
  - gradients: set each parameter's .grad to nil before the capture, so the
    backward writes fresh gradients (captured into the pool) rather than
    adding to ones that the replays would add to again.
]]
local core = require "dormouse.core"

local Graph = {}
Graph.__index = Graph

-- run the captured work again; returns fn's results
function Graph:replay()
  core.cuda_graph_replay(self.handle)
  return table.unpack(self.outputs, 1, self.outputs.n)
end

-- the number of nodes (launches, copies, products) in the graph
function Graph:nodes() return core.cuda_graph_nodes(self.handle) end

function Graph:free() core.cuda_graph_free(self.handle) end

function Graph:__tostring()
  return string.format("dm.cuda.graph (%d nodes)", self:nodes())
end

local function graph(fn)
  if type(fn) ~= "function" then core.error("dm.cuda.graph: expected a function, got " .. type(fn)) end
  local ok, why = core.cuda_is_available()
  if not ok then core.error("dm.cuda.graph: CUDA graphs need a CUDA device (" .. tostring(why) .. ")") end
  collectgarbage()          -- garbage freed now goes back to the cache, not to the graph (see graph.h)
  core.cuda_graph_begin()
  local res = table.pack(pcall(fn))
  if not res[1] then
    local waited = core.cuda_graph_abort() or tostring(res[2]):find("stream is capturing", 1, true)
    if waited then
      core.error("dm.cuda.graph: the captured function waits for the device (x:item(), x:cpu(), print, " ..
                 "dm.cuda.synchronize), which a capture cannot do; read results after g:replay(). It failed " ..
                 "with: " .. tostring(res[2]))
    end
    error(string.format("dm.cuda.graph: the capture was abandoned: %s", tostring(res[2])), 0)
  end
  local handle = core.cuda_graph_end()
  return setmetatable({handle = handle, outputs = table.pack(table.unpack(res, 2, res.n))}, Graph)
end

return graph
