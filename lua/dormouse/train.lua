--[[
The training loop. One run, from a resolved config:

  model, optimiser, corpus  ← config (resumed from a checkpoint when asked)
  for step = first .. steps:
      for each micro-batch:  loss = model(x).loss / grad_accum ;  loss:backward()
      balance the experts on the step's routing counts
      clip, check (the NaN firewall), update
      every log.every steps:      a log line with the window's counters (report.html at most every 30 s)
      every eval.every steps:     held-out fin, bpb_fin, periter, depths, a short sample; report.html
      every checkpoint.every:     a checkpoint (the last `keep` kept)

Everything a run writes goes to runs/NAME/: config.lua (resolved), log.txt,
metrics.jsonl, report.html and the checkpoints.
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local nn = require "dormouse.nn"
local dist = require "dormouse.dist"
local optim = require "dormouse.optim"
local config = require "dormouse.config"
local schema = require "dormouse.schema"
local banks = require "dormouse.banks"
local instrument = require "dormouse.instrument"
local json = require "dormouse.json"
local human = require "dormouse.human"
local report = require "dormouse.report"
local evaluate = require "dormouse.eval"
local tasks = require "dormouse.tasks"
local preflight = require "dormouse.preflight"
local stepping = require "dormouse.step"   -- the training step

local train = {}

---------------------------------------------------------------- set-up

function train.pick_device(cfg)
  if cfg.device ~= "auto" then return cfg.device end
  return core.device_available("cuda") and "cuda" or "cpu"
end

-- the dtype a run's products take on `device`: the config's, but f32 on the CPU
function train.compute_dtype(cfg, device) return device == "cpu" and "f32" or cfg.dtype end

-- What a data-parallel job's rank > 0 writes its lines and records to: nothing (rank 0 writes the run)
local NOWHERE = {write = function(f) return f end, flush = function() end, close = function() end}

local function mkdir(path)
  core.mkdirs(path)
end

local function write_atomic(path, text)
  core.write_file(path, text)
end

-- The model file: models/ARCH.lua returns a function from the model table to a module, or
-- {keys = {rows}, build = that function} when it has keys of its own (config.lua schema_for).
function train.build_model(cfg, root)
  local arch = cfg.model.arch
  local path = config.model_path(arch, root)
  local chunk, err = config.loadfile(path)
  if not chunk then
    local models, near, best = {}, nil, nil
    for _, f in ipairs(core.listdir(root .. "/models") or {}) do
      local name = f:match("^(.+)%.lua$")
      if name then
        models[#models + 1] = name
        local d = config.distance(arch, name)
        if not best or d < best then near, best = name, d end
      end
    end
    table.sort(models)
    local hint = ""
    if not arch:find("/") and #models > 0 then
      hint = string.format(" (%smodels/ holds %s)", near and best <= math.max(2, #arch // 3) and
                           "did you mean '" .. near .. "'? " or "", table.concat(models, ", "))
    end
    error("model.arch " .. arch .. ": " .. err .. hint, 0)
  end
  local made = chunk()
  local build = type(made) == "table" and made.build or made
  if type(build) ~= "function" then
    error(path .. ": a model file must return a function from the model config to a module, or " ..
          "{keys = {...}, build = function} (docs/models.md)", 0)
  end
  return build(cfg.model)
end

--[[ A model that prepares a batch ahead (Engram tables in host memory gather
the next batch's rows while this step runs) gets a function that shows the
loader's next batch without taking it: model:set_lookahead(fn), fn() → x, prefix. ]]
function train.lookahead(r)
  local seg = r.cfg and r.cfg.model.segment
  if seg and seg < r.cfg.seq then return end     -- by segments each lookup is a segment's, not the batch's
  if r.model.set_lookahead and r.loader.peek then
    r.model:set_lookahead(function() return r.loader:peek() end)
  end
end

--[[ Whether run r's step runs as one CUDA graph: cfg.graph when set (true is
checked by step.new, which names what is missing), else whenever it can
(step.why_not_capture, the one list of the preconditions); then the second
result says why not, for the log. ]]
function train.graph_mode(r)
  if r.cfg.graph ~= nil then return r.cfg.graph end
  if r.device ~= "cuda" then return false end
  local why = stepping.why_not_capture(r)
  return why == nil, why
end

--[[ What train.step works on, without a run directory: the resolved config's
device, seeded model and optimiser, corpus and loader (lookahead set), at
step 0 (dormouse bench and the check scripts). opts.root: the folder of models/. ]]
function train.prepare(cfg, opts)
  local r = {cfg = cfg, step = 0, log_now = false, device = train.pick_device(cfg)}
  r.devices = dist.start_device(r.device)         -- NCCL where asked for (DORMOUSE_NCCL): a line, or nil
  r.model, r.opt = train.setup(cfg, r.device, opts and opts.root or ".")
  r.corpus = train.open_corpus(cfg, opts)
  train.fit_to_corpus(r.model, r.corpus)
  r.loader = r.corpus:loader {batch = cfg.batch, seq = cfg.seq, seed = cfg.seed, ctx = train.engram_ctx(cfg)}
  train.lookahead(r)
  return r
end

-- The seeded model and optimiser of a resolved config on `device`.
function train.setup(cfg, device, root)
  dm.manual_seed(cfg.seed)
  local model = nn.build({device = device, compute_dtype = train.compute_dtype(cfg, device)}, train.build_model, cfg, root)
  if cfg.data.records and not model.masks then
    error(string.format("data.records: the model %s does not say that its losses honour opts.mask (the field " ..
                        "masks = true), so it would train on the prompts too; docs/models.md says how " ..
                        "(nn.targets, nn.cross_entropy)", cfg.model.arch), 0)
  end
  return model, optim.new(model, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
end

-- A model's own fit to the corpus before a run's first step (model:prepare: models/byteflow.lua's
-- breaks); returns its phrase for the log, or nil
function train.fit_to_corpus(model, corpus)
  if model.prepare then return model:prepare(corpus) end
end

function train.engram_ctx(cfg) return nn.Engram.context_for(cfg.model.engram.orders) end

local Run = {}
Run.__index = Run

-- A line on stdout and in log.txt; lines said before the run folder exists wait for it.
function Run:say(line)
  if self.bar_shown then io.stdout:write("\r\27[K"); self.bar_shown = false end
  if not self.silent then print(line) end
  if self.log_file then self.log_file:write(line, "\n"); self.log_file:flush()
  else self.early_lines[#self.early_lines + 1] = line end
end

function Run:record(rec)
  self.records[#self.records + 1] = rec
  self.metrics_file:write(json.encode(rec), "\n")
  self.metrics_file:flush()
  if self.tensorboard then self.tensorboard:add(rec) end
end

---------------------------------------------------------------- checkpoints

-- the parameters and buffers by name: what model.safetensors holds
function train.named_state(model)
  local t = {}
  for _, p in ipairs(model:named_parameters()) do t[p.name] = p.tensor end
  for _, b in ipairs(model:named_buffers()) do t[b.name] = b.tensor end
  return t
end

local FLOATS = core.float_dtypes()        -- the floating-point dtypes (vm/core/dtype.c)

--[[ The firewall before a checkpoint: the name of the first tensor (by name) of `tensors` that
holds a NaN or an infinity, or nil. A tensor's sum is the cheap test, one reduction on the
device; a sum that is not finite is confirmed element by element, since finite values can
overflow a sum. Read at checkpoint time only, never inside a step. ]]
function train.first_nonfinite(tensors)
  local names = {}
  for name, t in pairs(tensors) do
    if dm.is_tensor(t) and FLOATS[t.dtype] and t:numel() > 0 then names[#names + 1] = name end
  end
  table.sort(names)
  return dm.no_grad(function()
    for _, name in ipairs(names) do
      local t = tensors[name]
      if not instrument.finite(t:sum():item()) and not instrument.finite(t:abs():max():item()) then return name end
    end
  end)
end

-- A state that would poison every resume is never written (and so never prunes a good one): the
-- run stops, naming the tensor and the newest checkpoint, which passed the same check.
function Run:check_before_checkpoint(state, optim_state)
  local bad, what = train.first_nonfinite(state), "the parameter"
  if not bad then bad, what = train.first_nonfinite(optim_state), "the optimiser state" end
  if not bad then return end
  local last = dm.ckpt.latest(self.dir)
  error(string.format("NaN firewall: %s '%s' holds non-finite values (NaN or inf) after step %d; no checkpoint " ..
                      "of that state was written. %s", what, bad, self.step,
                      last and string.format("The newest checkpoint, %s, passed this check (--resume %s continues " ..
                                             "from it)", last, self.dir)
                           or "The run has no checkpoint yet."), 0)
end

function Run:save_checkpoint()
  if self.follower then return end          -- rank 0 writes the job's checkpoints
  local seed, offset = dm.rng_state()
  local model, model_as, bank_info = train.named_state(self.model), nil, nil
  local optim_state = self.opt:state()
  self:check_before_checkpoint(model, optim_state)
  if self.cfg.checkpoint.banks ~= "f32" then        -- the banks as a low-bit format's codes (banks.lua)
    model, model_as, bank_info = banks.pack(self.model, model, self.cfg.checkpoint.banks)
  end
  local path = dm.ckpt.save(self.dir, self.step, {
    model = model, model_as = model_as,
    optim = optim_state,
    meta = {config = config.plain(self.cfg), step = self.step, data = {position = self.loader:position()},
            rng = {seed, offset}, firewall = self.firewall, banks = bank_info, init = self.init_from,
            ranks = dist.size},
  }, {keep = self.cfg.checkpoint.keep > 0 and self.cfg.checkpoint.keep or nil})
  self:say("checkpoint " .. path)
  if self.replaced then                   -- the run this one overwrote: gone once this one has a checkpoint
    core.remove_tree(self.replaced)
    self:say("removed the overwritten run (" .. self.replaced .. ")")
    self.replaced = nil
  end
end

-- A file of the run folder opened to write, or an error that names it and says why (read-only, full)
function train.open_run_file(path, mode)
  local f, err = io.open(path, mode)
  if not f then error(string.format("cannot write %s", err), 0) end
  return f
end

--[[ The run folder, made only once everything that can refuse the run has
passed (the config, the model, the corpus, a resume's checks): a refused run
leaves the disk as it was. With --overwrite the old run is moved aside to
runs/.NAME.replaced and removed once the new run has written its first
checkpoint; a run that fails before that puts it back. ]]
local function replaced_path(dir)
  local parent, name = dir:match("^(.*)/([^/]+)$")
  return (parent or ".") .. "/." .. (name or dir) .. ".replaced"
end

function Run:open_dir(opts)
  if self.follower then self.log_file = NOWHERE; return end
  local aside = replaced_path(self.dir)
  if core.listdir(aside) then
    error(string.format("%s holds a run that an --overwrite set aside and did not finish replacing: " ..
                        "move it back to %s or remove it, then run again", aside, self.dir), 0)
  end
  if opts.overwrite and not self.in_place and core.listdir(self.dir) then
    local ok, err = os.rename(self.dir, aside)
    if not ok then error(string.format("--overwrite: cannot move %s aside: %s", self.dir, err), 0) end
    self.replaced = aside
  end
  mkdir(self.dir)
  if self.in_place then self:set_later_aside() end
  self.log_file = train.open_run_file(self.dir .. "/log.txt", self.in_place and "a" or "w")
  for _, line in ipairs(self.early_lines) do self.log_file:write(line, "\n") end
  self.log_file:flush()
  write_atomic(self.dir .. "/config.lua", "return " .. dm.ckpt.serialize(config.plain(self.cfg)) .. "\n")
end

-- A resume of an earlier checkpoint in place: the run's later checkpoints are moved aside, never
-- deleted (ckpt-STEP.aside, or .aside-2, ...: no longer checkpoints to resume or prune), and said.
function Run:set_later_aside()
  local moved, taken = {}, {}
  for _, name in ipairs(core.listdir(self.dir) or {}) do taken[name] = true end
  for _, c in ipairs(dm.ckpt.list(self.dir)) do
    if c.step > self.step then
      local base = c.path:match("[^/]+$")
      local to, n = base .. ".aside", 1
      while taken[to] do n = n + 1; to = string.format("%s.aside-%d", base, n) end
      taken[to] = true
      to = self.dir .. "/" .. to
      local ok, err = os.rename(c.path, to)
      if not ok then error(string.format("resume: cannot move %s aside: %s", c.path, err), 0) end
      moved[#moved + 1] = to:match("[^/]+$")
    end
  end
  if #moved > 0 then
    self:say(string.format("resume: %d later checkpoint%s moved aside in %s (%s); remove them once not needed",
                           #moved, #moved == 1 and "" or "s", self.dir, table.concat(moved, ", ")))
  end
end

-- A run that failed after its folder was made: the overwritten run, if still aside, goes back.
function Run:undo_dir()
  if self.log_file then pcall(self.log_file.close, self.log_file); self.log_file = nil end
  if self.metrics_file then pcall(self.metrics_file.close, self.metrics_file); self.metrics_file = nil end
  if self.tensorboard then self.tensorboard:close(); self.tensorboard = nil end
  if self.replaced then
    core.remove_tree(self.dir)
    os.rename(self.replaced, self.dir)
    self.replaced = nil
  end
end

-- Refuse a resume whose resolved config differs other than in progress and form keys; returns the
-- form keys that differ ({key, a, b}: the optimiser's state is converted to them on load)
local function check_same_config(saved, cfg, dir)
  local is_form = {}
  for _, k in ipairs(config.form_keys) do is_form[k] = true end
  local d, form = {}, {}
  for _, x in ipairs(config.diff(saved, config.plain(cfg))) do   -- (progress keys left out)
    if is_form[x.key] then form[#form + 1] = x else d[#d + 1] = x end
  end
  if #d > 0 then
    error(string.format("cannot resume %s: the config differs from the checkpoint's in %d key%s:\n%s",
                        dir, #d, #d == 1 and "" or "s", config.format_diff(d, "checkpoint", "now")), 0)
  end
  return form
end


-- the fields a run's meta.lua must hold, each checked with a message naming it and the file
function train.check_meta(meta, path)
  local where = path .. "/meta.lua"
  local function bad(field, want, v)
    error(string.format("%s: %s must be %s, got %s", where, field, want, v == nil and "nothing" or tostring(v)), 0)
  end
  local function count(field, v) if math.type(v) ~= "integer" or v < 0 then bad(field, "an integer >= 0", v) end end
  if type(meta.config) ~= "table" then bad("config", "the run's config table", meta.config) end
  if type(meta.rng) ~= "table" then bad("rng", "{seed, offset}", meta.rng) end
  count("rng[1] (the seed)", meta.rng[1])
  count("rng[2] (the offset)", meta.rng[2])
  if type(meta.data) ~= "table" then bad("data", "{position = bytes}", meta.data) end
  count("data.position", meta.data.position)
  if meta.data.position > core.loader_max_start() then
    bad("data.position", "at most 2^62 (the batches drawn so far)", meta.data.position)
  end
  if meta.banks ~= nil and (type(meta.banks) ~= "table" or type(meta.banks.format) ~= "string" or
                            type(meta.banks.shapes) ~= "table") then
    bad("banks", "{format = name, shapes = {bank = shape}}", meta.banks)
  end
  if meta.init ~= nil and (type(meta.init) ~= "table" or type(meta.init.run) ~= "string" or
                           math.type(meta.init.step) ~= "integer" or type(meta.init.checksum) ~= "string") then
    bad("init", "{run = folder, step = integer, checksum = XXH64}", meta.init)
  end
  if meta.ranks ~= nil and (math.type(meta.ranks) ~= "integer" or meta.ranks < 1) then
    bad("ranks", "an integer >= 1 (the data-parallel job's ranks)", meta.ranks)
  end
  if meta.firewall ~= nil then
    if type(meta.firewall) ~= "table" then bad("firewall", "{total, windows_with_skips}", meta.firewall) end
    count("firewall.total", meta.firewall.total)
    count("firewall.windows_with_skips", meta.firewall.windows_with_skips)
  end
end

-- the saved tensors against the model's: every name, dtype and shape; none missing, none extra
function train.check_tensors(saved, state, file)
  local function shape(t) return "[" .. table.concat(t:shape(), ", ") .. "]" end
  local names, unlike = {}, {}
  for name in pairs(state) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do                 -- every tensor unlike the model's, named with both shapes
    local s, t = saved[name], state[name]
    if s and (s.dtype ~= t.dtype or shape(s) ~= shape(t)) then
      unlike[#unlike + 1] = string.format("tensor '%s' is %s %s, the model's is %s %s", name, s.dtype, shape(s),
                                          t.dtype, shape(t))
    end
  end
  if #unlike == 1 then error(file .. ": " .. unlike[1], 0) end
  if #unlike > 1 then
    error(string.format("%s: %d tensors unlike the model's:\n  %s", file, #unlike, table.concat(unlike, "\n  ")), 0)
  end
  for name, t in pairs(state) do
    local s = saved[name]
    if not s then error(file .. " has no tensor '" .. name .. "'", 0) end
    if s:numel() > 0 and FLOATS[s.dtype] and not instrument.finite(s:abs():max():item()) then
      error(string.format("%s: tensor '%s' holds non-finite values (NaN or inf); resume from an earlier " ..
                          "checkpoint", file, name), 0)
    end
  end
  local extra = {}
  for name in pairs(saved) do if not state[name] then extra[#extra + 1] = "'" .. name .. "'" end end
  table.sort(extra)
  if #extra > 0 then
    error(string.format("%s holds %d tensor%s the model does not have: %s", file, #extra, #extra == 1 and "" or "s",
                        table.concat(extra, ", ")), 0)
  end
end

--[[ What a --resume path names: a run folder (its newest complete checkpoint) or one checkpoint
of it, RUN/ckpt-STEP. Returns the run folder and the checkpoint's path. ]]
function train.resume_point(path, verb)
  verb = verb or "resume"
  path = path:gsub("(.)/+$", "%1")
  local function listed(dir)                    -- "ckpt-20, ckpt-40" or "none"
    local names = {}
    for _, c in ipairs(dm.ckpt.list(dir)) do names[#names + 1] = c.path:match("[^/]+$") end
    return #names > 0 and table.concat(names, ", ") or "none"
  end
  local run_dir = path:match("^(.*)/ckpt%-%d+$")
  if run_dir and core.file_kind(run_dir) == "a directory" then
    for _, c in ipairs(dm.ckpt.list(run_dir)) do
      if c.path == path then return run_dir, path end
    end
    error(string.format("cannot %s %s: it is not a complete checkpoint of %s (its checkpoints: %s)", verb, path,
                        run_dir, listed(run_dir)), 0)
  end
  if core.file_kind(path) == "missing" then
    error(string.format("cannot %s %s: there is no such run folder", verb, path), 0)
  end
  local latest = dm.ckpt.latest(path)
  if not latest then error(string.format("cannot %s %s: it holds no complete checkpoint", verb, path), 0) end
  return path, latest
end

function Run:restore(run_dir, path)
  local c = dm.ckpt.load(path)
  train.check_meta(c.meta, path)
  local folder_step = math.tointeger(tonumber(path:match("ckpt%-(%d+)$")))
  if c.meta.step ~= folder_step then
    error(string.format("%s/meta.lua: step %d, but the folder is ckpt-%s: a checkpoint's meta.lua and its " ..
                        "folder disagree; resume from another checkpoint", path, c.meta.step, tostring(folder_step)), 0)
  end
  local ranks = c.meta.ranks or 1
  if ranks ~= dist.size then
    error(string.format("cannot resume %s: its checkpoints were written by a job of %d rank%s (a step of %d x batch " ..
                        "rows) and this job has %d; resume it with mpirun -np %d", run_dir, ranks,
                        ranks == 1 and "" or "s", ranks, dist.size, ranks), 0)
  end
  local saved = config.upgrade(c.meta.config)
  if run_dir ~= self.dir and type(saved) == "table" then saved.name = self.cfg.name end   -- continued under a new name
  for _, x in ipairs(check_same_config(saved, self.cfg, run_dir)) do
    self:say(string.format("resume: %s was %s, now %s: the optimiser's state is converted on load", x.key,
                           tostring(x.a), tostring(x.b)))
  end
  local state = train.named_state(self.model)
  c.model = banks.unpack(c.model, c.meta.banks, path .. "/model.safetensors")
  train.check_tensors(c.model, state, path .. "/model.safetensors")
  dm.no_grad(function()
    for name, t in pairs(state) do t:copy_(c.model[name]) end
  end)
  local bad = train.first_nonfinite(c.optim)
  if bad then
    error(string.format("%s/optim.safetensors: tensor '%s' holds non-finite values (NaN or inf); resume from an " ..
                        "earlier checkpoint", path, bad), 0)
  end
  self.opt:load_state(c.optim)
  dm.set_rng_state(c.meta.rng[1], c.meta.rng[2])
  self.step = c.meta.step
  self.data_position = c.meta.data.position
  self.firewall = c.meta.firewall or self.firewall
  self.init_from = c.meta.init
  self:say(string.format("resumed from %s at step %d", path, self.step))
  if c.meta.banks then
    self:say(string.format("resume: the experts' banks were saved as %s: training continues from the values of " ..
                           "their codes, not from the f32 masters (a resume from them is not the run's own)",
                           c.meta.banks.format))
  end
end

-- The weights of loaded checkpoint c (at `point`) into model, each tensor's dtype and shape checked
local function load_weights(model, c, point)
  local state = train.named_state(model)
  local file = point .. "/model.safetensors"
  local tensors = banks.unpack(c.model, c.meta.banks, file)
  train.check_tensors(tensors, state, file)
  dm.no_grad(function()
    for name, t in pairs(state) do t:copy_(tensors[name]) end
  end)
end

--[[ A second model of the run's config, out of training, with the weights this run started from
(its init: the run, step and checksum its meta keeps); the global random state is left as it was.
The reference of rl.kl (dormouse.rl). ]]
function Run:initial_model(root)
  local cfg, device, init = self.cfg, self.device, self.init_from
  local point = init.run .. "/ckpt-" .. init.step
  local seed, offset = dm.rng_state()
  local model = nn.build({device = device, compute_dtype = train.compute_dtype(cfg, device)}, train.build_model, cfg,
                         root)
  dm.set_rng_state(seed, offset)
  local c = dm.ckpt.load(point)
  load_weights(model, c, point)
  local sum = dm.ckpt.checksum(point .. "/model.safetensors")
  if sum ~= init.checksum then
    error(string.format("rl.kl: %s/model.safetensors has changed since this run started from it (checksum %s, " ..
                        "then %s)", point, sum, init.checksum), 0)
  end
  model:eval()
  return model
end

--[[ init: the model's weights from the checkpoint cfg.init names (a run folder's newest, or
RUN/ckpt-STEP), everything else fresh. Refused, naming each: a model key that differs from the
checkpoint's other than those marked tune (schema.lua), and a tensor whose dtype or shape
differs. Keeps {run, step, checksum} (model.safetensors's XXH64) for this run's checkpoints. ]]
function Run:start_from(path)
  local run_dir, point = train.resume_point(path, "start from")
  local c = dm.ckpt.load(point)
  train.check_meta(c.meta, point)
  local saved = config.upgrade(c.meta.config)
  local d = config.diff({model = saved.model}, {model = config.plain(self.cfg).model}, config.tune_keys)
  if #d > 0 then
    error(string.format("init %s: the model differs from the checkpoint's in %d key%s that define%s its " ..
                        "weights:\n%s\n(a run from a checkpoint may change only these model keys: %s)", point, #d,
                        #d == 1 and "" or "s", #d == 1 and "s" or "", config.format_diff(d, "checkpoint", "now"),
                        table.concat(config.tune_keys, ", ")), 0)
  end
  load_weights(self.model, c, point)
  local sum = dm.ckpt.checksum(point .. "/model.safetensors")
  self.init_from = {run = run_dir, step = c.meta.step, checksum = sum}
  self:say(string.format("init: the model's weights from %s (step %d, model.safetensors %s); the optimiser, " ..
                         "schedule, data and step start fresh", point, c.meta.step, sum))
end

---------------------------------------------------------------- the step

--[[ One eager step of r (a run, or anything holding cfg, model, opt, loader, device and step),
read back at once: {loss, grad_norm (the step's, applied or skipped), skipped, lr, lr_mult,
counts, drops, engram, extras (summed over applied steps: nil or zero for a skipped one),
events}. The step is r.stepper's (dormouse.step, made eager on the first call); mark(phase),
when given, as Step:body takes it. For the tools that look at every step (dormouse stress and
long, the tests); a run reads its steps at log time. ]]
function train.step(r, mark)
  r.stepper = r.stepper or stepping.new(r)
  local res = r.stepper:run(r.step, {mark = mark})
  local w, last = r.stepper:window(1), r.stepper:last()
  return {loss = last.loss, grad_norm = last.grad_norm, skipped = w.applied == 0, lr = res.lr,
          lr_mult = res.lr_mult, counts = w.counts, drops = w.drops, engram = w.engram, extras = w.extras,
          events = res.events}
end

local function ceiling(cfg, loss, step, window)
  if instrument.finite(loss) and loss > cfg.ce_ceiling then
    error(string.format("CE ceiling: the training loss %.4g at step %d is above %g (window of steps %d..%d)",
                        loss, step, cfg.ce_ceiling, step - window.steps + 1, step), 0)
  end
end

-- One step into the window (a policy-gradient step with rl.k > 0: dormouse.rl); the window's sums
-- are read from the device at log time only, so the loss (and the CE ceiling) is the window's
-- mean. Returns the last window's loss.
function Run:take_step(window, tokens)
  local r
  if self.rl then r = self.rl:step(self)
  else r = self.stepper:run(self.step) end
  window.events = instrument.add_events(window.events, r.events)
  window.steps = window.steps + 1
  window.tokens = window.tokens + (self.rl and self.rl.sampled or tokens)   -- RL: the bytes it sampled
  window.lr = r.lr
  if self.log_now then
    local w = self.stepper:window(window.steps)
    window.loss, window.grad_norm, window.skips, window.counts = w.loss, w.grad_norm, w.skips, w.counts
    window.drops, window.extras = w.drops, w.extras
    window.engram = w.engram
    self.window_loss = w.applied > 0 and w.loss / w.applied or 0 / 0
    ceiling(self.cfg, self.window_loss, self.step, window)
  end
  return self.window_loss
end

-- KDA's forward passes by path so far, the captured step's replays included
function Run:kda_totals()
  local chunked, recurrent = core.kda_passes()
  if self.stepper then
    local c, r = self.stepper:kda_passes()
    chunked, recurrent = chunked + c, recurrent + r
  end
  return {chunked = chunked, recurrent = recurrent}
end

-- the training steps' KDA passes since the last call (evals and samples in between not counted), and
-- once, where a CUDA run's steps took the recurrent path, a line that says so
function Run:kda_window()
  local now, last = self:kda_totals(), self.kda_last or {chunked = 0, recurrent = 0}
  self.kda_last = now
  local d = {chunked = now.chunked - last.chunked, recurrent = now.recurrent - last.recurrent}
  if d.recurrent > 0 and self.device == "cuda" and not self.kda_warned then
    self.kda_warned = true
    self:say(string.format("kda: %d forward passes of the window took the recurrent path on cuda (slow: the " ..
                           "chunked kernels need T >= 64, dk and dv <= 64, not f64); the log line counts them",
                           d.recurrent))
  end
  return d
end

function Run:log_window(w)
  local now = os.time()
  local elapsed = math.max(core.now() - w.t0, 1e-9)
  local mem = dm.memory(self.device)
  local drops = w.drops
  if dm.is_tensor(drops) then drops = drops:sum():item() end
  local counts = w.counts and w.counts:totable()
  local moe = instrument.moe_counters(w.counts, drops)
  local applied = w.steps - w.skips               -- a window of skipped steps only has no loss: nan, never 0
  local extras
  for name, v in pairs(w.extras or {}) do       -- device sums (eager) or numbers (the graph's window)
    extras = extras or {}
    extras[name] = applied > 0 and (dm.is_tensor(v) and v:item() or v) / applied or 0 / 0
  end
  if self.model.after_window then              -- the window's own measures (ortho) and the arms on them
    local measures, events = self.model:after_window({orthogonality = self.cfg.log.orthogonality})
    for name, v in pairs(measures or {}) do extras = extras or {}; extras[name] = v end
    w.events = instrument.add_events(w.events, events)
  end
  local r = {step = self.step, loss = applied > 0 and w.loss / applied or 0 / 0, tok_s = w.tokens / elapsed,
             policy = self.rl ~= nil,
             lr = w.lr, grad_norm = applied > 0 and w.grad_norm / applied or 0 / 0, skips = w.skips,
             mem = {allocated = mem.allocated, peak = mem.peak}, moe = moe, engram = w.engram, extras = extras,
             events = w.events, kda = self:kda_window()}
  self.guard_state = self.guard_state or {}
  r.utilisation, r.utilisation_windows = instrument.utilisation(self.guard_state, moe, self.cfg.guard)
  self:say(instrument.log_line(r))
  self.last_moe = moe
  self:record({kind = "log", step = r.step, loss = r.loss, tok_s = r.tok_s, lr = r.lr,
               grad_norm = r.grad_norm, skips = r.skips, mem_allocated = mem.allocated, mem_peak = mem.peak,
               moe_busiest = moe and moe.busiest, moe_entropy = moe and moe.entropy,
               moe_dead = moe and moe.dead, moe_drops = moe and moe.drops, moe_load = instrument.shares(counts),
               engram_rows = w.engram and w.engram.rows, engram_unique = w.engram and w.engram.unique_frac,
               kda_chunked = r.kda.chunked, kda_recurrent = r.kda.recurrent, utilisation = r.utilisation,
               extras = extras, events = w.events, time = now})
  -- the page between evals, at most every 30 s (as often as it reloads); the last comes with the final eval
  if self.step < self.cfg.steps and core.now() - (self.report_at or -math.huge) >= 30 then self:write_report(true) end
  if instrument.end_window(self.firewall, w) then
    error(string.format("NaN firewall: steps were skipped in two log windows in a row (%d skipped in all, " ..
                        "the last window ends at step %d); the run stops", self.firewall.total, self.step), 0)
  end
  if r.utilisation and self.cfg.guard.action == "stop" then
    self:save_checkpoint()
    error(string.format("utilisation floor: %s for %d log windows in a row, to step %d; the run stops with its " ..
                        "checkpoint (--resume %s continues it; guard.action = flag only says so)", r.utilisation,
                        r.utilisation_windows, self.step, self.dir), 0)
  end
  if w.skips > 0 and self.step == self.cfg.steps then   -- no later window can clear it: no checkpoint of it
    error(string.format("NaN firewall: %d of the %d steps of the final log window (to step %d) were skipped; " ..
                        "the run stops without a checkpoint of that state", w.skips, w.steps, self.step), 0)
  end
end

function Run:eval()
  if self.follower then return end          -- a data-parallel job's rank 0 evaluates; its replicas are equal
  local e = evaluate.held_out(self.model, self.eval_x, self.eval_prefix, {
    batch = self.cfg.batch, device = self.device, depths = self.cfg.eval.depths, segment = self.cfg.model.segment,
    mask = self.eval_mask})
  e.step = self.step
  if self.tasks then                        -- correct@B of eval.tasks, beside the model's own measures
    e.measures = e.measures or {}
    for name, v in pairs(tasks.correct_at(self.model, self.tasks, self.cfg.eval.budgets, {device = self.device})) do
      e.measures[name] = v
    end
  end
  local exact = self.eval_mask and tasks.of_records(self.corpus:held_out(), self.cfg.eval.exact)
  if exact then                             -- exact@B: held-out responses generated within B bytes
    e.measures = e.measures or {}
    for name, v in pairs(tasks.correct_at(self.model, exact, self.cfg.eval.budgets, {device = self.device})) do
      e.measures["exact" .. name:match("@%d+$")] = v
    end
    -- pass@B: the code records' outputs run against their tests (any solution, not only the response)
    for name, v in pairs(tasks.passed_at(self.model, exact, self.cfg.eval.budgets, {device = self.device}) or {}) do
      e.measures[name] = v
    end
  end
  self:say(instrument.eval_line(e, self.baselines))
  local rec = {kind = "eval", step = self.step, time = os.time(), bytes = e.bytes, ctx = e.ctx, segment = e.segment,
               fin = e.fin,
               bpb_fin = e.fin / instrument.LN2,
               periter = e.periter, depths = e.depths, measures = e.measures}
  self:record(rec)
  self.last_eval = e
  self.first_eval = self.first_eval or e
  if self.cfg.eval.sample > 0 and not self.sample_failed then   -- a short sample for the report (streamed)
    local ok, text = pcall(evaluate.sample, self.model, self:sample_prompt(), self.cfg.eval.sample,
                           {temperature = 0.8, seed = self.cfg.seed, device = self.device})
    if ok then
      self:record({kind = "sample", step = self.step, time = os.time(), text = text})
    else                                    -- the report's sample is not worth the run: said, then off
      self.sample_failed = true
      self:say("eval: the report's sample failed, and is off for the rest of the run: " .. tostring(text))
    end
  end
  self:write_report(self.step < self.cfg.steps)
  self.kda_last = self:kda_totals()          -- the eval's passes are not the next window's
  return e
end

-- report.html from the records so far; live: the page reloads itself while the run goes;
-- stopped: the run ended before its last step (a stop, a signal)
function Run:write_report(live, stopped)
  if self.follower then return end
  self.report_at = core.now()
  write_atomic(self.dir .. "/report.html", report.html({name = self.cfg.name, config_text = self.config_text,
    summary = self.summary, live = live, stopped = stopped and self.step}, self.records, self.baselines))
end

---------------------------------------------------------------- the run

-- A path without its "." parts and doubled slashes, to compare two spellings of one folder ("./x", "x")
function train.plain_path(p)
  local parts = {}
  for part in p:gmatch("[^/]+") do if part ~= "." then parts[#parts + 1] = part end end
  return (p:sub(1, 1) == "/" and "/" or "") .. table.concat(parts, "/")
end

-- A file a config names: as given when it is there, else under the install's root (tasks/kjv.lua)
function train.find_file(path, root)
  if core.file_kind(path) ~= "missing" or path:sub(1, 1) == "/" then return path end
  local installed = (root or ".") .. "/" .. path
  return core.file_kind(installed) ~= "missing" and installed or path
end

--[[ The byte corpus a config names, as data.open takes it: {paths, opts = {eval_bytes, weights,
eval}, label = a short description}. data.path is one source (nil: the embedded corpus);
data.sources a mixture drawn by data.weights (nil: equal); data.eval a held-out source. ]]
function train.corpus_spec(d)
  if d.path and d.sources then
    error(string.format("data.path (%s) and data.sources (%s): a run reads one or the other", d.path,
                        table.concat(d.sources, ", ")), 0)
  end
  if d.weights and not d.sources then error("data.weights needs data.sources (the weights are theirs)", 0) end
  if d.sources and #d.sources == 0 then error("data.sources = {} names no source", 0) end
  if d.weights and #d.weights ~= #d.sources then
    error(string.format("data.weights has %d entries and data.sources %d: give one weight a source", #d.weights,
                        #d.sources), 0)
  end
  local paths = d.sources or {d.path or dm.data.default_corpus()}
  local weights = d.sources and (d.weights or {})
  local label = {}
  for i = 1, d.sources and #paths or 0 do
    weights[i] = weights[i] or 1
    label[i] = string.format("%s x %g", paths[i], weights[i])
  end
  return {paths = paths, opts = {eval_bytes = d.eval_bytes, weights = weights, eval = d.eval},
          label = d.sources and table.concat(label, " + ") or paths[1]}
end

--[[ The run's data and its path: the byte corpus of data.path or data.sources, or with
data.records a record set (dormouse.records: its loader's batches bring a mask, the loss covering
the response bytes). opts.root: where a path not found here is looked for (tasks/addition.lua in
the install). ]]
function train.open_corpus(cfg, opts)
  local d = cfg.data
  if d.records then
    for _, key in ipairs {"path", "sources", "eval"} do
      if d[key] then
        error(string.format("data.records (%s) and data.%s (%s): a run trains on one or the other", d.records, key,
                            type(d[key]) == "table" and table.concat(d[key], ", ") or d[key]), 0)
      end
    end
    local paths = {}
    for name in d.records:gmatch("[^,]+") do
      paths[#paths + 1] = train.find_file(name:match("^%s*(.-)%s*$"), opts and opts.root)
    end
    if #paths == 0 then error(string.format("data.records = %q names no file", d.records), 0) end
    return require("dormouse.records").open(paths, {eval_records = d.eval_records}), table.concat(paths, ",")
  end
  local spec = train.corpus_spec(d)
  return dm.data.open(spec.paths, spec.opts), spec.label
end

-- Every line of metrics.jsonl up to `step`, so a resumed run's file continues cleanly.
local function read_records(path, upto)
  local records = {}
  local f = io.open(path, "r")
  if not f then return records end
  for line in f:lines() do
    local ok, rec = pcall(json.decode, line)        -- a line cut by a kill is no record
    if ok and type(rec) == "table" and type(rec.kind) == "string" and math.type(rec.step) == "integer"
       and rec.step <= upto then
      rec.raw = line
      if rec.depths then                  -- depth -> fin_D: a list when the depths are 1..n, else an object
        local depths = {}
        for D, v in pairs(rec.depths) do depths[tonumber(D)] = v end
        rec.depths = depths
      end
      records[#records + 1] = rec
    end
  end
  f:close()
  return records
end

-- A run's steady rate: the median tokens/s of its log windows but the first (which holds the
-- warm-up and any capture), or of the one there is; the peak device memory any window saw; and
-- the last window's training loss.
local function steady_rate(records)
  local rates, peak, loss = {}, nil, nil
  for _, r in ipairs(records) do
    if r.kind == "log" then
      rates[#rates + 1] = r.tok_s
      if r.mem_peak then peak = math.max(peak or 0, r.mem_peak) end
      loss = r.loss
    end
  end
  if #rates > 1 then table.remove(rates, 1) end
  table.sort(rates)
  return rates[(#rates + 1) // 2], peak, loss
end

--[[ Train from a resolved config. opts: resume = run dir, overwrite = bool,
quiet = bool (no progress bar), silent = bool (nothing on stdout;
the log file still gets every line), root = the folder holding models/, runs = the
folder of run directories ("runs"), stop_at = a step after which the run
stops as if killed (tests of resume). Returns a summary {step, bpb_fin,
baselines, dir, model, device, periter, moe = the last log window's routing
counters, moe_worst = {busiest, dead}: the largest of any log window past the warm-up (nil
without routing), tok_s = the median log window's tokens/s but the first, mem_peak =
the peak device memory in bytes, train_bpb = the last log window's training loss in bits a
byte}. ]]
local run_body

--[[ A run folder has one process at a time: a lock beside it, PARENT/.NAME.lock, held for the
life of the run (flock: the kernel lets it go when the process ends, a kill -9 too, so a stale
one never blocks). Beside, not inside: --overwrite moves the folder aside. Returns the lock's
descriptor; a second process is refused with the holder's pid. ]]
function train.lock_run(dir)
  local parent, name = dir:match("^(.*)/([^/]+)$")
  parent, name = parent or ".", name or dir
  if parent ~= "" then mkdir(parent) end
  local path = (parent == "" and "" or parent .. "/") .. "." .. name .. ".lock"
  local fd, holder = core.lock_file(path)
  if not fd then
    error(string.format("%s is in use by process %d (its lock %s): wait for that run to end or stop it; " ..
                        "two processes in one run folder would overwrite each other's checkpoints",
                        dir, holder, path), 0)
  end
  return fd
end

--[[ What a data-parallel job cannot run yet, refused by name before anything is written. ]]
function train.check_parallel(cfg)
  local function refuse(what)
    error(string.format("a data-parallel job (%d ranks) cannot run %s yet; run it as one process", dist.size, what), 0)
  end
  if cfg.data.records then refuse("data.records (each rank's loss covers another count of response bytes)") end
  if cfg.rl.k > 0 then refuse("rl.k > 0 (each rank samples its own rollouts)") end
  if cfg.model.engram and cfg.model.engram.ram then refuse("model.engram.ram (the host tables' own sparse Adam)") end
end

function train.run(cfg, opts)
  opts = opts or {}
  local err = schema.run_name_error(cfg.name)
  if err then error(err, 0) end
  local self = setmetatable({cfg = cfg, records = {}, firewall = instrument.firewall(), step = 0,
                             data_position = 0, silent = opts.silent, early_lines = {}}, Run)
  self.device = train.pick_device(cfg)
  self.dir = (opts.runs or "runs") .. "/" .. cfg.name
  if dist.active() then train.check_parallel(cfg) end
  self.follower = opts.follower                -- a data-parallel job's rank > 0: reads the run, writes nothing
  if self.follower then self.silent = true end
  local lock = not self.follower and train.lock_run(self.dir)
  local ok_point, from_dir, from = pcall(function() if opts.resume then return train.resume_point(opts.resume) end end)
  if not ok_point then if lock then core.unlock_file(lock) end; error(from_dir, 0) end
  self.from_dir, self.from = from_dir, from              -- the run folder and checkpoint a resume reads
  self.in_place = from_dir ~= nil and train.plain_path(from_dir) == train.plain_path(self.dir)   -- writes where it reads
  if not self.in_place and not self.follower and dm.ckpt.latest(self.dir) and not opts.overwrite then
    core.unlock_file(lock)
    error(string.format("%s already holds checkpoints: resume it with --resume %s, or choose another " ..
                        "name with --set name=..., or pass --overwrite", self.dir, self.dir), 0)
  end
  self.config_text = config.describe(cfg)
  if dist.active() then dist.same(self.config_text, "config") end
  core.signals_hold(true)                     -- SIGINT/SIGTERM end the run between steps (Run:loop)
  local ok, res = pcall(run_body, self, cfg, opts)
  local sig = ok and core.signal_pending()      -- one that came during the last step or after it
  core.signals_hold(false)
  if not ok then self:undo_dir() end
  if lock then core.unlock_file(lock) end
  if not ok then error(res, 0) end
  if sig and not self.follower then             -- not dropped: the run is whole, and the caller stops
    local msg = string.format("%s: the run had reached its last step (%d) and is complete, with its checkpoint",
                              sig, res.step)
    local log = io.open(self.dir .. "/log.txt", "a")
    if log then log:write(msg, "\n"); log:close() end
    error(msg, 0)
  end
  return res
end

function run_body(self, cfg, opts)
  if train.compute_dtype(cfg, self.device) ~= cfg.dtype then
    self:say("cpu: matrix products run in f32 (dtype = " .. cfg.dtype .. " applies on the GPU)")
  end
  self.model, self.opt = train.setup(cfg, self.device, opts.root or ".")

  local corpus, path = train.open_corpus(cfg, opts)
  self.corpus = corpus
  local counts = self.model.counts and self.model:counts()
  self.summary = string.format("%s on %s: %s parameters%s; %s; device %s",
    cfg.name, cfg.model.arch, human.count(self.model:n_params()),
    counts and string.format(" (%s without the Engram tables, %s active per token per iteration)",
                             human.count(counts.without_tables), human.count(counts.active)) or "",
    corpus.describe and corpus:describe() or
      string.format("corpus %s (%d bytes, %d held out%s)", path, corpus:size(), corpus:eval_size(),
                    cfg.data.eval and " from " .. cfg.data.eval or ""), self.device)
  self:say(self.summary)
  for _, w in ipairs(corpus.decoded_whole and corpus:decoded_whole() or {}) do
    self:say(string.format("corpus: %s is held whole in memory (%d bytes decoded): its zstd frames are too large " ..
                           "to read in place; `dormouse corpus pack OUT.zst %s` writes it in frames", w.path, w.bytes,
                           w.path))
  end
  self:say(self.opt:describe())
  local arms = self.model.arms and self.model:arms() or {}
  if #arms > 0 then self:say("arms: " .. table.concat(arms, "; ")) end

  if cfg.eval.tasks then self.tasks = tasks.load(train.find_file(cfg.eval.tasks, opts.root)) end
  if dist.active() then
    self:say(string.format("data parallel: %d ranks over MPI, each %d rows of a step's %d (this is rank %d)",
                           dist.size, cfg.batch, cfg.batch * dist.size, dist.rank))
  end
  local devices = dist.start_device(self.device)
  if devices then self:say(devices) end
  if opts.resume then
    self:restore(self.from_dir, self.from)
    dist.barrier()                           -- every rank has read it before rank 0 writes beside it
  else
    local fitted = train.fit_to_corpus(self.model, corpus)
    if fitted then self:say(fitted) end
    if cfg.init then self:start_from(cfg.init) end
  end
  preflight.check(cfg, self.device, train.named_state(self.model), self.opt:state(), self.step, self.dir)
  self:open_dir(opts)
  local metrics_path = self.dir .. "/metrics.jsonl"
  if opts.resume then
    self.records = read_records(self.from_dir .. "/metrics.jsonl", self.step)
    local lines = {}
    for _, r in ipairs(self.records) do lines[#lines + 1] = r.raw end
    if not self.follower then write_atomic(metrics_path, #lines > 0 and table.concat(lines, "\n") .. "\n" or "") end
  end
  self.metrics_file = self.follower and NOWHERE or train.open_run_file(metrics_path, opts.resume and "a" or "w")
  if cfg.log.tensorboard and not self.follower then    -- dir/tb: on resume made again from the metrics kept
    local tb = require "dormouse.tensorboard"
    self.tensorboard = opts.resume and tb.rewrite(self.dir .. "/tb", self.records) or tb.open(self.dir .. "/tb")
  end

  local ctx = train.engram_ctx(cfg)
  local eval_seq = cfg.data.ctx or cfg.seq
  local cut
  self.eval_x, self.eval_prefix, self.eval_mask, cut = corpus:eval_windows {seq = eval_seq, n = cfg.eval.windows,
                                                                            ctx = ctx}
  dm.keep(self.eval_x); dm.keep(self.eval_prefix)
  if self.eval_mask then
    dm.keep(self.eval_mask)
    self:say(string.format("records: the eval scores the responses of %d held-out windows (bpb_fin: over the " ..
                           "response bytes)%s%s", self.eval_x:size(1),
                           cut > 0 and string.format("; %d held-out records are longer than %d bytes and cut",
                                                     cut, eval_seq + 1) or "",
                           #cfg.eval.baseline > 0 and "; no n-gram baseline on records (eval.baseline)" or ""))
  end
  self.baselines = {}
  for _, order in ipairs(self.eval_mask and {} or cfg.eval.baseline) do
    local bpb = corpus:ngram_bpb(order, {seq = eval_seq, n = self.eval_x:size(1),
                                         sample = cfg.eval.baseline_bytes})
    self.baselines[#self.baselines + 1] = {order = order, bpb = bpb}
  end
  self.loader = corpus:loader {batch = cfg.batch, seq = cfg.seq, seed = cfg.seed, ctx = ctx,
                               start = self.data_position, first_row = dist.active() and dist.rank * cfg.batch or nil}
  if cfg.rl.k > 0 then self.rl = require("dormouse.rl").new(self, opts.root)
  else train.lookahead(self) end                  -- (an RL step's rows are sampled, not the loader's)
  local graph, why = train.graph_mode(self)
  self.stepper = stepping.new(self, {capture = graph})
  if graph then
    self:say("graph: the step is captured as one CUDA graph after " .. self.stepper.warmup .. " eager steps and " ..
             "replayed" .. (cfg.graph == nil and " (graph = nil: the default where it can; --set graph=false for " ..
                            "eager)" or ""))
  elseif why then
    self:say("graph: eager steps (" .. why .. ")")
  end

  if self.init_from and self.step == 0 then self:eval() end   -- where the checkpoint's weights start
  local ok, err = pcall(self.loop, self, opts)     -- a graph's pool goes back also when the loop fails
  self.stepper:free()
  if not ok then error(err, 0) end
  self.loader:close()
  self.metrics_file:close()
  if self.tensorboard then self.tensorboard:close() end
  self.log_file:close()
  local e = self.last_eval
  local tok_s, mem_peak, loss = steady_rate(self.records)
  return {step = self.step, bpb_fin = e and e.fin / instrument.LN2, baselines = self.baselines, dir = self.dir,
          model = self.model, device = self.device, periter = e and e.periter, moe = self.last_moe,
          moe_worst = instrument.worst_routing(self.records, self.cfg.schedule.warmup),
          tok_s = tok_s, mem_peak = mem_peak, measures = e and e.measures,
          train_bpb = loss and loss / instrument.LN2, sample_prompt = self:sample_prompt(),
          first_eval = self.first_eval and {step = self.first_eval.step, bpb_fin = self.first_eval.fin / instrument.LN2,
                                            measures = self.first_eval.measures}}
end

-- What a sample of the run starts from: the first held-out record's prompt (records), else a verse's opening
function Run:sample_prompt()
  return self.eval_mask and self.corpus:held_out()[1].prompt or "In the beginning"
end

-- A due checkpoint is written after an applied step only: after a skipped one it waits for the
-- next applied step (said once). Returns whether it was written.
function Run:checkpoint_after_applied()
  if self.stepper:skipped() then          -- (read from the device only when a checkpoint is due)
    if not self.checkpoint_due then
      self:say(string.format("checkpoint of step %d deferred: the NaN firewall skipped that step; it is written " ..
                             "after the next applied one", self.step))
    end
    self.checkpoint_due = true
    return false
  end
  self.checkpoint_due = nil
  self:save_checkpoint()
  return true
end

-- Every parameter, buffer and optimiser state after the step, into the op trace: the
-- optimiser's update runs no ops, so a difference it makes shows here first.
function Run:trace_state()
  for _, part in ipairs {{"", train.named_state(self.model)}, {"optimiser state ", self.opt:state()}} do
    local prefix, state, names = part[1], part[2], {}
    for name in pairs(state) do names[#names + 1] = name end
    table.sort(names)
    for _, name in ipairs(names) do core.trace_tensor(prefix .. name .. " after step " .. self.step, state[name]) end
  end
end

-- The steps of a run, with its log lines, evals, checkpoints and progress bar.
function Run:loop(opts)
  local cfg = self.cfg
  local tty = not opts.quiet and core.isatty(1)
  local tokens_per_step = cfg.batch * cfg.seq * cfg.grad_accum * dist.size   -- every rank's
  local window = instrument.window()
  self.kda_last = self:kda_totals()
  local t_start = core.now()
  local first = self.step
  local last = math.min(cfg.steps, opts.stop_at or cfg.steps)
  while self.step < last do
    self.step = self.step + 1
    self.log_now = self.step % cfg.log.every == 0 or self.step == cfg.steps
    local tracing = core.trace_on()         -- dormouse determinism's search for the op where runs part
    if tracing then core.trace_mark("step " .. self.step) end
    local loss = self:take_step(window, tokens_per_step)
    if tracing then self:trace_state() end
    if self.log_now then self:log_window(window); window = instrument.window() end
    if (cfg.eval.every > 0 and self.step % cfg.eval.every == 0) or self.step == cfg.steps then self:eval() end
    local due = self.checkpoint_due or (cfg.checkpoint.every > 0 and self.step % cfg.checkpoint.every == 0) or
                self.step == cfg.steps
    local saved = due and self:checkpoint_after_applied()
    local sig = self.step < last and core.signal_pending()
    if sig then                               -- Ctrl-C or a TERM: this step is done; keep it, then stop
      if self.bar_shown then io.stdout:write("\r\27[K"); self.bar_shown = false end
      if not saved then self:save_checkpoint() end
      self:write_report(false, true)
      local msg = string.format("%s: the run stopped after step %d with its checkpoint; continue it with " ..
                                "--resume %s", sig, self.step, self.dir)
      self.log_file:write(msg, "\n")
      error(msg, 0)
    end
    if tty then
      io.stdout:write(instrument.progress(self.step - first, last - first, core.now() - t_start,
                                          loss and string.format("loss %.4f", loss) or ""))
      io.stdout:flush()
      self.bar_shown = true
    end
  end
  if self.bar_shown then io.stdout:write("\r\27[K") end
  if self.step < cfg.steps then self:write_report(false, true) end   -- stopped early (stop_at): not live
end

return train
