--[[
dormouse post-train --base RUN[/ckpt-N] --env TASKS[,TASKS...] [--verifier hard|soft] [--sft-steps N]
                    [--rl-steps N] [--name NAME] [--overwrite] [--quiet] [--set KEY=VALUE ...]

From a base checkpoint to a model that solves a task set, as two runs of the
base's own config (RUN/config.lua):

  1. NAME-sft: supervised fine-tuning on the task set's records (data.records),
     the model's weights from the base (init), --sft-steps steps (default 500;
     0: none);
  2. NAME-rl: reinforcement learning against the verifier (rl.k, default 8),
     the weights from NAME-sft's last checkpoint (or the base's), --rl-steps
     steps (default 200; 0: none).

--env names a task file (tasks/NAME.lua, here or in the install) or a path
to one, or to a JSONL file of records; several, separated by commas, train
and are held out together (each file's last data.eval_records records held
out). Each sample is scored by its record's verifier (code for a record with
tests, exact otherwise; rl.verifier names one for all); --verifier hard (the
default) rewards a pass, soft the verifier's partial credit (rl.reward =
"score": the share of the answer right, of a list of tests passed). NAME defaults to the base's name with
"-post". The --set keys go to both runs (rl.* matter in the second); each
phase's schedule warms up over a tenth of its steps unless schedule.warmup
is set; a sample ends at "\n" (rl.stop) when every training response ends with one,
unless rl.stop is set; the RL phase's learning rates are a tenth of the
config's unless optim.muon_lr or optim.adamw_lr is set. The table at the end gives, for the base and after each
phase, the held-out bpb over the responses and exact@B (docs/post-training.md).
]]
local config = require "dormouse.config"
local core = require "dormouse.core"

