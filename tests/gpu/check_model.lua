--[[
check_model.lua — the model kernels (kernels/{norm,xent,conv,silu_mul,kda,moe,engram,optim}.cu)
at model-sized shapes, and the optimiser kernels the op suite does not reach:
GPU (f32, bf16) against the CPU in f64 or f32; determinism; a few timings.
  dormouse run check_model.lua
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
local core = dm.core
local GPU = os.getenv("DRY") and "cpu" or "cuda"      -- DRY=1: the script itself, on the CPU

local checks = common.checks("check_model")
local check = checks.check

local rel = common.rel
local function same(a, b) return rel(a, b) == 0 end
local function randn(shape, seed, scale) return dm.randn(shape, {seed = seed, dtype = "f64"}):mul(scale or 1) end
local TOL = {f32 = 2e-5, bf16 = 2e-2}
local function randint(lo, hi, shape, seed, dtype)
  return dm.rand(shape, {seed = seed, dtype = "f64"}):mul(hi - lo):add(lo):to(dtype)
end

-- fn(inputs...) -> list of outputs; the gradients of sum(out_i * w_i) w.r.t. the float inputs
local function run(fn, inputs, dt, dev, want_grad)
  local xs = {}
  for i, x in ipairs(inputs) do
    if x.dtype == "f64" or x.dtype == "f32" then
      xs[i] = x:to(dt):to(dev)
      if want_grad then xs[i]:requires_grad(true) end
    else xs[i] = x:to(dev) end
  end
  local outs = {fn(table.unpack(xs))}
  local grads = {}
  if want_grad then
    local loss
    for i, o in ipairs(outs) do
      if o.dtype ~= "i64" then
        local w = dm.randn(o:shape(), {seed = 100 + i, dtype = "f64"}):to(o.dtype):to(dev)
        local s = (o * w):sum():to(dt == "f64" and "f64" or "f32")
        loss = loss and loss + s or s
      end
    end
    loss:backward()
    for i, x in ipairs(xs) do grads[i] = x.grad end
  end
  return outs, grads
end

local function against(name, fn, inputs, opts)
  opts = opts or {}
  for _, dt in ipairs(opts.dtypes or {"f32", "bf16"}) do
    check(string.format("%s, %s", name, dt), function()
      local ref_in = {}
      for i, x in ipairs(inputs) do ref_in[i] = (x.dtype == "f64") and x:to(dt):to("f64") or x end
      local want, wg = run(fn, ref_in, "f64", "cpu", not opts.no_grad)
      local got, gg = run(fn, ref_in, dt, GPU, not opts.no_grad)
      local tol = (opts.tol or TOL)[dt]
      local msg = {}
      local worst = 0
      for i = 1, #want do
        local e = rel(got[i], want[i])
        msg[#msg + 1] = string.format("out%d %.2g", i, e)
        worst = math.max(worst, e ~= e and math.huge or e)
      end
      for i = 1, #inputs do
        if wg[i] then
          local e = gg[i] and rel(gg[i], wg[i]) or math.huge
          msg[#msg + 1] = string.format("grad%d %.2g", i, e)
          worst = math.max(worst, e ~= e and math.huge or e)
        end
      end
      assert(worst <= tol, table.concat(msg, ", ") .. string.format(" (over %.1g)", tol))
      return table.concat(msg, ", ")
    end)
  end
end

print("device: " .. (GPU == "cuda" and cuda.device_name() or "cpu (dry run)"))

-- ---- norm, xent, conv and silu_mul at model shapes ----------------------------------------
against("rmsnorm [4096, 768] with gain", function(x, g) return x:rmsnorm(g) end,
        {randn({4096, 768}, 1), randn({768}, 2, 0.3):add(1)})
against("l2norm [8, 512, 12, 64]", function(x) return x:l2norm() end, {randn({8, 512, 12, 64}, 3)})
local tg = randint(0, 256, {8, 1024}, 4, "i64")
against("cross_entropy [8, 1024, 256] mean", function(x, t) return dm.cross_entropy(x, t) end,
        {randn({8, 1024, 256}, 5, 2), tg})
against("causal_conv1d [8, 512, 768] K 4", function(x, w) return dm.causal_conv1d(x, w) end,
        {randn({8, 512, 768}, 6), randn({768, 4}, 7, 0.5)})
against("silu_mul [4096, 2048]", function(a, b) return dm.silu_mul(a, b) end, {randn({4096, 2048}, 8), randn({4096, 2048}, 9)})

-- ---- KDA -----------------------------------------------------------------------------------
local function unit(shape, seed) local t = randn(shape, seed); return t:l2norm() end
local function kda_inputs(B, T, H, dk, dv, seed)
  return {unit({B, T, H, dk}, seed), unit({B, T, H, dk}, seed + 1), randn({B, T, H, dv}, seed + 2),
          dm.rand({B, T, H, dk}, {seed = seed + 3, dtype = "f64"}):mul(-1), dm.rand({B, T, H}, {seed = seed + 4, dtype = "f64"}):mul(0.9):add(0.05),
          randn({B, H, dk, dv}, seed + 5, 0.5)}
end
local function kda_fn(q, k, v, g, beta, s0) return dm.kda(q, k, v, g, beta, {initial_state = s0, output_final_state = true}) end
against("kda B2 T200 H3 64x64 (state in shared memory)", kda_fn, kda_inputs(2, 200, 3, 64, 64, 10))
against("kda B1 T70 H2 128x128 (shared memory over 48 KB)", kda_fn, kda_inputs(1, 70, 2, 128, 128, 20), {dtypes = {"f32"}})
against("kda B1 T40 H1 192x160 (state in device scratch)", kda_fn, kda_inputs(1, 40, 1, 192, 160, 30), {dtypes = {"f32"}})
against("kda f64 on the GPU", kda_fn, kda_inputs(1, 33, 2, 16, 8, 40), {dtypes = {"f64"}, tol = {f64 = 1e-12}})
check("kda backward is deterministic", function()
  local ins = kda_inputs(2, 130, 2, 64, 64, 50)
  local _, g1 = run(kda_fn, ins, "f32", GPU, true)
  local _, g2 = run(kda_fn, ins, "f32", GPU, true)
  for i = 1, 6 do assert(same(g1[i], g2[i]), "grad " .. i .. " differs") end
end)
against("kda_gate [8, 1024, 768] bounded", function(f, a, b) return dm.kda_gate(f, a, b) end,
        {randn({8, 1024, 768}, 60, 2), dm.rand({12}, {seed = 61, dtype = "f64"}):mul(2), randn({768}, 62)})

-- ---- MoE --------------------------------------------------------------------------------------
local function moe_fn(x, logits, bias, ug, uu, cg, cu, d)
  local idx, w, counts = dm.moe_route(logits, bias, 2)
  local perm, offsets, inv = dm.moe_sort(idx, 64)
  local rows = dm.moe_experts(x, perm, offsets, ug, uu, cg, cu, d, 2)
  return dm.moe_combine(rows, inv, w), idx, counts
end
against("moe route+sort+experts+combine N4096 E64 d256 r16 F256", moe_fn,
        {randn({4096, 256}, 70), randn({4096, 64}, 71, 2), randn({64}, 72, 0.01), randn({64, 256, 16}, 73, 0.1),
         randn({64, 256, 16}, 74, 0.1), randn({64, 16}, 75), randn({64, 16}, 76), randn({64, 16, 256}, 77, 0.2)},
        {dtypes = {"f32"}, tol = {f32 = 1e-4}})
check("moe experts backward is deterministic", function()
  local ins = {randn({2048, 128}, 80), randn({2048, 64}, 81, 2), randn({64}, 82, 0.01), randn({64, 128, 16}, 83, 0.1),
               randn({64, 128, 16}, 84, 0.1), randn({64, 16}, 85), randn({64, 16}, 86), randn({64, 16, 128}, 87, 0.2)}
  local _, g1 = run(moe_fn, ins, "f32", GPU, true)
  local _, g2 = run(moe_fn, ins, "f32", GPU, true)
  for i = 1, 8 do if g1[i] then assert(same(g1[i], g2[i]), "grad " .. i .. " differs") end end
end)
check("moe counters and balance", function()
  local counts = randint(0, 5, {1000}, 90, "i64")
  local a, b = dm.moe_counters(counts), dm.moe_counters(counts:to(GPU))
  assert(math.abs(a.entropy - b.entropy) < 1e-12 and a.dead == b.dead and a.busiest_share == b.busiest_share)
  local bias = randn({1000}, 91):to("f32")
  local gb = bias:to(GPU)
  dm.moe_balance_(bias, counts, 0.01)
  dm.moe_balance_(gb, counts:to(GPU), 0.01)
  assert(same(gb, bias))
end)

-- ---- Engram ------------------------------------------------------------------------------------
check("engram index, unique, sparse_grad at 8 x 1024 x 3 lookups", function()
  local L = dm.engram_layout{orders = {2, 3, 4}, heads = 1, rows = 65536}
  local x = randint(0, 256, {8, 1024}, 100, "u8")
  local idx = dm.engram_index(x, nil, L)
  assert(same(dm.engram_index(x:to(GPU), nil, L), idx), "index")
  local r1, i1, c1 = dm.engram_unique(idx)
  local r2, i2, c2 = dm.engram_unique(idx:to(GPU))
  assert(same(r2, r1) and same(i2, i1) and same(c2, c1), "unique")
  local g = dm.randn({idx:numel(), 32}, {seed = 101})
  local n = r1:numel()
  local s1 = dm.engram_sparse_grad(g, i1:reshape({idx:numel()}), n)
  local s2 = dm.engram_sparse_grad(g:to(GPU), i2:reshape({idx:numel()}), n)
  assert(same(s2, s1), "sparse_grad bits, rel " .. rel(s2, s1))
end)
check("engram_adam equals the CPU's", function()
  local t, m, v = dm.randn({5000, 32}, {seed = 110}), dm.zeros({5000, 32}), dm.zeros({5000, 32})
  local rows = dm.tensor({3, 10, 11, 400, 4999}, {dtype = "i64"})
  local g = dm.randn({5, 32}, {seed = 111})
  local T, M, V = t:to(GPU), m:to(GPU), v:to(GPU)
  for step = 1, 3 do
    dm.engram_adam(t, m, v, rows, g, {lr = 1e-2, step = step})
    dm.engram_adam(T, M, V, rows:to(GPU), g:to(GPU), {lr = 1e-2, step = step})
  end
  assert(rel(T, t) < 1e-6 and rel(M, m) < 1e-6 and rel(V, v) < 1e-6, string.format("%g", rel(T, t)))
end)
against("engram_alpha [8192, 256] with gain", function(u, k, w) return dm.engram_alpha(u, k, {gain = w}) end,
        {randn({8192, 256}, 120), randn({8192, 256}, 121), randn({256}, 122, 0.2):add(1)})

-- ---- optimisers ------------------------------------------------------------------------------------
local function params(dev, seed)
  local ps = {}
  for i, shape in ipairs {{768, 768}, {3, 129, 65}, {7}, {2048, 768}} do
    ps[i] = dm.randn(shape, {seed = seed + i}):to(dev)
  end
  return ps
end
local function set_grads(ps, seed, dtype)
  for i, p in ipairs(ps) do
    p:requires_grad(true)
    local w = dm.randn(p:shape(), {seed = seed + i}):to(dtype or "f32"):to(p.device)
    ;(p:to(dtype or "f32") * w):sum():backward()
  end
end
check("adamw (3 steps) equals the CPU's", function()
  local a, b = params("cpu", 200), params(GPU, 200)
  local function state(ps) local m, v = {}, {}; for i, p in ipairs(ps) do m[i] = dm.zeros(p:shape(), {device = p.device}); v[i] = dm.zeros(p:shape(), {device = p.device}) end; return m, v end
  local ma, va = state(a)
  local mb, vb = state(b)
  for step = 1, 3 do
    set_grads(a, 210 + step)
    set_grads(b, 210 + step)
    local hp = {lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, step = step}
    dm.no_grad(core.adamw_step, a, ma, va, hp)
    dm.no_grad(core.adamw_step, b, mb, vb, hp)
    for i = 1, #a do a[i].grad = nil; b[i].grad = nil end
  end
  for i = 1, #a do assert(rel(b[i], a[i]) < 1e-6, "param " .. i .. ": " .. rel(b[i], a[i])) end
end)
check("clip_grad_norm equals the CPU's (bf16 and f32 grads)", function()
  local a, b = params("cpu", 300), params(GPU, 300)
  set_grads(a, 310); set_grads(b, 310)
  local na = core.clip_grad_norm(a, 1.0)
  local nb = core.clip_grad_norm(b, 1.0)
  assert(math.abs(na - nb) / na < 1e-12, string.format("%.17g vs %.17g", na, nb))
  for i = 1, #a do assert(rel(b[i].grad, a[i].grad) < 1e-6) end
end)
check("muon (2 steps, f32 and bf16 Newton-Schulz) near the CPU's", function()
  for _, nsd in ipairs {"f32", "bf16"} do
    local a, b = {dm.randn({256, 384}, {seed = 400}), dm.randn({4, 64, 32}, {seed = 401})}, {}
    for i = 1, 2 do b[i] = a[i]:to(GPU) end
    local ba, bb = {dm.zeros({256, 384}), dm.zeros({4, 64, 32})}, {}
    for i = 1, 2 do bb[i] = ba[i]:to(GPU) end
    for step = 1, 2 do
      set_grads(a, 410 + step); set_grads(b, 410 + step)
      local hp = {lr = 0.02, momentum = 0.95, weight_decay = 0.01, ns_steps = 5, ns_dtype = nsd}
      dm.no_grad(core.muon_step, a, ba, hp)
      dm.no_grad(core.muon_step, b, bb, hp)
      for i = 1, 2 do a[i].grad = nil; b[i].grad = nil end
    end
    local tol = nsd == "f32" and 1e-4 or 3e-2
    for i = 1, 2 do assert(rel(b[i], a[i]) < tol, nsd .. " param " .. i .. ": " .. rel(b[i], a[i])) end
  end
end)

-- ---- timings (device ms, median) -------------------------------------------------------------------
local function t_kda(B, T, H, d)
  local ins = kda_inputs(B, T, H, d, d, 500)
  for i, x in ipairs(ins) do ins[i] = x:to("bf16"):to(GPU) end
  for i = 1, 5 do ins[i]:requires_grad(true) end
  local w = dm.randn({B, T, H, d}, {seed = 9, dtype = "bf16", device = GPU})
  local fwd = cuda.time(function() dm.no_grad(function() return dm.kda(ins[1], ins[2], ins[3], ins[4], ins[5]) end) end, {reps = 5})
  local both = cuda.time(function()
    local o = dm.kda(ins[1], ins[2], ins[3], ins[4], ins[5])
    ;(o * w):sum():backward()
    for i = 1, 5 do ins[i].grad = nil end
  end, {reps = 5, warmup = 1})
  print(string.format("time kda B%d T%d H%d d%d bf16: forward %.2f ms, forward+backward %.2f ms", B, T, H, d, fwd, both))
end
if GPU == "cuda" then check("kda timings", function() t_kda(8, 512, 12, 64); t_kda(8, 1024, 32, 64) end) end

checks.finish()
