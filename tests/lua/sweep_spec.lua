-- Seed sweeps: the verdict rule, and a real (tiny) sweep end to end.
local sweep = require "dormouse.sweep"

describe("the verdict", function()
  local function r(mean, spread) return {mean = mean, spread = spread, bpb = {}} end

  it("beats the control only past both spreads", function()
    local res = {control = r(2.0, 0.01), a = r(1.9, 0.02), b = r(1.995, 0.001), c = r(1.97, 0.05), d = r(2.2, 0.01)}
    sweep.verdicts(res, "control")
    assert.are.equal("control", res.control.verdict)
    assert.are.equal("beats control", res.a.verdict)
    assert.are.equal("no difference beyond the spread", res.b.verdict)   -- inside the control's spread
    assert.are.equal("no difference beyond the spread", res.c.verdict)   -- inside its own spread
    assert.are.equal("worse than control", res.d.verdict)
  end)
end)

describe("a sweep", function()
  it("trains every (arm, seed) and prints a table", function()
    local dir = os.tmpname(); os.remove(dir)
    os.execute("mkdir -p '" .. dir .. "'")
    local cwd = assert(io.popen("pwd")):read("l")
    local res = sweep.run {
      base = cwd .. "/experiments/tiny.lua", root = cwd, runs = dir, quiet = true,
      arms = {control = {}, slow = {["optim.muon_lr"] = 1e-5, ["optim.adamw_lr"] = 1e-5}},
      seeds = {1, 2},
      set = {steps = 12, ["schedule.warmup"] = 2, ["eval.every"] = 0, ["eval.windows"] = 4,
             ["eval.baseline"] = {}, ["checkpoint.every"] = 0},
    }
    assert.are.equal(2, #res.control.bpb)
    assert.is_true(res.control.mean < res.slow.mean)
    assert.are.equal("worse than control", res.slow.verdict)
    assert.is_truthy(io.open(dir .. "/sweep-tiny/verdict.txt"))
  end)
end)
