-- causal_conv1d's Lua options (its numerics are tests/ops/cases_conv.c's).
local dm = require "dormouse"
local helpers = require "tests.lua.helpers"

describe("dm.causal_conv1d with silu = true", function()
  local function run(fused, dtype)
    local x = dm.randn({2, 37, 5}, {seed = 1, dtype = dtype, requires_grad = true})
    local w = dm.randn({5, 4}, {seed = 2, dtype = dtype, requires_grad = true})
    local cache = dm.randn({2, 6, 5}, {seed = 3, dtype = dtype, requires_grad = true})
    local y
    if fused then y = dm.causal_conv1d(x, w, {dilation = 2, cache = cache, silu = true})
    else y = dm.causal_conv1d(x, w, {dilation = 2, cache = cache}):silu() end
    local g = dm.randn(y:shape(), {seed = 4, dtype = dtype})
    y:backward(g)
    return y, x.grad, w.grad, cache.grad
  end

  it("gives silu of the convolution and its gradients, bit for bit as :silu() after it", function()
    for _, dtype in ipairs {"f64", "f32"} do
      local a = table.pack(run(false, dtype))
      local b = table.pack(run(true, dtype))
      for i, what in ipairs {"y", "x's gradient", "w's gradient", "the cache's gradient"} do
        assert.is_true(dm.allclose(a[i], b[i], {rtol = 0, atol = 0}), dtype .. ": " .. what .. " differs")
      end
    end
  end)

  it("keeps only its input for the backward: one [B, T, C] tensor less than :silu() after it", function()
    local x = dm.randn({4, 256, 64}, {seed = 5, requires_grad = true})
    local w = dm.randn({64, 4}, {seed = 6, requires_grad = true})
    local function held(fused)
      collectgarbage(); collectgarbage()
      local before = dm.memory().current
      local y = fused and dm.causal_conv1d(x, w, {silu = true}) or dm.causal_conv1d(x, w):silu()
      local bytes = dm.memory().current - before
      y:sum():backward()
      x.grad, w.grad = nil, nil
      return bytes
    end
    assert.are.equal(4 * 256 * 64 * 4, held(false) - held(true))
  end)

  it("refuses a silu that is not a boolean", function()
    local x, w = dm.zeros({1, 3, 2}), dm.zeros({2, 4})
    helpers.has(helpers.err_of(dm.causal_conv1d, x, w, {silu = "yes"}), "silu must be true or false, got string")
  end)
end)
