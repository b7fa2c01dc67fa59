--[[
dormouse.rl — reinforcement learning against verifiers (rl.k > 0): each step
samples k outputs for each of rl.tasks tasks from the model as it is, scores
them, and takes a policy-gradient step on the sampled bytes. The trainer and
the sampler are one process with the same tensors: no weight is copied.

  local rl = require "dormouse.rl"
  local learner = rl.new(run)             -- run: cfg, model, opt, device, corpus (data.records)
  local res = learner:step(run)           -- run.stepper's step (dormouse.step), its sums read at log time

A step, t its tasks (drawn from the seed and the step among the training
records: prompt, and the response the verifier checks), s a sample:

  reward   r_ts = credit_ts - rl.bytes_penalty * bytes_ts, credit the verifier's pass (1 or 0; rl.reward
           = "pass", hard) or its score (partial credit in [0, 1]; "score", soft). The verifier: rl.verifier,
           else each task's own (code for a record with tests, exact otherwise)
  group    A_ts = r_ts - mean_s r_ts                 (every byte of the sample gets it)
  fork     each byte i of a sample is a fork point: rl.forks continuations
           from its prefix estimate V(prefix) (their mean reward; the whole
           sample's own reward is V of all of it); byte i's advantage is
           V(prefix through i) - V(prefix before i): the difference its
           decision made to the outcome
  loss     sum over the samples' bytes of A * CE(fin logits, byte), over the number of sampled bytes
           + rl.kl * the mean over those bytes of exp(q) - q - 1, q = log p_init - log p (an
             estimator of KL(p || p_init), unbiased for samples drawn at temperature 1; p_init
             the model the run started from, init)

The loss's gradient is the policy gradient of the mean reward (a byte whose
advantage is positive is made likelier). The log line counts pass (the share
of samples that passed), out_bytes (their mean length), adv_abs (the mean
|advantage| over the bytes), adv_std (the spread of the group's rewards) and
with rl.kl, kl. Every decision is a line of runs/NAME/rollouts.jsonl: each
sample (kind "rollout": the step, the task's place in the step's draw, the
sample, prompt, output, bytes, pass, score, reason, time) and with fork-replay
each continuation (kind "fork": at = the output bytes it continued from); a
resume keeps the lines of the steps before it.
]]
local dm = require "dormouse"
local evaluate = require "dormouse.eval"
local json = require "dormouse.json"
local rollouts = require "dormouse.rollouts"
local mix = require("dormouse.records").mix      -- the 64-bit mix the records' rows are drawn with
local verify = require "dormouse.verify"

local rl = {}
local Learner = {}
Learner.__index = Learner
rl.Learner = Learner                             -- (its methods, for tests on a learner of a given cfg)

function rl.new(r, root)
  local cfg = r.cfg
  if not (r.corpus and r.corpus.held_out) then
    error("rl.k > 0: reinforcement learning draws its tasks from data.records (prompt/response records or a " ..
          "task file); set data.records", 0)
  end
  local self = setmetatable({cfg = cfg.rl, seed = cfg.seed, tasks = {}}, Learner)
  for i, rec in ipairs(r.corpus.train) do
    self.tasks[i] = {prompt = rec.prompt, answer = rec.response, tests = rec.tests, language = rec.language,
                     head = rec.head, seconds = rec.seconds}
  end
  local named = cfg.rl.verifier and verify.get(cfg.rl.verifier)      -- nil: each task's own kind
  self.verifier = function(task, output) return (named or verify.of(task))(task, output) end
  if cfg.rl.kl > 0 then                       -- the weights the run started from, fixed: the KL term's reference
    if not r.init_from then
      error("rl.kl > 0 measures the policy against the model it started from: set init (--init RUN)", 0)
    end
    self.init = r:initial_model(root)
  end
  if r.dir then                                  -- every decision beside the run (a resume keeps those before it)
    self.log = r.dir .. "/rollouts.jsonl"
    rl.keep_log(self.log, r.step)
  end
  return self
end

