-- dm.littlebit, LittleBit's binary factor in one op: its forward's numerics are
-- tests/ops/cases_quant.c's; here its backward against the composition it replaces.
local dm = require "dormouse"
local helpers = require "tests.lua.helpers"

local function composed(x, row, col)
  local held = x:detach()
  local signs = held:sign() + (x - held)          -- sign forward, the gradient straight through
  return row * signs * col
end

local function run(fn, shape, dtype, seed)
  local E, m, n = shape[1], shape[2], shape[3]
  local x = dm.randn({E, m, n}, {seed = seed, dtype = dtype, requires_grad = true})
  local row = dm.randn({E, m, 1}, {seed = seed + 1, dtype = dtype, requires_grad = true})
  local col = dm.randn({E, 1, n}, {seed = seed + 2, dtype = dtype, requires_grad = true})
  local y = fn(x, row, col)
  y:backward(dm.randn(y:shape(), {seed = seed + 3, dtype = dtype}))
  return y, x.grad, row.grad, col.grad
end

describe("dm.littlebit", function()
  local shapes = {{1, 1, 1}, {3, 5, 7}, {2, 33, 17}, {4, 64, 129}, {1, 130, 3}}

  it("gives the composition's value and gradients on awkward shapes (f64 to 1e-12, f32 to 1e-5)", function()
    for _, dtype in ipairs {"f64", "f32"} do
      local tol = dtype == "f64" and 1e-12 or 1e-5
      for k, shape in ipairs(shapes) do
        local a = table.pack(run(composed, shape, dtype, 10 * k))
        local b = table.pack(run(dm.littlebit, shape, dtype, 10 * k))
        for i, what in ipairs {"w", "x's gradient", "row's gradient", "col's gradient"} do
          assert.is_true(dm.allclose(a[i], b[i], {rtol = tol, atol = tol}),
                         string.format("%s %s: %s differs", dtype, table.concat(shape, "x"), what))
        end
      end
    end
  end)

  it("gives zeros for a scale whose sum runs over an empty side", function()
    for _, shape in ipairs {{2, 0, 3}, {2, 3, 0}} do
      local _, gx, grow, gcol = run(dm.littlebit, shape, "f32", 7)
      assert.equal(0, gx:numel())
      for _, g in ipairs {grow, gcol} do
        if g:numel() > 0 then assert.equal(0, g:abs():max():item()) end
      end
    end
  end)

  it("computes only the gradients asked for", function()
    local x = dm.randn({2, 3, 4}, {seed = 1, requires_grad = true})
    local row, col = dm.randn({2, 3, 1}, {seed = 2}), dm.randn({2, 1, 4}, {seed = 3, requires_grad = true})
    dm.littlebit(x, row, col):sum():backward()
    assert.is_nil(row.grad)
    assert.is_true(dm.allclose(x.grad, (row * col):expand({2, 3, 4}), {rtol = 1e-6, atol = 1e-6}))
  end)

  it("refuses scales of the wrong shape, naming all three", function()
    local x = dm.zeros({2, 3, 4})
    helpers.has(helpers.err_of(dm.littlebit, x, dm.zeros({2, 3, 1}), dm.zeros({2, 4, 1})),
                "littlebit: x must be [E, m, n] with row [E, m, 1] and col [E, 1, n], got x [2, 3, 4], row [2, 3, 1], col [2, 4, 1]")
    helpers.has(helpers.err_of(dm.littlebit, x, dm.zeros({2, 3, 1}, {dtype = "f64"}), dm.zeros({2, 1, 4})), "littlebit")
  end)
end)
