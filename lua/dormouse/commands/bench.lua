--[[
dormouse bench EXPERIMENT.lua [--set KEY=VALUE ...] [--steps N] [--warmup N] [--json FILE]

Times an experiment's training step without training a run: the model,
optimiser and loader of the resolved config, --warmup untimed steps (default
3), then --steps timed ones (default 10). Prints tokens/s, ms a step and peak memory; the split
of a step into its phases (a second pass, the device synchronised between
phases: data, forward, backward, optimiser, the optimiser's own split into
clipping and each group's update); and each op family's share of the step
(a third pass, every op timed: CUDA events on a GPU, the wall clock on the
CPU); then, on a GPU, the step
captured as one CUDA graph and replayed (lua/dormouse/step.lua), or
why it cannot be. On the CPU the step is what `dormouse run` would run there
(f32 products, whatever cfg.dtype says; the header names them). Nothing is
written but --json's file. --set batch=... --set seq=... as usual.
example: dormouse bench experiments/b1.lua --steps 20
]]
local config = require "dormouse.config"
local core = require "dormouse.core"

local usage = "usage: dormouse bench FILE.lua [--set KEY=VALUE ...] [--steps N] [--warmup N] [--json FILE]"
local FLAGS = {steps = "N", warmup = "N", json = "FILE", help = true}

local GiB = 2 ^ 30

local function count_flag(flags, name, default, least)
  local v = flags[name]
  if v == nil then return default end
  local n = math.tointeger(tonumber(v))
  if not n or n < least then error(string.format("--%s must be an integer >= %d, got %s", name, least, v), 0) end
  return n
end

-- The run-like table the step works on: model, optimiser and loader of cfg, and its eager step.
local function prepare(cfg, root)
  local train = require "dormouse.train"
  local r = train.prepare(cfg, {root = root})
  r.sync = r.device == "cuda" and core.cuda_synchronize or function() end
  r.stepper = require("dormouse.step").new(r)
  return r, train
end

-- n eager steps as a run takes them (nothing read back)
local function run_steps(r, _, n, mark)
  for _ = 1, n do
    r.step = r.step + 1
    r.stepper:run(r.step, {mark = mark})
  end
end

-- the mean loss of the steps the stepper applied since its window was last read (nan: none)
local function window_loss(stepper, n)
  local w = stepper:window(n)
  return w.applied > 0 and w.loss / w.applied or 0 / 0
end

-- Pass 1: wall time of n steps back to back; and their mean loss (read after the clock stops)
local function time_steps(r, train, n)
  window_loss(r.stepper, 0)                       -- the warm-up's sums let go
  r.sync()
  if r.device ~= "cpu" then core.reset_peak(r.device) end
  local t0 = core.now()
  run_steps(r, train, n)
  r.sync()
  return (core.now() - t0) * 1e3 / n, window_loss(r.stepper, n)
end

-- Pass 2: the phases, with the device synchronised at each boundary.
local function split_steps(r, train, n)
  local split, order = {}, {"data", "forward", "backward", "optimiser"}
  for _, k in ipairs(order) do split[k] = 0 end
  local t = core.now()
  local function mark(phase)
    r.sync()
    local now = core.now()
    split[phase] = split[phase] + (now - t) * 1e3 / n
    t = now
  end
  r.sync()
  t = core.now()
  run_steps(r, train, n, mark)
  return split, order
end

-- Pass 3: every op timed on the device.
local function profile_steps(r, train, n)
  local profile = require "dormouse.profile"
  r.sync()
  profile.start()
  local ok, err = pcall(run_steps, r, train, n)
  local rows = profile.stop()
  if not ok then error(err, 0) end
  return rows
end

-- Pass 4 (CUDA): the same steps captured as one graph and replayed; nil and why when it cannot.
local function graph_steps(r, n)
  if r.device ~= "cuda" then return nil, "not measured: CUDA graphs need the cuda device" end
  local ok, res = pcall(function()
    local gs = require("dormouse.step").new(r, {capture = true})
    for _ = 1, 3 do r.step = r.step + 1; gs:run(r.step) end      -- 2 eager, then the capture
    r.sync()
    core.reset_peak(r.device)
    local t0 = core.now()
    for _ = 1, n do r.step = r.step + 1; gs:run(r.step) end
    r.sync()
    local ms = (core.now() - t0) * 1e3 / n
    local mem = core.memory(r.device)
    local out = {ms = ms, peak = mem.peak, reserved = mem.reserved or mem.peak, nodes = gs:nodes(),
                 loss = window_loss(gs, n + 3)}
    gs:free()
    return out
  end)
  if ok then return res end
  return nil, "not measured: " .. tostring(res)
end

local function human_bytes(b) return string.format("%.2f GiB", b / GiB) end

local function report(r, res)
  local dm = require "dormouse"
  local profile = require "dormouse.profile"
  local cfg = r.cfg
  local out = {}
  local function line(fmt, ...) out[#out + 1] = string.format(fmt, ...) end
  local where = r.device == "cuda" and dm.cuda.device_name() or "cpu"
  -- the products' dtype the step really ran (train.setup: f32 on the CPU, whatever cfg.dtype says)
  line("bench %s on %s: batch %d x seq %d x accum %d = %d tokens a step, %s products, %d warm-up + %d timed steps",
       cfg.name, where, cfg.batch, cfg.seq, cfg.grad_accum, res.tokens, res.compute_dtype, res.warmup, res.steps)
  if r.devices then line("%s", r.devices) end     -- NCCL asked for (DORMOUSE_NCCL=1): the step's collectives
  line("")
  line("%-7s %12s %10s %14s %14s %9s", "mode", "tokens/s", "ms/step", "peak alloc", "reserved", "loss")
  line("%-7s %12.0f %10.2f %14s %14s %9.4f", "eager", res.tokens / res.ms * 1e3, res.ms,
       human_bytes(res.peak), human_bytes(res.reserved), res.loss)
  if res.graph then
    local g = res.graph
    line("%-7s %12.0f %10.2f %14s %14s %9.4f   (%d nodes; %.2fx eager)", "graph", res.tokens / g.ms * 1e3, g.ms,
         human_bytes(g.peak), human_bytes(g.reserved), g.loss, g.nodes, res.ms / g.ms)
  else
    line("%-7s %s", "graph", res.graph_note)
  end
  line("")
  line("split of an eager step (device synchronised between phases; a pass of %d steps of its own, as each", res.steps)
  line("table below is: on a busy machine their times differ from ms a step's, and from each other's):")
  local total = 0
  for _, k in ipairs(res.order) do total = total + res.split[k] end
  for _, k in ipairs(res.order) do
    line("  %-12s %9.2f ms %6.1f%%", k, res.split[k], 100 * res.split[k] / total)
  end
  line("  %-12s %9.2f ms", "sum", total)
  if #res.optim_rows > 0 then
    line("the optimiser's groups (timed in the op profile's pass):")
    for _, row in ipairs(res.optim_rows) do
      line("    %-10s %9.2f ms", row.name, row.ms / res.steps)
    end
  end
  line("")
  line("op families of an eager step (each op timed %s; shares of the %.2f ms step):",
       r.device == "cuda" and "with CUDA events" or "by the wall clock", res.ms)
  line("%s", profile.table(res.rows, res.ms, {steps = res.steps, top = 15}))
  return table.concat(out, "\n")
end

local function bench(args, cli)
  local cfg = config.load(args.file, args.overrides)
  local steps = count_flag(args.flags, "steps", 10, 1)
  local warmup = count_flag(args.flags, "warmup", 3, 0)
  local r, train = prepare(cfg, cli.root or ".")
  io.stderr:write(string.format("bench: %s, %d warm-up steps...\n", cfg.name, warmup))
  run_steps(r, train, warmup)
  local res = {steps = steps, warmup = warmup, tokens = cfg.batch * cfg.seq * cfg.grad_accum,
               compute_dtype = r.model.compute_dtype}
  io.stderr:write(string.format("bench: %d timed steps, then the split and the op profile...\n", steps))
  res.ms, res.loss = time_steps(r, train, steps)
  local mem = core.memory(r.device)
  res.peak, res.reserved = mem.peak, mem.reserved or mem.peak
  res.split, res.order = split_steps(r, train, steps)
  res.rows = profile_steps(r, train, steps)
  res.optim_rows = {}
  for _, row in ipairs(res.rows) do
    if row.family == "optim" then res.optim_rows[#res.optim_rows + 1] = row end
  end
  res.graph, res.graph_note = graph_steps(r, steps)
  r.loader:close()
  local to_stdout = args.flags.json == "-"        -- the JSON alone on stdout, the table on stderr
  if to_stdout then io.stderr:write(report(r, res), "\n") else print(report(r, res)) end
  if args.flags.json then
    local json = require "dormouse.json"
    local fam = require("dormouse.profile").group(res.rows, function(row) return row.family end)
    local doc = {name = cfg.name, device = r.device, batch = cfg.batch, seq = cfg.seq, tokens = res.tokens,
                 eager = {ms = res.ms, tok_s = res.tokens / res.ms * 1e3, peak = res.peak, reserved = res.reserved,
                          loss = res.loss},
                 graph = res.graph and {ms = res.graph.ms, tok_s = res.tokens / res.graph.ms * 1e3,
                                        peak = res.graph.peak, reserved = res.graph.reserved, nodes = res.graph.nodes,
                                        loss = res.graph.loss},
                 split = res.split, families = {}, ops = {}}
    for _, g in ipairs(fam) do doc.families[g.key] = g.ms / steps end
    for _, row in ipairs(res.rows) do      -- every op of the profile, slowest first
      doc.ops[#doc.ops + 1] = {name = row.name, phase = row.phase, family = row.family, ms = row.ms / steps,
                               calls = row.calls // steps}
    end
    io.stdout:flush()
    core.write_output(args.flags.json, json.encode(doc) .. "\n")
  end
  return 0
end

local function run(argv, cli)
  local ok, args = pcall(config.parse_args, argv, 2, FLAGS)
  if not ok then io.stderr:write("dormouse bench: ", args, "\n", usage, "\n"); return 2 end
  if args.flags.help then io.write(require("dormouse.cli").help_text("bench", usage), "\n"); return 0 end
  if not args.file then io.stderr:write("dormouse bench: which experiment?\n", usage, "\n"); return 2 end
  local done, err = pcall(bench, args, cli)
  if done then return 0 end
  io.stderr:write("dormouse bench: ", tostring(err), "\n")
  return 1
end

return {
  summary = "time an experiment's step: tokens/s, ms, memory, the split and the op families",
  args = "FILE [--set k=v] [--steps N]",
  run = run,
}
