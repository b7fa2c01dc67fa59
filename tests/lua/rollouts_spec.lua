-- Rollouts: K samples a task through the batched generation engine, each verified, every decision in
-- the JSONL log; the same seed gives the same samples.
local dm = require "dormouse"
local config = require "dormouse.config"
local json = require "dormouse.json"
local train = require "dormouse.train"
local rollouts = require "dormouse.rollouts"
local helpers = require "tests.lua.helpers"

local function model()
  local cfg = config.load("experiments/tiny.lua")
  dm.manual_seed(cfg.seed)
  return train.build_model(cfg, ".")
end

local SET = {name = "t", tasks = {{prompt = "1+1=", answer = "2\n"}, {prompt = "12+30=", answer = "42\n"},
                                  {prompt = "5+5=", answer = "10\n"}}}

describe("rollouts", function()
  it("samples k a task, verifies each and logs every decision as a JSON line", function()
    local m, dir = model(), helpers.tmpdir()
    local log = dir .. "/rollouts.jsonl"
    -- a verifier of our own: passes an output whose first byte is even
    local function even(task, output)
      local pass = #output > 0 and output:byte(1) % 2 == 0
      return {pass = pass, score = pass and 1 or 0, reason = pass and "even" or "odd"}
    end
    local r = rollouts.run(m, SET, {k = 3, budget = 6, seed = 7, verifier = even, log = log, step = 12,
                                    temperature = 1.5})
    assert.equal(9, #r.samples)
    assert.equal(3, r.tasks)
    local passed, lines = 0, {}
    for line in io.lines(log) do lines[#lines + 1] = json.decode(line) end
    assert.equal(9, #lines)
    for j, s in ipairs(r.samples) do
      assert.equal(6, s.bytes)
      assert.equal(s.output:byte(1) % 2 == 0, s.pass)
      passed = passed + (s.pass and 1 or 0)
      local l = lines[j]
      assert.equal("rollout", l.kind); assert.equal(12, l.step)
      assert.equal(s.task, l.task); assert.equal(s.sample, l.sample)
      assert.equal(SET.tasks[s.task].prompt, l.prompt)
      assert.equal(s.output, l.output); assert.equal(s.pass, l.pass); assert.equal(s.reason, l.reason)
    end
    assert.equal(passed / 9, r.pass_rate)
    assert.equal(3, #r.groups[2])
    -- the samples of a task differ (a seed each); the same seed gives the same samples
    assert.are_not.equal(r.groups[1][1].output, r.groups[1][2].output)
    local again = rollouts.run(m, SET, {k = 3, budget = 6, seed = 7, verifier = even, temperature = 1.5})
    for j, s in ipairs(again.samples) do assert.equal(r.samples[j].output, s.output) end
  end)

  it("ends a sample at its stop string, and verifies by the answer unless told otherwise", function()
    local r = rollouts.run(model(), SET, {k = 2, budget = 40, stop = "1", seed = 1, temperature = 2, first = 2})
    assert.equal(4, #r.samples)
    for _, s in ipairs(r.samples) do
      local at = s.output:find("1", 1, true)
      assert.is_true(at == nil and s.bytes == 40 or at == s.bytes, s.output)
      assert.is_false(s.pass)                     -- an untrained model: "differs" or "stopped" said
      assert.truthy(s.reason:match("^differs at byte") or s.reason:match("^stopped after"))
    end
    assert.equal(0, r.pass_rate)
  end)

  it("runs more streams at once than one dm.cat takes (72)", function()
    local r = rollouts.run(model(), SET, {k = 24, budget = 2, seed = 3})
    assert.equal(72, #r.samples)
    for _, s in ipairs(r.samples) do assert.equal(2, s.bytes) end
  end)

  it("refuses unknown options and bad counts by name", function()
    helpers.has(helpers.err_of(rollouts.run, model(), SET, {K = 2}), "unknown option 'K'")
    helpers.has(helpers.err_of(rollouts.run, model(), SET, {k = 0}), "k must be an integer >= 1")
    helpers.has(helpers.err_of(rollouts.run, model(), SET, {verifier = "fuzzy"}), "no verifier 'fuzzy'")
  end)
end)