local usage = [[usage: dormouse post-train --base RUN[/ckpt-N] --env TASKS[,TASKS...] [--verifier hard|soft]
                           [--sft-steps N] [--rl-steps N] [--name NAME] [--overwrite] [--quiet] [--set KEY=VALUE ...]
SFT then RL from a base checkpoint, as two runs of the base's config (docs/post-training.md).
  --base RUN         the base: a run folder (its newest checkpoint) or RUN/ckpt-STEP (required)
  --env TASKS        the task set: tasks/TASKS.lua (here or in the install) or a path to a task
                     file or a JSONL file of records; several separated by commas (required)
  --verifier MODE    hard: the reward is the verifier's pass (default); soft: its partial credit
  --sft-steps N      supervised steps on the records (default 500; 0: none)
  --rl-steps N       RL steps against the verifier from the supervised model (default 200; 0: none)
  --name NAME        the runs are NAME-sft and NAME-rl (default: the base's name and -post)
  --overwrite        replace runs of those names
  --quiet            no progress bar
  --set KEY=VALUE    a config key for both runs (rl.k: 8 unless set; the RL run's learning rates a
                     tenth of the config's unless set; rl.stop "\n" when every response ends so)
example: dormouse post-train --base runs/base --env addition --sft-steps 1000 --rl-steps 200]]
local FLAGS = {base = "RUN", env = "TASKS", verifier = "MODE", ["sft-steps"] = "N", ["rl-steps"] = "N", name = "NAME",
               overwrite = true, quiet = true, help = true}

-- the RL phase's learning rates as a share of the config's (measured: docs/post-training.md)
local RL_LR = 0.1

local function user_sets(user, key)
  for _, s in ipairs(user) do if config.split_set(s) == key then return true end end
  return false
end

local function count(v, flag, default)
  if v == nil then return default end
  local n = math.tointeger(tonumber(v))
  if not n or n < 0 then error(string.format("--%s must be an integer >= 0, got %s", flag, v), 0) end
  return n
end

local function parse(argv)
  local args = config.parse_args(argv, 2, FLAGS)
  if args.flags.help then return {help = true} end
  if args.file then error(string.format("post-train takes no experiment file (it reads the base's config), got %s",
                                        args.file), 0) end
  local f = args.flags
  if not f.base then error("which base? --base runs/NAME (or runs/NAME/ckpt-STEP)", 0) end
  if not f.env then error("which task set? --env addition (tasks/addition.lua) or --env PATH", 0) end
  args.envs = {}
  for name in f.env:gmatch("[^,]+") do args.envs[#args.envs + 1] = name end
  if #args.envs == 0 then error(string.format("--env %q names no task set", f.env), 0) end
  local modes = {hard = "pass", soft = "score"}
  if f.verifier ~= nil and not modes[f.verifier] then
    error(string.format("--verifier %s: hard (the reward is a pass) or soft (partial credit)", f.verifier), 0)
  end
  args.reward = modes[f.verifier or "hard"]
  if f.verifier and user_sets(args.overrides, "rl.reward") then
    error("--verifier and --set rl.reward say the same thing: give one", 0)
  end
  args.sft_steps = count(f["sft-steps"], "sft-steps", 500)
  args.rl_steps = count(f["rl-steps"], "rl-steps", 200)
  if args.sft_steps + args.rl_steps == 0 then error("--sft-steps and --rl-steps are both 0: nothing to do", 0) end
  return args
end

-- the task set's file: a path as given, else tasks/NAME.lua here or in the install
local function env_file(name, root)
  if core.file_kind(name) == "file" then
    if name:find(",", 1, true) then error(string.format("--env: the path %s holds a comma", name), 0) end
    return name
  end
  for _, p in ipairs {"tasks/" .. name .. ".lua", (root or ".") .. "/tasks/" .. name .. ".lua"} do
    if core.file_kind(p) == "file" then return p end
  end
  error(string.format("--env %s: no such file, nor tasks/%s.lua here or in the install", name, name), 0)
end

-- the overrides of a phase: its own keys, then the user's --set (which win), then the keys it must have
local function overrides(defaults, user, forced)
  local by_key, order = {}, {}
  local function put(s)
    local key = config.split_set(s)
    if not by_key[key] then order[#order + 1] = key end
    by_key[key] = s
  end
  for _, s in ipairs(defaults) do put(s) end
  for _, s in ipairs(user) do put(s) end
  for _, s in ipairs(forced) do put(s) end
  local out = {}
  for _, key in ipairs(order) do out[#out + 1] = by_key[key] end
  return out
end


-- "\n" when every training response of the files ends with a newline, else nil
local function common_stop(paths)
  for _, path in ipairs(paths) do
    for _, r in ipairs(require("dormouse.records").read(path)) do
      if r.response:sub(-1) ~= "\n" then return nil end
    end
  end
  return "\n"
end

local function body(args, cli)
  local train = require "dormouse.train"
  local run_dir, point = train.resume_point(args.flags.base, "post-train from")
  local base_cfg = run_dir .. "/config.lua"
  local envs = {}
  for i, e in ipairs(args.envs) do envs[i] = env_file(e, cli.root) end
  local env = table.concat(envs, ",")
  local name = args.flags.name or (run_dir:match("([^/]+)$") .. "-post")
  local runs = run_dir:match("^(.*)/[^/]+$") or "."
  local user = args.overrides
  local rows = {}
  local function phase(label, steps, init, extra)
    local defaults = {string.format("schedule.warmup=%d", math.max(1, steps // 10))}
    local forced = {string.format("init=%q", init), string.format("data.records=%q", env), "data.path=nil",
                    string.format("name=%q", name .. "-" .. label), string.format("steps=%d", steps)}
    for _, s in ipairs(extra) do forced[#forced + 1] = s end
    local cfg = config.load(base_cfg, overrides(defaults, user, forced))
    io.stderr:write(string.format("post-train: %s, %d steps from %s\n", name .. "-" .. label, steps, init))
    return train.run(cfg, {root = cli.root, runs = runs, overwrite = args.flags.overwrite, quiet = args.flags.quiet})
  end
  local function row(label, s) rows[#rows + 1] = {label, s.bpb_fin, s.measures or {}} end
  local from = point
  if args.sft_steps > 0 then
    local s = phase("sft", args.sft_steps, from, {"rl.k=0"})
    if s.first_eval then rows[#rows + 1] = {"base", s.first_eval.bpb_fin, s.first_eval.measures or {}} end
    row("sft", s)
    from = s.dir
  end
  if args.rl_steps > 0 then
    local extra = {}
    if not user_sets(user, "rl.k") then extra[#extra + 1] = "rl.k=8" end
    if not user_sets(user, "rl.reward") then extra[#extra + 1] = string.format("rl.reward=%q", args.reward) end
    if not user_sets(user, "rl.stop") then
      local stop = common_stop(envs)
      if stop then
        extra[#extra + 1] = 'rl.stop="\\n"'
        io.stderr:write("post-train: every response ends with a newline: a sample ends at one (rl.stop)\n")
      end
    end
    local base = config.load(base_cfg)
    for _, key in ipairs {"muon_lr", "adamw_lr"} do      -- a policy step is smaller than a supervised one
      if not user_sets(user, "optim." .. key) then
        extra[#extra + 1] = string.format("optim.%s=%.17g", key, base.optim[key] * RL_LR)
      end
    end
    io.stderr:write(string.format("post-train: the RL phase's learning rates are %g of the config's unless " ..
                                  "--set optim.muon_lr and optim.adamw_lr say otherwise\n", RL_LR))
    local s = phase("rl", args.rl_steps, from, extra)
    if #rows == 0 and s.first_eval then rows[#rows + 1] = {"base", s.first_eval.bpb_fin, s.first_eval.measures or {}} end
    row("rl", s)
  end
  local names = {}
  for _, r in ipairs(rows) do for k in pairs(r[3]) do names[k] = true end end
  local cols = {}
  for k in pairs(names) do cols[#cols + 1] = k end
  table.sort(cols)
  print(string.format("%-6s %10s%s", "model", "bpb_fin", #cols > 0 and "  " .. table.concat(cols, "  ") or ""))
  for _, r in ipairs(rows) do
    local parts = {string.format("%-6s %10.4f", r[1], r[2] or 0 / 0)}
    for _, c in ipairs(cols) do parts[#parts + 1] = string.format("%" .. #c .. ".4f", r[3][c] or 0 / 0) end
    print(table.concat(parts, "  "))
  end
  local made = {}
  if args.sft_steps > 0 then made[#made + 1] = runs .. "/" .. name .. "-sft" end
  if args.rl_steps > 0 then made[#made + 1] = runs .. "/" .. name .. "-rl" end
  print(string.format("runs: %s (bpb_fin: held-out responses, bits a byte)", table.concat(made, ", ")))
end

return {
  summary = "SFT then RL from a base checkpoint on a task set (docs/post-training.md)",
  args = "--base RUN --env TASKS",
  run = function(argv, cli)
    return cli.framed("post-train", usage, parse, function(args) return body(args, cli) end)(argv)
  end,
}
