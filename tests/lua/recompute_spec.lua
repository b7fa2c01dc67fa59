-- Activation checkpointing: dm.recompute and the model's `recompute` key.
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"

local function same(a, b, what)
  assert.is_true(dm.allclose(a, b, {rtol = 0, atol = 0}), what .. " differs")
end

-- equal up to the order of a few additions (relative 1e-12 of the largest entry, f64)
local function near(a, b, what)
  local scale = b:abs():max():item()
  local err = (a - b):abs():max():item()
  assert.is_true(err <= 1e-12 * scale, string.format("%s: %.3g over %.3g", what, err, scale))
end

describe("dm.recompute", function()
  local W = dm.randn({8, 8}, {seed = 1, dtype = "f64", requires_grad = true})
  local function f(a) return a:matmul(W):tanh():matmul(W):sigmoid() end

  it("gives the output and every gradient of the plain call, bit for bit, and leaves no tape", function()
    local x = dm.randn({4, 8}, {seed = 2, dtype = "f64", requires_grad = true})
    local y1 = f(x):sum()
    y1:backward()
    local gW, gx = W.grad:clone(), x.grad:clone()
    W.grad, x.grad = nil, nil
    local y2 = dm.recompute(f, x):sum()
    assert.are.equal(1 + 1, dm.autograd.size())         -- the recompute's node and the sum's
    y2:backward()
    assert.are.equal(y1:item(), y2:item())
    same(W.grad, gW, "W's gradient")
    same(x.grad, gx, "x's gradient")
    assert.are.equal(0, dm.autograd.size())
    W.grad = nil
  end)

  it("says when it recomputes, and runs the function once a pass", function()
    local runs, again = 0, 0
    local x = dm.randn({4, 8}, {seed = 3, dtype = "f64", requires_grad = true})
    local y = dm.recompute(function(a)
      runs = runs + 1
      if dm.recomputing() then again = again + 1 end
      return f(a)
    end, x)
    assert.are.equal(1, runs)
    y:sum():backward()
    assert.are.equal(2, runs)
    assert.are.equal(1, again)
    assert.is_false(dm.recomputing())
    W.grad = nil
  end)

  it("raises the function's error, in the forward and in the backward, and the tape recovers", function()
    local x = dm.randn({4, 8}, {seed = 4, dtype = "f64", requires_grad = true})
    helpers.has(helpers.err_of(dm.recompute, function(a) return a + dm.zeros({3}) end, x), "add")
    helpers.has(helpers.err_of(dm.recompute, function() return 7 end, x), "must return one live tensor, got number")
    helpers.has(helpers.err_of(dm.recompute, 7, x), "expected a function, got number")
    local y = dm.recompute(function(a)
      if dm.recomputing() then error("fails the second time") end
      return f(a)
    end, x):sum()
    helpers.has(helpers.err_of(y.backward, y), "fails the second time")
    assert.are.equal(0, dm.autograd.size())
    assert.is_false(dm.recomputing())
    local z = f(x):sum()                                 -- recording works as before
    z:backward()
    assert.is_truthy(x.grad)
    W.grad = nil
  end)

  it("gives a tensor of its own when the function returns one it did not make", function()
    local x = dm.randn({4, 8}, {seed = 5, dtype = "f64", requires_grad = true})
    local y = dm.recompute(function(a) return a end, x)
    assert.is_false(rawequal(x, y))
    assert.is_true(x.is_leaf)                            -- not marked as the recompute's output
    y:sum():backward()
    same(x.grad, dm.ones({4, 8}, {dtype = "f64"}), "x's gradient")
    local z = (x * 2):sum()                              -- x is still a leaf to record from
    z:backward()
    same(x.grad, dm.full({4, 8}, 3, {dtype = "f64"}), "x's gradient, twice")
  end)

  it("refuses inputs dm_call would refuse before it holds the function", function()
    local h = W * 2
    h:sum():backward()                                   -- h's graph is freed
    for _ = 1, 1030 do                                   -- more than its 1024 slots
      helpers.has(helpers.err_of(dm.recompute, f, h), "already freed")
    end
    local xs = {}
    for i = 1, 17 do xs[i] = dm.randn({2}, {seed = i, dtype = "f64"}) end
    helpers.has(helpers.err_of(dm.recompute, function(a) return a end, table.unpack(xs)), "takes 1 to 16 tensors")
    local x = dm.randn({4, 8}, {seed = 6, dtype = "f64", requires_grad = true})
    dm.recompute(f, x):sum():backward()
    assert.is_truthy(x.grad)
    W.grad = nil
  end)

  it("raises when the function catches an error of the core and goes on, forward or backward", function()
    local x = dm.randn({4, 8}, {seed = 7, dtype = "f64", requires_grad = true})
    local function swallows(a)
      pcall(function() return a + dm.zeros({3}) end)
      return f(a)
    end
    helpers.has(helpers.err_of(dm.recompute, swallows, x), "caught an error of the core")
    local y = dm.recompute(function(a)
      if dm.recomputing() then return swallows(a) end
      return f(a)
    end, x):sum()
    helpers.has(helpers.err_of(y.backward, y), "caught an error of the core")
    assert.is_false(dm.recomputing())
    dm.autograd.clear()
    local z = f(x):sum()                                 -- recording works as before
    assert.is_true(z:requires_grad())
    z:backward()
    assert.is_truthy(x.grad)
    W.grad = nil
  end)
end)

