--[[
prof_moe.lua — one forward (no grad) and one forward+backward of the routed
experts at b1's shapes (bench_moe.lua's), for a profiler to look at:

  ncu --metrics gpu__time_duration.sum --print-summary per-kernel BUILD/dormouse run tests/gpu/prof_moe.lua
]]
local dm = require "dormouse"
local cuda = dm.cuda or require "dormouse.cuda"
local N, E, K, D, R, F = 8192, 1024, 2, 2048, 64, 5461
local function bf16(shape, seed, scale)
  return dm.randn(shape, {seed = seed, dtype = "bf16", device = "cuda"}):mul(scale or 1)
end
local idx = dm.moe_route(dm.randn({N, E}, {seed = 1, dtype = "f32", device = "cuda"}), nil, K)
local perm, offsets = dm.moe_sort(idx, E)
local u = bf16({N, D}, 2)
local ug, uu = bf16({E, D, R}, 3, D ^ -0.5), bf16({E, D, R}, 4, D ^ -0.5)
local cg, cu = dm.ones({E, R}, {dtype = "bf16", device = "cuda"}), dm.ones({E, R}, {dtype = "bf16", device = "cuda"})
local dw = bf16({E, R, F}, 5, R ^ -0.5)
local gy = bf16({N * K, F}, 6)
local params = {u, ug, uu, cg, cu, dw}
local function forward() return dm.moe_experts(u, perm, offsets, ug, uu, cg, cu, dw, K) end
cuda.synchronize()
dm.no_grad(function() forward():free() end)
for _, p in ipairs(params) do p:requires_grad(true) end
local y = forward()
y:backward(gy)
cuda.synchronize()
print("prof_moe done")
