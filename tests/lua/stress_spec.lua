-- The stress protocol (dormouse run EXPERIMENT --stress): guarded steps at raised learning rates,
-- one line: pass, or the step, the counter and the tensor that failed (issue 40).
local stress = require "dormouse.stress"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"
local has = helpers.has

local function tiny_cfg(k, steps, overrides)
  local chunk = assert(loadfile("experiments/tiny.lua"))
  return stress.config(chunk(), "experiments/tiny.lua", overrides or {}, k, steps)
end

-- stress.run with train.step wrapped: change(step, taken) may alter the loss a step reports
local function run_with(cfg, k, change)
  local step_fn = train.step
  train.step = function(r)
    local taken = step_fn(r)
    if change then taken.loss = change(r.step, taken) or taken.loss end
    return taken
  end
  local ok, res = pcall(stress.run, cfg, k, {root = "."})
  train.step = step_fn
  if not ok then error(res, 0) end
  return res
end

describe("the stress protocol", function()
  it("runs the experiment's steps at K times its learning rates, flat, and passes a stable one", function()
    local cfg = tiny_cfg(2, 12)
    local base = require("dormouse.config").load("experiments/tiny.lua")
    assert.equal(base.optim.muon_lr * 2, cfg.optim.muon_lr)
    assert.equal(base.optim.adamw_lr * 2, cfg.optim.adamw_lr)
    assert.equal("constant", cfg.schedule.kind)
    local res = run_with(cfg, 2)
    assert.is_true(res.passed, res.line)
    assert.truthy(res.line:find("^stress: pass: 12 steps at 2x the learning rates, the loss %d%.%d+ %-> %d%.%d+, " ..
                                "the largest gradient norm %d"), res.line)
  end)

  it("fails a diverging config at its step with the counter: the CE ceiling", function()
    local res = run_with(tiny_cfg(3000, 40), 3000)
    assert.is_false(res.passed)
    assert.truthy(res.line:find("^stress: FAIL at step %d+ of 40 at 3000x the learning rates: ") and
                  (res.line:find("[ceiling]", 1, true) or res.line:find("[nan]", 1, true) or
                   res.line:find("[explosion]", 1, true)), res.line)
  end)

  it("names the first non-finite tensor when the loss is NaN", function()
    local setup = train.setup
    train.setup = function(...)
      local model, opt = setup(...)
      require("dormouse").no_grad(function() model.head.weight:narrow(1, 1, 1):fill_(0 / 0) end)
      return model, opt
    end
    local ok, res = pcall(run_with, tiny_cfg(1, 5), 1)
    train.setup = setup
    assert.is_true(ok, tostring(res))
    has(res.line, "stress: FAIL at step 1 of 5", "the loss is", "[nan]",
        "the first non-finite tensor: head.weight (a parameter)")
  end)

  it("names the first module whose output breaks when a real divergence leaves the weights finite", function()
    local res = run_with(tiny_cfg(1e6, 50), 1e6)
    assert.is_false(res.passed)
    has(res.line, "[nan]", "the first non-finite tensor: ", "(an activation)")
  end)

  it("catches a gradient norm that explodes against the median of the steps before", function()
    local res = run_with(tiny_cfg(1, 20), 1, function(step, taken)
      if step == 9 then taken.grad_norm = taken.grad_norm * 1000 end
    end)
    has(res.line, "stress: FAIL at step 9 of 20", "times the median of the steps before", "[explosion]")
  end)

  it("is a flag of dormouse run: refused with --resume, its options checked", function()
    local bin = arg and arg[-1]
    local function run(args)
      local p = assert(io.popen(string.format("'%s' run experiments/tiny.lua %s 2>&1", bin, args)))
      local out = p:read("a")
      local _, _, code = p:close()
      return code, out
    end
    local code, out = run("--stress --stress-steps 6")
    assert.equal(0, code, out)
    has(out, "stress: 6 guarded steps of tiny at 2x its learning rates (nothing is written)", "stress: pass: 6 steps")
    code, out = run("--stress --stress-lr 0")
    assert.equal(1, code)
    has(out, "--stress-lr must be a positive number, got 0")
    code, out = run("--stress --resume runs/x")
    assert.equal(1, code)
    has(out, "not with --resume")
  end)
end)
