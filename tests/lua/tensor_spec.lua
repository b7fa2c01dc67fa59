-- The tensor surface: creation, dtypes, views, arithmetic, products,
-- reductions, indexing, joining, comparison and printing.
local dm = require "dormouse"

-- |a - b| <= tol elementwise over nested tables (or two numbers)
local function near(a, b, tol, path)
  tol, path = tol or 1e-6, path or "value"
  if type(b) == "table" then
    assert.equal("table", type(a), path .. " should be a table")
    assert.equal(#b, #a, path .. " has the wrong length")
    for i = 1, #b do near(a[i], b[i], tol, path .. "[" .. i .. "]") end
  else
    assert.is_true(math.abs(a - b) <= tol, string.format("%s: got %.9g, expected %.9g", path, a, b))
  end
end

-- a tensor's values against nested tables
local function values(t, expected, tol) near(t:totable(), expected, tol) end

describe("creation", function()
  it("randn with a seed is reproducible by itself and addressed by (seed, offset)", function()
    local a = dm.randn({4, 8}, {seed = 1})
    local b = dm.randn({4, 8}, {seed = 1})
    assert.same(a:totable(), b:totable())
    assert.are_not.same(a:totable(), dm.randn({4, 8}, {seed = 2}):totable())
    -- element i of a draw at offset o uses counter o + i/4: element 9 of a draw
    -- at offset 0 is element 1 of a draw at offset 2
    local long = dm.randn({9}, {seed = 3})
    assert.equal(long:narrow(1, 9, 1):item(), dm.randn({1}, {seed = 3, offset = 2}):item())
  end)

  it("randn draws standard normals and rand uniforms in [0, 1)", function()
    local n = dm.randn({20000}, {seed = 7})
    near(n:mean():item(), 0, 0.03)
    near(n:square():mean():item(), 1, 0.05)
    local u = dm.rand({20000}, {seed = 7})
    assert.is_true(u:min():item() >= 0)
    assert.is_true(u:max():item() < 1)
    near(u:mean():item(), 0.5, 0.02)
  end)

  it("without a seed, the global generator is used and advanced by ceil(n / 4) counters", function()
    dm.manual_seed(42)
    assert.same({42, 0}, {dm.rng_state()})
    local a = dm.randn({5})
    assert.same({42, 2}, {dm.rng_state()})
    local b = dm.rand({3})
    assert.same({42, 3}, {dm.rng_state()})
    -- the same numbers as the explicit addresses
    assert.same(dm.randn({5}, {seed = 42, offset = 0}):totable(), a:totable())
    assert.same(dm.rand({3}, {seed = 42, offset = 2}):totable(), b:totable())
    -- re-seeding replays the stream
    dm.manual_seed(42)
    assert.same(a:totable(), dm.randn({5}):totable())
    dm.set_rng_state(42, 2)
    assert.same(b:totable(), dm.rand({3}):totable())
  end)

  it("randn and rand take a dtype", function()
    local x = dm.randn({3}, {seed = 1, dtype = "f64"})
    assert.equal("f64", x.dtype)
    near(x:totable(), dm.randn({3}, {seed = 1}):totable(), 1e-6)
    assert.equal("bf16", dm.rand({2}, {seed = 1, dtype = "bf16"}).dtype)
  end)

  it("zeros, ones, full, empty", function()
    local z = dm.zeros({2, 3})
    assert.same({2, 3}, z:shape())
    assert.equal("f32", z.dtype)
    assert.equal("cpu", z.device)
    values(z, {{0, 0, 0}, {0, 0, 0}})
    values(dm.ones({2}, {dtype = "f64"}), {1, 1})
    local f = dm.full({2, 2}, 7, {dtype = "i32"})
    assert.equal("i32", f.dtype)
    assert.same({{7, 7}, {7, 7}}, f:totable())
    local e = dm.empty({3, 4}, {dtype = "f16"})
    assert.same({3, 4}, e:shape())
    assert.equal("f16", e.dtype)
    assert.equal(12, e:numel())
    assert.same({}, dm.zeros({}):shape())            -- a 0-dim tensor
    assert.same({0, 3}, dm.zeros({0, 3}):shape())    -- an empty one
  end)

  it("arange: stop; start, stop; start, stop, step; options after any of them", function()
    values(dm.arange(4), {0, 1, 2, 3})
    values(dm.arange(2, 5), {2, 3, 4})
    values(dm.arange(0, 1, 0.25), {0, 0.25, 0.5, 0.75})
    local i = dm.arange(3, {dtype = "i64"})
    assert.equal("i64", i.dtype)
    assert.same({0, 1, 2}, i:totable())
    assert.same({1, 2, 3, 4}, dm.arange(1, 5, {dtype = "i32"}):totable())
    assert.same({0, 2, 4}, dm.arange(0, 5, 2, {dtype = "i32"}):totable())
  end)

  it("tensor from nested tables, with a dtype", function()
    local t = dm.tensor({{1, 2}, {3, 4}}, {dtype = "f64"})
    assert.same({2, 2}, t:shape())
    assert.equal("f64", t.dtype)
    assert.same({{1, 2}, {3, 4}}, t:totable())
    local n = dm.tensor(2.5)
    assert.same({}, n:shape())
    assert.equal(2.5, n:item())
    assert.same({0}, dm.tensor({}):shape())
    local deep = dm.tensor({{{1}, {2}}, {{3}, {4}}}, {dtype = "i32"})
    assert.same({2, 2, 1}, deep:shape())
    assert.same({{{1}, {2}}, {{3}, {4}}}, deep:totable())
  end)

  it("the *_like functions take the shape, dtype and device of a tensor", function()
    local x = dm.randn({2, 3}, {seed = 1, dtype = "f64"})
    for _, name in ipairs {"zeros_like", "ones_like", "empty_like", "rand_like", "randn_like"} do
      local y = dm[name](x)
      assert.same({2, 3}, y:shape(), name)
      assert.equal("f64", y.dtype, name)
      assert.equal("cpu", y.device, name)
    end
    values(dm.ones_like(x), {{1, 1, 1}, {1, 1, 1}})
    assert.equal("i32", dm.zeros_like(x, {dtype = "i32"}).dtype)
    assert.is_true(dm.zeros_like(x, {requires_grad = true}):requires_grad())
  end)

  it("requires_grad as an option", function()
    local w = dm.zeros({8, 3}, {dtype = "f64", requires_grad = true})
    assert.is_true(w:requires_grad())
    assert.is_true(w.is_leaf)
    assert.is_false(dm.zeros({2}):requires_grad())
  end)
end)

describe("properties", function()
  it("shape, size, dim, numel, stride, dtype, device", function()
    local x = dm.zeros({4, 8})
    assert.same({4, 8}, x:shape())
    assert.same({4, 8}, x:size())
    assert.equal(8, x:size(2))
    assert.equal(8, x:size(-1))
    assert.equal(2, x:dim())
    assert.equal(2, x.ndim)
    assert.equal(32, x:numel())
    assert.same({8, 1}, x:stride())
    assert.equal(4, #x)
    assert.equal("f32", x.dtype)
    assert.equal("cpu", x.device)
    assert.is_true(dm.is_tensor(x))
    assert.is_false(dm.is_tensor({}))
  end)

  it("item gives a float for float dtypes and an integer for integer ones", function()
    assert.equal(1.5, dm.tensor({{1.5}}):item())
    assert.equal("float", math.type(dm.tensor({2}):item()))
    local i = dm.tensor({7}, {dtype = "i64"}):item()
    assert.equal(7, i)
    assert.equal("integer", math.type(i))
    assert.equal("integer", math.type(dm.tensor({7}, {dtype = "u8"}):totable()[1]))
  end)

  it("totable follows strides (a transposed view)", function()
    local x = dm.tensor({{1, 2, 3}, {4, 5, 6}})
    assert.same({{1, 4}, {2, 5}, {3, 6}}, x:t():totable())
    assert.equal(4, dm.tensor(4):totable())
  end)
end)

describe("dtypes", function()
  local all = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"}

  it("every dtype holds small integers exactly and converts to every other", function()
    for _, from in ipairs(all) do
      local x = dm.tensor({0, 1, 2, 100}, {dtype = from})
      assert.equal(from, x.dtype)
      assert.same({0, 1, 2, 100}, x:totable(), from)
      for _, to in ipairs(all) do
        local y = x:to(to)
        assert.equal(to, y.dtype, from .. " -> " .. to)
        assert.same({0, 1, 2, 100}, y:totable(), from .. " -> " .. to)
      end
    end
  end)

  it("bf16 rounds to nearest, ties to even", function()
    -- bf16 keeps 7 mantissa bits: the neighbours of 1 are 1 and 1 + 2^-7
    local b = dm.tensor({1 + 2^-8, 1 + 3 * 2^-8, 1 + 2^-8 + 2^-12, 3.14159}, {dtype = "bf16"})
    assert.same({1, 1 + 2^-6, 1 + 2^-7, 3.140625}, b:to("f64"):totable())
    -- the same through a cast from f32
    local c = dm.tensor({1 + 2^-8, 1 + 3 * 2^-8}):to("bf16")
    assert.same({1, 1 + 2^-6}, c:to("f64"):totable())
  end)

  it("f16 rounds to nearest, ties to even, and overflows to inf", function()
    local h = dm.tensor({1 + 2^-11, 1 + 3 * 2^-11, 65504, 65520, 0.1}, {dtype = "f16"})
    local v = h:to("f64"):totable()
    assert.same({1, 1 + 2^-9, 65504, math.huge}, {v[1], v[2], v[3], v[4]})
    assert.equal(0.0999755859375, v[5])
  end)

  it("x:to('bf16') and back loses only what bf16 cannot hold", function()
    local x = dm.randn({64}, {seed = 5})
    local back = x:to("bf16"):to("f32")
    assert.equal("f32", back.dtype)
    assert.is_true(dm.allclose(back, x, {rtol = 2^-8, atol = 0}))
    assert.is_false(dm.allclose(back, x, {rtol = 1e-7, atol = 0}))
    assert.equal("bf16", x:bf16().dtype)
    assert.equal("f16", x:half().dtype)
    assert.equal("f64", x:double().dtype)
    assert.equal("f32", x:double():float().dtype)
    assert.equal("i64", x:long().dtype)
    assert.equal("i32", x:int().dtype)
    assert.equal("f64", x:to({dtype = "f64", device = "cpu"}).dtype)
  end)

  it("a float converts to an integer dtype by truncation, u8 saturating", function()
    assert.same({2, 3, -2}, dm.tensor({2.5, 3.7, -2.5}):to("i32"):totable())
    assert.same({255, 0, 2}, dm.tensor({300, -1, 2.7}, {dtype = "u8"}):totable())
  end)
end)

describe("views", function()
  it("reshape, with -1 inferred, and view", function()
    local x = dm.arange(12)
    assert.same({3, 4}, x:reshape({3, 4}):shape())
    assert.same({2, 6}, x:reshape({2, -1}):shape())
    assert.same({2, 2, 3}, x:view(2, 2, 3):shape())
    values(x:reshape({3, 4}):narrow(1, 2, 1), {{4, 5, 6, 7}})
  end)

  it("transpose and permute take 1-based and negative dims", function()
    local x = dm.arange(24):reshape({2, 3, 4})
    assert.same({4, 3, 2}, x:transpose(1, 3):shape())
    assert.same({2, 4, 3}, x:transpose(-1, -2):shape())
    assert.same({4, 2, 3}, x:permute({3, 1, 2}):shape())
    assert.same({4, 2, 3}, x:permute(-1, 1, 2):shape())
    local p = x:permute({3, 1, 2})
    -- p[k][i][j] = x[i][j][k]
    assert.equal(x:totable()[2][3][4], p:totable()[4][2][3])
    assert.same({{1, 4}, {2, 5}, {3, 6}}, dm.tensor({{1, 2, 3}, {4, 5, 6}}):t():totable())
  end)

  it("narrow takes a 1-based start", function()
    local x = dm.arange(10)
    assert.same({0, 1, 2}, x:narrow(1, 1, 3):totable())
    assert.same({7, 8, 9}, x:narrow(1, 8, 3):totable())
    local m = dm.arange(12):reshape({3, 4})
    assert.same({{1, 2}, {5, 6}, {9, 10}}, m:narrow(2, 2, 2):totable())
    assert.same({{3}, {7}, {11}}, m:narrow(-1, 4, 1):totable())
  end)

  it("views share storage: a write through copy_ into a narrow view shows in the base", function()
    local base = dm.zeros({3, 4})
    local v = base:narrow(2, 2, 2)
    assert.is_false(v:is_contiguous())
    v:copy_(dm.full({3, 2}, 5))
    assert.same({{0, 5, 5, 0}, {0, 5, 5, 0}, {0, 5, 5, 0}}, base:totable())
    -- and the other way round, through a transpose
    local t = base:t()
    base:fill_(1)
    assert.same({{1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}}, t:totable())
    -- reshape of a contiguous tensor is a view too
    local r = base:reshape({12})
    r:zero_()
    assert.equal(0, base:sum():item())
  end)

  it("contiguous copies a strided view into row-major order", function()
    local x = dm.arange(6):reshape({2, 3}):t()
    assert.is_false(x:is_contiguous())
    local c = x:contiguous()
    assert.is_true(c:is_contiguous())
    assert.same({3, 2}, c:shape())
    assert.same({2, 1}, c:stride())
    assert.same(x:totable(), c:totable())
    -- a copy: writing it leaves the base alone
    c:fill_(9)
    assert.equal(0, x:totable()[1][1])
  end)

  it("squeeze, unsqueeze, expand, clone", function()
    local x = dm.zeros({2, 1, 3})
    assert.same({2, 3}, x:squeeze():shape())
    assert.same({2, 3}, x:squeeze(2):shape())
    assert.same({2, 1, 3, 1}, x:unsqueeze(-1):shape())
    assert.same({1, 2, 1, 3}, x:unsqueeze(1):shape())
    assert.same({2, 4, 3}, x:expand({2, 4, 3}):shape())
    local c = x:clone()
    c:fill_(1)
    assert.equal(0, x:sum():item())
  end)
end)

describe("arithmetic", function()
  local a = dm.tensor({{1, 2}, {3, 4}})
  local b = dm.tensor({{10, 20}, {30, 40}})

  it("+ - * / and unary minus", function()
    values(a + b, {{11, 22}, {33, 44}})
    values(b - a, {{9, 18}, {27, 36}})
    values(a * b, {{10, 40}, {90, 160}})
    values(b / a, {{10, 10}, {10, 10}})
    values(-a, {{-1, -2}, {-3, -4}})
    values(a:add(b), {{11, 22}, {33, 44}})
    values(a:sub(b), {{-9, -18}, {-27, -36}})
    values(a:mul(b), {{10, 40}, {90, 160}})
    values(a:div(b), {{0.1, 0.1}, {0.1, 0.1}})
    values(a ^ 2, {{1, 4}, {9, 16}})
  end)

  it("a number on either side", function()
    values(a + 1, {{2, 3}, {4, 5}})
    values(1 + a, {{2, 3}, {4, 5}})
    values(a - 1, {{0, 1}, {2, 3}})
    values(1 - a, {{0, -1}, {-2, -3}})
    values(a * 2, {{2, 4}, {6, 8}})
    values(2 * a, {{2, 4}, {6, 8}})
    values(a / 2, {{0.5, 1}, {1.5, 2}})
    values(12 / a, {{12, 6}, {4, 3}})
    local i = dm.tensor({1, 2}, {dtype = "i32"})
    assert.same({3, 4}, (i + 2):totable())
    assert.same({1, 0}, (2 - i):totable())
    assert.same({3, 6}, (3 * i):totable())
    assert.equal("i32", (i * 3).dtype)
  end)

  it("broadcasts as NumPy does", function()
    local col = dm.tensor({{1}, {2}})           -- [2, 1]
    local row = dm.tensor({10, 20, 30})         -- [3]
    local s = col + row
    assert.same({2, 3}, s:shape())
    values(s, {{11, 21, 31}, {12, 22, 32}})
    values(a * dm.tensor({1, -1}), {{1, -2}, {3, -4}})
    assert.same({5, 7, 3}, (dm.zeros({5, 1, 3}) + dm.zeros({7, 3})):shape())
    values(a + dm.tensor(100), {{101, 102}, {103, 104}})
  end)

  it("maximum, minimum and the in-place add_ and mul_", function()
    values(dm.maximum(a, dm.tensor({2, 2})), {{2, 2}, {3, 4}})
    values(a:minimum(2.5), {{1, 2}, {2.5, 2.5}})
    local x = dm.zeros({2})
    x:add_(dm.tensor({1, 2}), 3)
    values(x, {3, 6})
    x:add_(1)
    values(x, {4, 7})
    x:mul_(2)
    values(x, {8, 14})
    x:mul_(dm.tensor({0.5, 1}))
    values(x, {4, 14})
  end)
end)

describe("matrix products", function()
  local a = dm.tensor({{1, 2}, {3, 4}, {5, 6}})   -- [3, 2]
  local b = dm.tensor({{1, 0, 2}, {0, 1, 3}})     -- [2, 3]

  it("x:matmul(y) and dm.matmul", function()
    local ab = {{1, 2, 8}, {3, 4, 18}, {5, 6, 28}}
    values(a:matmul(b), ab)
    values(dm.matmul(a, b), ab)
  end)

  it("transpose flags read an input transposed without copying", function()
    values(dm.matmul(a, a, {transpose_a = true}), {{35, 44}, {44, 56}})
    values(dm.matmul(a, a, {transpose_b = true}), {{5, 11, 17}, {11, 25, 39}, {17, 39, 61}})
    values(dm.matmul(b, a, {transpose_a = true, transpose_b = true}), dm.matmul(a, b):t():totable())
    values(a:matmul(b:t(), {transpose_b = true}), a:matmul(b):totable())
    values(a:t():matmul(a), dm.matmul(a, a, {transpose_a = true}):totable())
  end)

  it("batch dims broadcast; linear is x @ w^T + b", function()
    local x = dm.randn({4, 3, 2}, {seed = 1, dtype = "f64"})
    local y = x:matmul(b:double())
    assert.same({4, 3, 3}, y:shape())
    near(y:narrow(1, 2, 1):reshape({3, 3}):totable(),
         x:narrow(1, 2, 1):reshape({3, 2}):matmul(b:double()):totable(), 1e-12)
    local w = dm.tensor({{1, 1}, {1, -1}, {2, 0}})   -- [out 3, in 2]
    values(dm.linear(a, w, dm.tensor({0, 0, 1})), {{3, -1, 3}, {7, -1, 7}, {11, -1, 11}})
  end)
end)

describe("unary methods", function()
  local x = dm.tensor({0.5, 1, 2}, {dtype = "f64"})
  local cases = {
    exp = math.exp, log = math.log, sqrt = math.sqrt,
    rsqrt = function(v) return 1 / math.sqrt(v) end,
    tanh = function(v) return (math.exp(v) - math.exp(-v)) / (math.exp(v) + math.exp(-v)) end,
    sigmoid = function(v) return 1 / (1 + math.exp(-v)) end,
    silu = function(v) return v / (1 + math.exp(-v)) end,
    softplus = function(v) return math.log(1 + math.exp(v)) end,
    abs = math.abs, square = function(v) return v * v end,
    neg = function(v) return -v end,
  }
  for name, f in pairs(cases) do
    it(name, function()
      local got = x[name](x):totable()
      for i, v in ipairs {0.5, 1, 2} do near(got[i], f(v), 1e-12, name) end
    end)
  end

  it("abs, relu and sign of negative values", function()
    local n = dm.tensor({-2, 0, 3})
    values(n:abs(), {2, 0, 3})
    values(n:relu(), {0, 0, 3})
    values(n:sign(), {-1, 0, 1})
  end)

  it("pow and clamp, with an open side", function()
    values(x:pow(3), {0.125, 1, 8}, 1e-12)
    values(x:pow(0.5), {math.sqrt(0.5), 1, math.sqrt(2)}, 1e-12)
    values(x:clamp(0.75, 1.5), {0.75, 1, 1.5})
    values(x:clamp(nil, 1), {0.5, 1, 1})
    values(x:clamp(1), {1, 1, 2})
  end)
end)

describe("reductions", function()
  local x = dm.tensor({{1, 5, 2}, {7, 3, 7}})

  it("sum over everything, over a dim, keeping it", function()
    assert.equal(25, x:sum():item())
    assert.same({}, x:sum():shape())
    values(x:sum(1), {8, 8, 9})
    values(x:sum(2), {8, 17})
    values(x:sum(-1), {8, 17})
    values(x:sum(2, true), {{8}, {17}})
    assert.same({1, 3}, x:sum(1, true):shape())
    local i = dm.tensor({{1, 2}, {3, 4}}, {dtype = "i32"}):sum()
    assert.equal("i64", i.dtype)
    assert.equal(10, i:item())
  end)

  it("mean", function()
    near(x:mean():item(), 25 / 6, 1e-6)
    values(x:mean(1), {4, 4, 4.5})
    values(x:mean(2, true), {{8 / 3}, {17 / 3}}, 1e-6)
  end)

  it("max and min give values and 1-based indices; ties go to the first", function()
    assert.equal(7, x:max():item())
    assert.equal(1, x:min():item())
    local v, i = x:max(2)
    values(v, {5, 7})
    assert.equal("i64", i.dtype)
    assert.same({2, 1}, i:totable())             -- row 2 has 7 twice: the first wins
    local mv, mi = x:min(1, true)
    values(mv, {{1, 3, 2}})
    assert.same({{1, 2, 1}}, mi:totable())
  end)

  it("argmax and argmin are 1-based; with no dim, a position in the flattened tensor", function()
    assert.same({2, 1}, x:argmax(2):totable())
    assert.same({2, 1, 2}, x:argmax(1):totable())
    assert.same({1, 2}, x:argmin(2):totable())
    assert.equal(4, x:argmax():item())           -- 7 at row 2, column 1: flat position 4
    assert.equal(1, x:argmin():item())
    assert.same({{2}, {1}}, x:argmax(2, true):totable())
  end)

  it("logsumexp is stable for large inputs", function()
    local l = dm.tensor({{1, 2, 3}, {1000, 1000, 1000}}, {dtype = "f64"}):logsumexp(2)
    near(l:totable(), {math.log(math.exp(1) + math.exp(2) + math.exp(3)), 1000 + math.log(3)}, 1e-9)
    near(dm.tensor({0, 0}, {dtype = "f64"}):logsumexp():item(), math.log(2), 1e-12)
  end)

  it("norm: p = 2 by default, other p, over a dim", function()
    local v = dm.tensor({{3, 4}, {6, 8}}, {dtype = "f64"})
    near(v:norm():item(), math.sqrt(9 + 16 + 36 + 64), 1e-12)
    values(v:norm(2, 2), {5, 10}, 1e-12)
    values(v:norm(1, 1), {9, 12}, 1e-12)
    assert.same({2, 1}, v:norm(2, 2, true):shape())
  end)

  it("softmax and log_softmax over the last dim by default", function()
    local s = dm.tensor({{1, 2, 3}}, {dtype = "f64"}):softmax()
    local z = math.exp(1) + math.exp(2) + math.exp(3)
    values(s, {{math.exp(1) / z, math.exp(2) / z, math.exp(3) / z}}, 1e-12)
    values(dm.tensor({{1, 2, 3}}, {dtype = "f64"}):log_softmax(), {{1 - math.log(z), 2 - math.log(z), 3 - math.log(z)}}, 1e-12)
  end)
end)

describe("comparisons and where", function()
  local a = dm.tensor({1, 2, 3})
  local b = dm.tensor({3, 2, 1})

  it("give u8 tensors of 0 and 1", function()
    local c = a:lt(b)
    assert.equal("u8", c.dtype)
    assert.same({1, 0, 0}, c:totable())
    assert.same({1, 1, 0}, a:le(b):totable())
    assert.same({0, 0, 1}, a:gt(b):totable())
    assert.same({0, 1, 1}, a:ge(b):totable())
    assert.same({0, 1, 0}, a:eq(b):totable())
    assert.same({1, 0, 1}, a:ne(b):totable())
    assert.same({0, 1, 1}, a:gt(1.5):totable())
  end)

  it("dm.where picks from a where the condition holds, else from b; numbers work", function()
    values(dm.where(a:gt(b), a, b), {3, 2, 3})
    values(dm.where(a:gt(1), a, 0), {0, 2, 3})
    values(dm.where(a:gt(1), -1, b), {3, -1, -1})
    -- the condition broadcasts
    values(dm.where(dm.tensor({{1}, {0}}, {dtype = "u8"}), a, b), {{1, 2, 3}, {3, 2, 1}})
  end)
end)

describe("indexing with 1-based indices", function()
  local x = dm.tensor({{1, 2, 3}, {4, 5, 6}})
  local function idx(t) return dm.tensor(t, {dtype = "i64"}) end

  it("gather", function()
    values(x:gather(2, idx({{3, 1}, {2, 2}})), {{3, 1}, {5, 5}})
    values(dm.gather(x, 1, idx({{2, 1, 2}})), {{4, 2, 6}})
    values(x:gather(-1, dm.tensor({{1}, {3}}, {dtype = "i32"})), {{1}, {6}})
  end)

  it("index_select", function()
    values(x:index_select(1, idx({2})), {{4, 5, 6}})
    values(x:index_select(2, idx({3, 1, 3})), {{3, 1, 3}, {6, 4, 6}})
    values(dm.index_select(x, 2, dm.tensor({2}, {dtype = "u8"})), {{2}, {5}})
  end)

  it("scatter_add adds at the indices, repeated ones adding up", function()
    local out = dm.scatter_add(dm.zeros({2, 3}), 2, idx({{1, 1}, {3, 2}}), dm.tensor({{1, 2}, {3, 4}}))
    values(out, {{3, 0, 0}, {0, 4, 3}})
    local base = dm.ones({3})
    values(base:scatter_add(1, idx({3, 3, 1}), dm.tensor({1, 1, 5})), {6, 1, 3})
    values(base, {1, 1, 1})                      -- a copy: the base is unchanged
  end)

  it("embedding ids are class ids, counted from 0", function()
    local tab = dm.tensor({{0, 0}, {1, 1}, {2, 2}})
    values(dm.embedding(idx({{2, 0}}), tab), {{{2, 2}, {0, 0}}})
  end)

  it("adds into a 16-bit destination in f32 and rounds once: a row hit many times keeps its small adds", function()
    -- rounded at every add, 1 + 1 + ... stops at 256 in bf16 (8 bits of significand), at 2048 in f16
    -- (11); 2560 and 2304 are exact in both
    for _, dt in ipairs {"bf16", "f16"} do
      local tab = dm.zeros({2, 3}, {dtype = dt, requires_grad = true})
      dm.embedding(dm.zeros({2560}, {dtype = "i64"}), tab):backward(dm.ones({2560, 3}, {dtype = dt}))
      values(tab.grad:to("f64"), {{2560, 2560, 2560}, {0, 0, 0}})
      local out = dm.zeros({1}, {dtype = dt}):scatter_add(1, dm.ones({2304}, {dtype = "i64"}), dm.ones({2304}, {dtype = dt}))
      values(out:to("f64"), {2304})
    end
  end)
end)

describe("cat and stack", function()
  local a = dm.tensor({{1, 2}, {3, 4}})
  local b = dm.tensor({{5, 6}})

  it("cat joins along an existing dim (1 by default)", function()
    values(dm.cat({a, b}), {{1, 2}, {3, 4}, {5, 6}})
    values(dm.cat({a, a}, 2), {{1, 2, 1, 2}, {3, 4, 3, 4}})
    values(dm.cat({a, a, a}, -1):narrow(2, 5, 2), {{1, 2}, {3, 4}})
  end)

  it("stack joins along a new dim", function()
    local s = dm.stack({a, a * 10})
    assert.same({2, 2, 2}, s:shape())
    values(s:narrow(1, 2, 1):squeeze(1), {{10, 20}, {30, 40}})
    assert.same({2, 2, 2}, dm.stack({a, a}, -1):shape())
    values(dm.stack({a, a * 10}, 3):narrow(3, 2, 1):squeeze(), {{10, 20}, {30, 40}})
  end)
end)

describe("allclose", function()
  it("compares with rtol and atol; shapes must match; NaN never passes", function()
    local a = dm.tensor({1, 2, 3})
    assert.is_true(dm.allclose(a, a))
    assert.is_true(dm.allclose(a, a + 1e-7))
    assert.is_false(dm.allclose(a, a + 1e-3))
    assert.is_true(dm.allclose(a, a + 1e-3, {atol = 1e-2}))
    assert.is_true(dm.allclose(a * 1.001, a, {rtol = 1e-2, atol = 0}))
    assert.is_false(dm.allclose(a * 1.1, a, {rtol = 1e-2, atol = 0}))
    assert.is_false(dm.allclose(a, dm.tensor({1, 2})))
    assert.is_false(dm.allclose(a, a:reshape({3, 1})))
    local nan = dm.tensor({0 / 0, 1, 1})
    assert.is_false(dm.allclose(nan, nan))
    assert.is_true(dm.allclose(a, a:double()))   -- dtypes may differ
  end)
end)

describe("printing", function()
  it("shows values, shape, dtype and device", function()
    local s = tostring(dm.tensor({{0.1, -2.5}, {3, 4}}))
    assert.equal("tensor([[ 0.1000, -2.5000],\n        [ 3.0000,  4.0000]], shape=[2, 2], dtype=f32, device=cpu)", s)
    assert.equal("tensor([   1,    2], shape=[2], dtype=i64, device=cpu)",
                 tostring(dm.tensor({1, 2}, {dtype = "i64"})))
    assert.equal("tensor(2.5000, shape=[], dtype=f64, device=cpu)", tostring(dm.tensor(2.5, {dtype = "f64"})))
    assert.equal("tensor([], shape=[0, 3], dtype=f32, device=cpu)", tostring(dm.zeros({0, 3})))
    assert.truthy(tostring(dm.zeros({2}, {requires_grad = true})):find("requires_grad", 1, true))
  end)

  it("summarises a large tensor with '...', three values at each end", function()
    local s = tostring(dm.arange(2000))
    assert.truthy(s:find("...", 1, true))
    assert.truthy(s:find("shape=[2000], dtype=f32, device=cpu", 1, true))
    assert.truthy(s:find("1999", 1, true))
    assert.is_nil(s:find("1000.0", 1, true))
    assert.is_true(#s < 200)
    local m = tostring(dm.arange(2500):reshape({50, 50}))
    local lines = 0
    for _ in m:gmatch("\n") do lines = lines + 1 end
    assert.equal(6, lines)                       -- 3 rows, a "...," row, 3 rows
    assert.truthy(m:find("\n        ...,\n", 1, true))
  end)

  it("switches to scientific notation for very large or small values", function()
    assert.truthy(tostring(dm.tensor({1e6, 1})):find("1.0000e+06", 1, true))
    assert.truthy(tostring(dm.tensor({1e-6, 1})):find("1.0000e-06", 1, true))
    assert.truthy(tostring(dm.tensor({0 / 0, 1 / 0, -1 / 0})):find("nan,     inf,    -inf", 1, true))
  end)
end)

describe("the LuaLS annotations (lua/meta/dormouse.lua)", function()
  local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
  local path = here .. "/../../lua/meta/dormouse.lua"

  local function annotated()
    local f = assert(io.open(path, "r"))
    -- and the lines of the functions the ops' descriptors give them (build/meta/ops.lua)
    local text = f:read("a") .. "\n" .. require("dormouse.ops.generated").luals(dm.core)
    f:close()
    local methods, funcs, fields = {}, {}, {}
    for name in text:gmatch("\nfunction Tensor:([%w_]+)%(") do methods[name] = true end
    for name in text:gmatch("\nfunction dm%.([%w_.]+)%(") do funcs[name] = true end
    for name in text:gmatch("\n%-%-%-@field ([%w_]+)") do fields[name] = true end
    for name in text:gmatch("\ndm%.([%w_]+) = ") do funcs[name] = true end
    return methods, funcs, fields
  end

  it("is valid Lua", function()
    assert.is_function(loadfile(path))
  end)

  it("annotates a function once: by hand, or from its op's descriptor", function()
    local f = assert(io.open(path, "r"))
    local by_hand = f:read("a")
    f:close()
    local generated = require("dormouse.ops.generated").luals(dm.core)
    for name in generated:gmatch("\nfunction ([%w_.:]+)%(") do
      assert.is_nil(by_hand:find("\nfunction " .. name:gsub("%.", "%%.") .. "%("),
                    name .. " is annotated by hand and from its descriptor")
    end
  end)

  it("lists every public tensor method, and no other", function()
    local methods = annotated()
    for name, v in pairs(dm.core.methods) do
      if type(v) == "function" and name:sub(1, 1) ~= "_" then
        assert.is_true(methods[name] ~= nil, "Tensor:" .. name .. " is not annotated")
      end
    end
    for name in pairs(methods) do
      assert.is_function(dm.core.methods[name], "Tensor:" .. name .. " is annotated but does not exist")
    end
  end)

  it("lists every function of the dormouse module, and no other", function()
    local _, funcs, fields = annotated()
    for name, v in pairs(dm) do
      if type(v) == "function" or name == "autograd" or name == "data" or name == "ckpt" or name == "config" then
        assert.is_true(funcs[name] ~= nil, "dm." .. name .. " is not annotated")
      else
        assert.is_true(fields[name] ~= nil, "dm." .. name .. " is not annotated as a field")
      end
    end
    for name in pairs(dm.autograd) do assert.is_true(funcs["autograd." .. name] ~= nil, "dm.autograd." .. name) end
    for name in pairs(funcs) do
      local v = dm
      for part in name:gmatch("[^.]+") do v = v[part] end
      assert.is_not_nil(v, "dm." .. name .. " is annotated but does not exist")
    end
    for _, field in ipairs {"dtype", "device", "ndim", "is_leaf", "grad"} do
      assert.is_true(fields[field], "the field ." .. field)
    end
  end)
end)
