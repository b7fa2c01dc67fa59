--[[
check_kda.lua — the chunked KDA kernels (kernels/kda_chunk.cu) against the
float64 recurrent oracle on the CPU (docs/kda.md §3): o, the final
state and the six gradients, in f32, bf16 and f16, on T = 1, 15, 17, 63,
65, 1000, 4096 and 8192 (ends inside a sub-chunk and a chunk; past 4,096
positions, where a long state's errors would show) with dk = dv = 64 and one
awkward dk, dv, under every gate regime (logsigmoid, weak with half zeros,
exactly zero, all at the bound -5, all at -50). Then, in f32: one call
against two with the state carried (split at 1, 63, 64, 65; outputs and
gradients, through the carried state), causality (inputs at t >= P
changed, P inside a partial trailing sub-chunk: outputs and gradients
before P bitwise the same) and determinism (two runs bitwise equal).
  dormouse run tests/gpu/check_kda.lua      (DRY=1: the chunked CPU kernels instead)
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
local DEV = os.getenv("DRY") and "cpu" or "cuda"
if DEV == "cuda" and not common.gpu_or_skip(cuda, "check_kda") then return end

local checks = common.checks("check_kda")
local check, rel = checks.check, common.rel
local TOL = {f32 = 2e-5, bf16 = 2e-2, f16 = 2e-2}
-- f16's smallest normal: a reference below it (the gate at -50 leaves dg and dS0 near e^-50) is not
-- representable in f16, so its error is taken against this floor
local FLOOR = {f16 = 2 ^ -14}
local DTYPES = {"f32", "bf16", "f16"}
local NAMES = {"q", "k", "v", "g", "beta", "S0"}

local function randn(shape, seed) return dm.randn(shape, {seed = seed, dtype = "f64"}) end

-- f64 CPU inputs {q, k, v, g, beta, S0}, q and k unit rows, g by regime
local function inputs(B, T, H, dk, dv, regime, seed)
  local qs = {B, T, H, dk}
  local g
  if regime == "zero" then g = dm.zeros(qs, {dtype = "f64"})
  elseif regime == "bound" then g = dm.full(qs, -5, {dtype = "f64"})
  elseif regime == "far" then g = dm.full(qs, -50, {dtype = "f64"})
  else
    g = randn(qs, seed + 3):sigmoid():log()                     -- logsigmoid(N(0, 1))
    if regime == "weak" then
      g = g:mul(0.1):mul(dm.rand(qs, {seed = seed + 6, dtype = "f64"}):gt(0.5):to("f64"))
    end
  end
  return {randn(qs, seed):l2norm(), randn(qs, seed + 1):l2norm(), randn({B, T, H, dv}, seed + 2), g,
          dm.rand({B, T, H}, {seed = seed + 4, dtype = "f64"}):mul(0.9):add(0.05),
          randn({B, H, dk, dv}, seed + 5):mul(0.5)}
end

-- outputs {o, S} and, with ws = {wo, wS}, the gradients of sum(o wo) + sum(S wS)
-- w.r.t. the six inputs; x: f64 CPU tensors moved to dev as dt
local function run(x, dt, dev, algo, ws)
  local xs = {}
  for i, t in ipairs(x) do
    xs[i] = t:to(dt):to(dev)
    if ws then xs[i]:requires_grad(true) end
  end
  local o, S = dm.kda(xs[1], xs[2], xs[3], xs[4], xs[5], {initial_state = xs[6], output_final_state = true,
                                                          algo = algo})
  local grads = {}
  if ws then
    local loss = (o * ws[1]:to(o.dtype):to(dev)):sum():to("f64") + (S * ws[2]:to(S.dtype):to(dev)):sum():to("f64")
    loss:backward()
    for i, t in ipairs(xs) do grads[i] = t.grad end
  end
  return {o:detach(), S:detach()}, grads
end

local function weights(x, seed)
  local B, T, H, dk, dv = x[1]:size(1), x[1]:size(2), x[1]:size(3), x[1]:size(4), x[3]:size(4)
  return {randn({B, T, H, dv}, seed), randn({B, H, dk, dv}, seed + 1)}
end

local function bitwise(a, b, what)
  assert(rel(a, b) == 0, what .. " differs (rel " .. rel(a, b) .. ")")
end

print("device: " .. (DEV == "cuda" and cuda.device_name() or "cpu (dry run)"))

-- ---- against the f64 recurrent oracle -----------------------------------------------------------
local shapes = {{1, 1, 2, 64, 64}, {2, 15, 2, 64, 64}, {1, 17, 3, 64, 64}, {1, 63, 2, 64, 64}, {2, 65, 2, 64, 64},
                {1, 1000, 2, 64, 64}, {1, 4096, 1, 64, 64}, {1, 8192, 1, 64, 64}, {1, 100, 2, 37, 50}}
local regimes = {"logsig", "weak", "zero", "bound", "far"}
-- how each dtype's products are taken (kernels/kda_chunk.cu); the dry run's are the CPU's float32 loops
local PATH = DEV == "cuda" and {f32 = "3xTF32 products", bf16 = "1xTF32 products", f16 = "1xTF32 products"}
             or {f32 = "CPU float32", bf16 = "CPU float32", f16 = "CPU float32"}
local worst_of = {f32 = {}, bf16 = {}, f16 = {}}                               -- dtype -> output -> the largest error
local seed = 100
for _, s in ipairs(shapes) do
  for _, regime in ipairs(regimes) do
    seed = seed + 10
    local x = inputs(s[1], s[2], s[3], s[4], s[5], regime, seed)
    local ws = weights(x, seed + 7)
    for _, dt in ipairs(DTYPES) do
      check(string.format("B%d T%d H%d %dx%d %s, %s", s[1], s[2], s[3], s[4], s[5], regime, dt), function()
        local xr = {}
        for i, t in ipairs(x) do xr[i] = t:to(dt):to("f64") end   -- the inputs the device sees
        local want, wg = run(xr, "f64", "cpu", "recurrent", ws)
        local got, gg = run(xr, dt, DEV, "chunked", ws)
        local msg, worst = {}, 0
        local function add(name, a, b)
          local e = rel(a, b, FLOOR[dt])
          e = e ~= e and math.huge or e
          worst = math.max(worst, e)
          worst_of[dt][name] = math.max(worst_of[dt][name] or 0, e)
          msg[#msg + 1] = string.format("%s %.2g", name, e)
        end
        add("o", got[1], want[1]); add("S", got[2], want[2])
        for i = 1, 6 do add("d" .. NAMES[i], gg[i], wg[i]) end
        assert(worst <= TOL[dt], table.concat(msg, ", ") .. string.format(" (over %.1g)", TOL[dt]))
        return table.concat(msg, ", ")
      end)
    end
  end
end

-- each path's largest error against the float64 recurrence, over the shapes and regimes above
for _, dt in ipairs(DTYPES) do
  local parts = {}
  for _, name in ipairs {"o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"} do
    parts[#parts + 1] = string.format("%s %.2g", name, worst_of[dt][name] or 0)
  end
  print(string.format("worst against f64, %s (%s): %s", dt, PATH[dt], table.concat(parts, ", ")))
end

-- ---- one call against two, the state carried ----------------------------------------------------------
for _, t1 in ipairs {1, 63, 64, 65} do
  check(string.format("split at %d of 200, state carried (f32)", t1), function()
    local x = inputs(2, 200, 2, 64, 64, "logsig", 900 + t1)
    local ws = weights(x, 950)
    local whole, wg = run(x, "f32", DEV, "chunked", ws)
    local xs = {}
    for i, t in ipairs(x) do
      xs[i] = t:to("f32"):to(DEV)
      xs[i]:requires_grad(true)
    end
    local function part(t, a, n) return t:narrow(2, a, n) end
    local function seg(a, n, s0)
      return dm.kda(part(xs[1], a, n), part(xs[2], a, n), part(xs[3], a, n), part(xs[4], a, n), part(xs[5], a, n),
                    {initial_state = s0, output_final_state = true, algo = "chunked"})
    end
    local o1, s1 = seg(1, t1, xs[6])
    local o2, s2 = seg(t1 + 1, 200 - t1, s1)
    local o = dm.cat({o1, o2}, 2)
    local loss = (o * ws[1]:to("f32"):to(DEV)):sum():to("f64") + (s2 * ws[2]:to("f32"):to(DEV)):sum():to("f64")
    loss:backward()
    local msg, worst = {}, 0
    local function add(name, a, b)
      local e = rel(a, b)
      worst = math.max(worst, e ~= e and math.huge or e)
      msg[#msg + 1] = string.format("%s %.2g", name, e)
    end
    add("o", o, whole[1]); add("S", s2, whole[2])
    for i = 1, 6 do add("d" .. NAMES[i], xs[i].grad, wg[i]) end
    assert(worst <= 1e-5, table.concat(msg, ", "))
    return table.concat(msg, ", ")
  end)
end

-- ---- causality: what comes at t >= P changes nothing before P -------------------------------------------
check("causality: inputs at t >= 90 of 100 changed (f32)", function()
  local T, P = 100, 90
  local x = inputs(1, T, 2, 64, 64, "logsig", 1200)
  local y = inputs(1, T, 2, 64, 64, "logsig", 1300)
  local z = {}
  for i = 1, 5 do z[i] = dm.cat({x[i]:narrow(2, 1, P), y[i]:narrow(2, P + 1, T - P)}, 2) end
  z[6] = x[6]
  local ws = weights(x, 1250)
  ws[1] = dm.cat({ws[1]:narrow(2, 1, P), dm.zeros({1, T - P, 2, 64}, {dtype = "f64"})}, 2)   -- o before P only
  ws[2] = dm.zeros(ws[2]:shape(), {dtype = "f64"})
  local a, ga = run(x, "f32", DEV, "chunked", ws)
  local b, gb = run(z, "f32", DEV, "chunked", ws)
  bitwise(a[1]:narrow(2, 1, P), b[1]:narrow(2, 1, P), "o before P")
  for i = 1, 5 do bitwise(ga[i]:narrow(2, 1, P), gb[i]:narrow(2, 1, P), "d" .. NAMES[i] .. " before P") end
  bitwise(ga[6], gb[6], "dS0")
  assert(rel(a[1]:narrow(2, P + 1, T - P), b[1]:narrow(2, P + 1, T - P)) > 0, "o after P did not change")
end)

-- ---- determinism ----------------------------------------------------------------------------------------
for _, dt in ipairs {"f32", "bf16"} do
  check("two runs bitwise equal (B2 T300 H3, " .. dt .. ")", function()
    local x = inputs(2, 300, 3, 64, 64, "logsig", 1400)
    local ws = weights(x, 1450)
    local a, ga = run(x, dt, DEV, "chunked", ws)
    local b, gb = run(x, dt, DEV, "chunked", ws)
    bitwise(a[1], b[1], "o"); bitwise(a[2], b[2], "S")
    for i = 1, 6 do bitwise(ga[i], gb[i], "d" .. NAMES[i]) end
  end)
end

checks.finish()
