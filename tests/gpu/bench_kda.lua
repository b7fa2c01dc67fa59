--[[
bench_kda.lua — KDA forward and forward+backward at the b1 model's shape
(B 8, T 1024, H 32, dk = dv = 64, bf16), chunked and recurrent, in device
ms from CUDA events: the median of REPS calls after WARMUP. The baseline is
FLA's chunk_kda on the same inputs, timed by tools/kda_fla.py in the same
run; both print one line per figure in the same format.

Inputs as the model makes them: q, k unit rows, v normal, bf16; g =
lb * sigmoid(N(0, 1)) with lb = -5 in f32 (the gate's output); beta =
sigmoid(N(0, 1)) in bf16; an f32 initial state without gradient, the
final state returned. forward+backward is o:backward(do), the gradients
of q, k, v, g and beta.
  dormouse run tests/gpu/bench_kda.lua [B T H D]
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
if not common.gpu_or_skip(cuda, "bench_kda") then return end

local WARMUP, REPS = 2, 9
local B, T, H, D = 8, 1024, 32, 64
if arg and arg[4] then B, T, H, D = tonumber(arg[1]), tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4]) end

local function randn(shape, seed) return dm.randn(shape, {seed = seed, device = "cuda"}) end
local x = {randn({B, T, H, D}, 1):l2norm():to("bf16"), randn({B, T, H, D}, 2):l2norm():to("bf16"),
           randn({B, T, H, D}, 3):to("bf16"), randn({B, T, H, D}, 4):sigmoid():mul(-5),
           randn({B, T, H}, 5):sigmoid():to("bf16")}
local s0 = randn({B, H, D, D}, 6):mul(0.5)
local dout = randn({B, T, H, D}, 7):to("bf16")
for i = 1, 5 do x[i]:requires_grad(true) end
local shape = string.format("B%d T%d H%d d%d bf16", B, T, H, D)
print("device: " .. cuda.device_name())

for _, algo in ipairs {"chunked", "recurrent"} do
  local opts = {initial_state = s0, output_final_state = true, algo = algo}
  local fwd = cuda.time(function()
    dm.no_grad(function() dm.kda(x[1], x[2], x[3], x[4], x[5], opts) end)
  end, {warmup = WARMUP, reps = REPS})
  local both = cuda.time(function()
    local o = dm.kda(x[1], x[2], x[3], x[4], x[5], opts)
    o:backward(dout)
    for i = 1, 5 do x[i].grad = nil end
  end, {warmup = WARMUP, reps = REPS})
  local label = "ours " .. algo
  print(string.format("%-26s %-8s %s: %8.3f ms", label, "fwd", shape, fwd))
  print(string.format("%-26s %-8s %s: %8.3f ms", label, "fwd+bwd", shape, both))
  io.stdout:flush()
end
