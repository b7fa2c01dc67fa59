-- Supervised fine-tuning on spans (data.records): records read and packed into rows, the mask that
-- keeps the loss to the response bytes (exact against a by-hand mean, nothing from the prompt's
-- targets reaches the gradient), segments under a mask, and runs on records (eval, resume, refusals).
local dm = require "dormouse"
local config = require "dormouse.config"
local json = require "dormouse.json"
local records = require "dormouse.records"
local segments = require "dormouse.segments"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"

local dir
setup(function() dir = helpers.tmpdir() end)

local function write(name, text)
  local path = dir .. "/" .. name
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

-- n records: prompts of lower-case letters, responses of digits and a newline (lengths vary)
local function letters_and_digits(n)
  local lines = {}
  for i = 1, n do
    local prompt = string.rep(string.char(97 + i % 26), 1 + i % 7) .. ":"
    local response = tostring(i * 37 % 1000) .. "\n"
    lines[i] = json.encode({prompt = prompt, response = response, id = i})
  end
  return write("ld" .. n .. ".jsonl", table.concat(lines, "\n") .. "\n")
end

local function is_response_byte(b) return (b >= 48 and b <= 57) or b == 10 end

describe("records", function()
  it("reads JSONL and task files; a bad line is named by file and line", function()
    local list = records.read(letters_and_digits(5))
    assert.equal(5, #list)
    assert.same({prompt = "bb:", response = "37\n"}, list[1])
    local adds = records.read("tasks/addition.lua")
    assert.equal(20000, #adds)
    assert.truthy(adds[1].prompt:match("^%d+%+%d+=$") and adds[1].response:match("^%d+\n$"))

    local bad = write("bad.jsonl", '{"prompt": "a", "response": "b"}\n\n{"prompt": "a"}\n')
    helpers.has(helpers.err_of(records.read, bad), bad .. ":3 has no string \"response\"")
    bad = write("bad2.jsonl", '{"prompt": "a", "response": "b"}\nnot json\n')
    helpers.has(helpers.err_of(records.read, bad), bad .. ":2 is not a JSON object")
    bad = write("empty.jsonl", "\n\n")
    helpers.has(helpers.err_of(records.read, bad), bad .. " holds no record")
    bad = write("contains.lua", 'return {tasks = {{prompt = "a", answer = "b", check = "contains"}}}')
    helpers.has(helpers.err_of(records.read, bad), "tasks[1] is checked by \"contains\"")
    helpers.has(helpers.err_of(records.open, letters_and_digits(5), {eval_records = 5}),
                "5 records held out of the 5", "leaves none to train on")
  end)

  it("carries a code task's tests, language, head and seconds from JSONL and task files", function()
    local path = write("code.jsonl", json.encode({prompt = "p", response = "r", tests = {"assert(f(1) == 1)"},
                                                  language = "lua", head = "local function f(x) return ", seconds = 3}) ..
                                     "\n" .. json.encode({prompt = "q", response = "s", tests = "assert(true)"}) .. "\n")
    local list = records.read(path)
    assert.same({prompt = "p", response = "r", tests = {"assert(f(1) == 1)"}, language = "lua",
                 head = "local function f(x) return ", seconds = 3}, list[1])
    assert.same({prompt = "q", response = "s", tests = "assert(true)"}, list[2])
    local code = records.read("tasks/code.lua")
    assert.equal(20000, #code)
    assert.equal(code[1].prompt, code[1].head); assert.equal("lua", code[1].language); assert.equal(4, #code[1].tests)
    for _, c in ipairs {{'{"prompt": "a", "response": "b", "tests": []}', ":1: \"tests\" is an empty list"},
                        {'{"prompt": "a", "response": "b", "tests": 3}', ":1: \"tests\" must be a string"},
                        {'{"prompt": "a", "response": "b", "tests": "t", "language": "c"}', ":1: \"language\" must be"},
                        {'{"prompt": "a", "response": "b", "tests": "t", "seconds": -1}', ":1: \"seconds\" must be"}} do
      local bad = write("badcode.jsonl", c[1] .. "\n")
      helpers.has(helpers.err_of(records.read, bad), bad .. c[2])
    end
  end)

  it("opens several files: all of them train, each holds out its last records, taken in turn", function()
    local a, b = letters_and_digits(6), letters_and_digits(9)
    local set = records.open({a, b}, {eval_records = 2})
    assert.equal(4 + 7, #set.train)
    local la, lb = records.read(a), records.read(b)
    assert.same({la[5], lb[8], la[6], lb[9]}, set:held_out())
    assert.same({a, b}, set:files())
    helpers.has(set:describe(), a .. " + " .. b, "11 to train, 4 held out")
    helpers.has(helpers.err_of(records.open, {a, letters_and_digits(2)}, {eval_records = 2}),
                "2 records held out of the 2 in")
    -- a run's data.records names them separated by commas (spaces around a name are not part of it)
    local cfg = config.load("experiments/sft_addition.lua",
                            {string.format("data.records=%q", a .. ", " .. b), "data.eval_records=2"})
    local opened, path = train.open_corpus(cfg)
    assert.equal(a .. "," .. b, path)
    assert.equal(11, #opened.train)
  end)

  it("ships task sets whose answers are right: every sum of addition, every string function of strings", function()
    for _, r in ipairs(records.read("tasks/addition.lua")) do
      local a, b = r.prompt:match("^(%d+)%+(%d+)=$")
      assert.equal(tostring(tonumber(a) + tonumber(b)) .. "\n", r.response, r.prompt)
    end
    local fns = {reverse = string.reverse, upper = string.upper, length = function(w) return tostring(#w) end,
                 first = function(w) return w:sub(1, 1) end, last = function(w) return w:sub(-1) end,
                 sort = function(w)
                   local t = {}
                   for c in w:gmatch(".") do t[#t + 1] = c end
                   table.sort(t)
                   return table.concat(t)
                 end}
    local seen = {}
    for _, r in ipairs(records.read("tasks/strings.lua")) do
      local name, w = r.prompt:match("^(%l+)%((%l+)%)=$")
      local x, cw = r.prompt:match("^count%((%l),(%l+)%)=$")
      if x then
        assert.equal(select(2, cw:gsub(x, "")) .. "\n", r.response, r.prompt)
        seen.count = true
      else
        assert.equal(fns[name](w) .. "\n", r.response, r.prompt)
        seen[name] = true
      end
    end
    for _, name in ipairs {"reverse", "upper", "length", "first", "last", "sort", "count"} do assert.truthy(seen[name], name) end
  end)

  it("packs rows from record starts; the mask is 1 exactly on response targets; the batch is (seed, k)'s", function()
    local set <close> = records.open(letters_and_digits(200), {eval_records = 20})
    assert.equal(180, #set.train)
    local x, prefix, mask = set:batch(3, {batch = 5, seq = 40, seed = 2, ctx = 3})
    assert.same({5, 41}, x:shape()); assert.same({5, 3}, prefix:shape()); assert.same({5, 40}, mask:shape())
    local xs, ms, ps = x:totable(), mask:totable(), prefix:totable()
    local responses = 0
    for r = 1, 5 do
      assert.truthy(xs[r][1] >= 97 and xs[r][1] <= 122, "row " .. r .. " starts in a prompt")
      assert.equal(10, ps[r][3], "row " .. r .. "'s prefix ends where a record ends")
      for t = 1, 40 do
        assert.equal(is_response_byte(xs[r][t + 1]) and 1 or 0, ms[r][t], string.format("row %d target %d", r, t))
        responses = responses + ms[r][t]
      end
    end
    assert.truthy(responses > 0 and responses < 200)
    local x2, _, m2 = set:batch(3, {batch = 5, seq = 40, seed = 2, ctx = 3})
    assert.is_true(dm.allclose(x, x2, {rtol = 0, atol = 0}) and dm.allclose(mask, m2, {rtol = 0, atol = 0}))
    local x3 = set:batch(4, {batch = 5, seq = 40, seed = 2, ctx = 3})
    assert.is_false(dm.allclose(x, x3, {rtol = 0, atol = 0}))

    local loader <close> = set:loader {batch = 5, seq = 40, seed = 2, ctx = 3, start = 3}
    local px, _, pk, pm = loader:peek()
    assert.equal(3, pk); assert.equal(3, loader:position())
    local nx, _, nk, nm = loader:next()
    assert.equal(3, nk); assert.equal(4, loader:position())
    assert.is_true(dm.allclose(px, nx, {rtol = 0, atol = 0}) and dm.allclose(x, nx, {rtol = 0, atol = 0}))
    assert.is_true(dm.allclose(pm, nm, {rtol = 0, atol = 0}))
  end)

  it("packs the held-out records whole into eval windows, the rest padding under mask 0", function()
    local set <close> = records.open(letters_and_digits(60), {eval_records = 30})
    local x, prefix, mask, cut = set:eval_windows {seq = 24, ctx = 2}
    assert.equal(0, cut)
    local text, kept = {}, 0
    for r, row in ipairs(x:totable()) do
      local m = mask:totable()[r]
      local bytes = {}
      for t = 1, 25 do
        if row[t] ~= 0 then bytes[#bytes + 1] = string.char(row[t]) end
        if t > 1 then
          assert.equal((row[t] ~= 0 and is_response_byte(row[t])) and 1 or 0, m[t - 1])
          kept = kept + m[t - 1]
        end
      end
      text[r] = table.concat(bytes)
      assert.truthy(text[r]:match("^%l+:"), "window " .. r .. " starts with a record")
    end
    local want, responses = {}, 0
    for _, rec in ipairs(set:held_out()) do
      want[#want + 1] = rec.prompt .. rec.response
      responses = responses + #rec.response
    end
    assert.equal(table.concat(want), table.concat(text))
    -- a response's first byte is the target of its prompt's last; every response byte is scored
    assert.equal(responses, kept)
    assert.same({0, 0}, prefix:totable()[1])
    local _, _, _, cuts = set:eval_windows {seq = 3}
    assert.truthy(cuts > 0)
  end)
end)

-- a tiny model (f64) and a records batch of it
local function model_of(overrides)
  local cfg = config.load("experiments/tiny.lua", overrides)
  dm.manual_seed(cfg.seed)
  return train.build_model(cfg, "."):cast("f64")
end

local function grads_of(model)
  local g = {}
  for _, p in ipairs(model:named_parameters()) do
    if p.tensor.grad then g[p.name] = p.tensor.grad:clone() end
  end
  return g
end

describe("the loss under a mask", function()
  local set
  setup(function() set = records.open(letters_and_digits(200), {eval_records = 20}) end)

  for _, arch in ipairs {"dormouse", "stack"} do
    it(arch .. ": is the mean cross-entropy over the response targets (f64, by hand from the logits)", function()
      local m = model_of(arch == "stack" and {"model.arch=stack"} or nil)
      local x, prefix, mask = set:batch(1, {batch = 3, seq = 48, seed = 4, ctx = 2})
      dm.scope(function()
        local out = m:forward(x, prefix, {mask = mask})
        local T = 48
        local per = dm.cross_entropy(out.fin_logits:reshape({-1, 256}), x:narrow(2, 2, T):to("i64"):reshape({-1}),
                                     {reduction = "none"})
        local keep = mask:to("f64"):reshape({-1})
        local by_hand = (per * keep):sum():item() / keep:sum():item()
        assert.is_true(math.abs(out.fin:item() - by_hand) <= 1e-12 * by_hand, out.fin:item() .. " vs " .. by_hand)
        -- a mask of ones is no mask
        local all = m:forward(x, prefix, {mask = dm.ones({3, T}, {dtype = "u8"})})
        local none = m:forward(x, prefix)
        assert.is_true(math.abs(all.loss:item() - none.loss:item()) <= 1e-12 * none.loss:item())
      end)
    end)
  end

  it("takes nothing from a prompt's targets: the gradient is the same whatever they are", function()
    -- the last target of a row is no input: changing it changes nothing under mask 0, and does under mask 1
    local x, prefix, mask = set:batch(2, {batch = 2, seq = 32, seed = 1, ctx = 2})
    local function run(last, m_last)
      local m = model_of()
      local xv, mv = x:clone(), mask:clone()
      xv:narrow(2, 33, 1):fill_(last)
      mv:narrow(2, 32, 1):fill_(m_last)
      return dm.scope(function()
        local out = m:forward(xv, prefix, {mask = mv})
        out.loss:backward()
        return out.loss:item(), grads_of(m)
      end)
    end
    local la, ga = run(string.byte("q"), 0)
    local lb, gb = run(string.byte("7"), 0)
    assert.equal(la, lb)
    local n = 0
    for name, g in pairs(ga) do
      assert.is_true(dm.allclose(g, gb[name], {rtol = 0, atol = 0}), name)
      n = n + 1
    end
    assert.truthy(n > 20)
    local lc = run(string.byte("q"), 1)
    local ld = run(string.byte("7"), 1)
    assert.are_not.equal(lc, ld)
  end)

  it("weighs a step's micro-batches by their response targets: two of 2 rows step as one of 4 rows (f64)", function()
    local o = {batch = 2, seq = 24, seed = 1, ctx = train.engram_ctx(config.load("experiments/tiny.lua"))}
    local a, b = {set:batch(0, o)}, {set:batch(3, o)}
    local na, nb = a[3]:to("f64"):sum():item(), b[3]:to("f64"):sum():item()
    assert.are_not.equal(na, nb)                          -- else equal weights would pass too
    local function step(batches, accum)                     -- train.step's loss and the gradient it stepped on
      local m, i, grads = model_of(), 0, nil
      local cfg = config.load("experiments/tiny.lua", {"grad_accum=" .. accum, "data.records=\"x.jsonl\""})
      local opt = {dev = {sumsq = dm.zeros({1}, {dtype = "f64"})}, zero_grad = function() end,   -- (f64: no update)
                   scalars = function(o) return o.dev end, sync = function() return {t = 0} end,
                   prepare = function() return {lr = 0, lr_mult = 1} end,
                   step_async = function()                      -- the gradients as the update would read them
                     grads = {}
                     for name, g in pairs(grads_of(m)) do grads[name] = dm.keep(g) end   -- past the step's scope
                   end}
      local r = {cfg = cfg, model = m, device = "cpu", step = 1, opt = opt,
                 loader = {next = function() i = i + 1; return batches[i][1], batches[i][2], i - 1, batches[i][3] end}}
      return train.step(r).loss, grads
    end
    local function cat(j) return dm.cat({a[j], b[j]}, 1) end
    local l2, g2 = step({a, b}, 2)
    local l1, g1 = step({{cat(1), cat(2), cat(3)}}, 1)
    assert.is_true(math.abs(l1 - l2) < 1e-12 * math.abs(l1), l1 .. " vs " .. l2)
    local n = 0
    for name, g in pairs(g1) do
      assert.is_true(dm.allclose(g, g2[name], {rtol = 1e-9, atol = 1e-12}), name)
      n = n + 1
    end
    assert.truthy(n > 20)
    assert.same({0.25, 0.75}, require("dormouse.step").micro_weights({dm.tensor({1, 0}, {dtype = "u8"}), dm.tensor({1, 2}, {dtype = "u8"})}, 2))
    assert.same({0.5, 0.5}, require("dormouse.step").micro_weights(nil, 2))
    assert.same({0.5, 0.5}, require("dormouse.step").micro_weights({dm.zeros({2}, {dtype = "u8"}), dm.zeros({2}, {dtype = "u8"})}, 2))
  end)

  it("of a batch with no response byte is 0, with no NaN in any gradient", function()
    local m = model_of()
    local x, prefix = set:batch(0, {batch = 2, seq = 16, seed = 1, ctx = 2})
    dm.scope(function()
      local out = m:forward(x, prefix, {mask = dm.zeros({2, 16}, {dtype = "u8"})})
      assert.equal(0, out.loss:item())
      out.loss:backward()
      for name, g in pairs(grads_of(m)) do assert.equal(0, g:abs():sum():item(), name) end
    end)
  end)

  it("by segments equals the whole pass: the loss and every gradient (f64, 4 segments)", function()
    local a, b = model_of(), model_of()
    local x, prefix, mask = set:batch(5, {batch = 2, seq = 64, seed = 3, ctx = 2})
    mask:narrow(2, 1, 16):fill_(0)                          -- a segment with no target scored
    dm.scope(function()
      local out = a:forward(x, prefix, {mask = mask})
      local la = out.loss:item()
      out.loss:backward()
      local lb = segments.backward(b, x, prefix, 16, 1.0, nil, mask):item()
      assert.is_true(math.abs(la - lb) <= 1e-12 * la, la .. " vs " .. lb)
      local gb = grads_of(b)
      for name, g in pairs(grads_of(a)) do
        local e = (g - gb[name]):abs():max():item() / math.max(g:abs():max():item(), 1e-300)
        assert.is_true(e <= 1e-10, name .. ": " .. e)
      end
      local ea = segments.evaluate(a, x, prefix, 16, {mask = mask}).fin
      local whole = dm.no_grad(function() return a:forward(x, prefix, {mask = mask}).fin:item() end)
      assert.is_true(math.abs(ea - whole) <= 1e-12 * whole)
    end)
  end)
end)

describe("a run on records", function()
  local BASE = {"steps=6", "log.every=3", "eval.every=6", "checkpoint.every=3", "checkpoint.keep=0", "dtype=f32",
                "eval.sample=0", "schedule.warmup=2", "data.records=tasks/addition.lua", "eval.exact=4",
                "eval.budgets={4,8}"}

  local function lines(name, kind) return helpers.metrics(dir .. "/" .. name, kind) end

  it("evaluates the held-out responses (masked bpb, exact@B) and says what it reads", function()
    local res = helpers.run_quiet(helpers.tiny(BASE, {"name=sft"}), {runs = dir})
    assert.equal(6, res.step)
    local e = lines("sft", "eval")[1]
    assert.truthy(e.measures["exact@4"] and e.measures["exact@8"])
    assert.truthy(e.measures["exact@4"] <= e.measures["exact@8"])
    local set <close> = records.open("tasks/addition.lua", {eval_records = 256})
    local responses = 0
    local cfg = helpers.tiny(BASE)
    local _, _, mask = set:eval_windows {seq = cfg.seq, ctx = 3}
    responses = mask:to("f64"):sum():item()
    assert.equal(responses, e.bytes)
    local log = helpers.read(dir .. "/sft/log.txt")
    helpers.has(log, "records tasks/addition.lua (19744 to train, 256 held out;",
                "records: the eval scores the responses of", "no n-gram baseline on records", "exact@4 ")
  end)

  it("puts pass@B on the eval line for records with tests (tasks/code.lua beside tasks/addition.lua)", function()
    helpers.run_quiet(helpers.tiny(BASE, {"name=coded", "data.records=\"tasks/addition.lua,tasks/code.lua\"",
                                          "eval.exact=6", "eval.budgets={8,16}"}), {runs = dir})
    local e = lines("coded", "eval")[1]
    for _, m in ipairs {"exact@8", "exact@16", "pass@8", "pass@16"} do assert.truthy(e.measures[m], m) end
    assert.truthy(e.measures["pass@8"] <= e.measures["pass@16"])
  end)

  it("pass@B: a greedy output cut at B bytes, judged by its tests, any solution counting", function()
    local evaluate, tasks = require "dormouse.eval", require "dormouse.tasks"
    local outputs = {a = "x * 2 end\n", b = "x + x end\n", c = "x * 3 end\n"}
    local saved = evaluate.greedy_until
    evaluate.greedy_until = function(_, prompt, n, judge)         -- the model's greedy bytes, given
      local text = outputs[prompt:sub(1, 1)]
      for i = 1, math.min(n, #text) do if judge(text:sub(1, i)) then return text:sub(1, i), true end end
      return text:sub(1, n)
    end
    local head, tests = "local function f(x) return ", {"assert(f(2) == 4)", "assert(f(-1) == -2)"}
    local set = {tasks = {}}
    for _, p in ipairs {"a", "b", "c"} do
      set.tasks[#set.tasks + 1] = {prompt = p .. "\n" .. head, answer = "x * 2 end\n", head = head, tests = tests,
                                   language = "lua"}
    end
    set.tasks[4] = {prompt = "a", answer = "z"}                 -- no tests: not counted
    local ok, out = pcall(tasks.passed_at, nil, set, {4, 16})
    evaluate.greedy_until = saved
    assert(ok, out)
    assert.same({["pass@4"] = 0, ["pass@16"] = 2 / 3}, out)
    assert.is_nil(tasks.passed_at(nil, {tasks = {{prompt = "a", answer = "z"}}}, {4}))
  end)

  it("resumes exactly: 6 steps straight equal 3, a stop and a resume", function()
    helpers.run_quiet(helpers.tiny(BASE, {"name=straight"}), {runs = dir})
    helpers.run_quiet(helpers.tiny(BASE, {"name=stopped"}), {runs = dir, stop_at = 3})
    helpers.run_quiet(helpers.tiny(BASE, {"name=stopped"}), {runs = dir, resume = dir .. "/stopped"})
    local a, b = lines("straight", "log"), lines("stopped", "log")
    assert.equal(2, #a)
    for i = 1, 2 do assert.equal(a[i].loss, b[i].loss) end
  end)

  it("refuses data.path beside data.records, naming both", function()
    local err = helpers.err_of(helpers.run_quiet, helpers.tiny(BASE, {"name=both", "data.path=x.txt"}), {runs = dir})
    helpers.has(err, "data.records (tasks/addition.lua) and data.path (x.txt)")
    assert.is_nil(io.open(dir .. "/both/log.txt"))
  end)
end)
