--[[
check_moe.lua — the routed experts' products (moe_experts and its backward) on
the GPU at model-like shapes with skewed routing: bf16 and f16 (the tensor-core
kernels of kernels/moe_tc.cu) against the CPU in f64 from the same rounded inputs,
every gradient; and two backward runs giving the same bits.

  BUILD/dormouse run tests/gpu/check_moe.lua

Routing is skewed on purpose: a selection bias draws most tokens to experts
0..3 (several tiles of rows each), pushes experts E-4..E-1 out (no rows), and
the rest get a few rows. F = 384 keeps rows on 16-byte boundaries, F = 383
does not (the kernels' shifted path); F = 2001 and d = 1000 give the
streaming kernels more chunks than one unit takes (several units an
expert). The "heavy" cases send nearly every token to expert 1 (over 1,024
rows: the streaming kernels split it by rows, and its weight gradients are
joined from partial sums).
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"

if not common.gpu_or_skip(cuda, "check_moe") then return end

local checks = common.checks("check_moe")
local check, rel = checks.check, common.rel
local TOL = {bf16 = 2e-2, f16 = 1e-2}

local function randn(shape, seed, scale) return dm.randn(shape, {seed = seed, dtype = "f64"}):mul(scale or 1) end

-- the sorted layout of a skewed routing of N tokens to E experts, k each (on the CPU)
local function layout(N, E, k, seed, heavy)
  local b = {}
  for e = 1, E do b[e] = heavy and e == 1 and 8 or e <= 4 and 0.35 or e > E - 4 and -2 or 0 end
  local idx = dm.moe_route(randn({N, E}, seed, 1.5), dm.tensor(b, {dtype = "f64"}), k)
  local perm, offsets = dm.moe_sort(idx, E)
  local off = offsets:totable()
  local most, dead = 0, 0
  for e = 1, E do
    local c = off[e + 1] - off[e]
    most = math.max(most, c)
    if c == 0 then dead = dead + 1 end
  end
  return perm, offsets, string.format("busiest %d rows, %d without", most, dead)
end

-- y_rows and the gradients of sum(y_rows * gy) w.r.t. u, Ug, Uu, cg, cu, D
local function run(ins, perm, offsets, k, gy, dt, dev)
  local xs = {}
  for i, x in ipairs(ins) do
    xs[i] = x:to(dt):to(dev)
    xs[i]:requires_grad(true)
  end
  local y = dm.moe_experts(xs[1], perm:to(dev), offsets:to(dev), xs[2], xs[3], xs[4], xs[5], xs[6], k)
  y:backward(gy:to(dt):to(dev))
  local g = {}
  for i, x in ipairs(xs) do g[i] = x.grad end
  return y:detach(), g
end

local NAMES = {"u", "Ug", "Uu", "cg", "cu", "D"}

for _, s in ipairs {{N = 300, E = 64, d = 256, r = 64, F = 384}, {N = 300, E = 64, d = 256, r = 64, F = 383},
                    {N = 200, E = 16, d = 96, r = 32, F = 77}, {N = 200, E = 16, d = 1000, r = 16, F = 2001},
                    {N = 2200, E = 8, d = 256, r = 64, F = 383, heavy = true},
                    {N = 1100, E = 16, d = 1000, r = 16, F = 2001, heavy = true}} do
  local k = 2
  local perm, offsets, what = layout(s.N, s.E, k, 11, s.heavy)
  local ins = {randn({s.N, s.d}, 1), randn({s.E, s.d, s.r}, 2, s.d ^ -0.5), randn({s.E, s.d, s.r}, 3, s.d ^ -0.5),
               dm.rand({s.E, s.r}, {seed = 4, dtype = "f64"}):add(0.5), dm.rand({s.E, s.r}, {seed = 5, dtype = "f64"}):add(0.5),
               randn({s.E, s.r, s.F}, 6, s.r ^ -0.5)}
  local gy = randn({s.N * k, s.F}, 7)
  local label = string.format("N%d E%d d%d r%d F%d (%s)", s.N, s.E, s.d, s.r, s.F, what)
  for _, dt in ipairs {"bf16", "f16"} do
    check(string.format("moe_experts %s, %s", label, dt), function()
      local rin = {}
      for i, x in ipairs(ins) do rin[i] = x:to(dt):to("f64") end
      local want_y, want_g = run(rin, perm, offsets, k, gy:to(dt):to("f64"), "f64", "cpu")
      local got_y, got_g = run(ins, perm, offsets, k, gy, dt, "cuda")
      local msg, worst = {}, rel(got_y, want_y)
      msg[1] = string.format("y %.2g", worst)
      for i = 1, #ins do
        local e = got_g[i] and rel(got_g[i], want_g[i]) or math.huge
        if e ~= e then e = math.huge end
        msg[#msg + 1] = string.format("d%s %.2g", NAMES[i], e)
        worst = math.max(worst, e)
      end
      assert(worst <= TOL[dt], table.concat(msg, ", ") .. string.format(" (over %.1g)", TOL[dt]))
      return table.concat(msg, ", ")
    end)
  end
  check(string.format("moe_experts %s, fp8 banks: the 16-bit kernels' bits on the banks' values", label), function()
    -- the codes read by the kernels against the 16-bit kernels on quantize's values (QAT's): y and every
    -- gradient the same bits (the factors' gradients reach them through the stand-ins as through a cast)
    local function leaves(list)
      local out = {}
      for i, x in ipairs(list) do out[i] = x:to("bf16"):to("cuda"); out[i]:requires_grad(true) end
      return out
    end
    local q16 = {}
    for i, x in ipairs(ins) do
      q16[i] = x:to("bf16"):to("cuda")
      if i == 2 or i == 3 or i == 6 then q16[i] = dm.quantize(q16[i], "fp8_e4m3") end
    end
    local a, b = leaves(ins), leaves(q16)
    local fp8 = {}
    for i, name in pairs {[2] = "Ug", [3] = "Uu", [6] = "D"} do fp8[name] = {dm.bank_fp8(a[i], "bf16")} end
    local g = gy:to("bf16"):to("cuda")
    local ya = dm.moe_experts(a[1], perm:to("cuda"), offsets:to("cuda"), dm.stand_in(a[2], "bf16"),
                              dm.stand_in(a[3], "bf16"), a[4], a[5], dm.stand_in(a[6], "bf16"), k, fp8)
    ya:backward(g)                       -- (a backward frees the whole tape: one product at a time)
    local yb = dm.moe_experts(b[1], perm:to("cuda"), offsets:to("cuda"), b[2], b[3], b[4], b[5], b[6], k)
    yb:backward(g)
    assert(rel(ya:detach(), yb:detach()) == 0, "y differs: " .. rel(ya:detach(), yb:detach()))
    for i = 1, #ins do
      local e = rel(a[i].grad, b[i].grad)
      assert(e == 0, "d" .. NAMES[i] .. " differs: " .. e)
    end
    return "y and d" .. table.concat(NAMES, ", d") .. ": the same bits"
  end)
  check(string.format("moe_experts backward %s, bf16: two runs, the same bits", label), function()
    local y1, g1 = run(ins, perm, offsets, k, gy, "bf16", "cuda")
    local y2, g2 = run(ins, perm, offsets, k, gy, "bf16", "cuda")
    assert(rel(y1, y2) == 0, "y differs")
    for i = 1, #ins do assert(rel(g1[i], g2[i]) == 0, "d" .. NAMES[i] .. " differs") end
  end)
end

checks.finish()
