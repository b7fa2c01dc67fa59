--[[
The stress protocol (`dormouse run EXPERIMENT --stress [--stress-lr K] [--stress-steps N]`): the
stability smoke before a long run. N guarded steps (50) of the experiment at K times (2) its
learning rates, flat after a short warm-up, with no run folder and nothing written; each step is
checked, and the first that fails ends it:

  nan        the loss or the gradient norm is not finite (the first tensor that is not, named: a
             parameter, a gradient, or else the first module whose output is not)
  ceiling    the loss is above ce_ceiling
  explosion  the gradient norm is over 50 times the median of the steps before (from step 6 on)

One line says how it went: `stress: pass: ...`, or `stress: FAIL at step S: ...`.
]]
local config = require "dormouse.config"
local instrument = require "dormouse.instrument"

local stress = {}

stress.EXPLOSION = 50          -- a gradient norm this many times the median of the steps before
stress.SETTLE = 5              -- steps before the explosion guard (the median needs some)

local function median(xs)
  local s = {table.unpack(xs)}
  table.sort(s)
  return s[(#s + 1) // 2]
end

-- the config of the stress steps: the experiment's (raw, as its file returned it), with K times its
-- learning rates, flat
function stress.config(raw, file, overrides, k, steps)
  local base = config.resolve(raw, file, overrides)
  local o = {table.unpack(overrides or {})}
  for _, s in ipairs {"steps=" .. steps, "schedule.kind=constant", "schedule.warmup=" .. math.max(1, steps // 10),
                      string.format("optim.muon_lr=%.17g", base.optim.muon_lr * k),
                      string.format("optim.adamw_lr=%.17g", base.optim.adamw_lr * k)} do
    o[#o + 1] = s
  end
  return (config.resolve(raw, file, o))
end

-- the first parameter or gradient (by name) holding a NaN or an infinity: "name (a parameter)" or nil
local function first_bad(model)
  local train = require "dormouse.train"
  local params, grads = {}, {}
  for _, p in ipairs(model:named_parameters()) do
    params[p.name] = p.tensor
    grads[p.name] = p.tensor.grad
  end
  local bad = train.first_nonfinite(params)
  if bad then return bad .. " (a parameter)" end
  bad = train.first_nonfinite(grads)
  if bad then return bad .. " (its gradient)" end
end

--[[ The first module, in the order the forward runs them, whose output on the step's batch holds a
NaN or an infinity: "name (an activation)", or nil. A step whose loss is not finite is skipped
before its backward, so its parameters and gradients are finite: the forward, run again on the
same rows with each module's output checked, says where the values first break. ]]
local function first_bad_activation(r, step)
  local train, dm = require "dormouse.train", require "dormouse"
  local cfg = r.cfg
  local x, prefix = r.corpus:batch((step - 1) * cfg.grad_accum, {batch = cfg.batch, seq = cfg.seq, seed = cfg.seed,
                                                                  ctx = train.engram_ctx(cfg)})
  if r.device ~= "cpu" then x, prefix = x:to(r.device), prefix:to(r.device) end
  local first
  local wrapped = {}
  -- each module's forward, and a norm's add_forward (the residual add before it and the norm in one
  -- op: its norm's output is the second result)
  local function wrap(mod, name, method, at)
    local fn = mod[method]
    if not fn then return end
    wrapped[#wrapped + 1] = {mod, method, rawget(mod, method)}
    mod[method] = function(self, ...)
      local out = table.pack(fn(self, ...))
      local t = out[at]
      if not first and dm.is_tensor(t) and train.first_nonfinite({[name] = t}) then first = name end
      return table.unpack(out, 1, out.n)
    end
  end
  for _, m in ipairs(r.model:named_modules()) do
    local name = m.name ~= "" and m.name or "the model's output"
    wrap(m.module, name, "forward", 1)
    if m.module.add_forward then wrap(m.module, name, "add_forward", 2) end
  end
  pcall(dm.scope, function() dm.no_grad(function() r.model:forward(x, prefix) end) end)
  for _, w in ipairs(wrapped) do w[1][w[2]] = w[3] end
  return first and first .. " (an activation)"
end

--[[ Run the steps of cfg (stress.config's). opts.root, opts.on_step(step, loss, norm). Returns
{passed, steps, line, failure = {step, counter, tensor}}. ]]
function stress.run(cfg, k, opts)
  opts = opts or {}
  local train = require "dormouse.train"
  local r = train.prepare(cfg, {root = opts.root})
  local norms, first_loss, last_loss, top = {}, nil, nil, 0
  local failure
  for step = 1, cfg.steps do
    r.step = step
    local taken = train.step(r)
    local loss, norm = taken.loss, taken.grad_norm
    if opts.on_step then opts.on_step(step, loss, norm) end
    if not instrument.finite(loss) or not instrument.finite(norm) then
      local what = not instrument.finite(loss) and "the loss is " .. tostring(loss) or
                   "the gradient norm is " .. tostring(norm)
      failure = {step = step, counter = "nan", text = what,
                 tensor = first_bad(r.model) or first_bad_activation(r, step)}
    elseif loss > cfg.ce_ceiling then
      failure = {step = step, counter = "ceiling", text = string.format("the loss %.4g is above ce_ceiling %g",
                                                                         loss, cfg.ce_ceiling)}
    elseif #norms >= stress.SETTLE and norm > stress.EXPLOSION * median(norms) then
      failure = {step = step, counter = "explosion", text = string.format(
        "the gradient norm %.4g is %.0f times the median of the steps before (%.4g)", norm, norm / median(norms),
        median(norms))}
    end
    if failure then break end
    norms[#norms + 1] = norm
    first_loss = first_loss or loss
    last_loss = loss
    top = math.max(top, norm)
  end
  r.loader:close()
  r.corpus:close()
  if failure then
    return {passed = false, steps = failure.step, failure = failure,
            line = string.format("stress: FAIL at step %d of %d at %gx the learning rates: %s [%s]%s", failure.step,
                                 cfg.steps, k, failure.text, failure.counter,
                                 failure.tensor and "; the first non-finite tensor: " .. failure.tensor or "")}
  end
  return {passed = true, steps = cfg.steps,
          line = string.format("stress: pass: %d steps at %gx the learning rates, the loss %.4f -> %.4f, the " ..
                               "largest gradient norm %.4g", cfg.steps, k, first_loss, last_loss, top)}
end

return stress
