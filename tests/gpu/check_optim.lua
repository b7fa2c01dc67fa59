--[[
Muon on the GPU against the CPU: core.muon_step on matrices and banks whose
rows are not a multiple of 8 elements (the GPU lays the Newton-Schulz stack
out with rows padded to 8; the CPU does not), in the plain form (a square
and a wide matrix) and the Gram form (tall and wide banks), with f32 and bf16
momentum buffers, the bf16 ones rounded to nearest or stochastically.
Newton-Schulz in f32 on both sides; the parameters and buffers after two
steps agree within 2e-4 of their largest entry (cuBLAS and the CPU add in
other orders); stochastic rounding draws the same bits on both sides, so at
most 1 in 1,000 of its buffers' elements differ (a sum that differs in its
last f32 bit may round the other way). Then the per-expert update scales;
the Gram form on TF32 (ns_dtype bf16, the GPU's default) against the CPU's
f32, the update within 1e-2 (a bank padded into the Gram form among them);
Newton-Schulz in bf16 against f32 on the device. Then AdamW with 8-bit moments
(core.adamw_8bit_step) and the Engram tables' sparse Adam with them
(core.engram_adam_8bit, and its at form) on both sides.
  dormouse run tests/gpu/check_optim.lua
DRY=1 runs the script with the CPU on both sides.
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local core = require "dormouse.core"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "check_optim") then return end
local GPU = DRY and "cpu" or "cuda"
local checks = common.checks("check_optim")

local shapes = {
  {{37, 37}},                       -- plain form, square
  {{24, 61}, {24, 61}},             -- plain form, wide, two members of one group
  {{3, 64, 13}},                    -- Gram form, tall bank
  {{2, 13, 300}, {13, 300}},        -- Gram form, wide: a bank and a matrix of one shape
  {{5, 64, 5461}},                  -- b1's D bank, five of its experts
}

local function step_both(list, mom)
  local sides = {}
  for side, device in pairs {cpu = "cpu", gpu = GPU} do
    local p, b = {}, {}
    for i, shape in ipairs(list) do
      p[i] = dm.randn(shape, {seed = i}):to(device)
      b[i] = dm.zeros(shape, {dtype = mom == "f32" and "f32" or "bf16"}):to(device)
    end
    for s = 1, 2 do
      for i, shape in ipairs(list) do p[i].grad = dm.randn(shape, {seed = 100 * s + i}):to(device) end
      core.muon_step(p, b, {lr = 0.02, momentum = 0.95, nesterov = true, weight_decay = 0.1, ns_steps = 5,
                            coeffs = "quintic", ns_dtype = "f32", momentum_sround = mom == "bf16_stochastic",
                            sround_salt = 11, step = s})
    end
    sides[side] = {p = p, b = b}
  end
  return sides
end

-- the share of a's elements that differ from b's (bf16 or u8)
local function share_differing(a, b)
  local n = a:numel()
  local x, y = a:to("cpu"):reshape({n}):totable(), b:to("cpu"):reshape({n}):totable()
  local d = 0
  for i = 1, n do if x[i] ~= y[i] then d = d + 1 end end
  return d / n
end

for _, mom in ipairs {"f32", "bf16", "bf16_stochastic"} do
  for _, list in ipairs(shapes) do
    local names = {}
    for i, shape in ipairs(list) do names[i] = "[" .. table.concat(shape, ", ") .. "]" end
    checks.check(string.format("muon_step %s, %s momentum: GPU = CPU", table.concat(names, " + "), mom), function()
      local s = step_both(list, mom)
      local worst = 0
      for i in ipairs(list) do
        local e = common.rel(s.gpu.p[i], s.cpu.p[i])
        local eb = common.rel(s.gpu.b[i], s.cpu.b[i])
        assert(e <= 2e-4, string.format("parameter %d: relative error %.3g", i, e))
        assert(eb <= (mom == "f32" and 1e-6 or 1e-2), string.format("buffer %d: relative error %.3g", i, eb))
        if mom == "bf16_stochastic" then
          local d = share_differing(s.gpu.b[i], s.cpu.b[i])
          assert(d <= 1e-3, string.format("buffer %d: %.3g of its elements differ", i, d))
        end
        worst = math.max(worst, e)
      end
      return string.format("worst parameter error %.2g", worst)
    end)
  end
end

-- per-expert update scales (model.moe.update_by_load): the GPU's apply pass against the CPU's
checks.check("muon_step [6, 64, 13] + [6, 13, 300] with per-expert update scales: GPU = CPU", function()
  local shapes, scales = {{6, 64, 13}, {6, 13, 300}}, {0, 1, 0.25, 1, 0.5, 0}
  local out = {}
  for side, device in pairs {cpu = "cpu", gpu = GPU} do
    local p, b, s = {}, {}, {}
    for i, shape in ipairs(shapes) do
      p[i] = dm.randn(shape, {seed = 60 + i}):to(device)
      p[i].grad = dm.randn(shape, {seed = 70 + i}):to(device)
      b[i] = dm.zeros(shape):to(device)
      s[i] = dm.tensor(scales):to(device)
    end
    core.muon_step(p, b, {lr = 0.02, momentum = 0.95, nesterov = true, weight_decay = 0.1, ns_steps = 5,
                          coeffs = "quintic", ns_dtype = "f32", scales = s})
    out[side] = p
  end
  local worst = 0
  for i in ipairs(shapes) do
    local e = common.rel(out.gpu[i], out.cpu[i])
    assert(e <= 2e-4, string.format("parameter %d: relative error %.3g", i, e))
    worst = math.max(worst, e)
  end
  return string.format("worst parameter error %.2g", worst)
end)

-- Muon's Gram form with its products on TF32 (ns_dtype bf16, the GPU's default) against the CPU's f32,
-- on b1's bank shapes, with scales: the update's relative error (the parameters' own size left out)
-- [2, 100, 197]: the Gram form only through the pitch (197 columns padded to 200), its stack f32
for _, shape in ipairs {{4, 64, 2048}, {4, 2048, 64}, {3, 64, 5461}, {2, 100, 197}} do
  checks.check(string.format("muon_step [%s], Newton-Schulz on TF32 (%s) against f32 (cpu)", table.concat(shape, ", "),
                             GPU), function()
    local upd = {}
    for side, device in pairs {cpu = "cpu", gpu = GPU} do
      local p0 = dm.randn(shape, {seed = 81})
      local p = p0:to(device)
      p.grad = dm.randn(shape, {seed = 82}):to(device)
      local s = dm.tensor({1, 0.5, 0.25, 1}):narrow(1, 1, shape[1]):to(device)
      core.muon_step({p}, {dm.zeros(shape):to(device)}, {lr = 0.02, momentum = 0.95, nesterov = true,
                     weight_decay = 0.1, ns_steps = 5, coeffs = "polar_express", scales = {s},
                     ns_dtype = side == "cpu" and "f32" or "bf16"})
      upd[side] = p:to("cpu") - p0
    end
    local e = common.rel(upd.gpu, upd.cpu)
    assert(e <= 1e-2, string.format("update: relative error %.3g", e))
    return string.format("update's relative error %.2g", e)
  end)
end

-- Newton-Schulz in bf16 against f32 on the device, on b1's bank shapes (the Gram form: the stack in
-- bf16, its Gram matrix kept in f32) and a square matrix (the plain form): the update's relative error
-- and each form's distance from orthogonal (|X Xt - I| over the short side's rows, the Frobenius norm
-- relative to I's), printed for the record (docs/performance.md)
local function off_orthogonal(x)
  local s = x:to("f32")
  if s:size(2) > s:size(3) then s = s:transpose(2, 3) end
  local g = dm.matmul(s, s, {transpose_b = true})
  local b, r = g:size(1), g:size(2)
  -- |G - I|^2 = |G|^2 - 2 tr G + r a matrix, tr G = |s|^2
  local d2 = g:to("f64"):square():sum():item() - 2 * s:to("f64"):square():sum():item() + b * r
  return math.sqrt(math.max(d2, 0) / (b * r))
