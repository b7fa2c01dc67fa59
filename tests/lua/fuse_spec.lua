-- dm.fuse on the CPU: the parser and its errors, the evaluation against the
-- same expression composed of ops (f64: 1e-12), every float dtype, the
-- symbolic backward against the composition's autograd and against finite
-- differences, broadcasting, and the CUDA source compiled by NVRTC where the
-- build has it (no GPU needed). The GPU's own checks: tests/gpu/fuse_graph.lua.
local dm = require "dormouse"
local fuse = dm.fuse or require "dormouse.fuse"
local helpers = require "tests.lua.helpers"
local err_of, has = helpers.err_of, helpers.has

-- max |a - b| / max(|b|, 1e-300), in f64
local function rel(a, b)
  a, b = a:to("f64"), b:to("f64")
  local den = b:abs():max():item()
  local num = (a - b):abs():max():item()
  return den > 0 and num / den or num
end

local seed = 0
local function randn(shape, opts)
  seed = seed + 1
  return dm.randn(shape, {dtype = "f64", seed = seed}) * ((opts or {}).scale or 1)
end
local function positive(shape) return randn(shape):abs() + 0.5 end

-- expression, the same by ops (its arguments in the order the inputs first appear), the
-- inputs' shapes (broadcasting against each other), generators by input name
local CASES = {
  {"silu(a) * b", function(a, b) return a:silu() * b end, {{3, 1, 5}, {4, 1}}},
  {"a * b + c", function(a, b, c) return a * b + c end, {{3, 1, 5}, {4, 1}, {5}}},
  {"exp(a) - log(b) / sqrt(b)", function(a, b) return a:exp() - b:log() / b:sqrt() end, {{2, 7}, {7}}, {b = positive}},
  {"rsqrt(b) + tanh(a) * sigmoid(c)", function(b, a, c) return b:rsqrt() + a:tanh() * c:sigmoid() end,
   {{6}, {2, 6}, {2, 1}}, {b = positive}},
  {"softplus(a * 3) - abs(b) + relu(c)", function(a, b, c) return (a * 3):softplus() - b:abs() + c:relu() end,
   {{4, 5}, {4, 5}, {5}}},
  {"a ^ 2 + b ^ 0.5 - c ^ -1 + a ^ 3", function(a, b, c) return a:pow(2) + b:pow(0.5) - c:pow(-1) + a:pow(3) end,
   {{9}, {9}, {1}}, {b = positive, c = positive}},
  {"-a ^ 2 - (-a) * 2", function(a) return -(a:pow(2)) - (-a) * 2 end, {{3, 3}}},
  {"where(a > 0, b, c * 0.5) / (1 + 1e-3 * a)", function(a, b, c)
     return dm.where(a:gt(0), b, c * 0.5) / (a * 1e-3 + 1) end, {{2, 3, 4}, {3, 1}, {4}}},
  {"(a < b) + (a <= b) * 2 + (a > b) * 4 + (a >= b) * 8 + (a == a) * 16 + (a ~= b) * 32",
   function(a, b)
     local function f(t) return t:to("f64") end
     return f(a:lt(b)) + f(a:le(b)) * 2 + f(a:gt(b)) * 4 + f(a:ge(b)) * 8 + f(a:eq(a)) * 16 + f(a:ne(b)) * 32
   end, {{5, 4}, {4}}},
  {"x", function(x) return x * 1 end, {{2, 2}}},
}

local function inputs_of(case)
  local ins = {}
  local f = fuse(case[1])
  for i, shape in ipairs(case[3]) do
    local make = (case[4] or {})[f.inputs[i]] or randn
    ins[i] = make(shape)
  end
  return ins
end

