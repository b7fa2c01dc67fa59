-- The compute dtype between ops: branches in it, the residual stream in f32,
-- each parameter cast once a pass, and the experts' F padded for aligned products.
-- On the CPU f64 stands in for bf16 (the same code paths; the CPU's experts take f32 and f64).
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"

-- fn inside a scope, as a training step runs (the tape is kept until its end), its modules built
-- on device in the compute dtype
local function with_nn(device, dtype, fn)
  return nn.build({device = device, compute_dtype = dtype}, dm.scope, fn)
end

local function max_diff(a, b) return (a:to("f64") - b:to("f64")):abs():max():item() end

describe("nn.build", function()
  it("gives the modules built inside it its device and compute dtype, and nests", function()
    local outer, inner = nn.build({device = "cpu", compute_dtype = "f64"}, function()
      local a = nn.Linear(3, 2)
      return a, nn.build({device = "meta"}, function() return nn.Linear(3, 2) end)
    end)
    assert.same({"cpu", "f64"}, {outer.device, outer.compute_dtype})
    assert.same({"meta", "f64"}, {inner.device, inner.compute_dtype})
    assert.equal("meta", inner.weight.device)
    local plain = nn.Linear(3, 2)                       -- outside any build: the CPU in f32
    assert.same({"cpu", "f32"}, {plain.device, plain.compute_dtype})
  end)

  it("is undone when its function raises, the error passed on as it was raised", function()
    assert.has_error(function()
      nn.build({compute_dtype = "f64"}, function() error("in the build", 0) end)
    end, "in the build")
    assert.same({"cpu", "f32"}, {nn.building()})
    local raised = {why = "an object"}
    local ok, got = pcall(nn.build, {device = "meta"}, function() error(raised) end)
    assert.is_false(ok)
    assert.equal(raised, got)
    assert.same({"cpu", "f32"}, {nn.building()})
  end)

  it("refuses an unknown key and an unknown dtype", function()
    assert.has_error(function() nn.build({dtype = "f64"}, function() end) end, "nn.build: unknown key 'dtype'")
    assert.has_error(function() nn.build({compute_dtype = "i32"}, function() end) end,
                     "nn.build: compute_dtype must be f32, bf16, f16 or f64, got i32")
  end)

  it("lets a forward run in the module's dtype wherever it is called, and compute_in change it", function()
    local L = nn.build({compute_dtype = "f64"}, nn.Linear, 3, 2)
    local x = dm.randn({4, 3}, {seed = 1})
    assert.equal("f64", L:activation(x).dtype)
    assert.equal("f32", L:project(x, L.weight).dtype)  -- an f32 input: cast in, the output cast back
    L:compute_in("f32")
    assert.equal(x, L:activation(x))
  end)
end)

describe("nn.like", function()
  it("is the tensor itself in its own dtype, a cast in another", function()
    with_nn("cpu", "f64", function()
      local L = nn.Linear(3, 2)
      local x = dm.randn({4, 3}, {seed = 1})
      assert.equal(L.weight, nn.like(L.weight, x))
      local c = nn.like(L.weight, x:to("f64"))
      assert.equal("f64", c.dtype)
      assert.are_not.equal(c, nn.like(L.weight, x:to("f64")))       -- outside a pass: a cast each call
    end)
  end)

  it("casts a parameter once inside nn.pass, lets the copy go after it, and sums its gradients in the master", function()
    with_nn("cpu", "f64", function()
      local L = nn.Linear(3, 2)
      local x = dm.randn({4, 3}, {seed = 2, dtype = "f64"})
      local copy
      local loss = nn.pass(function()
        dm.scope(function() copy = nn.like(L.weight, x) end)            -- made in an inner scope it outlives
        assert.equal(copy, nn.like(L.weight, x))
        assert.is_false(copy:is_freed())
        return (L:project(x, L.weight):sum() + L:project(x * 2, L.weight):sum())
      end)
      assert.is_true(copy:is_freed())                                   -- the tape holds what backward needs
      loss:backward()
      -- d/dW of sum(x W^T) + sum(2x W^T): every row of W gets 3 * (the column sums of x)
      local want = (x:sum(1) * 3):reshape({1, 3}):expand({2, 3})
      assert.is_true(max_diff(L.weight.grad, want) < 1e-5, max_diff(L.weight.grad, want))
      assert.equal("f32", L.weight.grad.dtype)
    end)
  end)

  it("gives a recomputation its own copy (on its own tape)", function()
    with_nn("cpu", "f64", function()
      local L = nn.Linear(3, 3)
      local x = dm.randn({2, 3}, {seed = 3, dtype = "f64", requires_grad = true})
      local y = nn.pass(function()
        return dm.recompute(function(h) return L:project(L:project(h, L.weight):tanh(), L.weight) end, x):sum()
      end)
      y:backward()
      local plain = dm.randn({2, 3}, {seed = 3, dtype = "f64", requires_grad = true})
      local g1 = L.weight.grad
      L.weight.grad = nil
      local W = L.weight:to("f64")
      dm.linear(dm.linear(plain, W):tanh(), W):sum():backward()
      assert.is_true(max_diff(g1, L.weight.grad) < 1e-6, max_diff(g1, L.weight.grad))
      assert.is_true(max_diff(x.grad, plain.grad) < 1e-12, max_diff(x.grad, plain.grad))
    end)
  end)
end)

describe("nn.residual", function()
  it("runs the branch in the compute dtype and adds it back in the stream's", function()
    with_nn("cpu", "f64", function()
      local norm = nn.RMSNorm(4)
      local h = dm.randn({2, 4}, {seed = 4})
      local seen
      local out = nn.residual(h, norm, function(u) seen = u.dtype; return u * 2 end)
      assert.equal("f64", seen)
      assert.equal("f32", out.dtype)
      local want = h:to("f64") + dm.rmsnorm(h:to("f64"), norm.gain:to("f64")) * 2
      assert.is_true(max_diff(out, want) < 1e-6)
    end)
  end)
end)

describe("the experts' F padded to a multiple of 8", function()
  it("gives the unpadded forward and gradients (F = 13, float64)", function()
    local function run(compute)
      local res
      with_nn("cpu", compute, function()
        dm.manual_seed(5)
        local moe = nn.MoE(8, {experts = 4, top_k = 2, rank = 2, shared_rank = 3, ffn = 13}):cast("f64")
        local u = dm.randn({2, 5, 8}, {seed = 6, dtype = "f64", requires_grad = true})
        local y = moe:forward(u)
        assert.equal(13, moe.write.weight:size(2))                   -- the parameters keep their shapes
        ;(y * y):sum():backward()
        res = {y = dm.keep(y:detach()), gu = dm.keep(u.grad), gw = dm.keep(moe.write.weight.grad),
                                      gsd = dm.keep(moe.sd.weight.grad)}
      end)
      return res
    end
    local padded, plain = run("f64"), run("f32")     -- an f64 input under an f32 compute dtype: no padding
    for _, k in ipairs {"y", "gu", "gw", "gsd"} do
      assert.is_true(max_diff(padded[k], plain[k]) < 1e-12, k)
    end
  end)
end)

describe("a b1 step in bf16 (meta device)", function()
  it("casts each parameter once a pass and each branch's input and output once: at most 96 casts forward", function()
    local cfg = config.load("experiments/b1.lua")
    local casts = 0
    with_nn("meta", "bf16", function()
      local model = train.build_model(cfg, ".")
      local x = dm.zeros({cfg.batch, cfg.seq + 1}, {dtype = "u8", device = "meta"})
      local prefix = dm.zeros({cfg.batch, 4}, {dtype = "u8", device = "meta"})
      dm.profile.start()
      dm.scope(function() model:forward(x, prefix).loss:backward() end)
      for _, r in ipairs(dm.profile.stop()) do
        if r.name == "cast" and r.phase == "forward" then casts = casts + r.calls end
      end
    end)
    -- 46 parameters read by the block and the readouts, 2 per branch (3 branches, 4 iterations),
    -- 2 per readout (5), beta, the router's scores and the Engram rows per iteration
    assert.is_true(casts > 0 and casts <= 96, casts .. " casts")
  end)
end)

describe("dm.add_rmsnorm: a residual add and the next branch's norm in one op", function()
  local helpers = require "tests.lua.helpers"

  -- the outputs and the leaves' gradients of fn(h, y, gain) under one loss: s and u weighted
  -- (through a transpose, with `strided`: gradients that reach the op as strided views)
  local function run(fn, hdt, ydt, D, strided)
    local h = dm.randn({3, 5, D}, {seed = 1, dtype = hdt}):requires_grad(true)
    local y = dm.randn({3, 5, D}, {seed = 2, dtype = ydt}):requires_grad(true)
    local gain = (dm.rand({D}, {seed = 3}) + 0.5):to(ydt):requires_grad(true)
    local ws, wu = dm.randn({3, D, 5}, {seed = 4, dtype = hdt}), dm.randn({3, D, 5}, {seed = 5, dtype = ydt})
    if not strided then ws, wu = ws:reshape({3, 5, D}), wu:reshape({3, 5, D}) end
    local function view(t) return strided and t:transpose(2, 3) or t end
    return dm.scope(function()
      local s, u = fn(h, y, gain)
      ;((view(s) * ws):sum():to("f64") + (view(u) * wu):sum():to("f64")):backward()
      return {s = s:detach(), u = u:detach(), h = h.grad, y = y.grad, gain = gain.grad}
    end)
  end

  local function composite(h, y, gain)
    local s = h + y:to(h.dtype)
    return s, dm.rmsnorm(s:to(y.dtype), gain, {eps = 1e-6})
  end

  it("gives the bits of the add, the casts and rmsnorm, forward and backward", function()
    for _, case in ipairs {{"f32", "f32"}, {"f64", "f64"}, {"f32", "bf16"}, {"f32", "f16"}} do
      for _, D in ipairs {7, 64, 300} do
        for _, strided in ipairs {false, true} do
          local fused = run(function(h, y, gain) return dm.add_rmsnorm(h, y, gain) end, case[1], case[2], D, strided)
          local plain = run(composite, case[1], case[2], D, strided)
          for _, k in ipairs {"s", "u", "h", "y", "gain"} do
            assert.equal(plain[k].dtype, fused[k].dtype, k)
            assert.is_true(dm.allclose(plain[k], fused[k], {rtol = 0, atol = 0}),
                           string.format("%s, h %s, y %s, D %d%s", k, case[1], case[2], D, strided and ", strided" or ""))
          end
        end
      end
    end
  end)

  it("refuses h and y of two shapes, and a gain of another dtype or length, by name", function()
    local h, y = dm.randn({2, 3}), dm.randn({2, 4})
    helpers.has(helpers.err_of(dm.add_rmsnorm, h, y), "add_rmsnorm: h and y must be of one shape")
    helpers.has(helpers.err_of(dm.add_rmsnorm, h, dm.randn({2, 3}), dm.ones({3}, {dtype = "f64"})),
                "add_rmsnorm (gain and y)")
    helpers.has(helpers.err_of(dm.add_rmsnorm, h, dm.randn({2, 3}), dm.ones({4})), "gain of shape [4] does not fit")
  end)
end)

describe("l2norm's scale", function()
  -- y and x's gradient under a weighted sum of y
  local function run(fn, dt, D)
    local x = dm.randn({4, 3, D}, {seed = 7, dtype = dt}):requires_grad(true)
    local w = dm.randn({4, 3, D}, {seed = 8, dtype = dt})
    return dm.scope(function()
      local y = fn(x)
      ;(y * w):sum():to("f64"):backward()
      return {y = y:detach(), x = x.grad}
    end)
  end

  it("a power of two inside the norm gives the bits of the norm and then the product (q's dk^-1/2)", function()
    for _, dt in ipairs {"f32", "f64", "bf16"} do
      for _, D in ipairs {5, 64, 300} do
        local inside = run(function(x) return x:l2norm(1e-6, 0.125) end, dt, D)
        local after = run(function(x) return x:l2norm(1e-6) * 0.125 end, dt, D)
        for _, k in ipairs {"y", "x"} do
          assert.is_true(dm.allclose(inside[k], after[k], {rtol = 0, atol = 0}), string.format("%s, %s, D %d", k, dt, D))
        end
      end
    end
  end)

  it("any other scale, to rounding; a scale that is not finite is refused by name", function()
    local inside = run(function(x) return x:l2norm(1e-6, 0.3) end, "f64", 9)
    local after = run(function(x) return x:l2norm(1e-6) * 0.3 end, "f64", 9)
    assert.is_true(dm.allclose(inside.y, after.y, {rtol = 1e-14, atol = 1e-15}))
    assert.is_true(dm.allclose(inside.x, after.x, {rtol = 1e-13, atol = 1e-14}))
    require("tests.lua.helpers").has(require("tests.lua.helpers").err_of(function()
      return dm.randn({2, 3}):l2norm(1e-6, 0 / 0)
    end), "l2norm: scale must be a finite number")
  end)
end)

describe("nn.residual's one op for the add and the next norm", function()
  it("runs in every pass, with grad and without, small and large", function()
    local config, train = require "dormouse.config", require "dormouse.train"
    local cfg = config.load("experiments/tiny.lua", {})
    local m = nn.build({device = "cpu", compute_dtype = "f32"}, train.build_model, cfg, ".")
    local function calls(grad, B, T)
      local x = dm.zeros({B, T + 1}, {dtype = "u8"})
      local prefix = dm.zeros({B, m:context()}, {dtype = "u8"})
      dm.profile.start()
      dm.scope(function()
        if grad then m:forward(x, prefix) else dm.no_grad(function() m:forward(x, prefix) end) end
      end)
      dm.autograd.clear()
      local n = 0
      for _, r in ipairs(dm.profile.stop()) do if r.name == "add_rmsnorm" then n = n + r.calls end end
      return n
    end
    assert.equal(3 * cfg.model.max_iter - 1, calls(false, 2, 3))
    assert.equal(3 * cfg.model.max_iter - 1, calls(true, 2, 3))
    assert.equal(3 * cfg.model.max_iter - 1, calls(false, 2, 2049))    -- 4,098 rows
  end)
end)