end
for _, shape in ipairs {{8, 64, 2048}, {8, 2048, 64}, {4, 64, 5461}, {1, 2048, 2048}} do
  checks.check(string.format("newton_schulz [%s] bf16 against f32 (%s)", table.concat(shape, ", "), GPU), function()
    local x = dm.randn(shape, {seed = 7}):to(GPU)
    local r16 = core.newton_schulz(x, 5, "polar_express", "bf16")
    local r32 = core.newton_schulz(x, 5, "polar_express", "f32")
    local e = common.rel(r16:to("f32"), r32)
    assert(r16.dtype == "bf16", "the result is " .. r16.dtype)
    assert(e <= 2e-2, string.format("relative error %.3g", e))
    return string.format("relative error %.2g; off orthogonal: bf16 %.3g, f32 %.3g", e, off_orthogonal(r16),
                         off_orthogonal(r32))
  end)
end

-- AdamW with 8-bit moments: parameters to 1e-5 of their largest entry, scales to 1e-5, and at most 1 in
-- 1,000 codes different (an f32 sum that differs in its last bit may round the other way)
checks.check("adamw_8bit_step [3, 100] + [5461] (bf16 gradient) + [7]: GPU = CPU", function()
  local shapes = {{3, 100}, {5461}, {7}}
  local sides = {}
  for side, device in pairs {cpu = "cpu", gpu = GPU} do
    local p, mc, ms, rc, rs = {}, {}, {}, {}, {}
    for i, shape in ipairs(shapes) do
      p[i] = dm.randn(shape, {seed = 40 + i}):to(device)
      local n = p[i]:numel()
      mc[i] = dm.zeros(shape, {dtype = "u8"}):to(device)
      rc[i] = dm.zeros(shape, {dtype = "u8"}):to(device)
      ms[i] = dm.zeros({(n + 255) // 256}):to(device)
      rs[i] = dm.zeros({(n + 255) // 256}):to(device)
    end
    for step = 1, 3 do
      for i, shape in ipairs(shapes) do
        p[i].grad = dm.randn(shape, {seed = 300 * step + i}):to(i == 2 and "bf16" or "f32"):to(device)
      end
      core.adamw_8bit_step(p, mc, ms, rc, rs, {lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1,
                                             step = step, salt = 21})
    end
    sides[side] = {p = p, mc = mc, ms = ms, rc = rc, rs = rs}
  end
  local worst = 0
  for i in ipairs(shapes) do
    local e = common.rel(sides.gpu.p[i], sides.cpu.p[i])
    assert(e <= 1e-5, string.format("parameter %d: relative error %.3g", i, e))
    for _, k in ipairs {"ms", "rs"} do
      local es = common.rel(sides.gpu[k][i], sides.cpu[k][i])
      assert(es <= 1e-5, string.format("%s %d: relative error %.3g", k, i, es))
    end
    for _, k in ipairs {"mc", "rc"} do
      local d = share_differing(sides.gpu[k][i], sides.cpu[k][i])
      assert(d <= 1e-3, string.format("%s %d: %.3g of the codes differ", k, i, d))
    end
    worst = math.max(worst, e)
  end
  return string.format("worst parameter error %.2g", worst)
end)

-- the Engram tables' sparse Adam with 8-bit moments (a row a block, a warp a row on the GPU): rows of 32 and of
-- 40 values (a warp's lanes over a row longer than it), eagerly and from device scalars
for _, de in ipairs {32, 40} do
  checks.check(string.format("engram_adam_8bit [300, %d], 3 steps of 120 rows, then the at form: GPU = CPU", de), function()
    local R, k = 300, 120
    local sides = {}
    for side, device in pairs {cpu = "cpu", gpu = GPU} do
      local w = dm.randn({R, de}, {seed = 70}):to(device)
      local m8 = {m = dm.zeros({R, de}, {dtype = "u8"}):to(device), m_scale = dm.zeros({R}):to(device),
                  v = dm.zeros({R, de}, {dtype = "u8"}):to(device), v_scale = dm.zeros({R}):to(device), salt = 5}
      for step = 1, 4 do
        local picked = {}
        for i = 1, k do picked[i] = (i * 7 + step * 13) % R end
        table.sort(picked)
        local uniq = {}
        for _, r in ipairs(picked) do if uniq[#uniq] ~= r then uniq[#uniq + 1] = r end end
        local rows = dm.tensor(uniq, {dtype = "i64"}):to(device)
        local g = dm.randn({#uniq, de}, {seed = 80 + step}):to(device)
        dm.no_grad(function()
          if step < 4 then
            core.engram_adam_8bit(w, m8, rows, g, #uniq, 1e-2, 0.9, 0.95, 1e-8, step)
          else
            local function one(v, dt) return dm.tensor({v}, {dtype = dt}):to(device) end
            core.engram_adam_8bit_at(w, m8, rows, g, one(#uniq, "i64"), 0.9, 0.95, 1e-8, one(1e-2, "f64"),
                                   one(step, "i64"), one(3.0, "f64"))
          end
        end)
      end
      sides[side] = {w = w, m8 = m8}
    end
    local e = common.rel(sides.gpu.w, sides.cpu.w)
    assert(e <= 1e-5, string.format("table: relative error %.3g", e))
    for _, key in ipairs {"m_scale", "v_scale"} do
      local es = common.rel(sides.gpu.m8[key], sides.cpu.m8[key])
      assert(es <= 1e-5, string.format("%s: relative error %.3g", key, es))
    end
    for _, key in ipairs {"m", "v"} do
      local d = share_differing(sides.gpu.m8[key], sides.cpu.m8[key])
      assert(d <= 1e-3, string.format("%s codes: %.3g differ", key, d))
    end
    return string.format("table error %.2g", e)
  end)
end

checks.finish()
