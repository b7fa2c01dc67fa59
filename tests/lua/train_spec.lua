-- The training program: resume is exact, refusals are clear, bad input is caught.
local dm = require "dormouse"
local config = require "dormouse.config"
local train = require "dormouse.train"

local tmpdir = require("tests.lua.helpers").tmpdir

local function tiny(overrides)
  local o = {"steps=20", "eval.every=0", "checkpoint.every=10", "checkpoint.keep=0",
             "log.every=5", "schedule.warmup=2", "eval.windows=4", "eval.baseline={}"}
  for _, s in ipairs(overrides or {}) do o[#o + 1] = s end
  return (config.load("experiments/tiny.lua", o))
end

local function params_of(model)
  local t = {}
  for _, p in ipairs(model:named_parameters()) do t[p.name] = p.tensor:clone() end
  for _, b in ipairs(model:named_buffers()) do t[b.name] = b.tensor:clone() end
  return t
end

local function losses(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    if line:find('"kind":"log"') then out[#out + 1] = line:match('"loss":([^,}]+)') end
  end
  return out
end

local function run_quiet(cfg, opts)
  opts.quiet, opts.silent, opts.root = true, true, "."
  return train.run(cfg, opts)
end

describe("resume", function()
  it("20 steps straight equal 10 steps, a stop, a resume and 10 more, bit for bit", function()
    local runs = tmpdir()
    local straight = run_quiet(tiny {"name=straight"}, {runs = runs})
    local a = params_of(straight.model)
    run_quiet(tiny {"name=resumed"}, {runs = runs, stop_at = 10})
    local resumed = run_quiet(tiny {"name=resumed"}, {runs = runs, resume = runs .. "/resumed"})
    assert.are.equal(20, resumed.step)
    local b = params_of(resumed.model)
    for name, t in pairs(a) do
      assert.is_true(dm.allclose(t, b[name], {rtol = 0, atol = 0}), name .. " differs after the resume")
    end
    assert.are.same(losses(runs .. "/straight"), losses(runs .. "/resumed"))
  end)

  it("refuses a resume whose config differs, naming each key and both values", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=r"}, {runs = runs, stop_at = 10})
    local ok, err = pcall(run_quiet, tiny {"name=r", "optim.muon_lr=0.01", "seed=7"},
                          {runs = runs, resume = runs .. "/r"})
    assert.is_false(ok)
    assert.matches("config differs", err)
    assert.matches("optim.muon_lr", err)
    assert.matches("seed", err)
    assert.matches("0.01", err)
  end)

  it("accepts a resume that changes only progress keys", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=p"}, {runs = runs, stop_at = 10})
    local res = run_quiet(tiny {"name=p", "log.every=2"}, {runs = runs, resume = runs .. "/p"})
    assert.are.equal(20, res.step)
  end)

  it("refuses a corrupted checkpoint, naming the file", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=c"}, {runs = runs, stop_at = 10})
    local path = runs .. "/c/ckpt-10/model.safetensors"
    local f = assert(io.open(path, "r+b"))
    f:seek("end", -4)
    f:write("XXXX")
    f:close()
    local ok, err = pcall(run_quiet, tiny {"name=c"}, {runs = runs, resume = runs .. "/c"})
    assert.is_false(ok)
    assert.matches("model.safetensors", err)
  end)

  it("refuses to overwrite a run that has checkpoints", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=o"}, {runs = runs, stop_at = 10})
    local ok, err = pcall(run_quiet, tiny {"name=o"}, {runs = runs})
    assert.is_false(ok)
    assert.matches("%-%-resume", err)
  end)
end)

describe("a run", function()
  it("writes its config, log, metrics, report and checkpoints, and the loss falls", function()
    local runs = tmpdir()
    local res = run_quiet(tiny {"name=w", "steps=30", "eval.every=15"}, {runs = runs})
    for _, f in ipairs {"config.lua", "log.txt", "metrics.jsonl", "report.html", "ckpt-30/meta.lua"} do
      assert.is_truthy(io.open(runs .. "/w/" .. f), f .. " missing")
    end
    local l = losses(runs .. "/w")
    assert.is_true(tonumber(l[#l]) < tonumber(l[1]), "the loss did not fall: " .. table.concat(l, " "))
    local log = io.open(runs .. "/w/log.txt"):read("a")
    assert.matches("moe busiest [%d.]+ entropy [%d.]+ dead %d+ drops %d+", log)
    -- KDA's passes by path, the window's steps only (tiny: 2 iterations a step, the CPU's recurrent
    -- path; the eval at step 15 not counted in the window after it)
    local cfg = tiny {"name=w"}
    local every = cfg.log.every
    for line in log:gmatch("step +%d+[^\n]*") do
      assert.truthy(line:find("kda chunked 0 recurrent " .. every * cfg.model.max_iter, 1, true), line)
    end
    assert.matches('"kda_recurrent":' .. every * cfg.model.max_iter, io.open(runs .. "/w/metrics.jsonl"):read("a"))
    assert.matches("engram rows %d+ uniq [%d.]+", log)
    local html = io.open(runs .. "/w/report.html"):read("a")
    assert.matches("held%-out bits per byte", html)       -- the charts (tests/lua/report_spec.lua has the rest)
    assert.is_true(res.bpb_fin > 0)
  end)

  it("counts the experts' use with the op moe_counters: busiest share, entropy over log E, dead (by hand)", function()
    local instrument = require "dormouse.instrument"
    local counts = {6, 0, 2, 0, 8}
    local total, h = 16, 0
    for _, c in ipairs(counts) do if c > 0 then h = h - c / total * math.log(c / total) end end
    local want = {busiest = 0.5, entropy = h / math.log(5), dead = 2, drops = 3}
    local got = instrument.moe_counters(counts, 3)
    assert.equal(want.busiest, got.busiest); assert.equal(want.dead, got.dead); assert.equal(3, got.drops)
    assert.is_true(math.abs(want.entropy - got.entropy) < 1e-12)
    assert.same(got, instrument.moe_counters(dm.tensor(counts, {dtype = "i64"}), 3))   -- a tensor, as the trainer's
    assert.same({busiest = 0, entropy = 0, dead = 3, drops = 0}, instrument.moe_counters({0, 0, 0}))
    assert.same({busiest = 1, entropy = 0, dead = 0, drops = 0}, instrument.moe_counters({7}))
    assert.is_nil(instrument.moe_counters(nil))
  end)

  it("gives the worst routing of the log windows past the warm-up", function()
    local instrument = require "dormouse.instrument"
    local records = {{kind = "log", step = 10, moe_busiest = 0.9, moe_dead = 60},      -- in the warm-up
                     {kind = "eval", step = 20},
                     {kind = "log", step = 20, moe_busiest = 0.2, moe_dead = 7},
                     {kind = "log", step = 30, moe_busiest = 0.3, moe_dead = 4},
                     {kind = "log", step = 40}}                                        -- no routing
    assert.same({busiest = 0.3, dead = 7}, instrument.worst_routing(records, 10))
    assert.same({busiest = 0.9, dead = 60}, instrument.worst_routing(records, 0))
    assert.is_nil(instrument.worst_routing(records, 40))
  end)

  it("watches the experts' use against the utilisation floor: flagged on the line, or stopped with a checkpoint",
     function()
    local instrument = require "dormouse.instrument"
    local state, guard = {}, {busiest = 0.1, dead = 2, windows = 2}
    assert.is_nil(instrument.utilisation(state, {busiest = 0.3, dead = 0}, guard))      -- one window: not yet
    assert.same({"busiest 0.300 > 0.100, dead 3 > 2", 2},
                {instrument.utilisation(state, {busiest = 0.3, dead = 3}, guard)})
    assert.is_nil(instrument.utilisation(state, {busiest = 0.05, dead = 0}, guard))     -- back under: counted anew
    assert.is_nil(instrument.utilisation(state, {busiest = 0.3, dead = 0}, guard))
    assert.is_nil(instrument.utilisation({}, {busiest = 0.9, dead = 99}, {windows = 1})) -- nothing watched
    local runs = tmpdir()
    run_quiet(tiny {"name=fl", "steps=20", "log.every=5", "guard.busiest=0.01", "guard.windows=2"}, {runs = runs})
    local log = io.open(runs .. "/fl/log.txt"):read("a")
    assert.matches("step +10 [^\n]*utilisation busiest [%d.]+ > 0%.010 for 2 windows", log)
    assert.is_nil(log:match("step +5 [^\n]*utilisation"))
    local ok, err = pcall(tiny, {"name=st", "guard.dead=-1"})
    assert.is_false(ok)
    assert.matches("guard.dead: expected integer >= 0 or nil", err)
    ok, err = pcall(run_quiet, tiny {"name=st", "steps=20", "log.every=5", "guard.busiest=0.01", "guard.windows=2",
                                     "guard.action=stop"}, {runs = runs})
    assert.is_false(ok)
    assert.matches("utilisation floor: busiest [%d.]+ > 0%.010 for 2 log windows in a row, to step 10", err)
    assert.is_truthy(io.open(runs .. "/st/ckpt-10/meta.lua"), "its checkpoint")
  end)

  it("stops with a clear error on a missing corpus", function()
    local ok, err = pcall(run_quiet, tiny {"name=m", "data.path=/nonexistent/corpus.txt"}, {runs = tmpdir()})
    assert.is_false(ok)
    assert.matches("/nonexistent/corpus.txt", err)
  end)

  it("trains on a mixture of sources and scores a separate eval source, and refuses keys that clash", function()
    local dir, runs = tmpdir(), tmpdir()
    local kjv = dm.data.open(dm.data.default_corpus())
    for i, name in ipairs {"a.txt", "b.txt", "e.txt"} do
      local f = assert(io.open(dir .. "/" .. name, "wb"))
      f:write(kjv:bytes(i * 100000, 30000))
      f:close()
    end
    kjv:close()
    local sources = string.format("data.sources={%s/a.txt, %s/b.txt}", dir, dir)
    local summary = run_quiet(tiny {"name=mix", "steps=4", "eval.every=4", "log.every=2", sources,
                                    "data.weights={3, 1}", "data.eval=" .. dir .. "/e.txt"}, {runs = runs})
    assert.are.equal(4, summary.step)
    assert.is_truthy(summary.bpb_fin)
    local log = require("tests.lua.helpers").read(runs .. "/mix/log.txt")
    assert.is_truthy(log:find(string.format("corpus %s/a.txt x 3 + %s/b.txt x 1 (64096 bytes, 4096 held out from %s/e.txt)",
                                            dir, dir, dir), 1, true), log)
    local function refused(overrides, part)
      local ok, err = pcall(run_quiet, tiny(overrides), {runs = runs})
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find(part, 1, true), tostring(err))
    end
    refused({"name=r1", sources, "data.path=" .. dir .. "/a.txt"}, "data.path (" .. dir .. "/a.txt) and data.sources")
    refused({"name=r2", "data.weights={1, 2}"}, "data.weights needs data.sources")
    refused({"name=r3", sources, "data.weights={1, 2, 3}"}, "data.weights has 3 entries and data.sources 2")
    refused({"name=r4", "data.records=tasks/addition.lua", "data.eval=" .. dir .. "/e.txt"},
            "data.records (tasks/addition.lua) and data.eval")
    os.execute("rm -rf '" .. dir .. "' '" .. runs .. "'")
  end)

  it("ends at the first log window above the CE ceiling, naming the step and the window", function()
    local ok, err = pcall(run_quiet, tiny {"name=ce", "ce_ceiling=0.5", "log.every=3"}, {runs = tmpdir()})
    assert.is_false(ok)
    assert.matches("CE ceiling", err)
    assert.matches("at step 3 is above 0.5 %(window of steps 1%.%.3%)", err)
  end)
end)
