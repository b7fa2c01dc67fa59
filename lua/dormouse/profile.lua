--[[
dm.profile — where the time goes, by op and op family (vm/core/profile.h).

  dm.profile.start()
  ... forward, backward, opt:step ...
  local rows = dm.profile.stop()        -- {{name, family, phase, ms, calls}, ...}
  print(dm.profile.table(rows, step_ms))

Every outermost op is timed on its device (CUDA events: device time, the
host never waits), its forward and its backward apart; the optimiser's
kernels are timed as regions of family "optim". Times are summed over the
calls made between start and stop.
]]
local core = require "dormouse.core"

local profile = {}

function profile.start() core.profile_start() end

-- Stop timing and return the rows, slowest first.
function profile.stop()
  core.profile_stop()
  local rows = core.profile_read()
  table.sort(rows, function(a, b) return a.ms > b.ms end)
  return rows
end

function profile.on() return core.profile_on and core.profile_on() end

-- Time fn() as a region named `name` of `family` on `device` (nested calls count towards it).
function profile.region(name, family, device, fn, ...)
  core.profile_push(name, family, device)
  local ok, a, b, c, d = pcall(fn, ...)
  core.profile_pop()
  if not ok then error(a, 0) end
  return a, b, c, d
end

-- The rows summed by key(row) → {{key, ms, calls}, ...}, slowest first.
function profile.group(rows, key)
  local by, list = {}, {}
  for _, r in ipairs(rows) do
    local k = key(r)
    local g = by[k]
    if not g then g = {key = k, ms = 0, calls = 0}; by[k] = g; list[#list + 1] = g end
    g.ms = g.ms + r.ms
    g.calls = g.calls + r.calls
  end
  table.sort(list, function(a, b) return a.ms > b.ms end)
  return list
end

--[[ A printable table of the families' shares of `total_ms` (the measured
step; the remainder is time no op was running: launch gaps, the host, the
loader), and the `top` slowest ops with their phase. `steps` divides every
figure (rows summed over several steps). ]]
function profile.table(rows, total_ms, opts)
  opts = opts or {}
  local steps, top = opts.steps or 1, opts.top or 12
  local out = {}
  local function line(fmt, ...) out[#out + 1] = string.format(fmt, ...) end
  local fam = profile.group(rows, function(r) return r.family end)
  local sum = 0
  for _, g in ipairs(fam) do sum = sum + g.ms end
  total_ms = total_ms and total_ms * steps or sum
  line("%-22s %10s %7s %8s", "op family", "ms/step", "share", "calls")
  for _, g in ipairs(fam) do
    line("%-22s %10.2f %6.1f%% %8d", g.key, g.ms / steps, 100 * g.ms / total_ms, g.calls // steps)
  end
  if total_ms > sum then
    line("%-22s %10.2f %6.1f%%", "(no op running)", (total_ms - sum) / steps, 100 * (total_ms - sum) / total_ms)
  end
  line("%-22s %10.2f", "step", total_ms / steps)
  if total_ms > sum then
    line("(no op running: the step's time between ops, the Lua that drives them, the tape's bookkeeping, " ..
         "allocation and the data's copy)")
  end
  line("")
  line("%-30s %-9s %10s %7s %8s", "slowest ops", "phase", "ms/step", "share", "calls")
  for i = 1, math.min(top, #rows) do
    local r = rows[i]
    line("%-30s %-9s %10.2f %6.1f%% %8d", r.name, r.phase, r.ms / steps, 100 * r.ms / total_ms, r.calls // steps)
  end
  return table.concat(out, "\n")
end

return profile
