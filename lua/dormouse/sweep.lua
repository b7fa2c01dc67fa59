--[[
Seed sweeps: every (arm, seed) of an experiment, trained on the same data
and evaluated on the same held-out windows, then a verdict table.

  dm.sweep {
    base  = "experiments/small.lua",
    arms  = {control = {}, lfb = {["model.moe.lfb_gamma"] = 0}},
    seeds = {1, 2, 3},
    set   = {steps = 500},                 -- overrides for every arm (optional)
  }

Optional: control (the name of the control arm, "control"), name (of the
sweep: its file's base name, else the base file's), runs (the runs folder), quiet (no output),
cli_set (a list of "KEY=VALUE" strings, as --set gives them: they apply to
every arm over `set`; an arm's own keys still win), jobs (runs at once, 1:
with more, each run is a process of its own, `dormouse sweep FILE --run
ARM:SEED`, its output in runs/sweep-NAME/ARM-sSEED.log; several small runs
share one GPU well), file (the sweep's file, which those processes read),
select ("a,b": those arms only, besides the control; --arms), overwrite
(--overwrite: every run afresh).

A sweep run again goes on where it stopped: a run whose folder holds its
last checkpoint and whose result file is there is read, not trained; one
stopped before its end resumes from its newest checkpoint. A run folder that
holds a run of another config is refused before anything trains, naming the
keys, unless overwrite is set.

Each run's result goes to runs/sweep-NAME/ARM-sSEED.json: its final
bpb_fin, its last log window's training loss in bits a byte (train_bpb: a
held-out figure far above it says the run memorises), its tokens/s (the median log window but the first), its peak
device memory and the last eval's measures (an arm's own: draft_accept). With jobs > 1 the runs share the device, so their tokens/s
is each run's share of it, comparable only between runs that overlapped
alike; `dormouse bench` measures one arm alone.

When the runs are shorter than the base's warm-up and decay allow (a short
sweep of a long preset) and schedule.warmup is set nowhere, the warm-up is
cut to a tenth of the steps, and a line says so.

`dormouse sweep FILE [--set KEY=VALUE ...]` runs a file that returns such a
table (experiments/sweep_seeds.lua).

An arm beats the control only when its mean final bpb_fin is lower by more
than both spreads (the sample standard deviation over seeds of each); with
one seed there is no spread and the verdict says so. When the runs route
experts, the table also gives the busiest expert's share and the dead
experts of each arm's last log window, and the largest of each over the log
windows past the warm-up (max busy, max dead: means over seeds of each run's
largest; a dash when a seed's result file, from before these figures, lacks
them). The table goes to stdout and to runs/sweep-NAME/verdict.txt and
verdict.json.
]]
local config = require "dormouse.config"
local json = require "dormouse.json"

local sweep = {}

local function stats(values)
  local n, sum = #values, 0
  for _, v in ipairs(values) do sum = sum + v end
  local mean = sum / n
  local ss = 0
  for _, v in ipairs(values) do ss = ss + (v - mean) ^ 2 end
  return mean, n > 1 and math.sqrt(ss / (n - 1)) or 0
end

