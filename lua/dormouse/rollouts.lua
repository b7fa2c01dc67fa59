--[[
dormouse.rollouts — K samples a task from the model as it is, through the
generation engine (eval.sample_streams: every sample of every task one
stream of a batch, continuous), each scored by a verifier, and every
decision written down.

  local rollouts = require "dormouse.rollouts"
  local set = require("dormouse.tasks").load("tasks/addition.lua")
  local r = rollouts.run(model, set, {k = 4, budget = 16, stop = "\n", temperature = 1, seed = 1,
                                      first = 64, log = "runs/x/rollouts.jsonl", step = 0})
  -- r.samples[i] = {task = t, sample = s, output = "...", bytes = n, pass = bool, score = x,
  --                 reason = "...", seconds = the verifier's}
  -- r.pass_rate, r.mean_bytes, r.tasks (the tasks sampled), r.groups[t] = {its samples}

opts: k (samples a task, default 4), budget (bytes a sample, default 64),
stop (a string that ends a sample, e.g. "\n"), temperature (1), top_p (0.95),
seed (sample s of task t draws from seed + (t-1) k + s - 1), first (the first n
tasks of the set; default all), streams (how many run at once; default all),
device, verifier (a name of dormouse.verify or a function(task, output);
default: code for a task with tests, exact otherwise), log (a path: one JSON
line a sample appended, kind "rollout", with the step, task, sample, prompt,
output, bytes, pass, score, reason, seconds and time), step (written in the log).
]]
local core = require "dormouse.core"
local json = require "dormouse.json"
local evaluate = require "dormouse.eval"
local verify = require "dormouse.verify"

local rollouts = {}

local KNOWN = {k = true, budget = true, stop = true, temperature = true, top_p = true, seed = true, first = true,
               streams = true, device = true, verifier = true, log = true, step = true}

local function check(opts)
  for key in pairs(opts) do
    if not KNOWN[key] then error(string.format("rollouts: unknown option '%s'", tostring(key)), 3) end
  end
  for _, key in ipairs {"k", "budget", "first", "streams"} do
    local v = opts[key]
    if v ~= nil and (math.type(v) ~= "integer" or v < 1) then
      error(string.format("rollouts: %s must be an integer >= 1, got %s", key, tostring(v)), 3)
    end
  end
end

-- the verifier of a task: the function given, the one named, or the task's own kind
local function verifier_of(opts, task)
  if type(opts.verifier) == "function" then return opts.verifier end
  return verify.of(task, opts.verifier)
end

function rollouts.run(model, set, opts)
  opts = opts or {}
  check(opts)
  local k, budget = opts.k or 4, opts.budget or 64
  local n = math.min(opts.first or #set.tasks, #set.tasks)
  local prompts, who = {}, {}
  for t = 1, n do
    for s = 1, k do
      prompts[#prompts + 1] = set.tasks[t].prompt
      who[#prompts] = {t, s}
    end
  end
  local texts = evaluate.sample_streams(model, prompts, budget, {
    temperature = opts.temperature or 1, top_p = opts.top_p, seed = opts.seed or 0, stop = opts.stop,
    streams = opts.streams, device = opts.device})
  local log = opts.log and assert(io.open(opts.log, "ab"))
  local out = {samples = {}, groups = {}, tasks = n}
  local passed, bytes = 0, 0
  for j, text in ipairs(texts) do
    local t, s = who[j][1], who[j][2]
    local task = set.tasks[t]
    local t0 = core.now()
    local v = verifier_of(opts, task)(task, text)
    local rec = {task = t, sample = s, output = text, bytes = #text, pass = v.pass, score = v.score,
                 reason = v.reason, seconds = core.now() - t0}
    out.samples[j] = rec
    out.groups[t] = out.groups[t] or {}
    out.groups[t][s] = rec
    passed, bytes = passed + (v.pass and 1 or 0), bytes + #text
    if log then
      log:write(json.encode({kind = "rollout", step = opts.step, task = t, sample = s, prompt = task.prompt,
                             output = text, bytes = #text, pass = v.pass, score = v.score, reason = v.reason,
                             seconds = rec.seconds, time = os.time()}), "\n")
    end
  end
  if log then log:close() end
  out.pass_rate = passed / #texts
  out.mean_bytes = bytes / #texts
  return out
end

return rollouts
