-- dormouse determinism: three runs of an experiment compared step by step and tensor by tensor
-- (issue 40): the CPU backend agrees with itself, a resume included; a run that is not the same
-- each time is caught and named.
local determinism = require "dormouse.commands.determinism"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"
local has, tmpdir = helpers.has, helpers.tmpdir

describe("dormouse determinism", function()
  it("finds the CPU backend deterministic, bit for bit, straight through and across a resume", function()
    local r = determinism.check("experiments/tiny.lua", {steps = 6, root = ".", runs = tmpdir()})
    assert.equal(2, #r.checks)
    for _, c in ipairs(r.checks) do assert.is_nil(c.difference, c.what .. ": " .. tostring(c.difference)) end
    assert.equal(3, r.half)
  end)

  it("finds the 8-bit and stochastically rounded optimiser states deterministic across a resume too", function()
    local r = determinism.check("experiments/tiny.lua", {steps = 6, root = ".", runs = tmpdir(),
      overrides = {"optim.adamw_moments=8bit", "optim.engram_moments=8bit", "optim.momentum_dtype=bf16_stochastic"}})
    for _, c in ipairs(r.checks) do assert.is_nil(c.difference, c.what .. ": " .. tostring(c.difference)) end
  end)

  it("catches a run that is not the same each time, naming where", function()
    local setup, calls = train.setup, 0
    train.setup = function(...)               -- each run's head a little different: nondeterministic
      local model, opt = setup(...)
      calls = calls + 1
      require("dormouse").no_grad(function() model.head.weight:add_(calls * 1e-3) end)
      return model, opt
    end
    local ok, r = pcall(determinism.check, "experiments/tiny.lua", {steps = 4, root = ".", runs = tmpdir()})
    train.setup = setup
    assert.is_true(ok, tostring(r))
    for _, c in ipairs(r.checks) do
      assert.is_truthy(c.difference, c.what)
      assert.is_truthy(c.difference:find("^step %d+: [a-z_]+ %S+ against %S+$") or
                       c.difference:find("^parameter '[%w_.]+' differs, by up to"), c.difference)
    end
  end)

  it("runs as a command: a verdict line, exit 1 when the runs differ, usage errors with exit 2", function()
    local bin = arg and arg[-1]
    local here = assert(io.popen("pwd")):read("l")            -- ctest sets the folder, not $PWD
    local exe = bin:sub(1, 1) == "/" and bin or here .. "/" .. bin
    local dir = tmpdir()
    local p = assert(io.popen(string.format("cd '%s' && DORMOUSE_HOME='%s' '%s' determinism '%s/experiments/tiny.lua' " ..
                                            "--steps 4 2>/dev/null", dir, here, exe, here)))
    local out = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code, out)
    has(out, "determinism tiny on cpu: 4 steps", "run 3, resumed at step 2:", "verdict: deterministic, bit for bit")
    p = assert(io.popen(string.format("'%s' determinism experiments/tiny.lua --steps 1 2>&1", bin)))
    out = p:read("a")
    _, _, code = p:close()
    assert.equal(2, code)
    has(out, "--steps must be an integer >= 2, got 1", "usage: dormouse determinism")
  end)
end)
