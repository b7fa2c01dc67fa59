-- correct@budget (eval.tasks): task files checked by name, the budgets' arithmetic, the shipped
-- task set against the corpus it asks about, and the figures on the eval line, in metrics.jsonl and
-- in the report.
local dm = require "dormouse"
local tasks = require "dormouse.tasks"
local evaluate = require "dormouse.eval"
local instrument = require "dormouse.instrument"
local helpers = require "tests.lua.helpers"
local has, err_of, read, tmpdir = helpers.has, helpers.err_of, helpers.read, helpers.tmpdir

local function file(text)
  local path = tmpdir() .. "/t.lua"
  local f = assert(io.open(path, "w")); f:write(text); f:close()
  return path
end

describe("a task file", function()
  it("is refused naming the file, the task and the field", function()
    has(err_of(tasks.load, "/nonexistent/t.lua"), "eval.tasks:", "/nonexistent/t.lua")
    local cases = {
      {"return 3", "a task file returns {name = ..., tasks = "},
      {"return {tasks = {}}", "tasks holds no task"},
      {"return {tasks = {{answer = 'x'}}}", "tasks[1].prompt must be a non-empty string"},
      {"return {tasks = {{prompt = 'a', answer = 'b'}, {prompt = 'a'}}}", "tasks[2].answer must be a non-empty string (check prefix)"},
      {"return {tasks = {{prompt = 'a', answer = 'b', check = 'regex'}}}", 'tasks[1].check must be "prefix", "contains" or a function'},
      {"return {tasks = {{prompt = 'a', answer = 'b', budget = 3}}}", "tasks[1] has an unknown key 'budget'"},
      {"return {tasks = {{prompt = 'a', answer = 'b', tests = {}}}}", "tasks[1].tests is an empty list"},
      {"return {tasks = {{prompt = 'a', answer = 'b', tests = {'x', 3}}}}", "tasks[1].tests[2] must be a string"},
      {"return {tasks = {{prompt = 'a', answer = 'b', tests = 3}}}", "tasks[1].tests must be a program"},
      {"return {tasks = {{prompt = 'a', answer = 'b', tests = 'x', language = 'ruby'}}}", 'tasks[1].language must be "python3" or "lua"'},
      {"return {tasks = {{prompt = 'a', answer = 'b', tests = 'x', seconds = 0}}}", "tasks[1].seconds must be a number > 0"},
      {"return {tasks = {{prompt = 'a', answer = 'b', head = 'x'}}}", "tasks[1] has language, head or seconds but no tests"},
      {"error('broken')", "broken"},
    }
    for _, c in ipairs(cases) do
      local path = file(c[1])
      has(err_of(tasks.load, path), path, c[2])
    end
  end)
end)

describe("correct@budget", function()
  -- a model that continues every prompt with a fixed text, a byte at a time, as greedy_until does
  local function scripted(replies, fn)
    local real = evaluate.greedy_until
    local asked = {}
    evaluate.greedy_until = function(_, prompt, n, judge)
      local reply, text = replies[prompt], ""
      for i = 1, math.min(n, #reply) do
        text = reply:sub(1, i)
        local verdict = judge(text)
        if verdict ~= nil then asked[prompt] = i; return text, verdict end
      end
      asked[prompt] = #text
      return text, nil
    end
    local ok, err = pcall(fn, asked)
    evaluate.greedy_until = real
    if not ok then error(err, 0) end
  end

  it("counts a task solved after k bytes for every budget >= k, and stops a prefix gone astray", function()
    local set = tasks.load(file([[return {name = "t", tasks = {
      {prompt = "a", answer = "saying"},
      {prompt = "b", answer = "saying"},
      {prompt = "c", answer = "Moses", check = "contains"},
      {prompt = "d", check = function(text) return #text >= 300 and text:sub(-1) == "!" end},
    }}]]))
    scripted({a = "saying, Speak", b = "sayeth the LORD", c = ("x"):rep(100) .. "Moses" .. ("y"):rep(900),
              d = ("z"):rep(299) .. "!"}, function(asked)
      local got = tasks.correct_at(nil, set, {64, 256, 1024})
      assert.same({["correct@64"] = 0.25, ["correct@256"] = 0.5, ["correct@1024"] = 0.75}, got)
      assert.equal(6, asked.a)            -- solved at its answer's length
      assert.equal(4, asked.b)            -- "saye": astray, given up at once
      assert.equal(105, asked.c)          -- the answer's last byte
      assert.equal(300, asked.d)
    end)
    assert.equal("t", set.name)
  end)

  it("names the task whose predicate fails", function()
    local path = file("return {tasks = {{prompt = 'a', check = function(text) error('oops') end}}}")
    local set = tasks.load(path)
    scripted({a = "xyz"}, function()
      has(err_of(tasks.correct_at, nil, set, {8}), "eval.tasks: " .. path .. ": tasks[1].check failed", "oops")
    end)
  end)

  it("orders the budgets as numbers on the eval line", function()
    local line = instrument.eval_line({step = 5, bytes = 10, fin = 1, periter = {},
      measures = {["correct@1024"] = 0.5, ["correct@64"] = 0.25, ["correct@256"] = 0.375}})
    assert.truthy(line:find("correct@64 0.2500  correct@256 0.3750  correct@1024 0.5000", 1, true), line)
  end)
end)

describe("the shipped task set tasks/kjv.lua", function()
  it("asks for the embedded corpus's own text, from its training split", function()
    local set = tasks.load("tasks/kjv.lua")
    local f = assert(io.open(dm.data.default_corpus(), "rb"))
    local text = f:read("a")
    f:close()
    local train_split = text:sub(1, #text - 81920)
    assert.is_true(#set.tasks >= 10)
    for i, t in ipairs(set.tasks) do                 -- somewhere the prompt is followed by its answer
      local at, found = train_split:find(t.prompt, 1, true), false
      assert.is_truthy(at, "task " .. i .. "'s prompt is not in the training split")
      while at and not found do
        local after = train_split:sub(at + #t.prompt, at + #t.prompt + 1023)
        if t.check == "prefix" then found = after:sub(1, #t.answer) == t.answer
        else found = after:find(t.answer, 1, true) ~= nil end
        at = train_split:find(t.prompt, at + 1, true)
      end
      assert.is_true(found, "task " .. i .. ": its answer never follows its prompt (within 1,024 bytes)")
    end
  end)
end)

describe("a run with eval.tasks", function()
  it("puts correct@B on the eval line, in metrics.jsonl and in the report's eval table", function()
    local runs = tmpdir()
    helpers.run_quiet(helpers.tiny({"name=ct", "steps=2", "eval.every=0", "log.every=1", "schedule.warmup=1",
                                    "eval.windows=2", "eval.baseline={}", "eval.tasks=tasks/kjv.lua",
                                    "eval.budgets={4,16}", "checkpoint.every=0"}), {runs = runs})
    local log = read(runs .. "/ct/log.txt")
    assert.truthy(log:find("eval +2 .* correct@4 %d%.%d+  correct@16 %d%.%d+"), log)
    has(read(runs .. "/ct/metrics.jsonl"), '"correct@4":', '"correct@16":')
    has(read(runs .. "/ct/report.html"), "<th>correct@4</th><th>correct@16</th>")
    has(err_of(helpers.run_quiet, helpers.tiny({"name=ct2", "steps=2", "schedule.warmup=1",
                                                "eval.tasks=tasks/none.lua"}), {runs = runs}),
        "eval.tasks:", "tasks/none.lua")
    assert.is_nil(io.open(runs .. "/ct2/log.txt"))            -- refused before the folder was made
  end)
end)
