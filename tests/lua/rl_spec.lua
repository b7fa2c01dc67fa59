-- Reinforcement learning against verifiers (rl.k > 0): the advantages (group, fork-replay), the
-- policy-gradient loss against a by-hand sum, and runs from a supervised base (the log line's
-- counters, resume, the KL term against the base, refusals).
local dm = require "dormouse"
local config = require "dormouse.config"
local json = require "dormouse.json"
local rl = require "dormouse.rl"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"

local BASE = {"log.every=2", "checkpoint.keep=0", "dtype=f32", "eval.sample=0", "schedule.warmup=2",
              "data.records=tasks/addition.lua", "eval.exact=4", "eval.budgets={8}", "eval.windows=4"}
-- (the penalty on bytes: the samples' rewards differ even where none passes, so the gradient is not 0)
local RL = {"rl.k=4", "rl.tasks=3", "rl.budget=6", 'rl.stop="\\n"', "rl.bytes_penalty=0.01", "steps=4",
            "eval.every=4", "checkpoint.every=2"}

local function with(...)
  local o = {}
  for _, list in ipairs {...} do for _, s in ipairs(list) do o[#o + 1] = s end end
  return o
end

local function records(dir, name, kind) return helpers.metrics(dir .. "/" .. name, kind) end

describe("reinforcement learning", function()
  local dir
  setup(function()
    dir = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny(with(BASE, {"name=base", "steps=8", "eval.every=8", "checkpoint.every=8"})),
                      {runs = dir})
  end)

  it("takes policy-gradient steps from a base: the log line counts pass, bytes and advantages", function()
    local res = helpers.run_quiet(helpers.tiny(with(BASE, RL, {"name=rl", "init=" .. dir .. "/base"})), {runs = dir})
    assert.equal(4, res.step)
    local logs = records(dir, "rl", "log")
    assert.equal(2, #logs)
    for _, l in ipairs(logs) do
      assert.truthy(l.extras.pass >= 0 and l.extras.pass <= 1)
      assert.truthy(l.extras.out_bytes > 0 and l.extras.out_bytes <= 6)
      assert.truthy(l.extras.adv_abs >= 0 and l.extras.adv_std >= 0)
      assert.truthy(l.loss == l.loss and l.grad_norm > 0)
    end
    local log = helpers.read(dir .. "/rl/log.txt")
    helpers.has(log, "pg_loss ", "sampled/s ", " pass ")
    -- on the GPU too the step stays eager: it samples before each update
    helpers.has(require("dormouse.step").why_not_capture({cfg = helpers.tiny(with(BASE, RL)), device = "cuda"}),
                "rl.k > 0: each step samples from the model")
    assert.equal(2, #records(dir, "rl", "eval"))            -- at step 0 (the base's weights) and 4
    local lines = {}
    for line in io.lines(dir .. "/rl/rollouts.jsonl") do lines[#lines + 1] = json.decode(line) end
    assert.equal(4 * 3 * 4, #lines)                         -- steps x tasks x samples, each decision
    assert.equal(1, lines[1].step); assert.equal(4, lines[#lines].step)
    assert.equal("rollout", lines[1].kind)
    assert.truthy(lines[1].prompt:match("^%d+%+%d+=$") and lines[1].reason)
  end)

  it("resumes exactly: 4 steps straight equal 2, a stop and a resume", function()
    local cfg = with(BASE, RL, {"init=" .. dir .. "/base", "rl.advantage=fork", "rl.forks=2", "rl.kl=0.1"})
    helpers.run_quiet(helpers.tiny(with(cfg, {"name=straight"})), {runs = dir})
    helpers.run_quiet(helpers.tiny(with(cfg, {"name=stopped"})), {runs = dir, stop_at = 2})
    helpers.run_quiet(helpers.tiny(with(cfg, {"name=stopped"})), {runs = dir, resume = dir .. "/stopped"})
    local a, b = records(dir, "straight", "log"), records(dir, "stopped", "log")
    assert.equal(2, #a)
    for i = 1, 2 do
      assert.equal(a[i].loss, b[i].loss)
      assert.equal(a[i].extras.kl, b[i].extras.kl)
    end
    assert.truthy(a[1].extras.kl >= 0)
    -- the decisions too: every sample and every fork's continuation, the same bytes
    local ra, rb = helpers.read(dir .. "/straight/rollouts.jsonl"), helpers.read(dir .. "/stopped/rollouts.jsonl")
    assert.truthy(ra:find('"kind":"fork"', 1, true))
    local function strip(t) return (t:gsub(',"time":%d+', ""):gsub('"seconds":[^,]+,', "")) end   -- the clocks
    assert.equal(strip(ra), strip(rb))
  end)

  it("refuses rl.kl without init and rl.k without records, naming what is missing", function()
    local err = helpers.err_of(helpers.run_quiet, helpers.tiny(with(BASE, RL, {"name=nokl", "rl.kl=0.1"})),
                               {runs = dir})
    helpers.has(err, "rl.kl > 0 measures the policy against the model it started from: set init")
    err = helpers.err_of(helpers.run_quiet, helpers.tiny({"name=nodata", "rl.k=2", "steps=2", "schedule.warmup=1"}), {runs = dir})
    helpers.has(err, "rl.k > 0: reinforcement learning draws its tasks from data.records")
  end)
end)

describe("dormouse post-train", function()
  local dir
  setup(function()
    dir = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny(with(BASE, {"name=base", "steps=4", "eval.every=4", "checkpoint.every=4"})),
                      {runs = dir})
  end)

  -- the command in this process: its exit code and what it printed
  local function post_train(...)
    local printed, saved = {}, _G.print
    _G.print = function(...) printed[#printed + 1] = table.concat({...}, "\t") end
    local ok, code = pcall(require("dormouse.commands.post_train").run, {[0] = "dormouse", "post-train", ...},
                           require("dormouse.cli"))
    _G.print = saved
    assert(ok, code)
    return code, table.concat(printed, "\n")
  end

  it("runs SFT then RL from a base and tables the held-out figures of each", function()
    local code, out = post_train("--base", dir .. "/base", "--env", "addition", "--sft-steps", "4", "--rl-steps", "2",
                                 "--quiet", "--set", "eval.exact=4", "--set", "eval.windows=4", "--set", "rl.tasks=2",
                                 "--set", "rl.k=2", "--set", "rl.budget=6", "--set", "eval.budgets={8}")
    assert.equal(0, code)
    helpers.has(out, "model     bpb_fin  exact@8", "\nbase ", "\nsft ", "\nrl ", dir .. "/base-post-sft")
    local meta = require("dormouse.ckpt").load_meta(dir .. "/base-post-rl/ckpt-2")
    assert.equal(dir .. "/base-post-sft", meta.init.run)
    assert.equal(4, meta.init.step)
    local cfg = dofile(dir .. "/base-post-rl/config.lua")
    assert.equal("\n", cfg.rl.stop)                         -- every addition answer ends with a newline
    assert.equal(2, cfg.rl.k)
    assert.equal("pass", cfg.rl.reward)                     -- --verifier hard, the default
  end)

  it("trains on several task sets at once, each sample judged by its own verifier (--verifier soft)", function()
    local code, out = post_train("--base", dir .. "/base", "--env", "addition,code", "--verifier", "soft",
                                 "--name", "mixed", "--sft-steps", "0", "--rl-steps", "2", "--quiet",
                                 "--set", "eval.exact=4", "--set", "eval.windows=4", "--set", "rl.tasks=6",
                                 "--set", "rl.k=2", "--set", "rl.budget=8", "--set", "eval.budgets={8}")
    assert.equal(0, code)
    helpers.has(out, dir .. "/mixed-rl")
    local cfg = dofile(dir .. "/mixed-rl/config.lua")
    assert.equal("score", cfg.rl.reward)
    helpers.has(cfg.data.records, "tasks/addition.lua,", "tasks/code.lua")
    local kinds = {}
    for line in io.lines(dir .. "/mixed-rl/rollouts.jsonl") do
      local r = json.decode(line)
      kinds[r.prompt:match("^%-%- ") and "code" or "sum"] = r.reason
      if r.prompt:match("^%-%- ") then                     -- the code verifier's reasons, not exact's
        assert.falsy(r.reason:match("differs at byte") or r.reason:match("stopped after"), r.reason)
      end
    end
    assert.truthy(kinds.code and kinds.sum, "both task sets drawn")
    helpers.has(helpers.read(dir .. "/mixed-rl/log.txt"), "records ", "tasks/addition.lua + ", "tasks/code.lua")
  end)

  it("refuses a missing base or task set, a verifier mode it does not know, and nothing to do, by name", function()
    local function refused(...)
      local saved = io.stderr
      local lines = {}
      io.stderr = {write = function(_, ...) for _, s in ipairs {...} do lines[#lines + 1] = s end end}
      local code = post_train(...)
      io.stderr = saved
      return code, table.concat(lines)
    end
    local code, msg = refused("--env", "addition")
    assert.equal(2, code); helpers.has(msg, "which base? --base runs/NAME")
    code, msg = refused("--base", dir .. "/base", "--env", "addition", "--verifier", "lenient")
    assert.equal(2, code); helpers.has(msg, "--verifier lenient: hard (the reward is a pass) or soft")
    code, msg = refused("--base", dir .. "/base", "--env", "addition", "--verifier", "soft", "--set", "rl.reward=\"pass\"")
    assert.equal(2, code); helpers.has(msg, "--verifier and --set rl.reward say the same thing")
    code, msg = refused("--base", dir .. "/base", "--env", "addition,nope")
    assert.equal(1, code); helpers.has(msg, "--env nope: no such file")
    code, msg = refused("--base", dir .. "/base", "--env", "nope")
    assert.equal(1, code); helpers.has(msg, "--env nope: no such file, nor tasks/nope.lua")
    code, msg = refused("--base", dir .. "/base", "--env", "addition", "--sft-steps", "0", "--rl-steps", "0")
    assert.equal(2, code); helpers.has(msg, "nothing to do")
  end)
end)

describe("the samples' seeds", function()
  it("give each step's samples and forks runs of seeds that no other step's or kind's overlap", function()
    local learner = setmetatable({seed = 3}, rl.Learner)
    local bases = {}
    for step = 1, 300 do
      for kind = 1, 2 do
        local b = learner:stream_seed(step, kind)
        assert.truthy(math.type(b) == "integer" and b >= 0 and b < 1 << 48)
        bases[#bases + 1] = b
      end
    end
    table.sort(bases)
    for i = 2, #bases do assert.truthy(bases[i] - bases[i - 1] > 1e6, "two runs of seeds within 1e6") end
    assert.equal(learner:stream_seed(7, 1), setmetatable({seed = 3}, rl.Learner):stream_seed(7, 1))
    assert.are_not.equal(learner:stream_seed(7, 1), setmetatable({seed = 4}, rl.Learner):stream_seed(7, 1))
  end)
end)

describe("the reward", function()
  it("credits a pass (hard) or the verifier's score (soft), less the bytes' penalty", function()
    local hard = setmetatable({cfg = {reward = "pass", bytes_penalty = 0.01}}, rl.Learner)
    local soft = setmetatable({cfg = {reward = "score", bytes_penalty = 0}}, rl.Learner)
    assert.equal(0 - 0.04, hard:reward({pass = false, score = 0.75}, 4))
    assert.equal(1 - 0.04, hard:reward({pass = true, score = 1}, 4))
    assert.equal(0.75, soft:reward({pass = false, score = 0.75}, 4))
  end)
end)

describe("the policy gradient", function()
  local function tiny_model()
    local cfg = config.load("experiments/tiny.lua")
    dm.manual_seed(cfg.seed)
    return train.build_model(cfg, "."):cast("f64")
  end

  it("rows put each sample's advantage on its output bytes and nothing on its prompt", function()
    local samples = {{output = "12\n"}, {output = "7"}}
    local x, w, m = rl.rows(samples, {"5+7=", "3+4="}, function(j, i) return j * 10 + i end)
    assert.same({2, 7}, x:shape())
    assert.equal("5+7=12\n", string.char(table.unpack(x:totable()[1])))
    assert.same({0, 0, 0, 11, 12, 13}, w:totable()[1])
    assert.same({0, 0, 0, 21, 0, 0}, w:totable()[2])
    assert.same({0, 0, 0, 1, 1, 1}, m:totable()[1])
  end)

  it("is the advantage-weighted cross-entropy of the sampled bytes over their number (f64, by hand)", function()
    local model = tiny_model()
    local learner = setmetatable({cfg = {kl = 0}}, rl.Learner)
    local x, w, m = rl.rows({{output = "42\n"}, {output = "5"}}, {"40+2=", "2+3="},
                            function(j, i) return j == 1 and 0.5 or -0.25 end)
    x, w, m = x, w:to("f64"), m:to("f64")
    dm.scope(function()
      local loss = learner:loss(model, x, w, m)
      local out = model:forward(x, dm.zeros({2, model:context()}, {dtype = "u8"}))
      local ce = dm.cross_entropy(out.fin_logits:reshape({-1, 256}), x:narrow(2, 2, x:size(2) - 1):to("i64"):reshape({-1}),
                                  {reduction = "none"}):totable()
      local by_hand, ws = 0, w:reshape({-1}):totable()
      for i, c in ipairs(ce) do by_hand = by_hand + c * ws[i] end
      by_hand = by_hand / 4                                  -- 4 sampled bytes
      assert.is_true(math.abs(loss:item() - by_hand) <= 1e-12 * math.abs(by_hand), loss:item() .. " vs " .. by_hand)
    end)
  end)

  it("fork-replay credits each byte with the change in value it made (the sum is the reward less V(prompt))", function()
    local model = tiny_model()
    local set = {tasks = {{prompt = "1+1=", answer = "2\n"}, {prompt = "3+4=", answer = "7\n"}}}
    local learner = setmetatable({cfg = {forks = 3, bytes_penalty = 0.01}, verifier = require("dormouse.verify").exact,
                                  sampled = 0}, rl.Learner)
    local ro = require("dormouse.rollouts").run(model, set, {k = 2, budget = 3, seed = 5, temperature = 2})
    for _, s in ipairs(ro.samples) do s.reward = learner:reward(s, s.bytes) end
    local advantage, _, value = learner:fork_advantages(model, ro, set, {budget = 3, temperature = 2, seed = 5})
    for j, s in ipairs(ro.samples) do
      local sum = 0
      for i = 1, #s.output do sum = sum + advantage(j, i) end
      assert.is_true(math.abs(sum - (s.reward - value[j][0])) <= 1e-12)
      assert.equal(s.reward, value[j][#s.output])
      assert.truthy(value[j][0] <= 1 and value[j][0] >= -0.03)
    end
  end)
end)
