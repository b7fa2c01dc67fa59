--[[
Pre-flight: before a run's folder is made, what it will need of the disk (the checkpoints it
keeps) and of host memory (the tensors that live there), against what the machine has. A run
that cannot fit is refused with both numbers; nothing is written.

  disk   a checkpoint's bytes (the parameters and buffers as saved, the optimiser state) times
         the checkpoints on disk at once (checkpoint.keep of them, and the one being written before
         the oldest goes), less those already there, against the free space where runs/ is.
  host   on a CUDA run the tensors kept in host memory (model.engram.ram's tables and their
         moments); on a CPU run the parameters, buffers and optimiser state; against MemAvailable.
]]
local core = require "dormouse.core"
local dm = require "dormouse"

local preflight = {}

local size = require("dormouse.human").bytes

local function bytes_of(tensors, keep)
  local n = 0
  for _, t in pairs(tensors) do
    if dm.is_tensor(t) and (not keep or keep(t)) then n = n + t:numel() * core.dtype_size(t.dtype) end
  end
  return n
end

-- the number of checkpoints a run from `step` writes: every checkpoint.every steps and the last
local function checkpoints_written(cfg, step)
  local left = cfg.steps - step
  if left <= 0 then return 0 end
  local every = cfg.checkpoint.every
  local n = every > 0 and (cfg.steps // every - step // every) or 0
  if every == 0 or cfg.steps % every ~= 0 then n = n + 1 end
  return n
end

--[[ The bytes the run needs on disk and in host memory, and what the machine has.
state: the model's named tensors; optim: the optimiser's state table; existing: the checkpoints
of the run folder already on disk (a resume's). ]]
function preflight.needs(cfg, device, state, optim, step, existing)
  local ckpt = bytes_of(state) + bytes_of(optim)
  local written = checkpoints_written(cfg, step)
  local keep = cfg.checkpoint.keep
  local at_once = keep > 0 and math.min(keep + 1, written + existing) or written + existing
  local host = device == "cpu" and ckpt or
               bytes_of(state, function(t) return t.device == "cpu" end) +
               bytes_of(optim, function(t) return t.device == "cpu" end)
  return {ckpt = ckpt, disk = math.max(0, at_once - existing) * ckpt, at_once = at_once, host = host}
end

-- nil when the run fits, else the refusal (both numbers named)
function preflight.refusal(need, runs_dir, free_disk, free_host)
  if free_disk and need.disk > free_disk then
    return string.format("pre-flight: the run's checkpoints need about %s more in %s (%d of %s each on " ..
                         "disk at once; checkpoint.keep sets how many), and its filesystem has %s free: free " ..
                         "some space, lower checkpoint.keep or checkpoint.every, or run elsewhere",
                         size(need.disk), runs_dir, need.at_once, size(need.ckpt), size(free_disk))
  end
  if free_host and need.host > free_host then
    return string.format("pre-flight: the run keeps %s of tensors in host memory and %s is available " ..
                         "(MemAvailable): a smaller model, the tables on the device (model.engram.ram = false) or " ..
                         "a machine with more memory", size(need.host), size(free_host))
  end
end

-- The run's check: raises the refusal, or returns the needs
function preflight.check(cfg, device, state, optim, step, run_dir)
  local parent = run_dir:match("^(.*)/[^/]+$") or "."
  local there = parent                          -- runs/ may not be made yet: the folder it will be in
  while core.file_kind(there) == "missing" and there:find("/") do there = there:match("^(.*)/[^/]*$") end
  if core.file_kind(there) == "missing" then there = "." end
  local existing = #require("dormouse.ckpt").list(run_dir)
  local need = preflight.needs(cfg, device, state, optim, step, existing)
  local why = preflight.refusal(need, parent, core.disk_free(there ~= "" and there or "/"), core.memory_available())
  if why then error(why, 0) end
  return need
end

return preflight
