--[[
dm.cuda — the CUDA device.

  local cuda = require "dormouse.cuda"      -- dm.cuda once init.lua loads it
  if cuda.is_available() then
    local x = dm.randn({1024, 1024}, {device = "cuda", dtype = "bf16"})
    print(cuda.device_name(), cuda.memory().reserved)
  end

Launches are queued on one stream and the host does not wait for them,
except where it must read device memory (x:cpu(), x:item(), print(x)) or
when asked: cuda.synchronize(). An index out of range found on the device is
raised at the next of those points (run with DM_DEBUG=1 to have it raised
at the op itself).
]]
local core = require "dormouse.core"

local cuda = {}

-- true, or false and the reason (no device, no driver, a build without CUDA)
function cuda.is_available() return core.cuda_is_available() end

-- {name, major, minor, sm_count, total_memory, runtime_version, driver_version}
function cuda.info() return core.cuda_info() end
function cuda.device_name() return core.cuda_info().name end

-- wait for every queued launch; raises an error the device found meanwhile
function cuda.synchronize() core.cuda_synchronize() end

-- give cached device memory with nothing in use back to the driver
function cuda.empty_cache() core.cuda_empty_cache() end

-- allocated, peak, count, reserved (held from the driver), device_allocs (cudaMalloc calls)
function cuda.memory() return core.memory("cuda") end
function cuda.reset_peak() core.reset_peak("cuda") end

-- cuda.tf32(true): f32 matrix products on TF32 tensor cores (about 1e-3 relative
-- error instead of 1e-6); cuda.tf32() tells the current setting
function cuda.tf32(on)
  if on ~= nil and type(on) ~= "boolean" then
    error("dm.cuda.tf32: expected a boolean, got " .. type(on), 2)
  end
  return core.cuda_tf32(on)
end

-- Milliseconds of device time taken by fn(), measured with CUDA events:
-- `warmup` untimed calls, then the median of `reps` timed ones (each waits
-- for the device at its end). opts: {warmup = 3, reps = 20}.
function cuda.time(fn, opts)
  opts = opts or {}
  local warmup, reps = opts.warmup or 3, opts.reps or 20
  for _ = 1, warmup do fn() end
  local ms = {}
  for i = 1, reps do
    core.cuda_timer_start()
    fn()
    ms[i] = core.cuda_timer_stop()
  end
  table.sort(ms)
  return ms[(reps + 1) // 2], ms
end

return cuda
