--[[
tests/gpu/bench.lua — the CUDA backend's micro-benchmarks, each against a
baseline measured in the same run on the same GPU.

  build/dormouse run tests/gpu/bench.lua [RESULTS.md] [SECTIONS]    (tools/gpu.sh runs it)

  matmul      bf16 8192 x 8192 x 8192 through dm.matmul, against cuBLASLt
              called directly (target >= 95%)
  elementwise a * b + c on 256M bf16 elements, against the device-to-device
              copy bandwidth (bytes read plus written; target >= 80%)
  fuse        silu(a) * b + 0.5 * c from dm.fuse (4 ops, one kernel) on 256M
              bf16 elements, the same way (target >= 80%)
  rows        softmax, logsumexp over [32768, 256] and [8192, 8192] (target
              >= 70%), launched from Lua and replayed as a CUDA graph of
              back-to-back launches (the target applies to the replay: a
              kernel of a few us is otherwise timed with the host's launches)
  launch      the host cost of one op called from Lua (eager), in us, and the
              same 200-op sequence eager and replayed as a CUDA graph
  littlebit   LittleBit's factor row * sign(x) * col at b1's bank shapes (Ug
              [1024, 2048, 64], D [1024, 64, 5461]) in bf16, forward and
              forward + backward, over the bytes their kernels read and write
              (target >= 70%)

SECTIONS is a comma-separated subset of copy (always run: the baseline),
matmul, elementwise, fuse, rows, launch, littlebit; all by default.

Times are device time from CUDA events: warm-up first, then the median of
15 samples, each over several runs queued back to back behind an untimed
matrix product, so the GPU never waits for the host. Inputs are random
normals, never zeros. The table is printed last (and written to RESULTS.md
when given).
]]
local dm = require "dormouse"
local cuda = dm.cuda or require "dormouse.cuda"
local core = dm.core

local available, why = cuda.is_available()
if not available then
  print("GPU benchmarks skipped: no CUDA device (" .. tostring(why) .. ")")
  return
end

local fuse = dm.fuse or require "dormouse.fuse"
local graph = cuda.graph or require "dormouse.graph"

local REPS, INNER = 15, 5
local spacer = dm.randn({4096, 4096}, {dtype = "bf16", device = "cuda", seed = 99})

local want = {}
for name in (arg and arg[2] or "matmul,elementwise,fuse,rows,launch,littlebit"):gmatch("[^,]+") do want[name] = true end

-- ms of device time per call of fn
local function device_ms(fn, inner)
  inner = inner or INNER
  for _ = 1, 3 do fn() end
  cuda.synchronize()
  local ms = {}
  for r = 1, REPS do
    dm.matmul(spacer, spacer):free()         -- ~0.2 ms of queued work ahead of the timed runs
    core.cuda_timer_start()
    for _ = 1, inner do fn() end
    ms[r] = core.cuda_timer_stop() / inner
  end
  table.sort(ms)
  return ms[(REPS + 1) // 2]
end

-- the same, from replays of a CUDA graph of `inner` calls of fn queued back to back
local function graph_ms(fn, inner)
  inner = inner or INNER
  fn()                                           -- compiled kernels, plans: before the capture
  local g = graph(function() for _ = 1, inner do fn() end end)
  local ms = device_ms(function() g:replay() end, 1)
  g:free()
  return ms / inner
end

local rows = {}
local function row(name, value, unit, baseline, ratio, target)
  rows[#rows + 1] = {name, value, unit, baseline or "", ratio, target}
  print(string.format("%-40s %10.1f %-7s %s", name, value, unit, ratio and string.format("%.1f%%", ratio * 100) or ""))
end

local function randn(shape, seed) return dm.randn(shape, {dtype = "bf16", device = "cuda", seed = seed}) end

local info = cuda.info()
print(string.format("device: %s, sm_%d%d, %d SMs, %.0f GiB; CUDA runtime %d, driver %d", info.name, info.major,
                    info.minor, info.sm_count, info.total_memory / 2^30, info.runtime_version, info.driver_version))

-- ---- the ceilings: copy bandwidth and cuBLASLt ------------------------------------------------

local N = 256 * 1024 * 1024
local copy_src, copy_dst = randn({N}, 1), dm.empty({N}, {dtype = "bf16", device = "cuda"})
local copy_ms = device_ms(function() copy_dst:copy_(copy_src) end)
local copy_bw = 2 * N * 2 / (copy_ms * 1e-3) / 1e9            -- GB/s, read + written
row("copy 512 MiB (dm copy_, D2D)", copy_bw, "GB/s")
local raw_bw = 2 * N * 2 / (core.cuda_bench_copy(N * 2, REPS) * 1e-3) / 1e9
row("copy 512 MiB (cudaMemcpyAsync)", raw_bw, "GB/s")
copy_src:free(); copy_dst:free()
local bw = math.max(copy_bw, raw_bw)

if want.matmul then
local M = 8192
local flop = 2 * M * M * M
local lt_ms = core.cuda_bench_gemm("bf16", M, M, M, REPS)
local lt_tf = flop / (lt_ms * 1e-3) / 1e12
row("matmul bf16 8192^3 (cuBLASLt direct)", lt_tf, "TFLOP/s")
local classic_tf = flop / (core.cuda_bench_gemm("bf16", M, M, M, REPS, true) * 1e-3) / 1e12
row("matmul bf16 8192^3 (cublasGemmEx)", classic_tf, "TFLOP/s")
do
  local a, b = randn({M, M}, 2), randn({M, M}, 3)
  local ms = device_ms(function() dm.matmul(a, b):free() end)
  local tf = flop / (ms * 1e-3) / 1e12
  row("matmul bf16 8192^3 (dm.matmul)", tf, "TFLOP/s", string.format("%.0f TFLOP/s", lt_tf), tf / lt_tf, 0.95)
  a:free(); b:free()
end
end

-- ---- elementwise: GB/s over the bytes the kernels read and write ------------------------------

if want.elementwise then
  local a, b, c = randn({N}, 4), randn({N}, 5), randn({N}, 6)
  local ms = device_ms(function() (a * b):free() end)
  local gbs = 3 * N * 2 / (ms * 1e-3) / 1e9
  row("a * b, 256M bf16", gbs, "GB/s", string.format("%.0f GB/s", bw), gbs / bw, 0.80)
  ms = device_ms(function()
    local t = a * b
    local o = t + c
    t:free(); o:free()
  end)
  gbs = 6 * N * 2 / (ms * 1e-3) / 1e9                       -- two kernels, 3 operands each
  row("a * b + c, 256M bf16 (2 kernels)", gbs, "GB/s", string.format("%.0f GB/s", bw), gbs / bw, 0.80)
  local ideal = 4 * N * 2 / (ms * 1e-3) / 1e9                -- a, b, c read once, out written once
  row("a * b + c, counting 4 passes (fused ideal)", ideal, "GB/s", string.format("%.0f GB/s", bw), ideal / bw)
  a:free(); b:free(); c:free()
end

-- ---- dm.fuse: one kernel for a 4-op expression ---------------------------------------------------

if want.fuse then
  local a, b, c = randn({N}, 4), randn({N}, 5), randn({N}, 6)
  local f = fuse("silu(a) * b + 0.5 * c")
  f(a, b, c):free()                                          -- compiled (or loaded from the cache)
  local ms = device_ms(function() f(a, b, c):free() end)
  local gbs = 4 * N * 2 / (ms * 1e-3) / 1e9                  -- a, b, c read, out written
  row("dm.fuse silu(a) * b + 0.5 * c, 256M bf16", gbs, "GB/s", string.format("%.0f GB/s", bw), gbs / bw, 0.80)
  local composed = device_ms(function()
    local s, t, u = a:silu(), nil, c * 0.5
    t = s * b
    local o = t + u
    s:free(); t:free(); u:free(); o:free()
  end)
  row("the same as 4 ops (same bytes counted)", 4 * N * 2 / (composed * 1e-3) / 1e9, "GB/s",
      string.format("%.0f GB/s", bw), 4 * N * 2 / (composed * 1e-3) / 1e9 / bw)
  a:free(); b:free(); c:free()
end

-- ---- softmax and logsumexp over rows -------------------------------------------------------------

for _, shape in ipairs(want.rows and {{32768, 256}, {8192, 8192}} or {}) do
  local n = shape[1] * shape[2]
  local label = string.format("[%d, %d]", shape[1], shape[2])
  for _, dt in ipairs {"bf16", "f32"} do
    local x = dm.randn(shape, {dtype = dt, device = "cuda", seed = 7}) * 3
    local es = dt == "bf16" and 2 or 4
    -- the copy of the same bytes, for scale: a short kernel does not reach the long copy's rate
    local xc = dm.empty(shape, {dtype = dt, device = "cuda"})
    local cms = device_ms(function() xc:copy_(x) end, 20)
    local cgbs = 2 * n * es / (cms * 1e-3) / 1e9
    row(string.format("copy %s %s (same bytes)", label, dt), cgbs, "GB/s", string.format("%.0f GB/s", bw), cgbs / bw)
    cms = graph_ms(function() xc:copy_(x) end, 20)
    cgbs = 2 * n * es / (cms * 1e-3) / 1e9
    row(string.format("copy %s %s (same bytes, graph)", label, dt), cgbs, "GB/s", string.format("%.0f GB/s", bw),
        cgbs / bw)
    xc:free()
    local function softmax() x:softmax():free() end
    local function lse() x:logsumexp(2):free() end
    for _, timing in ipairs {{"", device_ms}, {", graph", graph_ms}} do
      local eager = timing[1] == ""
      local ms = timing[2](softmax, 20)
      local gbs = 2 * n * es / (ms * 1e-3) / 1e9
      row(string.format("softmax %s %s%s", label, dt, timing[1]), gbs, "GB/s", string.format("%.0f GB/s", bw),
          gbs / bw, not eager and 0.70 or nil)
      ms = timing[2](lse, 20)
      gbs = (n + shape[1]) * es / (ms * 1e-3) / 1e9
      row(string.format("logsumexp %s %s%s", label, dt, timing[1]), gbs, "GB/s", string.format("%.0f GB/s", bw),
          gbs / bw, not eager and 0.70 or nil)
    end
    x:free()
  end
end

-- ---- LittleBit's factor at b1's banks ------------------------------------------------------------

for _, shape in ipairs(want.littlebit and {{1024, 2048, 64}, {1024, 64, 5461}} or {}) do
  local E, m, n = shape[1], shape[2], shape[3]
  local count = E * m * n
  local label = table.concat(shape, "x")
  local x, g = randn(shape, 8), randn(shape, 9)
  local r, c = randn({E, m, 1}, 10), randn({E, 1, n}, 11)
  local ms = device_ms(function() dm.littlebit(x, r, c):free() end, 3)
  local gbs = 2 * count * 2 / (ms * 1e-3) / 1e9                   -- x read, w written
  row(string.format("littlebit %s bf16 forward", label), gbs, "GB/s", string.format("%.0f GB/s", bw), gbs / bw, 0.70)
  x:requires_grad(true); r:requires_grad(true); c:requires_grad(true)
  local both = device_ms(function()
    local w = dm.littlebit(x, r, c)
    w:backward(g)
    w:free(); x.grad, r.grad, c.grad = nil, nil, nil
  end, 3)
  -- forward 4 bytes an element; backward: g, x read and gx written by rows, g, x read again by columns
  gbs = 14 * count / (both * 1e-3) / 1e9
  row(string.format("littlebit %s bf16 forward + backward (%.2f ms)", label, both), gbs, "GB/s",
      string.format("%.0f GB/s", bw), gbs / bw, 0.70)
  x:free(); g:free(); r:free(); c:free()
end

-- ---- the host's cost of one op ------------------------------------------------------------------

if want.launch then
  local x, y = dm.ones({1}, {device = "cuda"}), dm.ones({1}, {device = "cuda"})
  for _ = 1, 1000 do (x + y):free() end
  cuda.synchronize()
  local n = 20000
  local t0 = core.now()
  for _ = 1, n do (x + y):free() end
  local queued = core.now() - t0
  cuda.synchronize()
  local total = core.now() - t0
  row("launch: x + y from Lua, host time", queued / n * 1e6, "us/op")
  row("launch: x + y from Lua, until done", total / n * 1e6, "us/op")

  -- 200 ops on 1024 elements (100 x (t * 1.0001, t + x)), until done: eager, then one graph replay
  local z = dm.randn({1024}, {device = "cuda", seed = 98})
  local function sequence()
    local t = z
    for _ = 1, 100 do
      local u = t * 1.0001
      if t ~= z then t:free() end
      t = u + z
      u:free()
    end
    return t
  end
  sequence():free()
  local reps = 200
  cuda.synchronize()
  t0 = core.now()
  for _ = 1, reps do sequence():free() end
  cuda.synchronize()
  local eager_us = (core.now() - t0) / (reps * 200) * 1e6
  local g = graph(sequence)
  g:replay()
  cuda.synchronize()
  t0 = core.now()
  for _ = 1, reps do g:replay() end
  cuda.synchronize()
  local graph_us = (core.now() - t0) / (reps * 200) * 1e6
  row(string.format("200-op sequence, eager (%d nodes when captured)", g:nodes()), eager_us, "us/op")
  row("200-op sequence, graph replay (ratio: of eager)", graph_us, "us/op", string.format("%.2f us/op", eager_us),
      graph_us / eager_us)
  g:free()
end

-- ---- the table ------------------------------------------------------------------------------------

local out = {"| benchmark | measured | baseline | ratio | target |", "|---|---|---|---|---|"}
for _, r in ipairs(rows) do
  local ratio = r[5] and string.format("%.1f%%", r[5] * 100) or ""
  local target = r[6] and string.format(">= %d%% %s", math.floor(r[6] * 100 + 0.5), r[5] >= r[6] and "ok" or "MISS") or ""
  out[#out + 1] = string.format("| %s | %.1f %s | %s | %s | %s |", r[1], r[2], r[3], r[4], ratio, target)
end
local text = table.concat(out, "\n")
print("\n" .. text)
if arg and arg[1] then
  local f = assert(io.open(arg[1], "w"))
  f:write(string.format("device: %s (sm_%d%d, %d SMs)\n\n", info.name, info.major, info.minor, info.sm_count), text, "\n")
  f:close()
end
