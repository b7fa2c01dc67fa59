--[[
dormouse plan EXPERIMENT [--memory SIZE] [--set KEY=VALUE ...] [--json FILE]

Predicts the peak device memory of one training step of an experiment at its
batch x seq without running it (dormouse/plan.lua: the step runs on the meta
device, with every byte counted), prints what is live at the peak by
category, and with --memory (16GiB, 16000MiB, 12.5GB; default none) the largest
batch x seq that fits. --json FILE writes the same as one JSON object, in bytes (as bench's
--json: - for standard output alone; a link's target, a FIFO or device written
through).
example: dormouse plan experiments/b1.lua --memory 16GiB
]]
local config = require "dormouse.config"
local plan = require "dormouse.plan"
local json = require "dormouse.json"

local usage = "usage: dormouse plan EXPERIMENT.lua [--memory SIZE] [--set KEY=VALUE ...] [--json FILE]"

local function fail(msg, code)
  io.stderr:write(msg, "\n")
  return code
end

local function run(argv)
  local ok, args = pcall(config.parse_args, argv, 2, {memory = "SIZE", json = "FILE", help = true})
  if not ok then return fail("dormouse plan: " .. args .. "\n" .. usage, 2) end
  if args.flags.help then io.write(require("dormouse.cli").help_text("plan", usage), "\n"); return 0 end
  if not args.file then return fail("dormouse plan: which experiment? " .. usage, 2) end
  local memory
  if args.flags.memory then
    ok, memory = pcall(plan.parse_memory, args.flags.memory)
    if not ok then return fail("dormouse plan: --memory: " .. memory .. "\n" .. usage, 2) end
  end
  local cfg
  ok, cfg = pcall(config.load, args.file, args.overrides)
  if not ok then return fail(cfg, 1) end
  local r
  ok, r = pcall(plan.report, cfg, {memory = memory})
  if not ok then return fail("dormouse plan: " .. tostring(r), 1) end
  local why = r.memory and not r.proposal and plan.nothing_fits(r)
  if args.flags.json then
    local out = plan.plain(r)
    out.error = why or nil
    require("dormouse.core").write_output(args.flags.json, json.encode(out) .. "\n")
    if args.flags.json ~= "-" then io.write(plan.format(r), "\n") end
  else
    io.write(plan.format(r), "\n")
  end
  if why then return fail("dormouse plan: " .. why, 1) end
  return 0
end

return {
  summary = "a training step's peak device memory, predicted; the batch x seq that fits",
  args = "FILE [--memory 16GiB]",
  run = run,
}
