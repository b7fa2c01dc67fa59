--[[
tests/gpu/fuse_graph.lua — dm.fuse and dm.cuda.graph on the GPU.

  DM_POISON=1 build/dormouse run tests/gpu/fuse_graph.lua     (tools/gpu.sh runs it)
  DM_DEBUG=4 build/dormouse run tests/gpu/fuse_graph.lua debug-source   (prints a kernel's source)

dm.fuse: the generated kernels against the CPU's float64 evaluation at f32,
bf16 and f16 on every path (16-byte vectors with a tail, broadcast strides, a
broadcast scalar, transposed and misaligned operands), their gradients, the
disk cache of NVRTC and its compile errors. dm.cuda.graph: forward and
backward of a small MLP captured and replayed with new inputs, equal bit for
bit to eager runs; the private pool; a capture that waits for the device; the
graph's memory coming back. Plain asserts; "fuse_graph: N passed, M failed"
last; exits 1 on a failure.
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
local fuse = dm.fuse or require "dormouse.fuse"
local graph = cuda.graph or require "dormouse.graph"
local core = dm.core

if not common.gpu_or_skip(cuda) then return end

-- `... fuse_graph.lua debug-source` (run with DM_DEBUG=4): compile one fused op, which prints its source
if arg and arg[1] == "debug-source" then
  local f = fuse(string.format("a * %d + exp(b)", os.time()))     -- new to the cache
  f(dm.ones({10}, {device = "cuda"}), dm.ones({10}, {device = "cuda"})):cpu()
  return
end

local checks = common.checks("fuse_graph")
local check = checks.check

local rel = common.rel

local function same(a, b) return dm.allclose(a:cpu():to("f64"), b:cpu():to("f64"), {rtol = 0, atol = 0}) end

local TOL = {f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3}
local function randn(shape, seed, scale) return dm.randn(shape, {seed = seed, dtype = "f64"}) * (scale or 1) end

print(string.format("device: %s (sm_%d%d)", cuda.device_name(), cuda.info().major, cuda.info().minor))

-- ---- dm.fuse: the forward on every path ---------------------------------------------------

local EXPR = "silu(a) * b + 0.5 * c"
-- label, the inputs (f64 on the CPU), and how to place each on the device (default: as is)
local PATHS = {
  {"contiguous, 1M + 3 elements (vectors and a tail)", {randn({1048579}, 1), randn({1048579}, 2), randn({1048579}, 3)}},
  {"broadcast [513, 257] x [257] x [513, 1] (strided)", {randn({513, 257}, 4), randn({257}, 5), randn({513, 1}, 6)}},
  {"a broadcast scalar (vectors)", {randn({100003}, 7), randn({}, 8), randn({100003}, 9)}},
  {"a transposed input", {randn({300, 200}, 10), randn({200, 300}, 11), randn({300, 200}, 12)},
   {nil, function(t) return t:transpose(1, 2) end}},
  {"a misaligned input (offset by one element)", {randn({4097}, 13), randn({4097}, 14), randn({4098}, 15)},
   {nil, nil, function(t) return t:narrow(1, 2, 4097) end}},
}

for _, path in ipairs(PATHS) do
  for _, dt in ipairs {"f32", "bf16", "f16"} do
    check(string.format("fuse forward, %s, %s", path[1], dt), function()
      local f = fuse(EXPR)
      local cpu, gpu = {}, {}
      for i, x in ipairs(path[2]) do
        local place = (path[3] or {})[i] or function(t) return t end
        local r = x:to(dt)
        gpu[i] = place(r:cuda())
        cpu[i] = place(r:to("f64"))
      end
      local want = f(table.unpack(cpu))
      local got = f(table.unpack(gpu))
      assert(got.device == "cuda" and got.dtype == dt)
      local e = rel(got, want)
      assert(e <= TOL[dt], string.format("relative error %.3g over %.1g", e, TOL[dt]))
    end)
  end
end

check("fuse: every function, comparison, where and power, f32 and f64", function()
  local f = fuse("exp(a) * 0.1 + log(abs(b) + 1) - sqrt(abs(a)) + rsqrt(abs(b) + 0.5) + tanh(a) * sigmoid(b) " ..
                 "+ silu(a) - softplus(b) + relu(a - b) + where(a >= b, a ^ 2, -b ^ 3) + (a < b) - (a ~= b) * 0.5 " ..
                 "+ (a == a) + (a <= 0.5) / (1 + (b > 0))")
  local a, b = randn({5000}, 16), randn({37, 5000}, 17)
  local want = f(a, b)
  assert(rel(f(a:to("f32"):cuda(), b:to("f32"):cuda()), f(a:to("f32"):to("f64"), b:to("f32"):to("f64"))) < 1e-5)
  assert(rel(f(a:cuda(), b:cuda()), want) < 1e-12, "f64")
end)

-- ---- dm.fuse: the backward -------------------------------------------------------------------

for _, dt in ipairs {"f32", "bf16"} do
  check("fuse backward, broadcast, every input, " .. dt, function()
    local f = fuse("tanh(a) * b / (1 + c ^ 2) + sigmoid(a * c)")
    local xs = {randn({64, 1, 33}, 18), randn({7, 33}, 19), randn({33}, 20)}
    local w = randn({64, 7, 33}, 21)
    local function grads(dev, t)
      local ins = {}
      for i, x in ipairs(xs) do ins[i] = x:to(dt):to(t):to(dev); ins[i]:requires_grad(true) end
      ;(f(table.unpack(ins)) * w:to(dt):to(t):to(dev)):sum():backward()
      return ins
    end
    local g, c = grads("cuda", dt), grads("cpu", "f64")
    for i = 1, 3 do
      assert(g[i].grad.device == "cuda")
      local e = rel(g[i].grad, c[i].grad)
      local tol = dt == "f32" and 1e-5 or 3e-2
      assert(e <= tol, string.format("input %d: relative error %.3g over %.1g", i, e, tol))
    end
  end)
end

-- ---- NVRTC --------------------------------------------------------------------------------------

check("the NVRTC cache holds the compiled kernels", function()
  local dir = (os.getenv("XDG_CACHE_HOME") or (os.getenv("HOME") .. "/.cache")) .. "/dormouse/nvrtc"
  local p = io.popen("ls " .. dir .. " 2>/dev/null")
  local n = 0
  for name in p:lines() do
    assert(name:match("^%x+%.bin$"), "unexpected file " .. name)
    n = n + 1
  end
  p:close()
  assert(n >= 2, "only " .. n .. " files in " .. dir)
end)

check("a compile error is an error with NVRTC's log", function()
  local ok, err = pcall(core.nvrtc_compile, "extern \"C\" __global__ void k() { undeclared_thing(); }", "k")
  err = tostring(err)
  assert(not ok and err:find("NVRTC could not compile", 1, true) and err:find("undeclared_thing", 1, true), err)
  assert(core.nvrtc_compile("extern \"C\" __global__ void k2(float *p) { p[0] = 1; }", "k2"))
end)

-- ---- the row kernels of short rows (kernels/reduce.cu, tuned with the graph replays below) ----------

for _, case in ipairs {{{32768, 256}, "bf16"}, {{1000, 64}, "bf16"}, {{999, 128}, "f32"}, {{7, 3, 256}, "bf16"},
                       {{300, 200}, "f16"}} do
  local shape, dt = case[1], case[2]
  check(string.format("logsumexp and softmax of short rows %s, %s", table.concat(shape, "x"), dt), function()
    local x = randn(shape, 80):mul(3):to(dt)
    local want_l, want_s = x:to("f64"):logsumexp(-1), x:to("f64"):softmax()
    local g = x:cuda()
    assert(rel(g:logsumexp(-1), want_l) <= TOL[dt], "logsumexp")
    assert(rel(g:softmax(), want_s) <= TOL[dt], "softmax")
    local t = x:transpose(1, 2):contiguous():cuda():transpose(1, 2)      -- rows apart, not one stride
    if #shape == 3 then assert(rel(t:logsumexp(-1), want_l) <= TOL[dt], "logsumexp, strided batch") end
  end)
end

-- ---- dm.cuda.graph ---------------------------------------------------------------------------------

local mse = fuse("(o - t) ^ 2")

local function mlp()
  local function param(shape, seed, scale)
    local p = dm.randn(shape, {seed = seed, device = "cuda"}):mul(scale)
    p:requires_grad(true)
    return p
  end
  local m = {W1 = param({32, 64}, 30, 0.2), b1 = param({64}, 31, 0.1), W2 = param({64, 8}, 32, 0.2),
             b2 = param({8}, 33, 0.1)}
  m.params = {m.W1, m.b1, m.W2, m.b2}
  function m.step(x, y)
    for _, p in ipairs(m.params) do p.grad = nil end
    local h = (x:matmul(m.W1) + m.b1):tanh()
    local loss = mse(h:matmul(m.W2) + m.b2, y):mean()
    loss:backward()
    return loss
  end
  return m
end

check("graph: forward + backward of an MLP replays bit-identical to eager runs, with new inputs", function()
  local m = mlp()
  local x, y = dm.empty({64, 32}, {device = "cuda"}), dm.empty({64, 8}, {device = "cuda"})
  x:copy_(dm.randn({64, 32}, {seed = 40})); y:copy_(dm.randn({64, 8}, {seed = 41}))
  m.step(x, y)                                       -- eager first: plans, compiled kernels
  local g = graph(function() return m.step(x, y) end)
  local grads = {}
  for i, p in ipairs(m.params) do grads[i] = p.grad end
  assert(g:nodes() >= 10, "only " .. g:nodes() .. " nodes")
  for trial = 1, 3 do
    x:copy_(dm.randn({64, 32}, {seed = 50 + trial, device = "cuda"}))
    y:copy_(dm.randn({64, 8}, {seed = 60 + trial, device = "cuda"}))
    local loss = g:replay()
    local replayed = {loss:cpu()}
    for i = 1, 4 do replayed[i + 1] = grads[i]:cpu() end
    local eager = m.step(x, y)
    assert(same(replayed[1], eager), string.format("trial %d: loss %.9g replayed, %.9g eager", trial,
                                                   replayed[1]:item(), eager:item()))
    for i, p in ipairs(m.params) do assert(same(replayed[i + 1], p.grad), "trial " .. trial .. ": gradient " .. i) end
    assert(replayed[1]:item() > 0)
  end
  g:free()
end)

check("graph: its memory is its own while it lives, and comes back when freed", function()
  local x = dm.randn({1 << 20}, {seed = 70, device = "cuda"})
  collectgarbage()
  cuda.synchronize()
  local before = cuda.memory().allocated
  local g = graph(function()
    local t = x * 3                                  -- temporaries freed inside the capture
    local u = t + 1
    t:free()
    local v = u * 2
    u:free()
    return v
  end)
  local out = g.outputs[1]
  local others = {}
  for i = 1, 8 do others[i] = dm.full({1 << 20}, 7, {device = "cuda"}) end   -- eager, same size
  g:replay()
  assert(rel(out, x * 6 + 2) < 1e-6, "the replay's result")
  for i = 1, 8 do assert(others[i]:min():item() == 7 and others[i]:max():item() == 7, "an eager tensor was overwritten") end
  for i = 1, 8 do others[i]:free() end
  g:free()
  out:free()
  collectgarbage()
  cuda.synchronize()
  assert(cuda.memory().allocated == before, string.format("%d bytes more", cuda.memory().allocated - before))
  local ok, err = pcall(function() g:replay() end)
  assert(not ok and tostring(err):find("the graph was freed", 1, true), tostring(err))
end)

check("graph: a capture that waits for the device is a clear error, and the device works after it", function()
  local x = dm.randn({1000}, {seed = 71, device = "cuda"})
  local ok, err = pcall(graph, function() return (x * 2):sum():item() end)
  err = tostring(err)
  assert(not ok and err:find("waits for the device", 1, true), err)
  assert(not core.cuda_graph_capturing())
  assert(math.abs((x * 2):sum():item() - 2 * x:sum():item()) < 1e-3)
  local g = graph(function() return x + 1 end)          -- and a new capture works
  assert(rel(g:replay(), x + 1) == 0)
  ok, err = pcall(graph, function() return graph(function() return x end) end)
  assert(not ok and tostring(err):find("captures do not nest", 1, true), tostring(err))
end)

checks.finish()
