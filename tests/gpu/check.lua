--[[
tests/gpu/check.lua — what the op suite (`ops --device cuda`, small awkward
shapes) does not reach: the CUDA paths that only large shapes take (row
kernels of a block per row, split reductions, vector loops with tails,
tensor-core products), and the device's behaviour (Philox equal to the CPU,
errors naming both devices, the caching allocator's steady state and its
out-of-memory error, index errors found on the device, TF32, scatter_add and
index_add giving the CPU's bits in every float dtype).

  build/dormouse run tests/gpu/check.lua      (tools/gpu.sh runs it)

Needs a GPU; plain Lua asserts (the GPU machine has no Busted). Prints one
line per check and "check: N passed, M failed" last; exits 1 on a failure.
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
local core = dm.core

if not common.gpu_or_skip(cuda) then return end

local checks = common.checks("check")
local check = checks.check

local rel = common.rel

local TOL = {f32 = 1e-5, bf16 = 1e-2}

-- fn on the GPU at f32 and bf16 against fn on the CPU in f64, from the same rounded inputs
local function against_f64(name, fn, inputs, tol)
  for _, dt in ipairs {"f32", "bf16"} do
    check(string.format("%s, %s", name, dt), function()
      local cpu_in, gpu_in = {}, {}
      for i, x in ipairs(inputs) do
        cpu_in[i] = x:to(dt):to("f64")
        gpu_in[i] = x:to(dt):cuda()
      end
      local e = rel(fn(table.unpack(gpu_in)), fn(table.unpack(cpu_in)))
      local t = (tol or TOL)[dt]
      assert(e <= t, string.format("relative error %.3g over %.1g", e, t))
    end)
  end
end

-- the gradient of sum(fn(x) * w) on the GPU against the CPU's in f64
local function grad_against_f64(name, fn, x, tol)
  for _, dt in ipairs {"f32", "bf16"} do
    check(string.format("%s backward, %s", name, dt), function()
      local function grad(dev, t)
        local xi = x:to(t):to(dev)
        xi:requires_grad(true)
        local y = fn(xi)
        local w = dm.randn(y:shape(), {seed = 7}):to(dt):to(t):to(dev)
        ;(y * w):sum():backward()
        return xi.grad
      end
      local e = rel(grad("cuda", dt), grad("cpu", "f64"):to(dt):to("f64"))
      local t = (tol or TOL)[dt]
      assert(e <= t, string.format("relative error %.3g over %.1g", e, t))
    end)
  end
end

local function randn(shape, seed) return dm.randn(shape, {seed = seed or 1, dtype = "f64"}) end

print(string.format("device: %s (sm_%d%d, %d SMs, %.1f GiB)", cuda.device_name(), cuda.info().major,
                    cuda.info().minor, cuda.info().sm_count, cuda.info().total_memory / 2^30))

-- ---- tensors on the device ------------------------------------------------------------

for _, dt in ipairs {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"} do
  check("round trip " .. dt, function()
    local x = dm.rand({3, 1000, 7}, {seed = 2}):mul(200):to(dt)
    assert(dm.allclose(x:cuda():cpu():to("f64"), x:to("f64"), {rtol = 0, atol = 0}))
    local t = x:transpose(1, 3)                  -- strided source both ways
    assert(dm.allclose(t:cuda():cpu():to("f64"), t:to("f64"), {rtol = 0, atol = 0}))
    local c = x:cuda():transpose(2, 3):cpu()
    assert(dm.allclose(c:to("f64"), x:transpose(2, 3):to("f64"), {rtol = 0, atol = 0}))
  end)
end

check("casts on the device equal the CPU's", function()
  local x = randn({999, 37}):mul(50)
  for _, from in ipairs {"f64", "f32", "bf16", "f16"} do
    for _, to in ipairs {"f32", "bf16", "f16", "i32", "u8"} do
      local want = x:to(from):to(to)
      local got = x:to(from):cuda():to(to):cpu()
      assert(dm.allclose(got:to("f64"), want:to("f64"), {rtol = 0, atol = 0}), from .. " to " .. to)
    end
  end
end)

check("fill and arange on the device equal the CPU's", function()
  for _, dt in ipairs {"f32", "bf16", "i64", "u8"} do
    local a = dm.full({77, 5}, 3.25, {dtype = dt, device = "cuda"}):cpu()
    assert(dm.allclose(a:to("f64"), dm.full({77, 5}, 3.25, {dtype = dt}):to("f64"), {rtol = 0, atol = 0}))
    local r = dm.arange(0, 1000, 0.5, {dtype = dt, device = "cuda"}):cpu()
    assert(dm.allclose(r:to("f64"), dm.arange(0, 1000, 0.5, {dtype = dt}):to("f64"), {rtol = 0, atol = 0}))
  end
end)

check("Philox draws equal the CPU's (uniform exactly, normal to an ulp)", function()
  for _, dt in ipairs {"f32", "bf16", "f64"} do
    local u = dm.rand({4099}, {seed = 11, offset = 5, dtype = dt, device = "cuda"}):cpu()
    assert(dm.allclose(u, dm.rand({4099}, {seed = 11, offset = 5, dtype = dt}), {rtol = 0, atol = 0}), dt)
    local n = dm.randn({4099}, {seed = 11, dtype = dt, device = "cuda"}):cpu()
    assert(rel(n, dm.randn({4099}, {seed = 11, dtype = dt})) < 1e-6, dt)
  end
end)

check("an op on two devices names both", function()
  local ok, err = pcall(function() return dm.ones({2}) + dm.ones({2}, {device = "cuda"}) end)
  assert(not ok and tostring(err):find("cpu and cuda", 1, true), tostring(err))
end)

-- ---- the caching allocator ---------------------------------------------------------------

check("a repeated step takes no new device memory", function()
  local x = dm.randn({512, 1024}, {device = "cuda"})
  local w = dm.randn({1024, 1024}, {device = "cuda", requires_grad = true})
  local function step()
    dm.scope(function()
      local loss = (x:matmul(w):relu() * 0.5):softmax():sum()
      loss:backward()
      w.grad = nil
    end)
  end
  step(); step()
  cuda.synchronize()
  local before = cuda.memory().device_allocs
  for _ = 1, 5 do step() end
  cuda.synchronize()
  local after = cuda.memory().device_allocs
  assert(after == before, string.format("%d cudaMalloc calls in 5 steps", after - before))
end)

check("empty_cache gives unused memory back", function()
  do local big = dm.empty({64, 1024, 1024}, {device = "cuda"}); big:free() end
  local reserved = cuda.memory().reserved
  cuda.empty_cache()
  assert(cuda.memory().reserved < reserved, "reserved did not shrink")
end)

check("out of memory is an error with the statistics", function()
  local ok, err = pcall(dm.empty, {2 ^ 50}, {device = "cuda", dtype = "u8"})
  err = tostring(err)
  assert(not ok and err:find("out of cuda memory", 1, true) and err:find("reserved", 1, true), err)
  local x = dm.ones({10}, {device = "cuda"})           -- and the device still works
  assert(x:sum():item() == 10)
end)

-- ---- errors found on the device ------------------------------------------------------------

check("an index out of range is raised at the next synchronisation", function()
  local x = dm.randn({4, 3}, {device = "cuda"})
  local idx = dm.tensor({1, 9}, {dtype = "i64", device = "cuda"})
  local ok, err = pcall(function() return x:index_select(1, idx):cpu() end)
  err = tostring(err)
  assert(not ok and err:find("index 9 is out of range for a dim of size 4", 1, true), err)
  assert(x:index_select(1, dm.tensor({4, 1}, {dtype = "i64", device = "cuda"})):cpu():shape()[1] == 2)
end)

-- ---- large shapes: the paths small test cases do not take ----------------------------------

against_f64("a * b + c, 1M + 3 elements (vector loop and tail)", function(a, b, c) return a * b + c end,
            {randn({1048579}, 1), randn({1048579}, 2), randn({1048579}, 3)})
against_f64("silu, broadcast add, where", function(a, b)
  return dm.where(a:gt(b), a:silu(), b + a:narrow(2, 1, 1))
end, {randn({513, 257}, 4), randn({513, 257}, 5)})

for _, shape in ipairs {{64, 8192}, {64, 8191}, {300, 20000}, {1000, 256}, {17, 40000}} do
  local label = string.format("[%d, %d]", shape[1], shape[2])
  against_f64("softmax " .. label, function(x) return x:softmax() end, {randn(shape, 6):mul(3)})
  against_f64("log_softmax " .. label, function(x) return x:log_softmax() end, {randn(shape, 7):mul(3)})
  against_f64("logsumexp " .. label, function(x) return x:logsumexp(2) end, {randn(shape, 8):mul(3)})
end
against_f64("softmax over dim 1 of [5000, 33]", function(x) return x:softmax(1) end, {randn({5000, 33}, 9)})
grad_against_f64("softmax [64, 8192]", function(x) return x:softmax() end, randn({64, 8192}, 10))
grad_against_f64("log_softmax [64, 5000]", function(x) return x:log_softmax() end, randn({64, 5000}, 11))
-- in bf16 the saved output (about 9 here) carries an error near 0.02, which exp(x - y)
-- turns into about 2% of the gradient: the op's precision in bf16, not the kernel's
grad_against_f64("logsumexp [64, 8192]", function(x) return x:logsumexp(2) end, randn({64, 8192}, 12),
                 {f32 = 1e-5, bf16 = 4e-2})

against_f64("sum of 16M elements (split over blocks)", function(x) return x:sum() end, {randn({4096, 4096}, 13)},
            {f32 = 1e-5, bf16 = 1e-2})
against_f64("mean over dim 1 of [100000, 64] (columns)", function(x) return x:mean(1) end, {randn({100000, 64}, 14)})
against_f64("max over dim 2 of [3, 500000]", function(x) return (x:max(2)) end, {randn({3, 500000}, 15)})
check("argmax of a long row keeps the first of ties", function()
  local x = dm.zeros({1, 300000}, {device = "cuda"})
  x:narrow(2, 123457, 1):fill_(5)
  x:narrow(2, 200001, 1):fill_(5)
  assert(x:argmax(2):item() == 123457, "got " .. x:argmax(2):item())
end)

against_f64("matmul [1000, 1536] x [1536, 768]", function(a, b) return a:matmul(b) end,
            {randn({1000, 1536}, 16), randn({1536, 768}, 17)}, {f32 = 1e-5, bf16 = 1e-2})
against_f64("matmul batched, transposed b", function(a, b) return dm.matmul(a, b, {transpose_b = true}) end,
            {randn({6, 129, 256}, 18), randn({6, 100, 256}, 19)})
against_f64("linear: [4, 100, 512] x w^T, w shared", function(x, w) return dm.linear(x, w) end,
            {randn({4, 100, 512}, 20), randn({384, 512}, 21)})
-- generation's products, one row a stream: the rows kernel (kernels/rows_product.cu) in 16 bits, on with
-- DM_ROWS_PRODUCT=1 (`DM_ROWS_PRODUCT=1 dormouse run tests/gpu/check.lua`; without it they check cuBLASLt)
for _, rows in ipairs {1, 3, 8} do
  against_f64(string.format("linear of %d row(s): [1, %d, 2048] x [6304, 2048]^T (the rows kernel)", rows, rows),
              function(x, w) return dm.linear(x, w) end, {randn({1, rows, 2048}, 40 + rows), randn({6304, 2048}, 44)})
end
check("the rows kernel: rows and weight narrowed, 20,000 columns, bf16 and f16, against f64; it ran", function()
  local rows0, lt0 = core.product_paths()
  local worst = {}
  for _, dt in ipairs {"bf16", "f16"} do
    -- {rows, k, n, extra columns of x, of w}: an operand with extra columns is read at a row stride
    -- past k, from its 9th column (16 bytes in)
    for i, c in ipairs {{1, 2048, 20000, 0, 0}, {5, 264, 130, 24, 0}, {8, 64, 33, 0, 16}, {3, 520, 7, 8, 8}} do
      local m, k, n, xe, we = table.unpack(c)
      local xat, wat = xe >= 8 and 9 or 1, we >= 8 and 9 or 1
      local x = randn({m, k + xe}, 50 + i):to(dt):to("f64")
      local w = randn({n, k + we}, 60 + i):to(dt):to("f64")
      local want = dm.linear(x:narrow(2, xat, k), w:narrow(2, wat, k))
      local got = dm.linear(x:to(dt):cuda():narrow(2, xat, k), w:to(dt):cuda():narrow(2, wat, k))
      local e = rel(got, want)
      worst[dt] = math.max(worst[dt] or 0, e)
      assert(e <= 1e-2, string.format("%s, %d rows, k %d, n %d: relative error %.3g", dt, m, k, n, e))
    end
  end
  local rows1, lt1 = core.product_paths()
  local v = os.getenv("DM_ROWS_PRODUCT")
  local on = v ~= nil and v ~= "" and v ~= "0"                   -- as kernels/rows_product.cu reads it
  assert(rows1 - rows0 == (on and 8 or 0) and lt1 - lt0 == (on and 0 or 8),
         string.format("rows kernel %d, cuBLASLt %d of 8 products (DM_ROWS_PRODUCT %s)", rows1 - rows0, lt1 - lt0,
                       on and "on" or "off"))
  return string.format("relative error bf16 %.2g, f16 %.2g", worst.bf16, worst.f16)
end)
check("out = f32 from bf16 at 2 rows (the rows kernel with DM_ROWS_PRODUCT=1): an f32 product's values", function()
  local x, w = randn({1, 2, 2048}, 45):to("bf16"):cuda(), randn({1024, 2048}, 46):to("bf16"):cuda()
  local got = dm.matmul(x, w, {transpose_b = true, out = "f32"})
  local want = dm.linear(x:to("f32"), w:to("f32"))
  assert(got.dtype == "f32")
  local e = rel(got, want:to("f64"):cpu())
  assert(e < 1e-6, string.format("relative error %.3g", e))
end)
grad_against_f64("linear [8, 64, 256] x [128, 256]^T", function(x)
  return dm.linear(x, randn({128, 256}, 22):to(x.dtype):to(x.device))
end, randn({8, 64, 256}, 23))

check("tf32 switch: f32 products near 1e-3 with it, 1e-6 without", function()
  local a, b = randn({512, 2048}, 24), randn({2048, 512}, 25)
  local want = a:matmul(b)
  local ga, gb = a:to("f32"):cuda(), b:to("f32"):cuda()
  cuda.tf32(false)
  local e32 = rel(ga:matmul(gb), want)
  cuda.tf32(true)
  local etf = rel(ga:matmul(gb), want)
  cuda.tf32(false)
  assert(e32 < 1e-5 and etf > 1e-5 and etf < 5e-3, string.format("f32 %.3g, tf32 %.3g", e32, etf))
end)

local ids = {}
for i = 1, 5000 do ids[i] = (i * 7919) % 2000 + 1 end
local id = dm.tensor(ids, {dtype = "i64"})
against_f64("index_select of 5000 rows", function(x) return x:index_select(1, id:to(x.device)) end,
            {randn({2000, 64}, 26)})
grad_against_f64("index_select (index_add, repeated rows)", function(x) return x:index_select(1, id:to(x.device)) end,
                 randn({2000, 64}, 27))

-- ---- scatter_add and index_add: the CPU's bits, run after run ------------------------------------

-- Into a float dtype the GPU sorts the sources by destination and adds each destination's in
-- increasing source position, from its value (16-bit ones in f32, rounded once), as the CPU does:
-- the CPU's bits in all four dtypes (f64 holds every value of each exactly), the same every run.
-- Repeated and hot indices, strided sources, slices along an inner dim, and destinations past 256
-- and 65,536 (two and three passes of the sort).
local function same_bits(a, b)
  return dm.allclose(a:detach():cpu():to("f64"), b:detach():cpu():to("f64"), {rtol = 0, atol = 0})
end

-- n indices in lo .. hi (i64), a fraction `hot` of them the value lo + 1 (a byte embedding's space)
local function hot_ids(lo, hi, shape, seed, hot)
  local ids = dm.rand(shape, {seed = seed, dtype = "f64"}):mul(hi - lo + 1):add(lo):to("i64")
  local mask = dm.rand(shape, {seed = seed + 1, dtype = "f64"}):lt(hot)
  return dm.where(mask, dm.full(shape, lo + 1, {dtype = "i64"}), ids)
end

-- t on dev in dtype dt as a strided view: the leading part of a tensor one larger in the last dim
local function strided(t, dt, dev)
  local shape = t:shape()
  local big_shape = {table.unpack(shape)}
  big_shape[#shape] = shape[#shape] + 1
  local big = dm.zeros(big_shape, {dtype = dt, device = dev})
  local part = big:narrow(#shape, 1, shape[#shape])
  part:copy_(t:to(dt):to(dev))
  return part
end

local ACC_DTYPES = {"f32", "f64", "bf16", "f16"}

-- run(device) twice on the GPU and once on the CPU: the same bits each time
local function same_three_times(run)
  local a, b = run("cuda"), run("cuda")
  local want = run("cpu")
  assert(same_bits(a, b), "two runs differ")
  assert(same_bits(a, want), string.format("differs from the CPU (relative %.3g)", rel(a, want)))
end

-- index_add: the gradient of index_select (x [..], dim, ids), from a strided incoming gradient
for _, c in ipairs {
  {name = "rows", shape = {300, 37}, dim = 1, n = 5000, hot = 0.4},
  {name = "inner dim", shape = {7, 300, 5}, dim = 2, n = 1200, hot = 0.3},
  {name = "last dim", shape = {9, 61}, dim = 2, n = 200, hot = 0.5},
  {name = "1-D", shape = {70000}, dim = 1, n = 150000, hot = 0.1},
} do
  for _, dt in ipairs(ACC_DTYPES) do
    check(string.format("index_add (index_select's gradient), %s, %s: the CPU's bits", c.name, dt), function()
      local x = randn(c.shape, 40)
      local ids = hot_ids(1, c.shape[c.dim], {c.n}, 41, c.hot)
      local gshape = {table.unpack(c.shape)}
      gshape[c.dim] = c.n
      local g = randn(gshape, 42)
      local function grad(dev)
        local xi = x:to(dt):to(dev)
        xi:requires_grad(true)
        xi:index_select(c.dim, ids:to(dev)):backward(strided(g, dt, dev))
        return xi.grad
      end
      same_three_times(grad)
    end)
  end
end

-- index_add: a byte embedding's gradient, 64 x 1024 ids onto 256 rows, the space 15% of them
for _, dt in ipairs(ACC_DTYPES) do
  check(string.format("embedding gradient, 65,536 bytes onto 256 rows, %s: the CPU's bits", dt), function()
    local ids = hot_ids(0, 255, {64, 1024}, 43, 0.15):to("u8")
    local table_ = randn({256, 64}, 44)
    local g = randn({64, 1024, 64}, 45)
    local function grad(dev)
      local t = table_:to(dt):to(dev)
      t:requires_grad(true)
      dm.embedding(ids:to(dev), t):backward(g:to(dt):to(dev))
      return t.grad
    end
    same_three_times(grad)
  end)
end

-- scatter_add: onto x's values, from a strided source larger than the index; and gather's gradient
-- into 135,168 elements (three passes of the sort)
for _, dt in ipairs(ACC_DTYPES) do
  check(string.format("scatter_add, strided source, %s: the CPU's bits", dt), function()
    local x = randn({6, 50, 7}, 46)
    local idx = hot_ids(1, 50, {6, 300, 5}, 47, 0.3)
    local src = randn({6, 301, 6}, 48)
    local function run(dev)
      local s = src:to(dt):to(dev):transpose(2, 3):contiguous():transpose(2, 3)   -- [6, 301, 6], strided
      return x:to(dt):to(dev):scatter_add(2, idx:to(dev), s)
    end
    same_three_times(run)
  end)
  check(string.format("scatter_add (gather's gradient), 4096 x 33 from 4096 x 200, %s: the CPU's bits", dt), function()
    local x = randn({4096, 33}, 49)
    local idx = hot_ids(1, 33, {4096, 200}, 50, 0.2)
    local g = randn({4096, 200}, 51)
    local function grad(dev)
      local xi = x:to(dt):to(dev)
      xi:requires_grad(true)
      xi:gather(2, idx:to(dev)):backward(strided(g, dt, dev))
      return xi.grad
    end
    same_three_times(grad)
  end)
end

check("an index out of range in scatter_add is raised at the next synchronisation", function()
  local x = dm.zeros({4, 3}, {device = "cuda"})
  local bad = dm.tensor({{1, 9, 2}, {4, 4, 4}}, {dtype = "i64", device = "cuda"})
  local ok, err = pcall(function() return x:scatter_add(1, bad, dm.ones({2, 3}, {device = "cuda"})):cpu() end)
  err = tostring(err)
  assert(not ok and err:find("index 9 is out of range for a dim of size 4", 1, true), err)
  local good = dm.tensor({{1, 4, 2}, {4, 4, 4}}, {dtype = "i64", device = "cuda"})
  local got = x:scatter_add(1, good, dm.ones({2, 3}, {device = "cuda"})):cpu()
  assert(same_bits(got, dm.tensor({{1, 0, 0}, {0, 0, 1}, {0, 0, 0}, {1, 2, 1}})), "a good index after a bad one")
end)

-- LittleBit's factor at bank-like shapes: the row sums by warps, the column sums down long columns;
-- then rows of lanes shared by a warp with vectors not aligned to them (n = 20, 1), and x a view
-- at an unaligned offset, 21 elements in (shift: the kernels' element-a-lane form)
local LB_TOL = {f32 = TOL.f32, bf16 = TOL.bf16, f16 = 5e-3, f64 = 1e-12}   -- f64: the kernels compute in double
for _, shape in ipairs {{16, 2048, 64}, {8, 64, 5461}, {3, 5, 20}, {2, 33, 1}, {5, 3, 7, shift = true}} do
  for _, dt in ipairs {"f32", "bf16", "f16", "f64"} do
    check(string.format("littlebit %s and its three gradients, %s", table.concat(shape, "x"), dt), function()
      local E, m, n = shape[1], shape[2], shape[3]
      local src = {randn({E, m, n}, 28), randn({E, m, 1}, 29), randn({E, 1, n}, 30), randn({E, m, n}, 31)}
      local function run(dev, t)
        local x, row, col = src[1]:to(dt):to(t):to(dev), src[2]:to(dt):to(t):to(dev), src[3]:to(dt):to(t):to(dev)
        if shape.shift then                     -- the same values, one expert into a larger tensor
          local big = dm.zeros({E + 1, m, n}, {dtype = x.dtype, device = dev})
          big:narrow(1, 2, E):copy_(x)
          x = big:narrow(1, 2, E)
        end
        for _, p in ipairs {x, row, col} do p:requires_grad(true) end
        local w = dm.littlebit(x, row, col)
        w:backward(src[4]:to(dt):to(t):to(dev))
        return {w, x.grad, row.grad, col.grad}
      end
      local got, want = run("cuda", dt), run("cpu", "f64")
      for i, what in ipairs {"w", "x's gradient", "row's gradient", "col's gradient"} do
        local e = rel(got[i], want[i]:detach():to(dt):to("f64"))
        assert(e <= LB_TOL[dt], string.format("%s: relative error %.3g over %.1g", what, e, LB_TOL[dt]))
      end
    end)
  end
end

-- dm.add_rmsnorm on CUDA: the bits of the add, the casts and rmsnorm it stands for, forward and
-- backward, on rows of the model's width (the vector order) and odd ones (a lane an element)
do
  -- gain_kind: nil (a gain), "none", "strided" (every other element of a longer one), "shifted"
  -- (a gain, and h and y contiguous but one element into their storage: not on 16-byte boundaries),
  -- or "grad_shifted" (a gain, and the gradient reaching s one element into its storage, as cat's
  -- backward hands it on: the backward's element-by-element order over whole vector rows)
  -- the input [rows, D] and the leaf whose gradient holds its own
  local function input(rows, D, seed, dt, shifted)
    if not shifted then
      local t = dm.randn({rows, D}, {seed = seed, dtype = dt}):cuda():requires_grad(true)
      return t, t
    end
    local flat = dm.randn({rows * D + 1}, {seed = seed, dtype = dt}):cuda():requires_grad(true)
    return flat:narrow(1, 2, rows * D):reshape({rows, D}), flat
  end
  local function run(fused, hdt, ydt, rows, D, gain_kind)
    local h, h_leaf = input(rows, D, 1, hdt, gain_kind == "shifted")
    local y, y_leaf = input(rows, D, 2, ydt, gain_kind == "shifted")
    local gain = (dm.rand({D}, {seed = 3}) + 0.5):to(ydt):cuda():requires_grad(true)
    local g_in = gain
    if gain_kind == "none" then g_in = nil
    elseif gain_kind == "strided" then
      local long = (dm.rand({2 * D}, {seed = 3}) + 0.5):to(ydt):cuda():requires_grad(true)
      gain = long
      g_in = long:reshape({D, 2}):narrow(2, 1, 1):reshape({D})
    end
    local ws = dm.randn({rows, D}, {seed = 4, dtype = hdt}):cuda()
    local wu = dm.randn({rows, D}, {seed = 5, dtype = ydt}):cuda()
    return dm.scope(function()
      local s, u
      if fused then s, u = dm.add_rmsnorm(h, y, g_in)
      else
        s = h + y:to(hdt)
        u = dm.rmsnorm(s:to(ydt), g_in)
      end
      local s_term = (s * ws):sum():to("f64")
      if gain_kind == "grad_shifted" then                   -- s's gradient: a view one element in
        local one = dm.zeros({1}, {dtype = hdt}):cuda()
        local long = dm.cat({one, s:reshape({rows * D})})
        s_term = (long * dm.cat({one, ws:reshape({rows * D})})):sum():to("f64")
      end
      ;(s_term + (u * wu):sum():to("f64")):backward()
      local out = {}
      for k, t in pairs {s = s:detach(), u = u:detach(), h = h_leaf.grad, y = y_leaf.grad, gain = g_in and gain.grad} do
        out[k] = t:to("cpu")
      end
      return out
    end)
  end
  for _, case in ipairs {{"f32", "bf16"}, {"f32", "f16"}, {"f32", "f32"}, {"f64", "f64"}} do
    check(string.format("add_rmsnorm, h %s and y %s: the bits of the add, the casts and rmsnorm", case[1], case[2]),
          function()
      for _, shape in ipairs {{5, 7}, {3, 300}, {4, 2048}, {1, 2048}, {33, 1024}} do
        for _, gk in ipairs {false, "none", "strided", "shifted", "grad_shifted"} do
          local a = run(true, case[1], case[2], shape[1], shape[2], gk or nil)
          local b = run(false, case[1], case[2], shape[1], shape[2], gk or nil)
          for _, k in ipairs {"s", "u", "h", "y", "gain"} do
            assert((a[k] == nil) == (b[k] == nil) and (a[k] == nil or dm.allclose(a[k], b[k], {rtol = 0, atol = 0})),
                   string.format("%s differs at [%d, %d]%s: %.3g", k, shape[1], shape[2],
                                 gk == "shifted" and ", inputs shifted" or gk == "grad_shifted" and
                                 ", s's gradient shifted" or gk and ", gain " .. gk or "",
                                 a[k] and b[k] and rel(a[k], b[k]) or 0))
          end
        end
      end
    end)
  end
end

-- l2norm with a power-of-two scale on CUDA: the bits of the norm and then the product (KDA's q)
check("l2norm's scale 0.125: the bits of l2norm then * 0.125, forward and backward, f32 and bf16", function()
  for _, dt in ipairs {"f32", "bf16"} do
    for _, shape in ipairs {{5, 7}, {6, 64}, {3, 300}, {64, 64}} do
      local function run(inside)
        local x = dm.randn(shape, {seed = 7, dtype = dt}):cuda():requires_grad(true)
        local w = dm.randn(shape, {seed = 8, dtype = dt}):cuda()
        return dm.scope(function()
          local y = inside and x:l2norm(1e-6, 0.125) or x:l2norm(1e-6) * 0.125
          ;(y * w):sum():to("f64"):backward()
          return {y = y:detach():to("cpu"), x = x.grad:to("cpu")}
        end)
      end
      local a, b = run(true), run(false)
      for _, k in ipairs {"y", "x"} do
        assert(dm.allclose(a[k], b[k], {rtol = 0, atol = 0}),
               string.format("%s differs, %s [%d, %d]: %.3g", k, dt, shape[1], shape[2], rel(a[k], b[k])))
      end
    end
  end
end)

checks.finish()
