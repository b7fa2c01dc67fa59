-- The model's building blocks at b1's shapes on the GPU, forward and
-- backward apart (dm.profile's device times), in f32 as the model runs them:
--   dormouse run tests/gpu/bench_blocks.lua
local dm = require "dormouse"
local dev = os.getenv("DM_DEVICE") or "cuda"          -- DM_DEVICE=cpu: a smoke test at small shapes
local B, T, d = 8, 1024, 2048
if dev == "cpu" then B, T, d = 2, 64, 32 end
local function sync() if dev == "cuda" then dm.cuda.synchronize() end end

local function profile(name, steps, fn)
  fn()
  sync()
  dm.profile.start()
  for _ = 1, steps do fn() end
  local rows = dm.profile.stop()
  for _, r in ipairs(rows) do
    print(string.format("%-22s %-16s %-9s %9.3f ms/call", name, r.name, r.phase, r.ms / r.calls))
  end
end

local function leaf(shape, std)
  return (dm.randn(shape, {device = dev}) * (std or 1)):detach():requires_grad(true)
end

local x = leaf({B, T, d})
local gain = leaf({d})
profile("rmsnorm f32", 5, function()
  local y = dm.rmsnorm(x, gain, {eps = 1e-6});
  (y * y):sum():backward()
  x.grad, gain.grad = nil, nil
end)

local w = leaf({d, 4}, 0.1)
for _, dil in ipairs({1, 5}) do
  profile("conv f32 dil " .. dil, 5, function()
    local y = dm.causal_conv1d(x, w, {dilation = dil});
    (y * y):sum():backward()
    x.grad, w.grad = nil, nil
  end)
end

local W = leaf({d, d}, d ^ -0.5)
profile("linear bf16 (casts)", 5, function()
  local y = dm.linear(x:to("bf16"), W:to("bf16")):to("f32");
  (y * y):sum():backward()
  x.grad, W.grad = nil, nil
end)
