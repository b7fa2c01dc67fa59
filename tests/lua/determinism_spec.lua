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
    -- the traced runs part at the add_ above, whose number differs: an input from outside the ops
    assert.is_truthy(r.traced_steps >= 1 and r.traced_steps <= 4)
    has(r.parts, "before the first step, call ", "(forward of affine_): its inputs or attributes differ before any " ..
                 "op's outputs did")
  end)

  it("names the op where two traces part, the optimiser's update, or a different call", function()
    local function trace(entries)
      local t = {}
      for _, e in ipairs(entries) do
        local name, kind, inputs, outputs = e[1], e[2], e[3], e[4]
        t[#t + 1] = {name = name, kind = kind, inputs = inputs, outputs = outputs}
      end
      return t
    end
    local base = {{"step 1", "mark"}, {"matmul", "forward", "a", "b"}, {"embedding", "backward", "c", "d"},
                  {"w after step 1", "tensor", nil, "e"}, {"step 2", "mark"}, {"matmul", "forward", "f", "g"}}
    local a = trace(base)
    assert.is_nil(determinism.first_divergence(a, trace(base)))
    local b = trace(base)
    b[3].outputs = "x"
    b[6].inputs = "y"
    assert.equal("step 1, call 2: the backward of embedding gives other outputs from the same inputs; embedding " ..
                 "is not deterministic here", determinism.first_divergence(a, b))
    b = trace(base)
    b[4].outputs = "x"
    has(determinism.first_divergence(a, b), "w after step 1 differs while every op of the step agreed")
    b = trace(base)
    b[6].inputs = "y"
    has(determinism.first_divergence(a, b), "step 2, call 1 (forward of matmul): its inputs or attributes differ")
    b = trace(base)
    b[6].name = "add"
    has(determinism.first_divergence(a, b), "step 2: the runs call different ops (forward of add against forward of matmul)")
    b = trace(base)
    b[7] = {name = "step 3", kind = "mark"}
    has(determinism.first_divergence(a, b), "step 2: one run's trace ends there, the other goes on")
  end)

  it("says a difference that only the resumed run has comes with the resume, and a failed search as such", function()
    local check_tensors = train.check_tensors
    train.check_tensors = function(saved, state, file)        -- the resumed run's head a little off
      check_tensors(saved, state, file)
      if file:find("/3/", 1, true) then
        require("dormouse").no_grad(function() saved["head.weight"]:add_(1e-3) end)
      end
    end
    local ok, r = pcall(determinism.check, "experiments/tiny.lua", {steps = 4, root = ".", runs = tmpdir()})
    train.check_tensors = check_tensors
    assert.is_true(ok, tostring(r))
    assert.is_nil(r.checks[1].difference)
    assert.is_truthy(r.checks[2].difference)
    has(r.parts, "not searched: the two straight runs agree, so the difference comes with the resume")

    local setup, calls, locate = train.setup, 0, determinism.locate
    train.setup = function(...)
      local model, opt = setup(...)
      calls = calls + 1
      require("dormouse").no_grad(function() model.head.weight:add_(calls * 1e-3) end)
      return model, opt
    end
    determinism.locate = function() error("out of memory (as a traced run may be)", 0) end
    ok, r = pcall(determinism.check, "experiments/tiny.lua", {steps = 2, root = ".", runs = tmpdir()})
    train.setup, determinism.locate = setup, locate
    assert.is_true(ok, tostring(r))
    assert.is_truthy(r.checks[1].difference)
    assert.equal("not searched: a traced run failed: out of memory (as a traced run may be)", r.parts)
  end)

  it("keeps one trace in C and finds where the next parts from it, from the step's mark", function()
    local dm, core = require "dormouse", require "dormouse.core"
    local w = dm.randn({3, 4}, {seed = 5})
    local function run(shift)
      core.trace_start()
      core.trace_mark("step 1")
      local _ = dm.tanh(w)
      core.trace_mark("step 2")
      local _ = dm.exp(w)
      local _ = dm.tanh(w + shift)
      core.trace_stop()
    end
    run(0)
    core.trace_keep()
    run(0)
    assert.is_nil(core.trace_parting())
    core.trace_keep()
    run(1)
    local at, mark = core.trace_parting()
    assert.equal(3, mark)                          -- "step 2"
    assert.is_truthy(at > mark)
    local a, b = core.trace_read(mark, at, true), core.trace_read(mark, at)
    assert.equal("step 2", a[1].name)
    has(determinism.first_divergence(a, b), "step 2, call 2 (forward of affine): its inputs or attributes differ")
    assert.equal(0, #core.trace_read(5, 4))
    -- a meta tensor hashes by its shape: the same each time
    core.trace_start()
    local m = dm.zeros({64, 64}, {device = "meta"})
    core.trace_tensor("m", m)
    core.trace_tensor("m", m)
    core.trace_stop()
    local t = core.trace_read()
    assert.equal(t[1].outputs, t[2].outputs)
  end)

  it("hashes every outermost op call, forward and backward, and the marks and tensors given", function()
    local dm, core = require "dormouse", require "dormouse.core"
    local w = dm.randn({3, 4}, {seed = 3, requires_grad = true})
    core.trace_start()
    core.trace_mark("step 1")
    local y = (dm.tanh(w) * 2):sum()
    y:backward()
    core.trace_tensor("w", w)
    core.trace_stop()
    local t = core.trace_read()
    local seen = {}
    for _, e in ipairs(t) do seen[#seen + 1] = e.kind .. " " .. e.name end
    local text = table.concat(seen, ", ")
    has(text, "mark step 1, forward tanh", "backward tanh", "tensor w")
    for _, e in ipairs(t) do
      if e.kind == "forward" or e.kind == "backward" then
        assert.is_truthy(e.inputs:match("^%x+$") and #e.inputs == 16, text)
      end
      if e.kind ~= "mark" then assert.is_truthy(e.outputs:match("^%x+$"), text) end
    end
    -- the same calls again give the same hashes; another weight another
    core.trace_start()
    core.trace_mark("step 1")
    local y2 = (dm.tanh(w) * 2):sum()
    core.trace_stop()
    local again = core.trace_read()
    assert.equal(t[2].outputs, again[2].outputs)
    w.grad = nil
    dm.no_grad(function() w:add_(1) end)
    core.trace_start()
    local _ = dm.tanh(w)
    core.trace_stop()
    assert.are_not.equal(t[2].inputs, core.trace_read()[1].inputs)
    assert.is_truthy(y2)
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
