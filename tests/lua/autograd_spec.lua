-- Autograd through the Lua surface: gradients, accumulation, grad mode,
-- the tape's lifetime and the checks that keep a gradient honest.
local dm = require "dormouse"
local helpers = require "tests.lua.helpers"
local err_of, has = helpers.err_of, helpers.has

local function near(a, b, tol, path)
  tol, path = tol or 1e-10, path or "value"
  if type(b) == "table" then
    assert.equal(#b, #a, path .. " has the wrong length")
    for i = 1, #b do near(a[i], b[i], tol, path .. "[" .. i .. "]") end
  else
    assert.is_true(math.abs(a - b) <= tol, string.format("%s: got %.12g, expected %.12g", path, a, b))
  end
end

-- The same two-layer MLP in plain Lua loops, with its gradients derived by
-- hand: loss = mean over rows of (tanh(x W1 + b1) W2 - t)^2.
local function mlp_by_hand(x, W1, b1, W2, t)
  local n, d, h = #x, #W1, #W1[1]
  local loss, dW1, db1, dW2 = 0, {}, {}, {}
  for j = 1, h do db1[j], dW2[j] = 0, {0} end
  for i = 1, d do dW1[i] = {}; for j = 1, h do dW1[i][j] = 0 end end
  for r = 1, n do
    local a, y = {}, 0
    for j = 1, h do
      local z = b1[j]
      for i = 1, d do z = z + x[r][i] * W1[i][j] end
      a[j] = math.tanh(z)
      y = y + a[j] * W2[j][1]
    end
    local e = y - t[r][1]
    loss = loss + e * e / n
    local dy = 2 * e / n                          -- d loss / d y
    for j = 1, h do
      dW2[j][1] = dW2[j][1] + dy * a[j]
      local dz = dy * W2[j][1] * (1 - a[j] * a[j])  -- through tanh
      db1[j] = db1[j] + dz
      for i = 1, d do dW1[i][j] = dW1[i][j] + dz * x[r][i] end
    end
  end
  return loss, dW1, db1, dW2
end

describe("backward", function()
  it("through a small MLP equals the hand-computed gradients", function()
    local x = dm.randn({5, 3}, {seed = 1, dtype = "f64"})
    local t = dm.randn({5, 1}, {seed = 2, dtype = "f64"})
    local W1 = dm.randn({3, 4}, {seed = 3, dtype = "f64", requires_grad = true})
    local b1 = dm.randn({4}, {seed = 4, dtype = "f64", requires_grad = true})
    local W2 = dm.randn({4, 1}, {seed = 5, dtype = "f64", requires_grad = true})
    local y = (x:matmul(W1) + b1):tanh():matmul(W2)
    local loss = (y - t):square():mean()
    loss:backward()
    local l, dW1, db1, dW2 = mlp_by_hand(x:totable(), W1:totable(), b1:totable(), W2:totable(), t:totable())
    near(loss:item(), l)
    near(W1.grad:totable(), dW1)
    near(b1.grad:totable(), db1)
    near(W2.grad:totable(), dW2)
    assert.equal("f64", W1.grad.dtype)
    assert.same({3, 4}, W1.grad:shape())
    assert.is_nil(x.grad)                          -- x did not require grad
  end)

  it("flows through views, broadcasting and reductions", function()
    local w = dm.tensor({{1, 2, 3}, {4, 5, 6}}, {dtype = "f64", requires_grad = true})
    -- d/dw of sum(w[:, 2:3]^T * 2) + mean(w) * 6 = 2 on the narrowed columns, + 1 everywhere
    local loss = (w:narrow(2, 2, 2):t() * 2):sum() + w:mean() * 6
    loss:backward()
    near(w.grad:totable(), {{1, 3, 3}, {1, 3, 3}})
  end)

  it("with an explicit gradient for a non-scalar output", function()
    local w = dm.tensor({1, 2, 3}, {dtype = "f64", requires_grad = true})
    local y = w * w
    y:backward(dm.tensor({1, 0, -1}, {dtype = "f64"}))
    near(w.grad:totable(), {2, 0, -6})
  end)

  it("gradients accumulate across two backwards", function()
    local w = dm.tensor({1, 2}, {dtype = "f64", requires_grad = true})
    ;(w * 3):sum():backward()
    near(w.grad:totable(), {3, 3})
    ;(w * w):sum():backward()
    near(w.grad:totable(), {5, 7})
    -- .grad can be reset (an optimiser's zero_grad)
    w.grad = nil
    assert.is_nil(w.grad)
    ;(w * 3):sum():backward()
    near(w.grad:totable(), {3, 3})
  end)

  it("adds a gradient met again in place only when nothing else holds the sum's first term", function()
    local w = dm.tensor({1, 2}, {dtype = "f64", requires_grad = true})
    ;(w * 3):sum():backward()
    local held = w.grad                                  -- a holder: the next sum is a new tensor
    ;(w * 2):sum():backward()
    near(held:totable(), {3, 3})
    near(w.grad:totable(), {5, 5})
    held = nil
    collectgarbage(); collectgarbage()
    local x = dm.tensor({1, 2}, {dtype = "f64", requires_grad = true})
    ;((x * 2) + (x * 3) + (x * x)):sum():backward()      -- three gradients meet in x.grad
    near(x.grad:totable(), {7, 9})
  end)

  -- a bf16 copy of an f32 matrix cast again (as a checkpoint's recomputation does): the
  -- second cast's gradient is added into the first's slice by slice (vm/ops/shape.c
  -- cast_bwd_into), never held whole in f32 beside the sum
  it("adds a cast's gradient into the one met before without a second full copy", function()
    local n = (1 << 25) + 5                              -- three slices of the cast's backward
    local w = dm.zeros({n}, {requires_grad = true})
    local y = w:to("bf16"):sum() + (w:to("bf16") * 3):sum()
    collectgarbage(); collectgarbage()
    dm.reset_peak()
    local before = dm.memory().current
    y:backward()
    local rise = dm.memory().peak - before
    assert.are.equal(4, w.grad:min():item())
    assert.are.equal(4, w.grad:max():item())
    assert.are.equal(4, w.grad:narrow(1, n - 4, 5):sum():item() / 5)
    -- the f32 gradient (4n bytes), one bf16 gradient on its way (2n) and one f32 slice (4 * 2^24)
    assert.is_true(rise <= 4 * n + 2 * n + 4 * (1 << 24) + (1 << 20),
                   string.format("the backward rose by %.1f MiB", rise / 2 ^ 20))
    w.grad = nil
  end)

  it("a leaf's .grad is its own memory, writable in place", function()
    local w = dm.tensor({1, 2}, {requires_grad = true})
    w:sum():backward()
    local g = w.grad
    g:zero_()
    assert.same({0, 0}, w.grad:totable())
  end)
end)

describe("matmul's out dtype", function()
  it("keeps a 16-bit product's f32 sums and takes its gradient as a cast's", function()
    local a = dm.randn({2, 5, 7}, {seed = 11}):to("bf16")
    local b = dm.randn({2, 7, 3}, {seed = 12}):to("bf16")
    local w = dm.randn({2, 5, 3}, {seed = 13})
    a:requires_grad(true)
    local y = dm.matmul(a, b, {out = "f32"})
    assert.equal("f32", y.dtype)
    -- the sums of the widened inputs, not rounded to bf16 (the rounded product differs somewhere)
    assert.equal(0, (y - a:detach():to("f32"):matmul(b:to("f32"))):abs():max():item())
    assert.is_true((y - dm.matmul(a:detach(), b):to("f32")):abs():max():item() > 0)
    local loss = (y * w):sum()
    loss:backward()
    local a2 = a:detach()
    a2:requires_grad(true)
    local loss2 = (dm.matmul(a2, b) * w:to("bf16")):sum()
    loss2:backward()
    assert.equal("bf16", a.grad.dtype)
    assert.equal(0, (a.grad:to("f32") - a2.grad:to("f32")):abs():max():item())
    -- b's gradient, b read transposed
    local bt = b:transpose(2, 3):contiguous()
    bt:requires_grad(true)
    local lt = (dm.matmul(a:detach(), bt, {transpose_b = true, out = "f32"}) * w):sum()
    lt:backward()
    local bt2 = b:transpose(2, 3):contiguous()
    bt2:requires_grad(true)
    local lt2 = (dm.matmul(a:detach(), bt2, {transpose_b = true}) * w:to("bf16")):sum()
    lt2:backward()
    assert.equal(0, (bt.grad:to("f32") - bt2.grad:to("f32")):abs():max():item())
  end)

  it("refuses any other pair of dtypes", function()
    local x = dm.randn({2, 2})
    has(err_of(function() dm.matmul(x, x, {out = "bf16"}) end),
        "matmul: out = bf16 from f32 inputs; the product comes in the inputs' dtype, or in f32 from bf16 or f16 ones")
    local h = x:to("f16")
    has(err_of(function() dm.matmul(h, h, {out = "bf16"}) end), "matmul: out = bf16 from f16 inputs")
    assert.equal("f32", dm.matmul(x, x, {out = "f32"}).dtype)
  end)
end)

describe("cast's grad dtype", function()
  it("gives a leaf its gradient in the copy's dtype, and an op's output in its own", function()
    local w = dm.randn({4, 3}, {seed = 21})
    w:requires_grad(true)
    local l1 = (dm.cast(w, "bf16", "bf16") * 3):sum():to("f32")
    l1:backward()
    assert.equal("bf16", w.grad.dtype)
    assert.equal(3, w.grad:to("f32"):max():item())
    local v = dm.randn({4, 3}, {seed = 22})
    v:requires_grad(true)
    local l2 = (dm.cast(v * 2, "bf16", "bf16") * 3):sum():to("f32")   -- x made by an op: f32 to it
    l2:backward()
    assert.equal("f32", v.grad.dtype)
    assert.equal(6, v.grad:max():item())
  end)

  it("refuses a grad dtype that is neither x's nor the copy's", function()
    local w = dm.randn({2, 2})
    has(err_of(function() dm.cast(w, "bf16", "f16") end),
        "cast: grad = f16; the gradient comes in x's dtype (f32) or the copy's (bf16)")
    has(err_of(function() dm.stand_in(w, "bf16", "f64") end), "stand_in: grad = f64")
  end)
end)

describe("detach and requires_grad", function()
  it("x:detach() shares the values and ends the graph", function()
    local w = dm.tensor({1, 2}, {requires_grad = true})
    local h = w * 2
    local d = h:detach()
    assert.is_false(d:requires_grad())
    assert.is_true(d.is_leaf)
    assert.same(h:totable(), d:totable())
    local loss = (d * w):sum()                     -- d is a constant here
    loss:backward()
    near(w.grad:totable(), {2, 4})
  end)

  it("requires_grad() reads, requires_grad(true) marks a leaf", function()
    local x = dm.zeros({2})
    assert.is_false(x:requires_grad())
    assert.equal(x, x:requires_grad(true))
    assert.is_true(x:requires_grad())
    local y = x * 2
    assert.is_true(y:requires_grad())
    assert.is_false(y.is_leaf)
  end)
end)

describe("grad mode", function()
  it("dm.no_grad records no tape and returns fn's values", function()
    dm.autograd.clear()
    local w = dm.ones({3}, {requires_grad = true})
    local a, b = dm.no_grad(function()
      assert.is_false(dm.grad_enabled())
      local y = w * 2 + 1
      assert.equal(0, dm.autograd.size())
      return y, "second"
    end)
    assert.is_false(a:requires_grad())
    assert.equal("second", b)
    assert.is_true(dm.grad_enabled())
  end)

  it("dm.no_grad restores grad mode after an error inside", function()
    local msg = err_of(function() dm.no_grad(function() error("inside") end) end)
    has(msg, "inside")
    assert.is_true(dm.grad_enabled())
    -- nested: enable_grad inside no_grad, both restored
    dm.no_grad(function()
      dm.enable_grad(function() assert.is_true(dm.grad_enabled()) end)
      assert.is_false(dm.grad_enabled())
    end)
    assert.is_true(dm.grad_enabled())
  end)

  it("in-place writes to a tensor that requires grad need no_grad", function()
    local w = dm.ones({2}, {requires_grad = true})
    has(err_of(function() w:copy_(dm.zeros({2})) end), "copy_", "requires grad", "dm.no_grad")
    has(err_of(function() w:fill_(0) end), "fill_", "requires grad")
    dm.no_grad(function() w:add_(dm.ones({2}), -0.5) end)
    assert.same({0.5, 0.5}, w:totable())
  end)
end)

describe("the tape", function()
  it("is recorded while grad mode is on and freed after backward", function()
    dm.autograd.clear()
    local w = dm.ones({2}, {requires_grad = true})
    local loss = (w * 2):exp():sum()
    assert.equal(3, dm.autograd.size())
    assert.equal(3, dm.memory().tape_nodes)
    loss:backward()
    assert.equal(0, dm.autograd.size())
  end)

  it("a second backward errors saying the graph was freed", function()
    local w = dm.ones({2}, {requires_grad = true})
    local loss = (w * w):sum()
    loss:backward()
    has(err_of(function() loss:backward() end), "graph", "already freed")
  end)

  it("ops on nothing that requires grad record nothing", function()
    dm.autograd.clear()
    local _ = (dm.ones({2}) * 2):exp():sum()
    assert.equal(0, dm.autograd.size())
  end)

  it("a tensor whose graph was freed cannot feed a new recorded op", function()
    local w = dm.ones({2}, {requires_grad = true})
    local h = w * 2
    h:sum():backward()
    has(err_of(function() local _ = h * w end), "freed", ":detach()")
  end)

  it("dm.autograd.clear() drops a graph that will not be used", function()
    local w = dm.ones({2}, {requires_grad = true})
    local loss = (w * 2):sum()
    assert.is_true(dm.autograd.size() > 0)
    dm.autograd.clear()
    assert.equal(0, dm.autograd.size())
    has(err_of(function() loss:backward() end), "freed")
  end)
end)

describe("backward refuses", function()
  it("requires_grad(true) on an integer tensor", function()
    has(err_of(function() dm.zeros({2}, {dtype = "i32"}):requires_grad(true) end),
        "only float tensors", "i32")
    has(err_of(function() dm.zeros({2}, {dtype = "u8", requires_grad = true}) end), "u8")
  end)

  it("a non-scalar without a gradient", function()
    local w = dm.ones({2, 2}, {requires_grad = true})
    has(err_of(function() (w * 2):backward() end), "gradient is needed", "4 elements")
    dm.autograd.clear()
  end)

  it("a tensor that does not require grad", function()
    has(err_of(function() dm.ones({1}):backward() end), "does not require grad")
  end)

  it("when a saved tensor was written in place after the forward", function()
    local w = dm.tensor({1, 2}, {requires_grad = true})
    local h = w * 3
    local loss = (h * h):sum()                   -- mul saves h
    dm.no_grad(function() h:add_(1) end)
    has(err_of(function() loss:backward() end), "backward of mul", "modified in place")
    assert.equal(0, dm.autograd.size())          -- the failed backward left no tape behind
    assert.is_nil(w.grad)
  end)

  it("when a saved tensor was freed after the forward", function()
    local w = dm.tensor({1, 2}, {requires_grad = true})
    local h = w * 3
    local loss = (h * h):sum()
    h:free()
    has(err_of(function() loss:backward() end), "backward of mul", "freed")
  end)
end)
