--[[
bench_moe.lua — the routed experts' products at b1 (8,192 tokens, E = 1024,
k = 2, d = 2048, r = 64, F = 5461, bf16) through the Lua API, against the
bandwidth floor: the bytes that must move, at the device's copy bandwidth
measured in the same run (core.cuda_bench_copy, read + written).

  BUILD/dormouse run tests/gpu/bench_moe.lua [OLD]
  DM_MOE_FMA=1 BUILD/dormouse run tests/gpu/bench_moe.lua [OLD]

The floor counts each pass's bytes once: forward reads Ug, Uu, cg, cu, D and
u and writes y_rows; the backward reads the weights, gy_rows and u again and
writes the weights' gradients and u's. Routing is dm.moe_route on random
logits, then dm.moe_sort; a second case routes as real training reaches
(common.moe_b1's "skewed": one expert with 40% of the rows, a hundred with
none), where the same bytes should take about the same time. Times are the median device time of several runs
after warm-up (forward under no_grad; forward+backward from y:backward(gy)).
With DM_MOE_FMA=1 the FMA kernels run instead of the tensor cores; given OLD,
that run writes its times there and a later tensor-core run prints them as
the old kernels' column.
]]
local dm = require "dormouse"
local common = require "tests.gpu.common"
local cuda = dm.cuda or require "dormouse.cuda"
local core = dm.core

if not common.gpu_or_skip(cuda, "bench_moe") then return end

local REPS = 9
local fma = os.getenv("DM_MOE_FMA")
fma = fma ~= nil and fma ~= "" and fma ~= "0"
local old_file = arg and arg[1]

local info = cuda.info()
print(string.format("device: %s, sm_%d%d, %d SMs; kernels: %s", info.name, info.major, info.minor, info.sm_count,
                    fma and "FMA (DM_MOE_FMA=1)" or "tensor cores"))

local COPY = 512 * 1024 * 1024
local copy_bw = 2 * COPY / (core.cuda_bench_copy(COPY, 15) * 1e-3) / 1e9
print(string.format("copy bandwidth (cudaMemcpyAsync D2D, 512 MiB, read + written): %.0f GB/s", copy_bw))

-- the routing's spread, then the two passes' median times
local function run_case(x)
  local off = x.offsets:cpu():totable()
  local most, least, dead = 0, math.huge, 0
  for e = 1, x.E do
    local c = off[e + 1] - off[e]
    most, least = math.max(most, c), math.min(least, c)
    if c == 0 then dead = dead + 1 end
  end
  print(string.format("routing %s: %d rows, %.1f an expert on average, %d to %d (busiest %.3f), %d experts without",
                      x.routing, x.N * x.K, x.N * x.K / x.E, least, most, most / (x.N * x.K), dead))
  local gy, params, forward = x.gy, x.params, x.forward
  local fwd = cuda.time(function() dm.no_grad(function() forward():free() end) end, {reps = REPS, warmup = 2})
  for _, p in ipairs(params) do p:requires_grad(true) end
  local both = cuda.time(function()
    local y = forward()
    y:backward(gy)
    y:free()
    for _, p in ipairs(params) do p.grad = nil end
  end, {reps = REPS, warmup = 2})
  return fwd, both
end

local times = {}
for _, routing in ipairs {"random", "skewed"} do
  local x = common.moe_b1(dm, routing)
  x.routing = routing
  times[routing] = {run_case(x)}
  if not fma then   -- the same products from fp8 banks (model.moe.fp8)
    local q = common.moe_b1(dm, routing, true)
    q.routing = routing .. ", fp8 banks"
    times[routing .. " fp8"] = {run_case(q)}
  end
  collectgarbage()
end

-- a pass's banks from the f32 masters: the cast to bf16 the 16-bit kernels read, against the fp8 codes
local function masters()
  local E, D, R, F = 1024, 2048, 64, 5461
  local function f32(shape, seed) return dm.randn(shape, {seed = seed, dtype = "f32", device = "cuda"}) end
  return {f32({E, D, R}, 3), f32({E, D, R}, 4), f32({E, R, F}, 5)}
end
local ws = masters()
local cast_ms = cuda.time(function() for _, w in ipairs(ws) do w:to("bf16"):free() end end, {reps = REPS, warmup = 2})
local encode_ms = cuda.time(function()
  for _, w in ipairs(ws) do
    local c, sc = dm.bank_fp8(w, "bf16")
    c:free()
    sc:free()
  end
end, {reps = REPS, warmup = 2})
ws = nil
collectgarbage()
local fwd_ms, both_ms = times.random[1], times.random[2]
local N, E, K, D, R, F = 8192, 1024, 2, 2048, 64, 5461

-- the floor's bytes (bf16: 2 a value)
local weights = 2 * (2 * E * D * R + 2 * E * R + E * R * F)
local acts_in, rows_out = 2 * N * D, 2 * N * K * F
local fwd_bytes = weights + acts_in + rows_out
local bwd_bytes = weights + rows_out + acts_in + weights + acts_in

local old = {}
if old_file then
  if fma then
    local f = assert(io.open(old_file, "w"))
    f:write(string.format("%.6f %.6f\n", fwd_ms, both_ms))
    f:close()
  else
    local f = io.open(old_file)
    if f then
      old.fwd, old.both = f:read("n", "n")
      f:close()
    end
  end
end

local out = {"| pass | ms | floor bytes | GB/s equivalent | of copy bandwidth | old kernels ms |", "|---|---|---|---|---|---|"}
local skew = times.skewed
for _, r in ipairs {{"forward", fwd_ms, fwd_bytes, old.fwd}, {"forward+backward", both_ms, fwd_bytes + bwd_bytes, old.both},
                    {"forward, skewed routing", skew[1], fwd_bytes}, {"forward+backward, skewed routing", skew[2],
                    fwd_bytes + bwd_bytes}} do
  local gbs = r[3] / (r[2] * 1e-3) / 1e9
  out[#out + 1] = string.format("| %s%s | %.3f | %.3f GB | %.0f | %.1f%% | %s |", r[1], fma and " (FMA)" or "", r[2],
                                r[3] / 1e9, gbs, 100 * gbs / copy_bw, r[4] and string.format("%.3f", r[4]) or "-")
end
if not fma then
  out[#out + 1] = ""
  out[#out + 1] = "| fp8 banks (model.moe.fp8) | ms | against the 16-bit kernels |"
  out[#out + 1] = "|---|---|---|"
  for _, r in ipairs {{"forward", times["random fp8"][1], fwd_ms}, {"forward+backward", times["random fp8"][2], both_ms},
                      {"forward, skewed routing", times["skewed fp8"][1], skew[1]},
                      {"forward+backward, skewed routing", times["skewed fp8"][2], skew[2]},
                      {"a pass's banks from the f32 masters: bank_fp8 against the cast to bf16", encode_ms, cast_ms}} do
    out[#out + 1] = string.format("| %s | %.3f | %.3f (%+.1f%%) |", r[1], r[2], r[3], 100 * (r[2] / r[3] - 1))
  end
end
print("\n" .. table.concat(out, "\n"))
