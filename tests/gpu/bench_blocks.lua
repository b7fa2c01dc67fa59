-- The model's building blocks at b1's shapes on the GPU, forward and
-- backward apart (dm.profile's device times), in bf16 as the model's branches run
-- them (DM_DTYPE=f32 for the residual stream's dtype):
--   dormouse run tests/gpu/bench_blocks.lua
local dm = require "dormouse"
local dev = os.getenv("DM_DEVICE") or "cuda"          -- DM_DEVICE=cpu: a smoke test at small shapes
local B, T, d, H, dh = 8, 1024, 2048, 32, 64
if dev == "cpu" then B, T, d, H, dh = 2, 64, 32, 2, 16 end
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

local dtype = os.getenv("DM_DTYPE") or "bf16"
local function leaf(shape, std)
  return (dm.randn(shape, {device = dev}) * (std or 1)):to(dtype):detach():requires_grad(true)
end

local x = leaf({B, T, d})
local gain = leaf({d})
profile("rmsnorm " .. dtype, 5, function()
  local y = dm.rmsnorm(x, gain, {eps = 1e-6});
  (y * y):sum():backward()
  x.grad, gain.grad = nil, nil
end)

local w = leaf({d, 4}, 0.1)
for _, dil in ipairs({1, 5}) do
  profile("conv " .. dtype .. " dil " .. dil, 5, function()
    local y = dm.causal_conv1d(x, w, {dilation = dil});
    (y * y):sum():backward()
    x.grad, w.grad = nil, nil
  end)
  profile("conv+silu " .. dtype .. " dil " .. dil, 5, function()
    local y = dm.causal_conv1d(x, w, {dilation = dil, silu = true});
    (y * y):sum():backward()
    x.grad, w.grad = nil, nil
  end)
end

local f = leaf({B, T, H, dh})
local A_log = dm.randn({H}, {device = dev}):requires_grad(true)
local dt_bias = dm.randn({H * dh}, {device = dev}):requires_grad(true)
profile("kda_gate " .. dtype, 5, function()
  local g = dm.kda_gate(f, A_log, dt_bias);
  (g * g):sum():backward()
  f.grad, A_log.grad, dt_bias.grad = nil, nil, nil
end)

local W = leaf({d, d}, d ^ -0.5)
profile("linear " .. dtype, 5, function()
  local y = dm.linear(x, W);
  (y * y):sum():backward()
  x.grad, W.grad = nil, nil
end)
