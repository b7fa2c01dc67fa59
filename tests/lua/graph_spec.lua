-- dm.cuda.graph without a GPU: it says it needs a CUDA device and checks its
-- argument. The captures themselves (forward and backward of an MLP replayed
-- bit-identical to eager runs, the private pool, a capture that waits for the
-- device) are checked on the GPU by tests/gpu/fuse_graph.lua.
local dm = require "dormouse"
local graph = (dm.cuda and dm.cuda.graph) or require "dormouse.graph"
local helpers = require "tests.lua.helpers"
local err_of = helpers.err_of

describe("dm.cuda.graph", function()
  it("takes a function", function()
    local err = err_of(graph, 42)
    assert.truthy(err:find("dm.cuda.graph: expected a function, got number", 1, true), err)
  end)

  if not dm.cuda.is_available() then
    it("says that CUDA graphs need a CUDA device, and why there is none", function()
      local ran = false
      local err = err_of(graph, function() ran = true end)
      assert.truthy(err:find("CUDA graphs need a CUDA device", 1, true), err)
      assert.truthy(err:find(select(2, dm.cuda.is_available()), 1, true), err)
      assert.is_false(ran)
      assert.is_false(dm.core.cuda_graph_capturing())
    end)
  end
end)
