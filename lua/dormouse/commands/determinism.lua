--[==[
dormouse determinism EXPERIMENT.lua [--steps N] [--set KEY=VALUE ...]

Trains the experiment three times for N steps (default 20) from the same
seed: twice straight through, and once stopped after step N/2 (as a kill
would: its checkpoint there) and resumed. Each later run is compared with
the first: the training loss and gradient norm of every step, then every
parameter and optimiser state of the final checkpoint, bit for bit. Prints
the first difference each has (the step and both values, or the tensor and
its largest difference) and exits 1 when there is one. Runs that differ are
then searched for the op where they part: two more runs up to the first
differing step, eager, with every op call's inputs and outputs hashed; the
first call whose outputs differ from equal inputs is named (the op that is
not deterministic on that device), or the step whose data or optimiser
update differed. The runs are kept in runs/determinism-NAME/ (replaced by
the next check of NAME).
example: dormouse determinism experiments/tiny.lua --steps 20
]==]
local config = require "dormouse.config"

local usage = "usage: dormouse determinism EXPERIMENT.lua [--steps N] [--set KEY=VALUE ...]"
local FLAGS = {steps = "N", help = true}

local determinism = {}

local function parse(argv)
  local args = config.parse_args(argv, 2, FLAGS)
  if args.flags.help then return {help = true} end
  if not args.file then error("which experiment? (an experiments/*.lua file)", 0) end
  local steps = math.tointeger(tonumber(args.flags.steps or 20))
  if not steps or steps < 2 then
    error(string.format("--steps must be an integer >= 2, got %s", tostring(args.flags.steps)), 0)
  end
  args.steps = steps
  return args
end

-- the log records of a run's metrics.jsonl by step: {loss =, grad_norm =}
local function steps_of(path)
  local json, out = require "dormouse.json", {}
  for line in io.lines(path) do
    local rec = json.decode(line)
    if rec.kind == "log" then out[rec.step] = rec end
  end
  return out
end

-- the first step where b's loss or gradient norm differs from a's: a sentence and the step, or nil
local function first_step_difference(a, b, steps)
  for step = 1, steps do
    local x, y = a[step], b[step]
    if not x or not y then return string.format("step %d is logged in one run only", step), step end
    for _, key in ipairs {"loss", "grad_norm"} do
      if x[key] ~= y[key] then
        return string.format("step %d: %s %s against %s", step, key, tostring(y[key]), tostring(x[key])), step
      end
    end
  end
end

