-- dm.profile (the op profiler) and `dormouse bench`.
local dm = require "dormouse"
local helpers = require "tests.lua.helpers"
local has = helpers.has

local function row(rows, name, phase)
  for _, r in ipairs(rows) do if r.name == name and r.phase == phase then return r end end
end

describe("dm.profile", function()
  it("times each outermost op's forward and backward, by name and family", function()
    local x = dm.randn({64, 64}, {requires_grad = true})
    dm.profile.start()
    for _ = 1, 3 do
      local y = dm.matmul(x, x):tanh():sum()
      y:backward()
    end
    local rows = dm.profile.stop()
    local mm = row(rows, "matmul", "forward")
    assert.equal(3, mm.calls)
    assert.equal("matmul", mm.family)
    assert.equal(3, row(rows, "matmul", "backward").calls)
    assert.equal(3, row(rows, "tanh", "backward").calls)
    assert.equal("elementwise", row(rows, "tanh", "forward").family)
    for _, r in ipairs(rows) do assert.is_true(r.ms >= 0) end
    -- the backward's inner ops (matmuls of the gradient) count towards the node, not as calls of their own
    assert.equal(3, row(rows, "matmul", "forward").calls)
  end)

  it("times a recompute's ops, not the recompute op: their forward, their recompute, their backward", function()
    local w = dm.randn({32, 32}, {requires_grad = true})
    local x = dm.randn({8, 32}, {requires_grad = true})
    dm.profile.start()
    local y = dm.recompute(function(a) return dm.matmul(a, w):tanh() end, x):sum()
    y:backward()
    local rows = dm.profile.stop()
    assert.is_nil(row(rows, "recompute", "forward"))
    assert.is_nil(row(rows, "recompute", "backward"))
    for _, phase in ipairs {"forward", "recompute", "backward"} do
      assert.equal(1, row(rows, "matmul", phase).calls, "matmul " .. phase)
      assert.equal(1, row(rows, "tanh", phase).calls, "tanh " .. phase)
    end
  end)

  it("counts nothing while stopped, and restarts from an empty table", function()
    dm.profile.start()
    local _ = dm.ones({3}) + 1
    dm.profile.stop()
    local _ = dm.ones({3}) * 2
    dm.profile.start()
    local rows = dm.profile.stop()
    assert.equal(0, #rows)
  end)

  it("times a named region as one call, its ops inside it", function()
    dm.profile.start()
    dm.profile.region("update", "optim", "cpu", function()
      local a = dm.ones({8}) + 1
      return a * 2
    end)
    local rows = dm.profile.stop()
    assert.equal(1, #rows)
    assert.equal("optim", rows[1].family)
    assert.equal("region", rows[1].phase)
  end)

  it("keeps timing after an op raised inside a profile", function()
    dm.profile.start()
    assert.is_false(pcall(function() return dm.ones({2, 3}) + dm.ones({4}) end))
    local _ = dm.ones({3}) + dm.ones({3})
    local rows = dm.profile.stop()
    assert.is_truthy(row(rows, "add", "forward"))
  end)

  it("prints a table of family shares that sum to the step", function()
    local rows = {{name = "kda", family = "kda", phase = "forward", ms = 6, calls = 2},
                  {name = "matmul", family = "matmul", phase = "backward", ms = 2, calls = 4}}
    local text = dm.profile.table(rows, 5, {steps = 2})
    has(text, "kda", "3.00", "60.0%", "matmul", "1.00", "20.0%", "(no op running)", "20.0%",
        "(no op running: the step's time between ops")
  end)
end)

describe("dormouse bench", function()
  local bin = arg and arg[-1]
  it("times tiny on the CPU and writes its figures as JSON", function()
    local out_json = os.tmpname()
    local p = assert(io.popen(string.format("'%s' bench experiments/tiny.lua --steps 2 --warmup 1 " ..
      "--set device=cpu --json '%s' 2>/dev/null", bin, out_json)))
    local text = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code)
    has(text, "bench tiny on cpu", "eager", "tokens/s", "forward", "backward", "optimiser", "op family", "kda",
        "f32 products", "timed by the wall clock")
    local f = assert(io.open(out_json))
    local doc = f:read("a")
    f:close()
    os.remove(out_json)
    assert.is_true(tonumber(doc:match('"tok_s":([%d%.eE%+%-]+)')) > 0)
    assert.is_true(tonumber(doc:match('"kda":([%d%.eE%+%-]+)')) > 0)
    local ops = require("dormouse.json").decode(doc).ops                 -- every op, slowest first
    assert.is_true(#ops > 10)
    local kda = 0
    for i, op in ipairs(ops) do
      if i > 1 then assert.is_true(op.ms <= ops[i - 1].ms) end
      if op.name == "kda" then kda = kda + op.calls; assert.equal("kda", op.family) end
    end
    assert.is_true(kda > 0)
  end)

  it("writes the JSON alone to stdout with --json -, the table to stderr", function()
    local err = os.tmpname()
    local p = assert(io.popen(string.format("'%s' bench experiments/tiny.lua --steps 1 --warmup 0 " ..
      "--set device=cpu --json - 2>'%s'", bin, err)))
    local text = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code)
    local doc = require("dormouse.json").decode(text)            -- nothing else on stdout
    assert.is_true(doc.eager.tok_s > 0)
    local f = assert(io.open(err))
    has(f:read("a"), "bench tiny on cpu", "tokens/s")
    f:close()
    os.remove(err)
  end)

  it("refuses an unknown flag and a missing experiment with exit 2", function()
    local p = assert(io.popen(string.format("'%s' bench --steps 2 2>&1", bin)))
    local text = p:read("a")
    local _, _, code = p:close()
    assert.equal(2, code)
    has(text, "which experiment")
    p = assert(io.popen(string.format("'%s' bench experiments/tiny.lua --fast 2>&1", bin)))
    text = p:read("a")
    _, _, code = p:close()
    assert.equal(2, code)
    has(text, "unknown flag --fast")
  end)
end)
