-- Seed sweeps: the verdict rule, and a real (tiny) sweep end to end.
local sweep = require "dormouse.sweep"
local has = require("tests.lua.helpers").has

describe("the verdict", function()
  local function r(mean, spread) return {mean = mean, spread = spread, bpb = {}} end

  it("beats the control only past both spreads", function()
    local res = {control = r(2.0, 0.01), a = r(1.9, 0.02), b = r(1.995, 0.001), c = r(1.97, 0.05), d = r(2.2, 0.01)}
    sweep.verdicts(res, "control")
    assert.are.equal("control", res.control.verdict)
    assert.are.equal("beats control", res.a.verdict)
    assert.are.equal("no difference beyond the spread", res.b.verdict)   -- inside the control's spread
    assert.are.equal("no difference beyond the spread", res.c.verdict)   -- inside its own spread
    assert.are.equal("worse than control", res.d.verdict)
  end)
end)

describe("a sweep", function()
  it("trains every (arm, seed) and prints a table", function()
    local dir = os.tmpname(); os.remove(dir)
    os.execute("mkdir -p '" .. dir .. "'")
    local cwd = assert(io.popen("pwd")):read("l")
    local res = sweep.run {
      base = cwd .. "/experiments/tiny.lua", root = cwd, runs = dir, quiet = true,
      arms = {control = {}, slow = {["optim.muon_lr"] = 1e-5, ["optim.adamw_lr"] = 1e-5}},
      seeds = {1, 2},
      set = {steps = 12, ["schedule.warmup"] = 2, ["eval.every"] = 0, ["eval.windows"] = 4,
             ["eval.baseline"] = {}, ["checkpoint.every"] = 0},
    }
    assert.are.equal(2, #res.control.bpb)
    assert.is_true(res.control.mean < res.slow.mean)
    assert.are.equal("worse than control", res.slow.verdict)
    assert.is_truthy(io.open(dir .. "/sweep-tiny/verdict.txt"))
    for _, arm in ipairs {"control", "slow"} do            -- the last window's training loss, in bits a byte
      assert.is_true(res[arm].train_bpb[1] > 0 and res[arm].train_bpb[2] > 0)
    end
    assert.is_true(res.control.train_bpb[1] < res.slow.train_bpb[1])
    -- the worst routing of the log windows past the warm-up (step 2), as the run's metrics give it
    local json = require "dormouse.json"
    local busiest, dead = 0, 0
    for line in io.lines(dir .. "/tiny-control-s1/metrics.jsonl") do
      local rec = json.decode(line)
      if rec.kind == "log" and rec.step > 2 then
        busiest, dead = math.max(busiest, rec.moe_busiest), math.max(dead, rec.moe_dead)
      end
    end
    assert.is_true(math.abs(busiest - res.control.busiest_max[1]) < 1e-6)   -- (the log's digits)
    assert.are.equal(dead, res.control.dead_max[1])
    assert.is_true(res.control.busiest_max[1] >= res.control.busiest[1])
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

describe("dormouse sweep", function()
  local bin = arg and arg[-1]
  local sh = require("tests.lua.helpers").sh

  -- a sweep file over tiny in a fresh folder (its runs there too): the folder, the file, the cwd.
  -- body: the table's fields after base and runs, as Lua source
  local function sweep_file(body)
    local dir = os.tmpname(); os.remove(dir)
    assert(os.execute("mkdir -p '" .. dir .. "'"))
    local cwd = assert(io.popen("pwd")):read("l")
    local file = dir .. "/s.lua"
    local f = assert(io.open(file, "w"))
    f:write(string.format("return {base = %q, runs = %q, %s}\n", cwd .. "/experiments/tiny.lua", dir, body))
    f:close()
    return dir, file, cwd
  end

  it("runs a sweep file with --set over every arm, a short run getting a short warm-up", function()
    local dir, file, cwd = sweep_file([[seeds = {1, 2},
  arms = {control = {}, slow = {["optim.muon_lr"] = 1e-5, ["optim.adamw_lr"] = 1e-5}},
  set = {steps = 300, ["eval.every"] = 0, ["eval.windows"] = 4, ["eval.baseline"] = {}, ["checkpoint.every"] = 0}]])
    -- tiny's warm-up (4) and decay (a fifth) do not fit 4 steps: the sweep says so and cuts it
    local code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --set steps=4", cwd, bin, file))
    assert.equal(0, code, out)
    assert.is_truthy(out:find("sweep: schedule.warmup 4 -> 1 for runs of 4 steps", 1, true), out)
    assert.is_truthy(out:find("worse than control", 1, true) or out:find("no difference", 1, true), out)
    local verdict = assert(io.open(dir .. "/sweep-s/verdict.txt")):read("a")
    assert.is_truthy(verdict:find("seed 2", 1, true))
    assert.is_truthy(verdict:find("held-out bpb_fin, bits a byte, lower is better", 1, true), verdict)
    -- a quick form: other seeds and steps from the command line, passed on to each run's process
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --seeds 3 --steps 4 --jobs 2 --overwrite", cwd, bin, file))
    assert.equal(0, code, out)
    verdict = assert(io.open(dir .. "/sweep-s/verdict.txt")):read("a")
    assert.is_truthy(verdict:find("seed 3", 1, true) and not verdict:find("seed 1", 1, true), verdict)
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --steps 4 --set steps=5", cwd, bin, file))
    assert.equal(2, code, out)
    assert.is_truthy(out:find("--steps and --set steps=... both give the steps", 1, true), out)
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --seeds x", cwd, bin, file))
    assert.equal(2, code, out)
    assert.is_truthy(out:find("--seeds takes integers >= 0 with commas, got x", 1, true), out)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("with --jobs trains the runs as processes of their own, to the same figures as one process", function()
    local dir, file, cwd = sweep_file([[seeds = {1, 2},
  arms = {control = {}, loom = {["model.loom"] = true}},
  set = {steps = 3, ["schedule.warmup"] = 1, ["eval.every"] = 0, ["eval.windows"] = 4, ["eval.baseline"] = {},
         ["checkpoint.every"] = 0, ["log.every"] = 1}]])
    local code, out = sh(string.format("cd '%s' && '%s' sweep '%s'", cwd, bin, file))
    assert.equal(0, code, out)
    local one = assert(io.open(dir .. "/sweep-s/verdict.json")):read("a")
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --jobs 3 --overwrite", cwd, bin, file))
    assert.equal(0, code, out)
    assert.is_truthy(out:find("== sweep: arm loom, seed 2 started", 1, true), out)
    assert.is_truthy(out:find("shared the device", 1, true), out)
    local json = require "dormouse.json"
    local a, b = json.decode(one), json.decode(assert(io.open(dir .. "/sweep-s/verdict.json")):read("a"))
    for _, arm in ipairs({"control", "loom"}) do
      for i = 1, 2 do assert.are.equal(a.arms[arm].bpb[i], b.arms[arm].bpb[i]) end
      assert.is_true(b.arms[arm].tok_s[1] > 0 and b.arms[arm].mem_peak[1] > 0)
    end
    assert.is_truthy(io.open(dir .. "/sweep-s/loom-s2.log"))
    -- a run that fails is named with its log, after the others end; a --run no sweep has is refused
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --jobs 2 --set model.max_iter=0", cwd, bin, file))
    assert.equal(1, code, out)
    assert.is_truthy(out:find("max_iter", 1, true), out)
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --arms lom", cwd, bin, file))
    assert.equal(1, code, out)
    assert.is_truthy(out:find("--arms names 'lom', which this sweep does not have (arms: control, loom)", 1, true), out)
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --arms control --set steps=2", cwd, bin, file))
    assert.equal(0, code, out)
    assert.is_nil(out:find("loom", 1, true), out)                          -- the control alone
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --run loom:9", cwd, bin, file))
    assert.equal(1, code, out)
    assert.is_truthy(out:find("--run loom:9 names no run of this sweep", 1, true), out)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("with --jobs passes a SIGTERM on to its runs, which stop with a checkpoint; none is left running", function()
    local dir, file, cwd = sweep_file([[seeds = {1, 2}, arms = {control = {}},
  set = {steps = 100000, ["eval.every"] = 0, ["eval.windows"] = 4, ["eval.baseline"] = {}, ["checkpoint.every"] = 0}]])
    -- the parent alone gets the signal (not its process group), once its runs have begun
    local code, out = sh(string.format("cd '%s' && ('%s' sweep '%s' --jobs 2 & p=$!; " ..
      "for i in $(seq 100); do grep -q '^step' '%s'/sweep-s/control-s2.log 2>/dev/null && break; sleep 0.1; done; " ..
      "kill -TERM $p; wait $p)", cwd, bin, file, dir))
    assert.equal(1, code, out)
    assert.is_truthy(out:find("== sweep: SIGTERM: the 2 runs going stop after their step", 1, true), out)
    assert.is_truthy(out:find("sweep: stopped by SIGTERM: 2 of 2 runs were not finished", 1, true), out)
    assert.is_truthy(out:find("== sweep: arm control, seed 1 stopped", 1, true), out)
    local log = assert(io.open(dir .. "/sweep-s/control-s1.log")):read("a")
    assert.is_truthy(log:find("SIGTERM: the run stopped after step", 1, true), log)
    local _, left = sh("pgrep -f '[s]weep " .. file .. "' || true")     -- [s]: not this pgrep's own shell
    assert.equal("", left)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("named by its file, run again reads the finished runs, resumes the stopped, refuses another config's", function()
    local dir, file, cwd = sweep_file([[seeds = {1}, arms = {control = {}, loom = {["model.loom"] = true}},
  set = {steps = 2, ["schedule.warmup"] = 1, ["eval.every"] = 0, ["eval.windows"] = 4, ["eval.baseline"] = {},
         ["checkpoint.every"] = 2, ["log.every"] = 1, ["schedule.decay"] = 0}]])
    local code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --jobs 2", cwd, bin, file))
    assert.equal(0, code, out)
    local first = assert(io.open(dir .. "/sweep-s/verdict.json")):read("a")
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --jobs 2", cwd, bin, file))   -- nothing to train
    assert.equal(0, code, out)
    has(out, "== sweep: arm control, seed 1: done before", "== sweep: arm loom, seed 1: done before")
    assert.is_nil(out:find("started", 1, true), out)
    assert.equal(first, assert(io.open(dir .. "/sweep-s/verdict.json")):read("a"))
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --set steps=4", cwd, bin, file))   -- as if stopped at 2
    assert.equal(0, code, out)
    local log = assert(io.open(dir .. "/s-loom-s1/log.txt")):read("a")
    has(log, "resumed from " .. dir .. "/s-loom-s1/ckpt-2 at step 2")
    assert.truthy(io.open(dir .. "/s-loom-s1/ckpt-4/meta.lua"))
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --set model.max_iter=3", cwd, bin, file))
    assert.equal(1, code, out)
    has(out, dir .. "/s-control-s1 holds a run of another config", "model.max_iter: 2 (that run) vs 3 (this sweep)",
        "--overwrite")
    assert.truthy(io.open(dir .. "/s-control-s1/ckpt-4/meta.lua"), "refused: nothing replaced")
    code, out = sh(string.format("cd '%s' && '%s' sweep '%s' --set model.max_iter=3 --overwrite", cwd, bin, file))
    assert.equal(0, code, out)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("refuses a file that is no sweep, and says how to run a sweep given to dormouse run", function()
    local cwd = assert(io.popen("pwd")):read("l")
    local code, out = sh(string.format("cd '%s' && '%s' sweep experiments/tiny.lua", cwd, bin))
    assert.equal(1, code)
    assert.is_truthy(out:find("must return a sweep", 1, true), out)
    code, out = sh(string.format("cd '%s' && '%s' run experiments/sweep_seeds.lua", cwd, bin))
    assert.equal(2, code)
    assert.is_truthy(out:find("dormouse sweep experiments/sweep_seeds.lua", 1, true), out)
  end)
end)

describe("the sweep files in experiments/", function()
  it("resolve for every arm and seed", function()
    local core = require "dormouse.core"
    local checked = 0
    for _, file in ipairs(core.listdir("experiments")) do
      local path = "experiments/" .. file
      local spec = file:match("%.lua$") and dofile(path)
      if type(spec) == "table" and rawget(spec, "arms") and rawget(spec, "base") then
        local names = {}
        for name in pairs(spec.arms) do names[#names + 1] = name end
        local cfgs = sweep.configs(spec, names, "check")
        for _, name in ipairs(names) do assert.equal(#spec.seeds, #cfgs[name], path .. " " .. name) end
        checked = checked + 1
      end
    end
    assert.is_true(checked >= 2)
  end)

  it("refuse a malformed sweep table naming the field (no seeds once gave a -nan verdict)", function()
    local base = "experiments/tiny.lua"
    for _, case in ipairs {
      {{base = base, arms = {control = {}}, seeds = {}}, "seeds must be a list of one seed or more"},
      {{base = base, arms = {control = {}}, seeds = {1, 2.5}}, "seeds[2] must be an integer >= 0"},
      {{base = base, arms = {control = 3}, seeds = {1}}, "arms.control must be a table of overrides"},
      {{base = base, arms = "x", seeds = {1}}, "arms must be a table"},
      {{arms = {control = {}}, seeds = {1}}, "base must be an experiment file's path"},
      {{base = base, arms = {control = {}}, seeds = {1}, name = "../x"}, "name must be a word"},
    } do
      has(select(2, pcall(sweep.run, case[1])), case[2])
    end
  end)

  it("name the arm whose key is wrong before any run trains", function()
    local runs = os.tmpname()
    os.remove(runs)
    local err = select(2, pcall(sweep.run, {base = "experiments/tiny.lua", seeds = {1},
                                             arms = {control = {}, typo = {["model.init.branch"] = "depth"}},
                                             quiet = true, runs = runs}))
    assert.is_nil(io.open(runs), "nothing was written")
    assert.truthy(tostring(err):find("sweep: arm typo, seed 1:", 1, true), err)
    assert.truthy(tostring(err):find("model.init.branch", 1, true), err)
  end)
end)

describe("a one-seed sweep", function()
  it("says it has no spread to judge by, and gives the routing of each arm's last log window and its worst",
     function()
    local res = {control = {mean = 2.0, spread = 0, bpb = {2.0}, busiest = {0.3}, dead = {2}},
                 a = {mean = 1.9, spread = 0, bpb = {1.9}, busiest = {0.1}, dead = {0}, tok_s = {1234.4},
                      mem_peak = {3 * 1024 * 1024}, train_bpb = {1.25}, busiest_max = {0.25}, dead_max = {7}}}
    sweep.verdicts(res, "control")
    assert.equal("one seed: lower by 0.1000, no spread to judge by", res.a.verdict)
    local text = sweep.table(res, {"control", "a"}, {1})
    assert.truthy(text:find("busiest   dead max busy max dead", 1, true), text)
    assert.truthy(text:find("1.9000    1.2500      1234        3    0.100    0.0    0.250      7.0", 1, true), text)
    assert.truthy(text:find("2.0000         -         -        -    0.300    2.0        -        -", 1, true), text)
    res.a.measures = {draft_accept = {0.25}}               -- an arm's own measure: a column, a dash elsewhere
    text = sweep.table(res, {"control", "a"}, {1})
    assert.truthy(text:find("max dead draft_accept", 1, true), text)
    assert.truthy(text:find("7.0       0.2500  ", 1, true), text)
    assert.truthy(text:find("-            -   control", 1, true), text)
  end)
end)

describe("dormouse sweep --quiet --base", function()
  it("prints the verdict table alone, the arms run on the base given", function()
    local bin = arg and arg[-1]
    assert(bin, "the dormouse binary (arg[-1])")
    local cwd = assert(io.popen("pwd")):read("l")
    if bin:sub(1, 1) ~= "/" then bin = cwd .. "/" .. bin end
    local dir = require("tests.lua.helpers").tmpdir()
    os.execute(string.format("ln -s '%s/experiments' '%s/' && ln -s '%s/models' '%s/'", cwd, dir, cwd, dir))
    local code, out = require("tests.lua.helpers").sh(string.format(
      "cd '%s' && '%s' sweep experiments/sweep_demo.lua --seeds 1 --steps 2 --base experiments/tiny.lua --quiet",
      dir, bin))
    local config = dir .. "/runs/sweep_demo-control-s1/config.lua"
    local saved = io.open(config) and require("tests.lua.helpers").read(config) or ""
    os.execute("rm -rf '" .. dir .. "'")
    assert.are.equal(0, code, out)
    has(out, "arm ", "control ", "no_lfb ", "held-out bpb_fin, bits a byte, lower is better")
    assert.truthy(saved:find("d = 64", 1, true), "the runs are tiny's (d 64): " .. saved)
    assert.is_nil(out:find("== sweep", 1, true), out)         -- no run's lines
    assert.is_nil(out:find("step ", 1, true), out)
  end)
end)