local function sorted_arms(arms, control)
  local names = {}
  for name in pairs(arms) do if name ~= control then names[#names + 1] = name end end
  table.sort(names)
  table.insert(names, 1, control)
  return names
end

-- The overrides of one run: the sweep's set, then the command line's --set, then the arm's own keys.
-- Each key is given once: the command line's take the set's place, the arm's the command line's.
local function overrides_of(spec, arm, seed, name)
  local cli = {}
  for _, s in ipairs(spec.cli_set or {}) do cli[(config.split_set(s))] = s end
  local o = {}
  for k, v in pairs(spec.set or {}) do if not cli[k] then o[k] = v end end
  for k, s in pairs(cli) do if arm[k] == nil then o[#o + 1] = s end end
  for k, v in pairs(arm) do o[k] = v end
  o.seed, o.name = seed, name
  return o
end

-- A warm-up the runs can hold: the base's warm-up plus its decay must fit the sweep's steps.
local function short_schedule(spec, say)
  local probe = overrides_of(spec, {}, 1, "sweep-probe")
  if probe["schedule.warmup"] ~= nil then return end
  for _, s in ipairs(probe) do if config.split_set(s) == "schedule.warmup" then return end end
  probe["schedule.warmup"] = 1                   -- the steps as the runs will have them, the check aside
  local ok, cfg = pcall(config.load, spec.base, probe)
  if not ok then return end                      -- the runs themselves will say what is wrong
  local warmup = config.load(spec.base).schedule.warmup
  local decay = cfg.schedule.kind == "wsd" and math.ceil(cfg.schedule.decay * cfg.steps) or 0
  if warmup + decay <= cfg.steps then return end
  local short = math.max(1, cfg.steps // 10)
  spec.set = spec.set or {}
  spec.set["schedule.warmup"] = short
  say(string.format("sweep: schedule.warmup %d -> %d for runs of %d steps (the base's warm-up does not fit; " ..
                    "--set schedule.warmup=N to choose)", warmup, short, cfg.steps))
end

-- The resolved config of every (arm, seed): cfgs[arm][i] for spec.seeds[i]. A key an arm gets
-- wrong is an error naming the arm before any run trains.
function sweep.configs(spec, names, base_name)
  local cfgs = {}
  for _, arm in ipairs(names) do
    cfgs[arm] = {}
    for i, seed in ipairs(spec.seeds) do
      local run_name = string.format("%s-%s-s%d", base_name, arm, seed)
      local ok, cfg = pcall(config.load, spec.base, overrides_of(spec, spec.arms[arm], seed, run_name))
      if not ok then error(string.format("sweep: arm %s, seed %d: %s", arm, seed, tostring(cfg)), 0) end
      cfgs[arm][i] = cfg
    end
  end
  return cfgs
end

-- The verdict of each arm against the control.
function sweep.verdicts(results, control)
  local c = results[control]
  for name, r in pairs(results) do
    if name == control then r.verdict = "control"
    elseif #r.bpb == 1 or #c.bpb == 1 then          -- one seed: no spread to judge by
      r.verdict = string.format("one seed: %s by %.4f, no spread to judge by", r.mean < c.mean and "lower" or "higher",
                                math.abs(c.mean - r.mean))
    else
      local diff = c.mean - r.mean
      if diff > r.spread and diff > c.spread then r.verdict = "beats control"
      elseif -diff > r.spread and -diff > c.spread then r.verdict = "worse than control"
      else r.verdict = "no difference beyond the spread" end
    end
  end
end

-- mean of the numbers in list (nil when none)
local function mean_of(list)
  local n, sum = 0, 0
  for _, v in pairs(list or {}) do n, sum = n + 1, sum + v end
  return n > 0 and sum / n or nil
end

-- the mean of a list of n values, nil unless all n are there (a run read from an earlier result file
-- may lack a figure added since: a mean of the others would pass for all seeds')
local function mean_of_all(list, n)
  local count = 0
  for _ in pairs(list or {}) do count = count + 1 end
  return count == n and mean_of(list) or nil
end

local MiB = 1024 * 1024

function sweep.table(results, names, seeds)
  local routing = false                           -- the last log window's routing, when the runs route
  for _, name in ipairs(names) do routing = routing or mean_of(results[name].busiest) ~= nil end
  local measured, seen = {}, {}                   -- an arm's own eval measures (draft_accept), each a column
  for _, name in ipairs(names) do
    for m in pairs(results[name].measures or {}) do
      if not seen[m] then seen[m] = true; measured[#measured + 1] = m end
    end
  end
  table.sort(measured, require("dormouse.instrument").natural_less)
  local head = {string.format("%-14s %9s %9s", "arm", "mean", "spread")}
  for _, s in ipairs(seeds) do head[#head + 1] = string.format("%9s", "seed " .. s) end
  head[#head + 1] = string.format("%9s %9s %8s", "train", "tok/s", "peak MiB")
  if routing then head[#head + 1] = string.format("%8s %6s %8s %8s", "busiest", "dead", "max busy", "max dead") end
  for _, m in ipairs(measured) do head[#head + 1] = string.format("%12s", m) end
  head[#head + 1] = "  verdict"
  local lines = {table.concat(head, " ")}
  for _, name in ipairs(names) do
    local r = results[name]
    local row = {string.format("%-14s %9.4f %9.4f", name, r.mean, r.spread)}
    for i = 1, #seeds do row[#row + 1] = string.format("%9.4f", r.bpb[i]) end
    local train, tok, peak = mean_of(r.train_bpb), mean_of(r.tok_s), mean_of(r.mem_peak)
    row[#row + 1] = string.format("%9s %9s %8s", train and string.format("%.4f", train) or "-",
                                  tok and string.format("%.0f", tok) or "-",
                                  peak and string.format("%.0f", peak / MiB) or "-")
    if routing then
      local b, d = mean_of(r.busiest), mean_of(r.dead)
      local bmax, dmax = mean_of_all(r.busiest_max, #seeds), mean_of_all(r.dead_max, #seeds)
      row[#row + 1] = string.format("%8s %6s %8s %8s", b and string.format("%.3f", b) or "-",
                                    d and string.format("%.1f", d) or "-", bmax and string.format("%.3f", bmax) or "-",
                                    dmax and string.format("%.1f", dmax) or "-")
    end
    for _, m in ipairs(measured) do
      local v = mean_of(r.measures and r.measures[m])
      row[#row + 1] = string.format("%12s", v and string.format("%.4f", v) or "-")
    end
    row[#row + 1] = "  " .. r.verdict
    lines[#lines + 1] = table.concat(row, " ")
  end
  return table.concat(lines, "\n")
end

local function result_path(dir, arm, seed) return string.format("%s/%s-s%d", dir, arm, seed) end

-- One run's figures, as its result file holds them
local function result_of(s)
  return {bpb_fin = s.bpb_fin, train_bpb = s.train_bpb, tok_s = s.tok_s, mem_peak = s.mem_peak,
          busiest = s.moe and s.moe.busiest, dead = s.moe and s.moe.dead, measures = s.measures, step = s.step,
          busiest_max = s.moe_worst and s.moe_worst.busiest, dead_max = s.moe_worst and s.moe_worst.dead}
end

local function read_result(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local text = f:read("a")
  f:close()
  local ok, r = pcall(json.decode, text)
  return ok and type(r) == "table" and r or nil
end

--[[ What an earlier sweep left of one run: "done" (its last checkpoint is at the run's steps and
its result file is there), "resume" (a checkpoint of the same config before that), or nil (none,
or spec.overwrite). A folder holding another config's run is an error naming the keys. ]]
function sweep.prior(spec, cfg, dir, arm, seed)
  if spec.overwrite then return nil end
  local ckpt = require "dormouse.ckpt"
  local rundir = (spec.runs or "runs") .. "/" .. cfg.name
  local latest = ckpt.latest(rundir)
  if not latest then return nil end
  local meta = ckpt.load_meta(latest)
  local d = config.diff(config.upgrade(meta.config), config.plain(cfg))
  if #d > 0 then
    error(string.format("sweep: arm %s, seed %d: %s holds a run of another config:\n%s\n--overwrite trains it " ..
                        "afresh (or give the sweep another name)", arm, seed, rundir,
                        config.format_diff(d, "that run", "this sweep")), 0)
  end
  local r = read_result(result_path(dir, arm, seed) .. ".json")
  if meta.step >= cfg.steps and r and r.step == meta.step and r.bpb_fin then return "done" end
  return "resume", rundir
end

-- Train one (arm, seed) in this process (or resume it, or read it: sweep.prior); its result file
-- is written when it ends
local function train_one(spec, cfg, dir, arm, seed)
  local how, rundir = sweep.prior(spec, cfg, dir, arm, seed)
  if how == "done" then return read_result(result_path(dir, arm, seed) .. ".json") end
  local train = require "dormouse.train"
  local s = train.run(cfg, {overwrite = spec.overwrite, resume = rundir, quiet = true, silent = spec.quiet,
                            root = spec.root, runs = spec.runs})
  local r = result_of(s)
  local core = require "dormouse.core"
  core.write_file(result_path(dir, arm, seed) .. ".json", json.encode(r) .. "\n")
  return r
end

-- The runs as processes of their own, `jobs` at a time; each writes its result file. Every run
-- is waited for; then a failed one is an error naming its log.
local function count(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n
end

local function train_jobs(spec, jobs, dir, names, say, cfgs)
  local core = require "dormouse.core"
  local queue, running, failed = {}, {}, {}
  for _, arm in ipairs(names) do
    for i, seed in ipairs(spec.seeds) do
      if sweep.prior(spec, cfgs[arm][i], dir, arm, seed) == "done" then
        say(string.format("== sweep: arm %s, seed %d: done before (%s.json)", arm, seed, result_path(dir, arm, seed)))
      else
        queue[#queue + 1] = {arm = arm, seed = seed}
      end
    end
  end
  local next_run, left, done = 1, #queue, 0
  local function start(job)
    local argv = {"/proc/self/exe", "sweep", spec.file}
    for _, s in ipairs(spec.cli_set or {}) do argv[#argv + 1] = "--set"; argv[#argv + 1] = s end
    if spec.select then argv[#argv + 1] = "--arms"; argv[#argv + 1] = spec.select end
    if spec.seeds_flag then argv[#argv + 1] = "--seeds"; argv[#argv + 1] = spec.seeds_flag end
    if spec.base_flag then argv[#argv + 1] = "--base"; argv[#argv + 1] = spec.base_flag end
    if spec.overwrite then argv[#argv + 1] = "--overwrite" end
    argv[#argv + 1] = "--run"
    argv[#argv + 1] = job.arm .. ":" .. job.seed
    job.log = result_path(dir, job.arm, job.seed) .. ".log"
    os.remove(result_path(dir, job.arm, job.seed) .. ".json")        -- a result is this sweep's, never an old one
    running[core.spawn_program(argv, job.log)] = job
    say(string.format("== sweep: arm %s, seed %d started (%s)", job.arm, job.seed, job.log))
  end
  local stopped                                   -- SIGINT or SIGTERM: passed to every run, none started after
  core.signals_hold(true)
  while left > 0 do
    while not stopped and next_run <= #queue and next_run - (#queue - left) <= jobs do
      start(queue[next_run]); next_run = next_run + 1
    end
    local pid, status = core.wait_program()
    local sig = not stopped and core.signal_pending()
    if sig then                                   -- each run stops as a run does: its step, a checkpoint
      stopped = sig
      for child in pairs(running) do core.signal_program(child, sig) end
      left = count(running)
      say(string.format("== sweep: %s: the %d runs going stop after their step; no more start", sig, left))
    end
    if not pid and status ~= "interrupted" then break end
    local job = pid and running[pid]
    if job then
      running[pid], left = nil, left - 1
      local r = status == 0 and read_result(result_path(dir, job.arm, job.seed) .. ".json")
      if r then
        done = done + 1
        say(string.format("== sweep: arm %s, seed %d done: bpb_fin %.4f (%d of %d left)", job.arm, job.seed,
                          r.bpb_fin or 0 / 0, left, #queue))
      elseif stopped then                         -- stopped by the signal, not failed: its log says where
        say(string.format("== sweep: arm %s, seed %d stopped (%s)", job.arm, job.seed, job.log))
      else
        failed[#failed + 1] = string.format("arm %s, seed %d (status %d; %s)", job.arm, job.seed, status, job.log)
        say("== sweep: " .. failed[#failed])
      end
    end
  end
  core.signals_hold(false)
  if stopped then
    error(string.format("sweep: stopped by %s: %d of %d runs were not finished (%s)", stopped, #queue - done,
                        #queue, dir), 0)
  end
  if #failed > 0 then
    error(string.format("sweep: %d of %d runs failed: %s", #failed, #queue, table.concat(failed, "; ")), 0)
  end
end

-- A sweep table's fields, each refused by name when malformed (before anything is resolved)
local function check_spec(spec)
  local function bad(key, want, v)
    error(string.format("sweep: %s must be %s, got %s", key, want, v == nil and "nothing" or
                        type(v) == "table" and "a table of another form" or string.format("%q", tostring(v))), 0)
  end
  if type(spec) ~= "table" then bad("the sweep", "a table {base =, arms =, seeds =}", spec) end
  if type(spec.base) ~= "string" then bad("base", "an experiment file's path", spec.base) end
  if type(spec.arms) ~= "table" then bad("arms", "a table {name = {KEY = value, ...}}", spec.arms) end
  for name, arm in pairs(spec.arms) do
    if type(name) ~= "string" or not name:match("^[%w_]+$") then bad("an arm's name", "a word", name) end
    if type(arm) ~= "table" then bad("arms." .. name, "a table of overrides {KEY = value}", arm) end
  end
  if type(spec.seeds) ~= "table" or #spec.seeds == 0 then bad("seeds", "a list of one seed or more", spec.seeds) end
  for i, seed in ipairs(spec.seeds) do
    if math.type(seed) ~= "integer" or seed < 0 then bad("seeds[" .. i .. "]", "an integer >= 0", seed) end
  end
  if spec.set ~= nil and type(spec.set) ~= "table" then bad("set", "a table {KEY = value}", spec.set) end
  if spec.name ~= nil and (type(spec.name) ~= "string" or not spec.name:match("^[%w_.%-]+$")) then
    bad("name", "a word (it names runs/sweep-NAME)", spec.name)
  end
end

function sweep.run(spec)
  check_spec(spec)
  local control = spec.control or "control"
  if not spec.arms[control] then error("dm.sweep: no arm named '" .. control .. "' (the control)", 2) end
  local base_name = spec.name or (spec.file and spec.file:match("([^/]+)%.lua$")) or spec.base:match("([^/]+)%.lua$")
  local names = sorted_arms(spec.arms, control)
  if spec.select then                                    -- some of the arms (--arms), the control always
    local chosen = {[control] = true}
    for name in spec.select:gmatch("[^,%s]+") do
      if not spec.arms[name] then
        error(string.format("sweep: --arms names '%s', which this sweep does not have (arms: %s)", name,
                            table.concat(names, ", ")), 0)
      end
      chosen[name] = true
    end
    local kept = {}
    for _, name in ipairs(names) do if chosen[name] then kept[#kept + 1] = name end end
    names = kept
  end
  local function say(line) if not spec.quiet then print(line) end end
  short_schedule(spec, say)
  local cfgs = sweep.configs(spec, names, base_name)    -- every run's config, checked before the first trains
  local dir = (spec.runs or "runs") .. "/sweep-" .. base_name
  if not spec.only then                                  -- what an earlier sweep left: checked before any trains
    for _, arm in ipairs(names) do
      for i, seed in ipairs(spec.seeds) do sweep.prior(spec, cfgs[arm][i], dir, arm, seed) end
    end
  end
  local core = require "dormouse.core"
  core.mkdirs(dir)
  if spec.only then                                      -- one run, a job of a sweep with jobs > 1
    local arm, seed = spec.only:match("^(.+):(%d+)$")
    local i
    for j, s in ipairs(spec.seeds) do if s == tonumber(seed) then i = j end end
    if not (arm and cfgs[arm] and i) then
      error(string.format("sweep: --run %s names no run of this sweep (ARM:SEED, arms %s, seeds %s)", spec.only,
                          table.concat(names, ", "), table.concat(spec.seeds, ", ")), 0)
    end
    return {[arm] = train_one(spec, cfgs[arm][i], dir, arm, tonumber(seed))}
  end
  local jobs = math.tointeger(spec.jobs or 1)
  if not jobs or jobs < 1 then error("sweep: jobs must be a whole number of at least 1, got " .. tostring(spec.jobs), 0) end
  if jobs > 1 then
    if not spec.file then error("sweep: jobs > 1 needs the sweep's file (spec.file), which each run's process reads", 0) end
    train_jobs(spec, jobs, dir, names, say, cfgs)
  end
  local results = {}
  for _, arm in ipairs(names) do
    local r = {bpb = {}, train_bpb = {}, tok_s = {}, mem_peak = {}}
    for i, seed in ipairs(spec.seeds) do
      local one
      if jobs > 1 then
        one = assert(read_result(result_path(dir, arm, seed) .. ".json"))
      else
        say(string.format("== sweep %s: arm %s, seed %d (%s)", base_name, arm, seed, cfgs[arm][i].name))
        one = train_one(spec, cfgs[arm][i], dir, arm, seed)
      end
      r.bpb[i], r.train_bpb[i], r.tok_s[i], r.mem_peak[i] = one.bpb_fin, one.train_bpb, one.tok_s, one.mem_peak
      for m, v in pairs(one.measures or {}) do
        r.measures = r.measures or {}
        r.measures[m] = r.measures[m] or {}
        r.measures[m][i] = v
      end
      if one.busiest then                            -- the last log window's routing
        r.busiest, r.dead = r.busiest or {}, r.dead or {}
        r.busiest[i], r.dead[i] = one.busiest, one.dead
      end
      if one.busiest_max then                        -- the worst log window past the warm-up
        r.busiest_max, r.dead_max = r.busiest_max or {}, r.dead_max or {}
        r.busiest_max[i], r.dead_max[i] = one.busiest_max, one.dead_max
      end
    end
    r.mean, r.spread = stats(r.bpb)
    results[arm] = r
  end
  sweep.verdicts(results, control)
  local text = sweep.table(results, names, spec.seeds)
  text = text .. "\n(mean, spread and the seeds: held-out bpb_fin, bits a byte, lower is better; train: the last " ..
         "log window's training loss in bits a byte)"
  if jobs > 1 then
    text = text .. string.format("\n(%d runs at once shared the device: tok/s is each run's share of it)", jobs)
  end
  say(text)
  core.write_file(dir .. "/verdict.txt", text .. "\n")
  core.write_file(dir .. "/verdict.json", json.encode({arms = results, seeds = spec.seeds}) .. "\n")
  return results, dir
end

return sweep
