--[[
Probing a trained model in the REPL: `dormouse repl runs/NAME[/ckpt-STEP]`
loads the checkpoint and its config and defines these helpers (help() lists
them):

  sample(prompt, n, {temperature, top_p, seed})   stream n bytes after prompt
  loss(text)        CE per iteration and fin_D at every depth, in bits per byte
  experts(text)     routed-expert usage over the text: busiest, entropy, dead, top experts
  engram(text)      Engram rows the text hits, per order, and how many are distinct
  params()          every parameter: name, shape, norm
  tensor(name)      a parameter or buffer by name
  model, cfg        the model and its resolved config
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local eval = require "dormouse.eval"

local probe = {}

local core = require "dormouse.core"
local human = require "dormouse.human"

local LN2 = math.log(2)

local function text_batch(text, what)
  if type(text) ~= "string" then
    error(string.format("%s(text): text must be a string, got %s", what, type(text)), 3)
  end
  local bytes = {text:byte(1, -1)}
  if #bytes < 2 then error("the text needs at least two bytes (an input and a target)", 3) end
  return dm.tensor({bytes}, {dtype = "u8"}), dm.zeros({1, 0}, {dtype = "u8"})
end

local function resolve_dir(path)
  local latest = dm.ckpt.latest(path)
  if latest then return latest end
  for _, name in ipairs(core.listdir(path) or {}) do       -- (opening meta.lua could block: a FIFO)
    if name == "meta.lua" then return path end
  end
  error(path .. " holds no checkpoint (expected runs/NAME or runs/NAME/ckpt-STEP)", 0)
end

--[[ Opening a checkpoint runs the model file its config names. By name (models/NAME.lua of the
install) that is this tree's code; by a path, it is whatever file is there, perhaps shipped
beside the checkpoint: that runs only when the user says so (opts.trust, --trust), and is
named as it runs. ]]
local function check_arch(meta, dir, trust)
  local arch = type(meta.config.model) == "table" and meta.config.model.arch
  if type(arch) ~= "string" or not arch:find("/", 1, true) then return end
  if not trust then
    error(string.format("%s/meta.lua: model.arch names a model file by its path (%s); opening a checkpoint " ..
                        "runs model files from models/ by name only. Read that file, then pass --trust to run " ..
                        "it, or copy it to models/NAME.lua and open the run with model.arch = NAME", dir, arch), 0)
  end
  io.stderr:write(string.format("probe: --trust: running the model file %s that %s names\n", arch, dir))
end

-- The model of a checkpoint (its run's latest, or ckpt-STEP), its config, folder and step.
-- opts.device: "cpu" (the default, f32) or "cuda" (the run's compute dtype, as it trained);
-- opts.trust: run a model file the checkpoint names by its path (check_arch).
function probe.load(path, root, opts)
  local device = opts and opts.device or "cpu"
  local train = require "dormouse.train"
  local dir = resolve_dir(path)
  local c = dm.ckpt.load(dir)
  train.check_meta(c.meta, dir)
  check_arch(c.meta, dir, opts and opts.trust)
  local cfg = config.resolve(config.upgrade(c.meta.config), dir .. "/meta.lua")
  local model = nn.build({device = device, compute_dtype = train.compute_dtype(cfg, device)}, train.build_model, cfg, root)
  local state = train.named_state(model)
  c.model = require("dormouse.banks").unpack(c.model, c.meta.banks, dir .. "/model.safetensors")
  train.check_tensors(c.model, state, dir .. "/model.safetensors")
  dm.no_grad(function()
    for name, t in pairs(state) do t:copy_(device == "cpu" and c.model[name] or c.model[name]:to(device)) end
  end)
  model:eval()
  return model, cfg, dir, c.meta.step
end

function probe.env(model, cfg)
  local env = {model = model, cfg = cfg}

  local SAMPLE_OPTIONS = {temperature = true, top_p = true, seed = true, return_text = true}
  function env.sample(prompt, n, opts)
    opts = opts or {}
    -- refused at the caller's line: a count, the options by name, their values
    if n ~= nil and not (math.type(n) == "integer" and n >= 1) then
      error(string.format("sample: n must be a whole number of bytes >= 1, got %s", tostring(n)), 2)
    end
    if type(opts) ~= "table" then error("sample: opts must be a table {temperature =, top_p =, seed =}", 2) end
    for k in pairs(opts) do
      if not SAMPLE_OPTIONS[k] then
        error(string.format("sample: unknown option '%s' (options: return_text, seed, temperature, top_p)",
                            tostring(k)), 2)
      end
    end
    local t, p = opts.temperature, opts.top_p
    if t ~= nil and not (type(t) == "number" and t >= 0 and t < math.huge) then
      error("sample: temperature must be a finite number >= 0, got " .. tostring(t), 2)
    end
    if p ~= nil and not (type(p) == "number" and p > 0 and p <= 1) then
      error("sample: top_p must be a number in (0, 1], got " .. tostring(p), 2)
    end
    local put, finish = human.byte_printer(function(s) io.write(s) end)
    local text = eval.sample(model, prompt or "", n or 200, {
      temperature = opts.temperature, top_p = opts.top_p, seed = opts.seed,
      on_byte = function(b) put(b); io.stdout:flush() end})
    finish()
    io.write("\n")
    -- streamed already: nothing more to print; {return_text = true} gives the text back
    if opts.return_text then return text end
  end

  function env.loss(text)
    local x, prefix = text_batch(text, "loss")
    local depths = {}
    for D = 1, cfg.model.max_iter do depths[D] = D end
    return dm.no_grad(function()
      local out = model:forward(x, prefix, {depths = depths})
      local r = {bytes = #text - 1, periter = {}, fin_D = {}}
      for i, ce in ipairs(out.periter) do r.periter[i] = ce:item() / LN2 end
      for D, ce in pairs(out.fin_D or {}) do r.fin_D[D] = ce:item() / LN2 end
      -- the forward's own fin (a model whose fin_D is empty has one too: docs/models.md)
      r.fin = out.fin and out.fin:item() / LN2 or r.fin_D[cfg.model.max_iter]
      return r
    end)
  end

  -- The modules of the model that implement a probe method (docs/models.md, "Probes"), or an
  -- error naming the method when none does.
  local function implementing(method, probe_name)
    local found = {}
    for _, m in ipairs(model.named_modules and model:named_modules() or {{name = "", module = model}}) do
      if type(m.module[method]) == "function" then found[#found + 1] = m end
    end
    if #found == 0 then
      error(string.format("%s(): no module of this model (%s) implements %s() (docs/models.md, \"Probes\")",
                          probe_name, cfg.model.arch, method), 3)
    end
    return found
  end

  -- usage of one routing's counts: busiest share, entropy, dead, the top experts
  local function usage(counts, tokens)
    local c = require("dormouse.instrument").moe_counters(counts)
    local order = {}
    for e = 1, #counts do order[e] = e end
    table.sort(order, function(a, b) return counts[a] > counts[b] end)
    c.top = {}
    for i = 1, math.min(8, #order) do c.top[i] = string.format("%d:%d", order[i], counts[order[i]]) end
    c.tokens = tokens
    return c
  end

  -- one result, or a table of them by module name when several modules answer
  local function by_module(found, one)
    if #found == 1 then return one(found[1].module) end
    local out = {}
    for _, m in ipairs(found) do out[m.name] = one(m.module) end
    return out
  end

  function env.experts(text)
    local found = implementing("routing", "experts")
    local x, prefix = text_batch(text, "experts")
    return dm.no_grad(function()
      model:forward(x, prefix)
      return by_module(found, function(m)
        local counts = m:routing()
        return counts and usage(counts:totable(), #text - 1) or nil
      end)
    end)
  end

  function env.engram(text)
    local found = implementing("lookups", "engram")
    local x, prefix = text_batch(text, "engram")
    return by_module(found, function(m)
      local rows = m:lookups(x:narrow(2, 1, #text - 1), prefix)
      return {positions = #text - 1, subtables = rows:size(3), lookups = rows:numel(),
              distinct_rows = dm.engram_unique(rows):numel()}
    end)
  end

  function env.params()
    local lines = {}
    for _, p in ipairs(model:named_parameters()) do
      lines[#lines + 1] = string.format("%-40s %-18s norm %.4g", p.name,
                                        table.concat(p.tensor:shape(), "x"), p.tensor:norm():item())
    end
    print(table.concat(lines, "\n"))
  end

  function env.tensor(name)
    if type(name) ~= "string" then error("tensor(name): name must be a string (params() lists them)", 2) end
    for _, p in ipairs(model:named_parameters()) do if p.name == name then return p.tensor end end
    for _, b in ipairs(model:named_buffers()) do if b.name == name then return b.tensor end end
    error("no parameter or buffer named '" .. name .. "' (params() lists them)", 2)
  end

  env.help_text = [[
model, cfg                     the model and its resolved config
sample(prompt, n, opts)        stream n bytes after prompt (opts: temperature, top_p, seed;
                               return_text = true also returns them)
loss(text)                     bits per byte: periter (each iteration), fin_D (each depth), fin
experts(text)                  routed-expert usage: busiest share, entropy, dead, top experts
                               (every module with routing(); several: a table by module name)
engram(text)                   Engram lookups of the text and how many distinct rows
                               (every module with lookups(x, prefix))
params()                       every parameter: name, shape, norm
tensor(name)                   a parameter or buffer by name]]
  return env
end

return probe