describe("dm.fuse", function()
  it("evaluates every case as its composition of ops does (f64: 1e-12), broadcasting", function()
    for _, case in ipairs(CASES) do
      local ins = inputs_of(case)
      local got, want = fuse(case[1])(table.unpack(ins)), case[2](table.unpack(ins))
      assert.are.same(want:shape(), got:shape(), case[1])
      assert.is_true(rel(got, want) <= 1e-12, case[1] .. ": relative error " .. rel(got, want))
    end
  end)

  it("computes every float dtype in double and rounds once", function()
    local f = fuse("silu(a) * b + exp(b) / 3")
    for _, dt in ipairs {"f32", "bf16", "f16"} do
      local a, b = randn({7, 9}):to(dt), randn({9}):to(dt)
      local y = f(a, b)
      assert.are.equal(dt, y.dtype)
      local want = f(a:to("f64"), b:to("f64")):to(dt)
      assert.are.equal(0, rel(y, want), dt)
    end
  end)

  it("takes its inputs by position or by name, and numbers as scalars", function()
    local f = fuse("a - 2 * b")
    local a, b = randn({4}), randn({4})
    assert.are.same({"a", "b"}, f.inputs)
    assert.are.equal(0, rel(f{b = b, a = a}, a - b * 2))
    assert.are.equal(0, rel(f(a, 0.25), a - 0.5))
    local g = fuse("a - 2 * b", {inputs = {"b", "a"}})
    assert.are.same({"b", "a"}, g.inputs)
    assert.are.equal(0, rel(g(b, a), a - b * 2))
  end)

  it("returns the same op for the same expression", function()
    assert.are.equal(fuse("a * b"), fuse("a * b"))
    assert.are_not.equal(fuse("a * b"), fuse("a * b", {inputs = {"b", "a"}}))
  end)

  it("derives the backward symbolically, simplified for constants", function()
    assert.are.equal("3", fuse("3 * a + 2").derivatives.a)
    assert.are.equal("1", fuse("a + b").derivatives.b)
    assert.are.equal("-1", fuse("a - b").derivatives.b)
    assert.are.equal("b", fuse("a * b").derivatives.a)
    assert.are.equal("2 * a", fuse("a ^ 2").derivatives.a)
    assert.are.equal("0", fuse("(a > 0) * 3").derivatives.a)
    assert.are.equal("silu'(a) * b", fuse("silu(a) * b").derivatives.a)
    assert.are.equal("where(c > 0, 1, 0)", fuse("where(c > 0, a, b)").derivatives.a)
  end)

  it("gives every input that requires grad the composition's gradient (1e-12), summed over broadcast dims", function()
    for _, case in ipairs(CASES) do
      local ins = inputs_of(case)
      local function grads(fn)
        local xs = {}
        for i, x in ipairs(ins) do xs[i] = x:detach(); xs[i]:requires_grad(true) end
        local y = fn(table.unpack(xs))
        local w = dm.randn(y:shape(), {dtype = "f64", seed = 99})
        if y:requires_grad() then (y * w):sum():backward() end     -- comparisons alone: no gradient
        local gs = {}
        for i, x in ipairs(xs) do gs[i] = x.grad or dm.zeros(x:shape(), {dtype = "f64"}) end
        return gs
      end
      local got, want = grads(fuse(case[1])), grads(case[2])
      for i = 1, #ins do
        assert.are.same(ins[i]:shape(), got[i]:shape(), case[1])
        assert.is_true(rel(got[i], want[i]) <= 1e-12, string.format("%s: input %d: %g", case[1], i, rel(got[i], want[i])))
      end
    end
  end)

  it("has gradients that match central differences", function()
    local f = fuse("tanh(a) * b / (1 + c ^ 2) + sigmoid(a * c)")
    local shapes = {{2, 3}, {3}, {2, 1}}
    local vals = {}
    for i, shape in ipairs(shapes) do
      vals[i] = randn({shape[1] * (shape[2] or 1)}):totable()
    end
    local w = randn({2, 3})
    local function loss(grad)
      local ts = {}
      for i, shape in ipairs(shapes) do
        ts[i] = dm.tensor(vals[i], {dtype = "f64"}):reshape(shape)
        if grad then ts[i]:requires_grad(true) end
      end
      local l = (f(table.unpack(ts)) * w):sum()
      if grad then l:backward() end
      return l:item(), ts
    end
    local _, ts = loss(true)
    local eps = 1e-6
    for i = 1, #shapes do
      local g = ts[i].grad:reshape({#vals[i]}):totable()
      for j = 1, #vals[i] do
        local old = vals[i][j]
        vals[i][j] = old + eps
        local up = loss()
        vals[i][j] = old - eps
        local down = loss()
        vals[i][j] = old
        local fd = (up - down) / (2 * eps)
        assert.is_true(math.abs(fd - g[j]) <= 1e-7 * math.max(1, math.abs(fd)),
                       string.format("input %d element %d: central difference %.10g, backward %.10g", i, j, fd, g[j]))
      end
    end
  end)

  it("leaves inputs that need no gradient alone, and records nothing under no_grad", function()
    local f = fuse("a * b")
    local a, b = randn({3}), randn({3})
    a:requires_grad(true)
    f(a, b):sum():backward()
    assert.is_nil(b.grad)
    assert.are.equal(0, rel(a.grad, b))
    local before = dm.autograd.size()
    dm.no_grad(function() f(a, b) end)
    assert.are.equal(before, dm.autograd.size())
  end)

  it("points at the column of a bad expression", function()
    local err = err_of(fuse, "silu(a) * * b")
    has(err, "dm.fuse: expected an operand at column 11 in 'silu(a) * * b'", "\n  silu(a) * * b\n            ^")
    has(err_of(fuse, "exp(a"), "expected ')' or ',' at column 6")
    has(err_of(fuse, "foo(a) + 1"), "unknown function 'foo'", "at column 1")
    has(err_of(fuse, "a + exp"), "expected '(' after 'exp' at column 5")
    has(err_of(fuse, "a ^ b"), "expected a number after '^'", "column 5")
    has(err_of(fuse, ""), "expected an operand at column 1")
    has(err_of(fuse, "2a"), "expected an operator or the end of the expression at column 2")
    has(err_of(fuse, "where(a, b)"), "where takes 3 arguments, got 2")
    has(err_of(fuse, "exp(a, b)"), "exp takes 1 argument, got 2")
    has(err_of(fuse, "1e999 * a"), "the number 1e999 is out of range")
    has(err_of(fuse, "1e+ * a"), "expected digits in the number's exponent at column 4")
    has(err_of(fuse, "(a + b"), "expected ')' at column 7")
    has(err_of(fuse, "3 + 4"), "'3 + 4' has no inputs")
    has(err_of(fuse, "a+b+c+d+e+f+g+h+i"), "has 9 inputs; at most 8")
  end)

  it("says what is wrong with its arguments and options", function()
    has(err_of(fuse, 42), "dm.fuse: expected an expression string, got number")
    has(err_of(fuse, "a", {input = {"a"}}), "unknown option 'input'")
    has(err_of(fuse, "a * b", {inputs = {"a"}}), "uses 'b', which opts.inputs does not list")
    has(err_of(fuse, "a", {inputs = {"a", "a"}}), "input 'a' is listed twice")
    has(err_of(fuse, "a", {inputs = {"exp"}}), "must be a name (not a function)")
    local f = fuse("a * b")
    local a = randn({2})
    has(err_of(f, a), "dm.fuse 'a * b' (a, b): takes 2 inputs, got 1")
    has(err_of(f, {a = a}), "missing input 'b'")
    has(err_of(f, {a = a, b = a, c = a}), "unknown input 'c'")
    has(err_of(f, a, "x"), "input 'b' must be a tensor or a number, got string")
    has(err_of(f, 1, 2), "needs at least one tensor input")
  end)

  it("checks dtypes and shapes, naming the expression and both sides", function()
    local f = fuse("a * b")
    has(err_of(f, randn({2}), randn({2}):to("f32")), "dm.fuse 'a * b'", "dtype mismatch, f64 and f32")
    has(err_of(f, randn({2, 3}), randn({4})), "dm.fuse 'a * b'", "shapes [2, 3] and [4] do not broadcast")
    has(err_of(f, dm.ones({2}, {dtype = "i64"}), dm.ones({2}, {dtype = "i64"})), "input 1 must be a float tensor")
    has(err_of(dm.core.call, "fuse", {randn({2})}, {1e6}), "no fused op has id 1000000")
  end)

  it("has CUDA source that NVRTC compiles for every dtype (CUDA builds; no GPU needed)", function()
    local ok, why = dm.core.nvrtc_check("__global__ void k() {}")
    if not ok then
      print("fuse_spec: NVRTC checks skipped: " .. tostring(why))
      return
    end
    for _, expr in ipairs {"silu(a) * b", "where(a > 0, a, 0.1 * a) + tanh(b) / (1 + c ^ 2) - softplus(-c)",
                           "rsqrt(abs(a) + 1) * relu(b) ^ 3 + exp(a) * log(1 + sigmoid(b))"} do
      local f = fuse(expr)
      for dt = 0, 3 do
        assert.is_true(dm.core.nvrtc_check("#define DM_DTYPE " .. dt .. "\n" .. f.source))
        assert.is_true(dm.core.nvrtc_check("#define DM_DTYPE " .. dt .. "\n" .. f.backward_source))
      end
    end
    has(err_of(dm.core.nvrtc_check, "this is not C++"), "NVRTC could not compile the kernel", "error")
  end)
end)
