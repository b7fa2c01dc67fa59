-- The dormouse model family: counts pinned, float64 agreement, a new architecture in Lua.
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"

local function build(file, overrides, device)
  local cfg = config.load(file, overrides)
  local before = nn.device
  nn.device = device or "cpu"
  dm.manual_seed(cfg.seed)
  local m = train.build_model(cfg, ".")
  nn.device = before
  return m, cfg
end

describe("b1", function()
  it("has its parameter counts, pinned, on the meta device (no memory)", function()
    local cpu = dm.memory("cpu").current
    local m = build("experiments/b1.lua", nil, "meta")
    local c = m:counts()
    assert.are.equal(dm.memory("cpu").current, cpu)
    assert.are.equal(1063082944, c.total)            -- about 1.07B
    assert.are.equal(402651680, c.tables)            -- about 403M in the Engram tables (3 primes near 2^22, de 32)
    assert.are.equal(660431264, c.without_tables)
    assert.are.equal(34674048, c.active)             -- per token per iteration
  end)
end)

describe("tiny", function()
  it("gives the same loss and gradients in float32 and float64 (rtol 1e-4)", function()
    local m32 = build("experiments/tiny.lua")
    local m64 = build("experiments/tiny.lua"):cast("f64")
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x, prefix = corpus:batch(3, {batch = 2, seq = 33, seed = 5, ctx = 2})
    local l32 = m32:forward(x, prefix).loss
    l32:backward()                                    -- one backward per tape: run them in turn
    local l64 = m64:forward(x, prefix).loss
    l64:backward()
    assert.is_true(math.abs(l32:item() - l64:item()) <= 1e-4 * math.abs(l64:item()))
    local p64 = {}
    for _, p in ipairs(m64:named_parameters()) do p64[p.name] = p.tensor end
    local checked = 0
    for _, p in ipairs(m32:named_parameters()) do
      local g32, g64 = p.tensor.grad, p64[p.name].grad
      assert.is_truthy(g32, p.name .. " has no gradient")
      local err = (g32:to("f64") - g64):abs():max():item()
      local scale = g64:abs():max():item()
      assert.is_true(err <= 1e-4 * scale + 1e-7, string.format("%s: %.3g over %.3g", p.name, err, scale))
      checked = checked + 1
    end
    assert.is_true(checked > 30)
    corpus:close()
  end)
end)

describe("a new architecture", function()
  it("is one Lua file (models/stack.lua) and trains", function()
    local m, cfg = build("experiments/stack.lua", {"steps=12", "schedule.warmup=2"})
    local opt = dm.optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local first, last
    for step = 1, cfg.steps do
      dm.scope(function()
        local x, prefix = corpus:batch(step, {batch = 4, seq = 64, seed = 1})
        local out = m:forward(x, prefix)
        out.loss:backward()
        opt:step(step)
        opt:zero_grad()
        last = out.loss:item()
        first = first or last
      end)
    end
    assert.is_true(last < first - 0.5, string.format("loss %.3f -> %.3f", first, last))
    corpus:close()
  end)
end)
