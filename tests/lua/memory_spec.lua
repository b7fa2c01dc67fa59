-- Memory is explicit: a training step in dm.scope (or with <close> variables)
-- gives back everything it allocated, without the garbage collector.
local dm = require "dormouse"

-- A 2-layer MLP on random data: parameters, one SGD step, and the loss.
local D, H, N, LR = 8, 16, 32, 0.05

local function params()
  return {
    W1 = dm.randn({D, H}, {seed = 1, requires_grad = true}),
    b1 = dm.zeros({H}, {requires_grad = true}),
    W2 = dm.randn({H, 1}, {seed = 2, requires_grad = true}),
    b2 = dm.zeros({1}, {requires_grad = true}),
  }
end

local function step(p, i)
  local x = dm.randn({N, D}, {seed = 100, offset = i * N * D})
  local t = x:sum(2, true):tanh()       -- a target the MLP can learn
  local h = (x:matmul(p.W1) + p.b1):relu()
  local loss = ((h:matmul(p.W2) + p.b2) - t):square():mean()
  loss:backward()
  dm.no_grad(function()
    for _, w in pairs(p) do
      w:add_(w.grad, -LR)
      w.grad = nil                       -- zero_grad: the next backward makes a new one
    end
  end)
  return loss:item()
end

local function live() return dm.memory().current end

-- Run fn with the garbage collector stopped: what comes back, comes back by refcount.
local function without_gc(fn)
  collectgarbage("collect")
  collectgarbage("stop")
  local ok, err = pcall(fn)
  collectgarbage("restart")
  if not ok then error(err, 0) end
end

describe("a training loop", function()
  it("returns to its memory baseline after every one of 1,000 steps in dm.scope", function()
    local p = params()
    dm.autograd.clear()
    without_gc(function()
      local base = live()
      local first, last
      for i = 1, 1000 do
        local loss = dm.scope(step, p, i)
        first = first or loss
        last = loss
        if live() ~= base or dm.autograd.size() ~= 0 then
          error(string.format("step %d: memory %d bytes above the baseline, %d tape nodes",
                              i, live() - base, dm.autograd.size()))
        end
      end
      assert.equal(base, live())
      assert.equal(0, dm.autograd.size())
      assert.is_true(last < first, string.format("the loss should fall: %g -> %g", first, last))
    end)
  end)

  it("does the same with <close> variables in a do-block", function()
    local p = params()
    dm.autograd.clear()
    without_gc(function()
      local base = live()
      for i = 1, 1000 do
        do
          local x <close> = dm.randn({N, D}, {seed = 100, offset = i * N * D})
          local s <close> = x:sum(2, true)
          local t <close> = s:tanh()
          local z1 <close> = x:matmul(p.W1)
          local a1 <close> = z1 + p.b1
          local h <close> = a1:relu()
          local z2 <close> = h:matmul(p.W2)
          local y <close> = z2 + p.b2
          local e <close> = y - t
          local e2 <close> = e:square()
          local loss <close> = e2:mean()
          loss:backward()
          dm.no_grad(function()
            for _, w in pairs(p) do
              local g <close> = w.grad
              w:add_(g, -LR)
              w.grad = nil
            end
          end)
        end
        if live() ~= base or dm.autograd.size() ~= 0 then
          error(string.format("step %d: memory %d bytes above the baseline, %d tape nodes",
                              i, live() - base, dm.autograd.size()))
        end
      end
    end)
  end)

  it("a step without a backward leaves no tape behind when its scope ends", function()
    local p = params()
    dm.autograd.clear()
    without_gc(function()
      local base = live()
      dm.scope(function()
        local _ = (dm.ones({2, D}):matmul(p.W1) + p.b1):relu():sum()
        assert.is_true(dm.autograd.size() > 0)
      end)
      assert.equal(0, dm.autograd.size())
      assert.equal(base, live())
    end)
  end)
end)

describe("dm.scope", function()
  it("drops what it made and keeps what it returns, also inside a returned table", function()
    without_gc(function()
      local base = live()
      local r, tab = dm.scope(function()
        local tmp = dm.ones({100})
        local _ = tmp * 3
        return tmp * 2, {t = dm.ones({10})}
      end)
      assert.equal(2, r:totable()[100])           -- totable makes no tensor (a view would hold r)
      assert.equal(10, tab.t:numel())
      assert.equal(base + 100 * 4 + 10 * 4, live())
      r:free()
      tab.t:free()
      assert.equal(base, live())
    end)
  end)

  it("dm.keep keeps a tensor past its scope", function()
    local kept, dropped
    dm.scope(function()
      kept = dm.keep(dm.full({3}, 7))
      dropped = dm.full({3}, 8)
    end)
    assert.same({7, 7, 7}, kept:totable())
    assert.is_true(dropped:is_freed())
    assert.is_false(kept:is_freed())
  end)

  it("a tensor returned from an inner scope belongs to the outer one", function()
    local inner
    dm.scope(function()
      inner = dm.scope(function() return dm.ones({2}) end)
      assert.is_false(inner:is_freed())
    end)
    assert.is_true(inner:is_freed())
  end)

  it("passes arguments through, and an error inside still ends the scope", function()
    local made
    local ok, err = pcall(dm.scope, function(n)
      made = dm.ones({n})
      error("stop")
    end, 4)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("stop", 1, true))
    assert.is_true(made:is_freed())
    -- and scopes still work afterwards
    local r = dm.scope(function(a, b) return dm.full({1}, a + b) end, 2, 3)
    assert.equal(5, r:item())
  end)

  it("an existing tensor passed in is not dropped", function()
    local outer = dm.ones({2})
    dm.scope(function(t) local _ = t * 2 end, outer)
    assert.is_false(outer:is_freed())
  end)
end)

describe("x:free() and <close>", function()
  it("x:free() lowers dm.memory().current at once", function()
    without_gc(function()
      local base = live()
      local x = dm.zeros({1000})
      assert.equal(base + 4000, live())
      x:free()
      assert.equal(base, live())
    end)
  end)

  it("x:free() frees the storage even while views hold it", function()
    without_gc(function()
      local base = live()
      local x = dm.zeros({1000})
      local v = x:narrow(1, 1, 10)
      x:free()
      assert.equal(base + 4000, live())           -- v still holds the storage
      v:free()
      assert.equal(base, live())
    end)
  end)

  it("a <close> variable gives its memory back at the end of its block", function()
    without_gc(function()
      local base = live()
      do
        local x <close> = dm.zeros({1000}, {dtype = "f64"})
        assert.equal(base + 8000, live())
      end
      assert.equal(base, live())
    end)
  end)

  it("dm.memory reports current, peak and count", function()
    local m = dm.memory()
    for _, k in ipairs {"current", "peak", "count", "reserved"} do
      assert.equal("number", type(m[k]), k)
    end
    assert.is_true(m.peak >= m.current)
    dm.reset_peak()
    local x = dm.zeros({1 << 16})
    assert.is_true(dm.memory().peak >= dm.memory().current)
    local count = dm.memory().count
    x:free()
    assert.equal(count - 1, dm.memory().count)
  end)
end)