-- the log's lines of steps up to `upto` (none: an empty file), written again in one piece
function rl.keep_log(path, upto)
  local kept = {}
  local f = io.open(path, "rb")
  if f then
    for line in f:lines() do
      local ok, rec = pcall(json.decode, line)
      if ok and type(rec) == "table" and (rec.step or math.huge) <= upto then kept[#kept + 1] = line .. "\n" end
    end
    f:close()
  end
  require("dormouse.core").write_file(path, table.concat(kept))
end

-- the step's tasks: rl.tasks of the training records, drawn from (seed, step)
function Learner:pick(step)
  local out = {name = "rl", tasks = {}}
  for i = 1, self.cfg.tasks do
    local z = mix(mix(mix(0x5eed + self.seed) + step) + i)
    out.tasks[i] = self.tasks[1 + z % #self.tasks]
  end
  return out
end

-- The first random seed of a step's samples (kind 1) or of its fork continuations (kind 2): stream j of
-- them draws from this + j - 1. Hashed from (seed, step, kind) into 48 bits, so that no two steps' or
-- kinds' runs of seeds overlap (adjacent bases would: a step's forks reuse a later step's samples').
function Learner:stream_seed(step, kind)
  return mix(mix(mix(0x7a11 + self.seed) + step) + kind) % (1 << 48)
end

function Learner:reward(v, bytes)
  local credit = self.cfg.reward == "score" and v.score or (v.pass and 1 or 0)
  return credit - self.cfg.bytes_penalty * bytes
end

-- rows prompt..output for each sample, per-target weights (the advantage of each output byte) and the
-- output's mask: x [N, L] u8, w and m [N, L-1] f32
function rl.rows(samples, prompts, advantage)
  local len = 2
  for j, s in ipairs(samples) do len = math.max(len, #prompts[j] + #s.output) end
  local xs, ws, ms = {}, {}, {}
  for j, s in ipairs(samples) do
    local text = prompts[j] .. s.output
    local row, w, m = {}, {}, {}
    for i = 1, len do row[i] = i <= #text and text:byte(i) or 0 end
    for t = 1, len - 1 do                        -- target t is byte t + 1
      local i = t + 1 - #prompts[j]                -- its place in the output (1 = the first output byte)
      local on = i >= 1 and i <= #s.output
      w[t], m[t] = on and advantage(j, i) or 0, on and 1 or 0
    end
    xs[j], ws[j], ms[j] = row, w, m
  end
  return dm.tensor(xs, {dtype = "u8"}), dm.tensor(ws, {dtype = "f32"}), dm.tensor(ms, {dtype = "f32"})
end

-- the group advantages: each sample's reward less its task's mean (a function (j) → sample j's), and
-- the mean over tasks of the rewards' spread
function Learner:group_advantages(ro)
  local adv, spread = {}, 0
  for _, group in pairs(ro.groups) do
    local mean = 0
    for _, s in ipairs(group) do mean = mean + s.reward end
    mean = mean / #group
    local var = 0
    for _, s in ipairs(group) do
      s.advantage = s.reward - mean
      var = var + s.advantage ^ 2
    end
    spread = spread + math.sqrt(var / #group)
  end
  for j, s in ipairs(ro.samples) do adv[j] = s.advantage end
  return function(j) return adv[j] end, spread / ro.tasks
end

-- fork-replay: V at each prefix of each sample from rl.forks continuations; byte i gets V(i) - V(i-1).
-- Returns that (a function (j, i)), the mean |reward - V(prompt)|, and the values value[j][i]
-- (i output bytes; value[j][#output] the sample's own reward)
function Learner:fork_advantages(model, ro, set, opts)
  local prompts, who = {}, {}
  for j, s in ipairs(ro.samples) do
    for i = 0, #s.output - 1 do                  -- the prefixes before each byte (0: the prompt alone)
      prompts[#prompts + 1] = set.tasks[s.task].prompt .. s.output:sub(1, i)
      who[#prompts] = {j, i}
    end
  end
  local forks = self.cfg.forks
  local list = {}
  for p = 1, #prompts do for _ = 1, forks do list[#list + 1] = prompts[p] end end
  local texts = #list > 0 and evaluate.sample_streams(model, list, opts.budget, {
    temperature = opts.temperature, seed = opts.fork_seed, stop = opts.stop, device = opts.device}) or {}
  for _, text in ipairs(texts) do self.sampled = self.sampled + #text end
  local value = {}                               -- value[j][i]: V of sample j's prefix of i output bytes
  local log = self.log and assert(io.open(self.log, "ab"))
  for p, w in ipairs(who) do
    local j, i = w[1], w[2]
    local s = ro.samples[j]
    local task, sum = set.tasks[s.task], 0
    for f = 1, forks do
      local out = s.output:sub(1, i) .. texts[(p - 1) * forks + f]
      local v = self.verifier(task, out)
      sum = sum + self:reward(v, #out)
      if log then                                -- the evidence of each value: every continuation
        log:write(json.encode({kind = "fork", step = opts.step, task = s.task, sample = s.sample, at = i, fork = f,
                               output = out, bytes = #out, pass = v.pass, score = v.score, reason = v.reason}), "\n")
      end
    end
    value[j] = value[j] or {}
    value[j][i] = sum / forks
  end
  if log then log:close() end
  local spread = 0
  for j, s in ipairs(ro.samples) do
    value[j] = value[j] or {}
    value[j][#s.output] = s.reward
    spread = spread + math.abs(s.reward - (value[j][0] or s.reward))
  end
  return function(j, i) return value[j][i] - value[j][i - 1] end, spread / #ro.samples, value
end

-- The step's loss from the rows (a device scalar) and the KL term (a number, or nil)
function Learner:loss(model, x, w, m)
  local T = x:size(2) - 1
  local n = math.max(m:sum():item(), 1)
  local targets = x:narrow(2, 2, T):to("i64"):reshape({-1})
  local prefix = dm.zeros({x:size(1), model.context and model:context() or 0}, {dtype = "u8", device = x.device})
  local out = model:forward(x, prefix)
  local ce = dm.cross_entropy(out.fin_logits:reshape({-1, 256}), targets, {reduction = "none"})
  local loss = (ce * w:reshape({-1}):to(ce.dtype)):sum() / n
  local kl
  if self.init then
    local ref = dm.no_grad(function()
      return dm.cross_entropy(self.init:forward(x, prefix).fin_logits:reshape({-1, 256}), targets,
                              {reduction = "none"})
    end)
    local q = ce - ref                             -- log p_init - log p of each sampled byte
    local mm = m:reshape({-1}):to(ce.dtype)
    local k3 = ((q:exp() - q - 1) * mm):sum() / n
    loss = loss + k3 * self.cfg.kl
    kl = k3:detach()
  end
  return loss, kl
end

--[[ One RL step of run r, taken by r.stepper (dormouse.step) with the policy-gradient
objective as its loss; returns Step:run's result. The window's extras: pass, out_bytes,
adv_abs, adv_std[, kl]. ]]
function Learner:step(r)
  local cfg, model = self.cfg, r.model
  local set = self:pick(r.step)
  local opts = {k = cfg.k, budget = cfg.budget, stop = cfg.stop, temperature = cfg.temperature,
                seed = self:stream_seed(r.step, 1), fork_seed = self:stream_seed(r.step, 2), device = r.device,
                step = r.step}
  -- the samples come from the model in the step's format (model.moe.qat; Step:run's call then finds it so)
  if model.before_step then model:before_step(r.step, r.cfg.steps) end
  local ro = rollouts.run(model, set, {k = opts.k, budget = opts.budget, stop = opts.stop,
                                       temperature = opts.temperature, seed = opts.seed, device = opts.device,
                                       verifier = self.verifier, log = self.log, step = r.step})
  self.sampled = 0                               -- the bytes sampled this step (the log line's rate)
  for _, s in ipairs(ro.samples) do
    s.reward = self:reward(s, s.bytes)
    self.sampled = self.sampled + s.bytes
  end
  local advantage, spread
  if cfg.advantage == "fork" then advantage, spread = self:fork_advantages(model, ro, set, opts)
  else advantage, spread = self:group_advantages(ro) end
  local prompts = {}
  for j, s in ipairs(ro.samples) do prompts[j] = set.tasks[s.task].prompt end
  return r.stepper:run(r.step, {backward = function(mark)
    local x, w, m = rl.rows(ro.samples, prompts, advantage)
    local adv_abs = w:abs():sum():item() / math.max(m:sum():item(), 1)
    if r.device ~= "cpu" then x, w, m = x:to(r.device), w:to(r.device), m:to(r.device) end
    local loss, kl = self:loss(model, x, w, m)
    mark("forward")
    loss:backward()
    mark("backward")
    return loss:detach():to("f64"), {pass = ro.pass_rate, out_bytes = ro.mean_bytes, adv_abs = adv_abs,
                                     adv_std = spread, kl = kl}
  end})
end

return rl
