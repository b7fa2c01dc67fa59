-- The training step, written once (lua/dormouse/step.lua): its eager form against the
-- captured form's work run eagerly on the CPU (input buffers, static shapes), the window's sums
-- read back once, clear refusals, and one firewall, one window, one counter path in the tree.
local dm = require "dormouse"
local config = require "dormouse.config"
local train = require "dormouse.train"
local step = require "dormouse.step"
local helpers = require "tests.lua.helpers"

-- the captured form's work, never captured (the CPU has no graphs)
local function uncaptured(r) return step.new(r, {capture = true, uncaptured = true}) end

local function tiny(overrides)
  local o = {"steps=20", "device=cpu", "schedule.warmup=2"}
  for _, s in ipairs(overrides or {}) do o[#o + 1] = s end
  return (config.load("experiments/tiny.lua", o))
end

-- the run-like table the step takes
local prepared = train.prepare

describe("the training step", function()
  it("trains bit for bit in its eager and captured forms and sums the window's loss and norm on the device",
     function()
    local cfg = tiny()
    local a, b = prepared(cfg), prepared(cfg)
    local gs = uncaptured(b)
    local loss_sum, norm_sum = 0, 0
    for n = 1, 6 do
      a.step = n
      local r = train.step(a)
      assert.is_false(r.skipped)
      loss_sum, norm_sum = loss_sum + r.loss, norm_sum + r.grad_norm
      local res = gs:run(n)
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

  it("balances on every micro-batch's routing counts (grad_accum > 1)", function()
    local totals = {}
    for _, accum in ipairs {1, 2} do
      local r = prepared(tiny({"grad_accum=" .. accum}))
      local moe = r.model.block.moe
      local update = moe.update_balance
      moe.update_balance = function(self, reduce)
        totals[accum] = self.counts:sum():item()
        return update(self, reduce)
      end
      r.step = 1
      train.step(r)
      r.loader:close()
    end
    assert.is_true(totals[1] > 0)
    assert.are.equal(2 * totals[1], totals[2])
  end)

  it("trains on records in both forms alike: the mask in a buffer of its own, bit for bit", function()
    local cfg = tiny({"data.records=tasks/addition.lua"})
    local a, b = prepared(cfg), prepared(cfg)
    local gs = uncaptured(b)
    local loss_sum = 0
    for n = 1, 4 do
      a.step = n
      loss_sum = loss_sum + train.step(a).loss
      gs:run(n)
    end
    assert.are.same({4, 64}, gs.buffers.mask:shape())
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
    local function captured(...) return step.new(r, {capture = true, warmup = ...}) end
    helpers.has(helpers.err_of(captured), "graph = true needs the cuda device (this run is on cpu)")
    r.device = "cuda"
    helpers.has(helpers.err_of(captured, 0), "at least one eager step")
    r.cfg = tiny({"grad_accum=2"})
    helpers.has(helpers.err_of(captured), "grad_accum must be 1, got 2")
    -- the trainer's default reads the same list: eager steps, for the same reason
    local train = require "dormouse.train"
    r.cfg = tiny({"grad_accum=2", "graph=nil"})
    local graph, why = train.graph_mode(r)
    assert.is_false(graph)
    helpers.has(why, "grad_accum must be 1, got 2")
    r.loader:close()
  end)

  it("refuses Engram tables in host memory in the captured form; the eager form trains them", function()
    local nn = require "dormouse.nn"
    nn.Engram.ram_on_cpu = true
    local ok, r = pcall(prepared, tiny({"model.engram.ram=true"}))
    nn.Engram.ram_on_cpu = false
    assert.is_true(ok, r)
    helpers.has(helpers.err_of(uncaptured, r), "needs the Engram tables on the device")
    local engram = r.model.block.engram
    local before = engram.table:clone()
    r.step = 1
    local s = train.step(r)
    assert.is_false(s.skipped)
    assert.is_true(s.engram.rows > 0)
    assert.is_false(dm.allclose(before, engram.table, {rtol = 0, atol = 0}), "the host table was not updated")
    r.loader:close()
  end)

  it("skips a step whose loss is not finite on the device, and reads its loss and norm when asked", function()
    local r = prepared(tiny())
    local forward, calls = r.model.forward, 0
    r.model.forward = function(m, ...)                  -- the second step's loss is NaN
      local out = forward(m, ...)
      calls = calls + 1
      if calls == 2 then out.loss = out.loss * (0 / 0) end
      return out
    end
    r.step = 1
    assert.is_false(train.step(r).skipped)
    local before = r.model.head.weight:clone()
    r.step = 2
    local s = train.step(r)
    assert.is_true(s.skipped)
    assert.is_true(s.loss ~= s.loss and s.grad_norm ~= s.grad_norm)     -- the step's own values: NaN
    assert.is_true(r.stepper:skipped())
    assert.is_true(dm.allclose(before, r.model.head.weight, {rtol = 0, atol = 0}), "a skipped step changed a weight")
    assert.are.equal(1, r.opt:sync().t)
    r.step = 3
    assert.is_false(train.step(r).skipped)
    assert.are.equal(2, r.opt:sync().t)
    -- an infinite loss whose gradients are finite (loss + inf): the loss alone decides
    r.model.forward = function(m, ...)
      local out = forward(m, ...)
      out.loss = out.loss + math.huge
      return out
    end
    r.step = 4
    s = train.step(r)
    assert.is_true(s.skipped and s.loss == math.huge)
    assert.are.equal(2, r.opt:sync().t)
    r.loader:close()
  end)
end)

describe("one step in the tree", function()
  -- the lines of the library's modules that match a pattern, as "file: line"
  local function lines_matching(pattern)
    local out = {}
    local p = assert(io.popen("cd lua && find dormouse -name '*.lua' | LC_ALL=C sort"))
    for path in p:lines() do
      local f = assert(io.open("lua/" .. path))
      for line in f:lines() do
        if line:find(pattern) and not line:match("^%s*%-%-") then out[#out + 1] = path .. ": " .. line end
      end
      f:close()
    end
    p:close()
    return out
  end

  it("has one NaN firewall, one window of sums, one counter path and one optimiser step", function()
    local function one(pattern, where)
      local found = lines_matching(pattern)
      assert.are.equal(1, #found, pattern .. ":\n" .. table.concat(found, "\n"))
      assert.truthy(found[1]:find(where, 1, true), found[1])
    end
    one("sumsq:lt%(", "dormouse/step.lua")                 -- the firewall's verdict on the device
    one("function [%w_.:]+:window%(", "dormouse/step.lua")  -- the window's sums read back
    one("model:step_counters%(", "dormouse/step.lua")          -- the model's counters, asked by the step only
    one("[%w_]%.opt:step_async%(", "dormouse/step.lua")          -- and the optimiser's update
    assert.are.same({}, lines_matching("block%.engram%.entries"))   -- no reach-in for the counters
  end)
end)