-- the first tensor (by name) of a checkpoint part that differs: a sentence, or nil
local function first_tensor_difference(a, b, part)
  local names = {}
  for name in pairs(a) do names[#names + 1] = name end
  for name in pairs(b) do if a[name] == nil then names[#names + 1] = name end end
  table.sort(names)
  for _, name in ipairs(names) do
    local x, y = a[name], b[name]
    if not x or not y then return string.format("%s '%s' is in one checkpoint only", part, name) end
    if x.dtype ~= y.dtype or table.concat(x:shape(), "x") ~= table.concat(y:shape(), "x") then
      return string.format("%s '%s' has another dtype or shape", part, name)
    end
    local xf, yf = x:to("f64"), y:to("f64")
    local same = xf:eq(yf):to("f64"):sum():item() == x:numel()
    if not same then
      local nan_same = xf:ne(xf):eq(yf:ne(yf)):to("f64"):sum():item() == x:numel() and
                       xf:ne(xf):to("f64"):sum():item() > 0
      if not nan_same then
        return string.format("%s '%s' differs, by up to %.3g", part, name, (xf - yf):abs():max():item())
      end
    end
  end
end

--[[ Where two op traces (core.trace_read: {name, kind, inputs, outputs} per outermost op call,
a mark "step N" before each step, each parameter after it) first part: a sentence, or nil when
they agree. The first entry whose outputs differ while its inputs agree names the op that is
not deterministic; inputs that differ first came from outside the ops (the data, a state set
between steps); a parameter that differs after a step whose ops all agreed was changed by the
optimiser's update, which runs no ops. ]]
function determinism.first_divergence(a, b)
  local step, call = "before the first step", 0
  for i = 1, math.max(#a, #b) do
    local x, y = a[i], b[i]
    if not x or not y then return string.format("%s: one run's trace ends there, the other goes on", step) end
    if x.kind ~= y.kind or x.name ~= y.name then
      return string.format("%s: the runs call different ops (%s of %s against %s of %s)", step, y.kind, y.name,
                           x.kind, x.name)
    end
    if x.kind == "mark" then step, call = x.name, 0
    elseif x.kind == "tensor" then
      if x.outputs ~= y.outputs then
        return string.format("%s differs while every op of the step agreed: the optimiser's update (or what " ..
                             "else changed it between steps) is not deterministic", x.name)
      end
    else
      call = call + 1
      if x.inputs ~= y.inputs then
        return string.format("%s, call %d (%s of %s): its inputs or attributes differ before any op's outputs " ..
                             "did; they came from outside the ops (the data, a number, or a tensor set between ops)",
                             step, call, x.kind, x.name)
      elseif x.outputs ~= y.outputs then
        return string.format("%s, call %d: the %s of %s gives other outputs from the same inputs; %s is not " ..
                             "deterministic here", step, call, x.kind, x.name, x.name)
      end
    end
  end
end

--[[ Two more runs of the first `upto` steps, eager (a captured graph cannot be traced), each
with every op call hashed: where they first part (first_divergence), or nil. The first run's
trace stays in C (core.trace_keep): a run's is up to millions of entries, and held as Lua
tables it would slow the collector that frees the second run's tensors. Only the step where
they part is read into Lua, from its mark on. ]]
function determinism.locate(file, overrides, dir, upto, root)
  local train, core = require "dormouse.train", require "dormouse.core"
  local o = {table.unpack(overrides)}
  o[#o + 1] = "graph=false"
  local cfg = config.load(file, o)
  for k = 1, 2 do
    collectgarbage()
    core.trace_start()
    local ok, err = pcall(train.run, cfg, {runs = dir .. "/trace-" .. k, overwrite = true, quiet = true, silent = true,
                                          root = root, stop_at = upto})
    core.trace_stop()
    if not ok then error(err, 0) end
    if k == 1 then core.trace_keep() end
  end
  local at, mark = core.trace_parting()
  if not at then return nil end
  return determinism.first_divergence(core.trace_read(mark or 1, at, true), core.trace_read(mark or 1, at))
end

-- Where two straight runs part (locate), as a sentence for the report
local function parting(file, o, dir, r, opts, cfg)
  local straight = r.checks[1].difference ~= nil
  if not straight then
    return "not searched: the two straight runs agree, so the difference comes with the resume (what the " ..
           "checkpoint keeps, or what a resumed run sets up again)"
  end
  if opts.say then opts.say(string.format("determinism: the runs differ; two more of %d steps, every op hashed, " ..
                                          "to find where they part", r.traced_steps)) end
  local ok, where = pcall(determinism.locate, file, o, dir, r.traced_steps, opts.root)
  if not ok then return "not searched: a traced run failed: " .. tostring(where) end
  if where then return where end
  return string.format("nowhere in %d steps run eagerly with every op hashed%s", r.traced_steps,
                       r.device == "cuda" and cfg.graph ~= false and
                       " (the runs above were captured as a graph: the difference may need it)" or "")
end

--[[ The three runs and their comparisons. opts: steps, overrides (a list of "k=v"), root, runs (the
folder of the three runs' folders). Returns {name, dir, steps, half, checks = {{what, difference}}}:
difference nil where the runs agree. ]]
function determinism.check(file, opts)
  local train = require "dormouse.train"
  local steps, half = opts.steps, opts.steps // 2
  local o = {}
  for _, s in ipairs(opts.overrides or {}) do o[#o + 1] = s end
  for _, s in ipairs {"steps=" .. steps, "log.every=1", "eval.every=0", "eval.sample=0",
                      "checkpoint.every=" .. half, "checkpoint.keep=0"} do o[#o + 1] = s end
  -- a warm-up the short runs can hold, unless one is asked for (as a sweep does)
  local asked = false
  for _, s in ipairs(opts.overrides or {}) do asked = asked or config.split_set(s) == "schedule.warmup" end
  if not asked then
    local probe = {table.unpack(o)}
    probe[#probe + 1] = "schedule.warmup=1"
    local c = config.load(file, probe)
    local decay = c.schedule.kind == "wsd" and math.ceil(c.schedule.decay * steps) or 0
    if config.load(file).schedule.warmup + decay > steps then o[#o + 1] = "schedule.warmup=" .. math.max(1, steps // 10) end
  end
  local cfg = config.load(file, o)
  local dir = (opts.runs or "runs") .. "/determinism-" .. cfg.name
  local function run(k, extra)
    local ro = {runs = dir .. "/" .. k, overwrite = true, quiet = true, silent = true, root = opts.root}
    for key, v in pairs(extra or {}) do ro[key] = v end
    return train.run(cfg, ro)
  end
  if opts.say then opts.say(string.format("determinism: run 1 of 3 (%d steps)", steps)) end
  run(1)
  if opts.say then opts.say("determinism: run 2 of 3") end
  run(2)
  if opts.say then opts.say(string.format("determinism: run 3 of 3, stopped after step %d and resumed", half)) end
  run(3, {stop_at = half})
  run(3, {resume = dir .. "/3/" .. cfg.name, overwrite = false})
  local dm = require "dormouse"
  local function folder(k) return dir .. "/" .. k .. "/" .. cfg.name end
  local first = {steps = steps_of(folder(1) .. "/metrics.jsonl"), ckpt = dm.ckpt.load(folder(1) .. "/ckpt-" .. steps)}
  local checks, upto, differ = {}, nil, false
  for k, what in pairs {[2] = "run 2, straight through", [3] = string.format("run 3, resumed at step %d", half)} do
    local other = dm.ckpt.load(folder(k) .. "/ckpt-" .. steps)
    local diff, step = first_step_difference(first.steps, steps_of(folder(k) .. "/metrics.jsonl"), steps)
    diff = diff or first_tensor_difference(first.ckpt.model, other.model, "parameter")
               or first_tensor_difference(first.ckpt.optim, other.optim, "optimiser state")
    checks[k - 1] = {what = what, difference = diff}
    differ = differ or diff ~= nil
    if diff and k == 2 then upto = step or steps end          -- the straight runs: traced up to there
  end
  first = nil                     -- the first run's checkpoint: let go before any traced run
  local r = {name = cfg.name, dir = dir, steps = steps, half = half, checks = checks, device = train.pick_device(cfg),
             traced_steps = upto}
  if differ and opts.locate ~= false then r.parts = parting(file, o, dir, r, opts, cfg) end
  return r
end

local function body(args, cli)
  local r = determinism.check(args.file, {steps = args.steps, overrides = args.overrides, root = cli.root,
                                          say = function(s) io.stderr:write(s, "\n") end})
  local lines, differ = {string.format("determinism %s on %s: %d steps from one seed, three runs (%s/)", r.name,
                                       r.device, r.steps, r.dir)}, false
  for _, c in ipairs(r.checks) do
    lines[#lines + 1] = string.format("  %-28s %s", c.what .. ":", c.difference and "differs from run 1: " ..
      c.difference or "equal to run 1 (every step's loss and gradient norm as logged, every parameter and optimiser state bit for bit)")
    differ = differ or c.difference ~= nil
  end
  if r.parts then lines[#lines + 1] = string.format("  %-28s %s", "where the runs part:", r.parts) end
  lines[#lines + 1] = differ and "verdict: not deterministic" or "verdict: deterministic, bit for bit"
  print(table.concat(lines, "\n"))
  return differ and 1 or 0
end

local function run(argv, cli)
  return cli.framed("determinism", usage, parse, function(args) return body(args, cli) end)(argv)
end

determinism.summary = "train three times (one stopped and resumed) and compare every step and tensor bit for bit"
determinism.args = "EXPERIMENT.lua [--steps N]"
determinism.run = run
return determinism
