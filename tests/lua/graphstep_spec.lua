-- The training step's graph-mode work (lua/dormouse/graphstep.lua), run
-- eagerly on the CPU: the same updates as the ordinary step, its window
-- sums read back once, and clear refusals.
local dm = require "dormouse"
local config = require "dormouse.config"
local train = require "dormouse.train"
local graphstep = require "dormouse.graphstep"
local helpers = require "tests.lua.helpers"

local function tiny(overrides)
  local o = {"steps=20", "device=cpu", "schedule.warmup=2"}
  for _, s in ipairs(overrides or {}) do o[#o + 1] = s end
  return (config.load("experiments/tiny.lua", o))
end

-- the run-like table train.step and graphstep take
local prepared = train.prepare

describe("graphstep (eagerly, on the CPU)", function()
  it("trains bit for bit as train.step does and sums the window's loss and norm on the device", function()
    local cfg = tiny()
    local a, b = prepared(cfg), prepared(cfg)
    local gs = graphstep.new(b, {eager = true})
    local loss_sum, norm_sum = 0, 0
    for step = 1, 6 do
      a.step = step
      local loss, r = train.step(a)
      loss_sum, norm_sum = loss_sum + loss, norm_sum + r.grad_norm
      local res = gs:step(step)
      assert.are.equal(r.lr, res.lr)
    end
    local w = gs:window(6)
    assert.is_true(w.engram.rows > 0 and w.engram.rows <= 4 * 64 * 2)     -- tiny: B 4, T 64, 2 sub-tables
    assert.is_true(w.engram.unique_frac > 0 and w.engram.unique_frac <= 1)
    assert.are.equal(6, w.applied)
    assert.are.equal(0, w.skips)
    assert.is_true(math.abs(w.loss - loss_sum) <= 1e-12 * loss_sum)
    assert.is_true(math.abs(w.grad_norm - norm_sum) <= 1e-9 * norm_sum)
    local pa, pb = a.model:named_parameters(), b.model:named_parameters()
    for i, e in ipairs(pa) do
      assert.is_true(dm.allclose(e.tensor, pb[i].tensor, {rtol = 0, atol = 0}), e.name)
    end
    assert.are.equal(0, gs:window(0).applied)            -- the sums start again
    gs.sum.loss:fill_(0 / 0)                               -- a non-finite sum is not carried on
    gs:window(0)
    assert.are.equal(0, gs:window(0).loss)
    a.loader:close(); b.loader:close()
  end)

  it("trains on records as train.step does: the mask in a buffer of its own, bit for bit", function()
    local cfg = tiny({"data.records=tasks/addition.lua"})
    local a, b = prepared(cfg), prepared(cfg)
    local gs = graphstep.new(b, {eager = true})
    local loss_sum = 0
    for step = 1, 4 do
      a.step = step
      loss_sum = loss_sum + train.step(a)
      gs:step(step)
    end
    assert.are.same({4, 64}, gs.mask:shape())
    assert.is_true(math.abs(gs:window(4).loss - loss_sum) <= 1e-12 * loss_sum)
    local pa, pb = a.model:named_parameters(), b.model:named_parameters()
    for i, e in ipairs(pa) do
      assert.is_true(dm.allclose(e.tensor, pb[i].tensor, {rtol = 0, atol = 0}), e.name)
    end
    a.loader:close(); b.loader:close()
  end)

  it("refuses the CPU, grad_accum > 1 and a capture with no eager step before it", function()
    local cfg = tiny()
    local r = prepared(cfg)
    helpers.has(helpers.err_of(graphstep.new, r), "graph = true needs the cuda device (this run is on cpu)")
    r.device = "cuda"
    helpers.has(helpers.err_of(graphstep.new, r, {warmup = 0}), "at least one eager step")
    r.cfg = tiny({"grad_accum=2"})
    helpers.has(helpers.err_of(graphstep.new, r), "grad_accum must be 1, got 2")
    -- the trainer's default reads the same list: eager steps, for the same reason
    local train = require "dormouse.train"
    r.cfg = tiny({"grad_accum=2", "graph=nil"})
    local graph, why = train.graph_mode(r)
    assert.is_false(graph)
    helpers.has(why, "grad_accum must be 1, got 2")
    r.loader:close()
  end)

  it("refuses Engram tables in host memory, at once and again at the update", function()
    local nn = require "dormouse.nn"
    nn.Engram.ram_on_cpu = true
    local ok, r = pcall(prepared, tiny({"model.engram.ram=true"}))
    nn.Engram.ram_on_cpu = false
    assert.is_true(ok, r)
    helpers.has(helpers.err_of(graphstep.new, r, {eager = true}), "needs the Engram tables on the device")
    r.opt:scalars()
    r.opt:prepare(1)
    local x, prefix = r.loader:next()
    local out = r.model:forward(x, prefix)
    out.loss:backward()
    helpers.has(helpers.err_of(r.opt.step_async, r.opt), "host memory (engram.ram = true)", "graph mode")
    r.loader:close()
  end)
end)
