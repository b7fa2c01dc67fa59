--[[
`dormouse run EXPERIMENT.lua [--set k=v ...] [--resume runs/NAME | --init runs/NAME] [--overwrite]`:
an experiment file returns a config table; this resolves it, trains, and
ends with the held-out BPB beside the n-gram baselines, a sample and the
report's path.
]]
local config = require "dormouse.config"

local experiment = {}

local FLAGS = {resume = "DIR", init = "RUN", overwrite = true, quiet = true, sample = "N", stress = true, ["stress-lr"] = "K",
               ["stress-steps"] = "N"}

-- --stress: the experiment's stability smoke (dormouse.stress) instead of the run; exit 1 when it fails
local function stress_run(file, raw, args, cli)
  local f = args.flags
  local k = tonumber(f["stress-lr"] or 2)
  if not k or k <= 0 or k == math.huge then
    error(string.format("--stress-lr must be a positive number, got %s", tostring(f["stress-lr"])), 0)
  end
  local steps = math.tointeger(tonumber(f["stress-steps"] or 50))
  if not steps or steps < 2 then
    error(string.format("--stress-steps must be an integer >= 2, got %s", tostring(f["stress-steps"])), 0)
  end
  if f.resume then error("--stress runs the experiment from its start: not with --resume", 0) end
  local stress = require "dormouse.stress"
  local cfg = stress.config(raw, file, args.overrides, k, steps)
  io.stderr:write(string.format("stress: %d guarded steps of %s at %gx its learning rates (nothing is written)\n",
                                steps, cfg.name, k))
  local res = stress.run(cfg, k, {root = cli.root})
  if not res.passed then error(res.line, 0) end
  print(res.line)
  return {stress = res}
end

-- --sample N: checked before the run starts, not after it has trained
local function sample_length(text)
  if text == nil then return 200 end
  local n = math.tointeger(tonumber(text))
  if not n or n < 0 then error(string.format("--sample must be an integer >= 0 (bytes; 0: none), got %s", text), 0) end
  return n
end

-- the run a --resume path names: PARENT/NAME (or PARENT/NAME/ckpt-STEP) -> NAME, PARENT (the folder
-- of run folders it lies in: "." for a bare NAME)
local function resumed_name(path)
  path = path:gsub("/+$", "")
  path = path:gsub("/ckpt%-%d+$", "")
  local parent, name = path:match("^(.*)/([^/]+)$")
  if not name then return path, "." end
  return name, parent == "" and "/" or parent
end

function experiment.run(file, raw, argv, cli)
  for i = 3, #argv do
    if argv[i] == "--help" or argv[i] == "-h" then cli.show_help("run") return end
  end
  local args = config.parse_args(argv, 2, FLAGS)
  if args.flags.stress then return stress_run(file, raw, args, cli) end
  if args.flags["stress-lr"] or args.flags["stress-steps"] then error("--stress-lr and --stress-steps go with --stress", 0) end
  local n = sample_length(args.flags.sample)
  if args.flags.init then                        -- --init RUN is --set init=RUN
    if args.flags.resume then error("--init starts a new run from a checkpoint's weights: not with --resume", 0) end
    args.overrides[#args.overrides + 1] = "init=" .. string.format("%q", args.flags.init)
  end
  local cfg, info = config.resolve(raw, file, args.overrides)
  -- a resume takes the run's name from its folder, and writes where it reads, unless --set name= says
  -- otherwise (the file's name, or its base name, names new runs, in runs/)
  local resume = args.flags.resume and (args.flags.resume:gsub("(.)/+$", "%1"))
  local runs
  if resume and not info.overridden.name then cfg.name, runs = resumed_name(resume) end
  local train = require "dormouse.train"
  local dist = require("dormouse.dist").init()     -- under mpirun: this process's rank of the job
  local summary = train.run(cfg, {resume = resume, overwrite = args.flags.overwrite,
                                  quiet = args.flags.quiet or dist.rank > 0, root = cli.root, runs = runs,
                                  follower = dist.rank > 0})
  if dist.rank > 0 then dist.finalize() return summary end     -- rank 0 says how it went
  local lines = {string.format("done: %s, step %d", summary.dir, summary.step)}
  if summary.bpb_fin then
    local parts = {string.format("held-out bpb_fin %.4f", summary.bpb_fin)}
    for _, b in ipairs(summary.baselines) do
      parts[#parts + 1] = string.format("order-%d n-gram %.4f (%s)", b.order, b.bpb,
                                        summary.bpb_fin < b.bpb and "beaten" or "not beaten")
    end
    lines[#lines + 1] = table.concat(parts, ", ")
  end
  -- the closing lines go to stdout and, as every line the run printed, to its log.txt
  local said = {}
  local function say(s) io.write(s); said[#said + 1] = s end
  say(table.concat(lines, "\n") .. "\n")
  if n > 0 then
    -- what is not printable UTF-8 as \xNN, as dormouse sample and the REPL show it (no BEL, no escapes)
    local put, finish = require("dormouse.human").byte_printer(say)
    if summary.sample_prompt ~= "In the beginning" then        -- a record's prompt (records) is shown first
      say("sample after the prompt \"")
      for i = 1, #summary.sample_prompt do put(summary.sample_prompt:sub(i, i)) end
      finish()
      say("\": ")
    else
      say("sample: ")
    end
    local ok, err = pcall(require("dormouse.eval").sample, summary.model, summary.sample_prompt, n, {
      temperature = 0.8, device = summary.device, seed = cfg.seed,
      on_byte = function(b) put(b); io.stdout:flush() end})
    finish()
    say("\n")
    -- the run is done and saved: a sample that fails is said, and the run still succeeds
    if not ok then io.stderr:write("sample: failed: ", tostring(err), "\n") end
  end
  say("report: " .. summary.dir .. "/report.html\n")
  local log = io.open(summary.dir .. "/log.txt", "a")
  if log then log:write(table.concat(said)); log:close() end
  dist.finalize()
  return summary
end

return experiment
