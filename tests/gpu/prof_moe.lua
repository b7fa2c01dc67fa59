--[[
prof_moe.lua — one forward (no grad) and one forward+backward of the routed
experts at b1's shapes (bench_moe.lua's), for a profiler to look at; ROUTING is
"random" (the default) or "skewed" (common.moe_b1's); FP8 = "fp8" reads the factors as
fp8 banks (model.moe.fp8):

  ncu --metrics gpu__time_duration.sum --print-summary per-kernel BUILD/dormouse run tests/gpu/prof_moe.lua [ROUTING [FP8]]
]]
local dm = require "dormouse"
local cuda = dm.cuda or require "dormouse.cuda"
local common = require "tests.gpu.common"
local x = common.moe_b1(dm, arg and arg[1], arg and arg[2] == "fp8")
local params, forward = x.params, x.forward
cuda.synchronize()
dm.no_grad(function() forward():free() end)
for _, p in ipairs(params) do p:requires_grad(true) end
local y = forward()
y:backward(x.gy)
cuda.synchronize()
print("prof_moe done")