describe("nn.MoE inside dm.recompute, without new_pass", function()
  it("sums the routing counts of the calls, once each", function()
    local function counts(checkpointed)
      dm.manual_seed(1)
      local moe = nn.MoE(8, {experts = 4, top_k = 2, rank = 2, shared_rank = 2, ffn = 8}):cast("f64")
      local x = dm.randn({2, 3, 8}, {seed = 3, dtype = "f64", requires_grad = true})
      return dm.scope(function()
        local h = x
        for _ = 1, 2 do
          h = checkpointed and dm.recompute(function(a) return moe:forward(a) end, h) or moe:forward(h)
        end
        h:sum():backward()
        return moe:update_balance()
      end)
    end
    local c = counts(true)
    same(c, counts(false), "the routing counts")
    assert.are.equal(2 * 6 * 2, c:sum():item())          -- two calls, 6 tokens, top 2
  end)
end)

describe("the model with recompute = true", function()
  local function run(recompute)
    local cfg = config.load("experiments/tiny.lua", {"model.recompute=" .. tostring(recompute), "device=cpu",
                                                     "model.max_iter=3"})
    dm.manual_seed(cfg.seed)
    local m = train.build_model(cfg, "."):cast("f64")
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x, prefix = corpus:batch(3, {batch = 2, seq = 33, seed = 5, ctx = 2})
    local out = m:forward(x, prefix)
    out.loss:backward()
    return m, out.loss:item(), m:update_balance()
  end

  -- The forward is the same computation; the gradients add the block's inner
  -- contributions before the outer ones, so they agree to rounding.
  it("gives the same loss and routing counts (bit for bit) and gradients (to 1e-12, f64)", function()
    local a, la, ca = run(false)
    local b, lb, cb = run(true)
    assert.are.equal(la, lb)
    same(ca, cb, "the routing counts")
    local ra, ga = a.block.engram:sparse_grad()
    local rb, gb = b.block.engram:sparse_grad()
    same(ra, rb, "the Engram rows")
    near(ga, gb, "the Engram gradient")
    local pb = {}
    for _, p in ipairs(b:named_parameters()) do pb[p.name] = p.tensor end
    local checked = 0
    for _, p in ipairs(a:named_parameters()) do
      if p.tensor.grad then
        near(p.tensor.grad, pb[p.name].grad, p.name .. "'s gradient")
        checked = checked + 1
      end
    end
    assert.is_true(checked > 30)
  end)
end)

describe("dm.checkpoint, the name recompute had", function()
  it("is an error that gives the new name", function()
    local helpers = require "tests.lua.helpers"
    helpers.has(helpers.err_of(dm.checkpoint, function(x) return x end, dm.zeros({1})),
                "dm.checkpoint(fn, ...) is now dm.recompute(fn, ...)")
  end)
end)
