-- What a run folder promises: names that are one plain folder, no shell, and
-- refused work that leaves the disk as it was (issue 18, findings 1, 2 and 9).
local dm = require "dormouse"
local core = require "dormouse.core"
local config = require "dormouse.config"
local helpers = require "tests.lua.helpers"
local tmpdir, has, err_of, run_quiet, read = helpers.tmpdir, helpers.has, helpers.err_of, helpers.run_quiet,
                                              helpers.read

local function tiny(overrides)
  return helpers.tiny({"steps=4", "eval.every=0", "checkpoint.every=2", "checkpoint.keep=0", "log.every=2",
                       "schedule.warmup=1", "eval.windows=2", "eval.baseline={}"}, overrides)
end

-- every path below dir with its bytes (folders as "dir"), to compare a tree before and after
local function snapshot(dir, out, prefix)
  out, prefix = out or {}, prefix or ""
  for _, name in ipairs(core.listdir(dir) or {}) do
    local path = dir .. "/" .. name
    if core.listdir(path) then
      out[prefix .. name] = "dir"
      snapshot(path, out, prefix .. name .. "/")
    else
      out[prefix .. name] = read(path) or "?"
    end
  end
  return out
end

describe("a run name", function()
  local bad = {"", "../victim", ".hidden", "a/b", "-rf", "x'; touch PWNED; echo '", string.rep("n", 101)}

  it("is one plain folder name, refused by the config with the rule and the value", function()
    for _, name in ipairs(bad) do
      local msg = err_of(config.load, "experiments/tiny.lua", {"name=" .. (name == "" and "''" or name)})
      has(msg, "name: ", "is not a run name", "letters, digits")
    end
    assert.equal("ok-name_1.2", tiny {"name=ok-name_1.2"}.name)
  end)

  it("is refused by train.run before anything is written, and no command runs", function()
    local root = tmpdir()
    local runs = root .. "/runs"
    core.mkdirs(runs .. "/keep")
    core.write_file(runs .. "/keep/file", "data")
    core.mkdirs(root .. "/victim")
    core.write_file(root .. "/victim/file", "data")
    local before = snapshot(root)
    for _, name in ipairs(bad) do
      local cfg = tiny()
      cfg.name = name                              -- past the config's own check
      has(err_of(run_quiet, cfg, {runs = runs, overwrite = true}), "is not a run name")
    end
    assert.are.same(before, snapshot(root))
    assert.is_nil(read("PWNED"))
  end)
end)

describe("--overwrite", function()
  it("moves the old run aside and removes it once the new run has written its first checkpoint", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=o", "steps=2"}, {runs = runs})
    core.write_file(runs .. "/o/old-only", "x")
    run_quiet(tiny {"name=o"}, {runs = runs, overwrite = true})
    assert.is_nil(read(runs .. "/o/old-only"))
    assert.is_nil(core.listdir(runs .. "/.o.replaced"))
    assert.is_truthy(read(runs .. "/o/ckpt-4/meta.lua"))
    has(read(runs .. "/o/log.txt"), "removed the overwritten run")
  end)

  it("leaves the old run as it was when the new one is refused or fails before a checkpoint", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=f", "steps=2"}, {runs = runs})
    local before = snapshot(runs)
    -- refused before the folder is touched: a corpus that does not exist
    has(err_of(run_quiet, tiny {"name=f", "data.path=" .. runs .. "/no-such-corpus"}, {runs = runs, overwrite = true}),
        "no-such-corpus")
    assert.are.same(before, snapshot(runs))
    -- failing after the folder was made: the CE ceiling ends the run at its first step
    has(err_of(run_quiet, tiny {"name=f", "ce_ceiling=0.001"}, {runs = runs, overwrite = true}), "ceiling")
    assert.are.same(before, snapshot(runs))
  end)

  it("refuses while an earlier overwrite's set-aside run is still there, saying what to do", function()
    local runs = tmpdir()
    core.mkdirs(runs .. "/.s.replaced")
    has(err_of(run_quiet, tiny {"name=s"}, {runs = runs, overwrite = true}), ".s.replaced", "move it back")
    assert.is_nil(core.listdir(runs .. "/s"))
  end)
end)

describe("a refused resume", function()
  it("changes nothing in the run folder", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=r", "steps=2"}, {runs = runs})
    local before = snapshot(runs)
    has(err_of(run_quiet, tiny {"name=r", "seed=9"}, {runs = runs, resume = runs .. "/r"}), "seed")
    assert.are.same(before, snapshot(runs))
  end)
end)

describe("core.remove_tree", function()
  it("removes a folder and what is below it, links as links, never what they point to", function()
    local root = tmpdir()
    core.mkdirs(root .. "/outside")
    core.write_file(root .. "/outside/precious", "keep me")
    core.mkdirs(root .. "/doomed/deep/er")
    core.write_file(root .. "/doomed/deep/er/f", "x")
    assert.is_truthy(os.execute("ln -s ../outside '" .. root .. "/doomed/link'"))
    core.remove_tree(root .. "/doomed")
    assert.is_nil(core.listdir(root .. "/doomed"))
    assert.equal("keep me", read(root .. "/outside/precious"))
    core.remove_tree(root .. "/doomed")                         -- nothing there: nothing to do
    for _, p in ipairs {"", ".", "..", root .. "/.."} do
      has(err_of(core.remove_tree, p), "refusing to remove")
    end
  end)
end)

describe("pruning old checkpoints", function()
  it("does not count a renamed, partial checkpoint, and drops it at the next save", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=p", "checkpoint.keep=1"}, {runs = runs})
    local list = dm.ckpt.list(runs .. "/p")
    assert.equal(1, #list)
    assert.equal(4, list[1].step)
    -- what a kill in the middle of a prune leaves: a renamed checkpoint with some of its files
    core.mkdirs(runs .. "/p/ckpt-2.tmp")
    core.write_file(runs .. "/p/ckpt-2.tmp/meta.lua", "return {}")
    assert.equal(1, #dm.ckpt.list(runs .. "/p"))
    local c = dm.ckpt.load(list[1].path)
    c.meta.step = 6
    dm.ckpt.save(runs .. "/p", 6, {model = c.model, optim = c.optim, meta = c.meta}, {keep = 1})
    assert.is_nil(core.listdir(runs .. "/p/ckpt-2.tmp"))
  end)

  it("that cannot be written says which file and why, not a traceback (a read-only folder once showed one)",
     function()
    local train = require "dormouse.train"
    local err = err_of(train.open_run_file, "/nonexistent-dir/r/log.txt", "w")
    assert.equal("cannot write /nonexistent-dir/r/log.txt: No such file or directory", err)
  end)

  it("cleans a folder under a final name that lacks its meta.lua (once left by two racing resumes)", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=i", "steps=2"}, {runs = runs})
    local c = dm.ckpt.load(runs .. "/i/ckpt-2")
    core.mkdirs(runs .. "/i/ckpt-212")
    core.write_file(runs .. "/i/ckpt-212/model.safetensors", "partial")
    assert.same({2}, {dm.ckpt.list(runs .. "/i")[1].step})
    c.meta.step = 4
    dm.ckpt.save(runs .. "/i", 4, {model = c.model, optim = c.optim, meta = c.meta})
    assert.is_nil(core.listdir(runs .. "/i/ckpt-212"))
    assert.is_truthy(core.listdir(runs .. "/i/ckpt-2"))
  end)

  it("stopped half-way through deleting an old checkpoint, leaves it uncounted", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=h", "steps=2"}, {runs = runs})
    local c = dm.ckpt.load(runs .. "/h/ckpt-2")
    -- the deletion dies after its first file, wherever it starts (a kill, simulated)
    local remove, remove_tree = os.remove, core.remove_tree
    local function dies(path)
      if tostring(path):find("ckpt%-2") then
        for _, f in ipairs {"optim.safetensors", "model.safetensors"} do remove(path .. "/" .. f) end
        remove(path:gsub("/[^/]+%.safetensors$", "") .. "/optim.safetensors")
        error("killed", 0)
      end
      return remove(path)
    end
    os.remove, core.remove_tree = dies, dies
    c.meta.step = 4
    local ok = pcall(dm.ckpt.save, runs .. "/h", 4, {model = c.model, optim = c.optim, meta = c.meta}, {keep = 1})
    os.remove, core.remove_tree = remove, remove_tree
    assert.is_false(ok)
    local steps = {}
    for _, e in ipairs(dm.ckpt.list(runs .. "/h")) do steps[#steps + 1] = e.step end
    assert.are.same({4}, steps)                     -- ckpt-2, its meta.lua still there, is not counted
  end)
end)

describe("a resume", function()
  -- a real run's checkpoint written again with one change (its checksums made anew)
  local function rewritten(name, change)
    local runs = tmpdir()
    run_quiet(tiny {"name=" .. name, "steps=2"}, {runs = runs})
    local dir = runs .. "/" .. name
    local c = dm.ckpt.load(dir .. "/ckpt-2")
    change(c)
    dm.ckpt.save(dir, 2, {model = c.model, optim = c.optim, meta = c.meta})
    return runs, dir
  end
  local function resume(runs, name)
    return err_of(run_quiet, tiny {"name=" .. name, "steps=4"}, {runs = runs, resume = runs .. "/" .. name})
  end

  it("checks every tensor against the model by name, dtype and shape, naming the file and the tensor", function()
    local runs = rewritten("dt", function(c) c.model["head.weight"] = c.model["head.weight"]:to("i32") end)
    has(resume(runs, "dt"), "ckpt-2/model.safetensors: tensor 'head.weight' is i32", "the model's is f32")
    runs = rewritten("sh", function(c) c.model["head.weight"] = c.model["head.weight"]:t():contiguous() end)
    has(resume(runs, "sh"), "tensor 'head.weight' is f32 [", "the model's is f32 [")
    runs = rewritten("ex", function(c) c.model["stray.weight"] = dm.zeros({2}) end)
    has(resume(runs, "ex"), "model.safetensors holds 1 tensor the model does not have: 'stray.weight'")
    runs = rewritten("mi", function(c) c.model["head.weight"] = nil end)
    has(resume(runs, "mi"), "model.safetensors has no tensor 'head.weight'")
  end)

  it("checks meta.lua's fields, naming the field", function()
    local runs = rewritten("rng", function(c) c.meta.rng = nil end)
    -- ckpt.save fills a missing rng with the generator's {seed =, offset =}: not the run's {seed, offset}
    has(resume(runs, "rng"), "meta.lua: rng[1] (the seed) must be an integer >= 0")
    runs = rewritten("pos", function(c) c.meta.data = {position = -3} end)
    has(resume(runs, "pos"), "meta.lua: data.position must be an integer >= 0, got -3")
    runs = rewritten("far", function(c) c.meta.data = {position = math.maxinteger - 2} end)   -- once a SIGSEGV
    local log = helpers.read(runs .. "/far/log.txt")
    has(resume(runs, "far"), "meta.lua: data.position must be at most 2^62")
    assert.equal(log, helpers.read(runs .. "/far/log.txt"))          -- refused before the folder was touched
    runs = rewritten("fw", function(c) c.meta.firewall = {total = "lots"} end)
    has(resume(runs, "fw"), "meta.lua: firewall.total must be an integer >= 0, got lots")
  end)

  it("refuses a meta.lua whose step disagrees with its folder's name (once: step 999999999 ended it untrained)",
     function()
    local runs = tmpdir()
    run_quiet(tiny {"name=st", "steps=2"}, {runs = runs})
    local dir = runs .. "/st/ckpt-2"
    local text, n = read(dir .. "/meta.lua"):gsub("step = 2,", "step = 999999999,")
    assert.equal(1, n)
    local f = assert(io.open(dir .. "/meta.lua", "wb")); f:write(text); f:close()
    f = assert(io.open(dir .. "/meta.xxh64", "wb")); f:write(core.file_checksum(dir .. "/meta.lua"), "\n"); f:close()
    has(resume(runs, "st"), "ckpt-2/meta.lua: step 999999999, but the folder is ckpt-2")
  end)

  it("of RUN/ckpt-STEP continues from that checkpoint, the later ones moved aside, not deleted", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=c", "steps=6"}, {runs = runs})
    local dir = runs .. "/c"
    local later = read(dir .. "/ckpt-6/model.safetensors")
    local straight = run_quiet(tiny {"name=s", "steps=6"}, {runs = runs})
    run_quiet(tiny {"name=c", "steps=6"}, {runs = runs, resume = dir .. "/ckpt-2/"})
    has(read(dir .. "/log.txt"), "resumed from " .. dir .. "/ckpt-2 at step 2",
        "resume: 2 later checkpoints moved aside in " .. dir .. " (ckpt-4.aside, ckpt-6.aside)")
    assert.equal(later, read(dir .. "/ckpt-6.aside/model.safetensors"))
    -- the same steps again from step 2: the same bits as the uninterrupted run
    assert.equal(read(runs .. "/s/ckpt-6/model.safetensors"), read(dir .. "/ckpt-6/model.safetensors"))
    assert.equal(straight.step, 6)
    local steps = {}
    for line in read(dir .. "/metrics.jsonl"):gmatch("[^\n]+") do
      if line:find('"kind":"log"', 1, true) then steps[#steps + 1] = line:match('"step":(%d+)') end
    end
    assert.same({"2", "4", "6"}, steps)              -- the log lines of steps 2, 4, 6, once each
    -- again from ckpt-2: the names taken are kept, the next is .aside-2
    run_quiet(tiny {"name=c", "steps=6"}, {runs = runs, resume = dir .. "/ckpt-2"})
    assert.is_truthy(core.listdir(dir .. "/ckpt-6.aside-2"))
    has(err_of(run_quiet, tiny {"name=c", "steps=6"}, {runs = runs, resume = dir .. "/ckpt-3"}),
        "cannot resume " .. dir .. "/ckpt-3: it is not a complete checkpoint of " .. dir,
        "(its checkpoints: ckpt-2, ckpt-4, ckpt-6)")
    -- a folder that is not there is said so, before the model is built (no banner first)
    local ok, err = pcall(require("dormouse.train").run, tiny {"name=nope"}, {runs = runs, resume = runs .. "/nope",
                                                          root = ".", quiet = true})
    assert.is_false(ok)
    assert.equal("cannot resume " .. runs .. "/nope: there is no such run folder", err)
  end)

  it("of a folder spelt another way (./x for x) continues in place", function()
    local train = require "dormouse.train"
    assert.equal("x", train.plain_path("./x"))
    assert.equal("runs/x", train.plain_path("runs//./x/"))
    assert.equal("/abs/runs/x", train.plain_path("/abs/./runs/x"))
    local runs = tmpdir()
    run_quiet(tiny {"name=sp", "steps=2"}, {runs = runs})
    run_quiet(tiny {"name=sp", "steps=4"}, {runs = runs, resume = runs .. "/./sp"})
    assert.is_truthy(core.listdir(runs .. "/sp/ckpt-4"))
  end)

  it("under another name (--set name=) continues into a new folder, the old one untouched", function()
    local runs = tmpdir()
    run_quiet(tiny {"name=a", "steps=4"}, {runs = runs})
    local before = snapshot(runs .. "/a")
    run_quiet(tiny {"name=b", "steps=6"}, {runs = runs, resume = runs .. "/a/ckpt-2"})
    assert.same(before, snapshot(runs .. "/a"))
    has(read(runs .. "/b/log.txt"), "resumed from " .. runs .. "/a/ckpt-2 at step 2")
    assert.is_truthy(core.listdir(runs .. "/b/ckpt-6"))
    assert.is_nil(core.listdir(runs .. "/b/ckpt-2"))
    has(read(runs .. "/b/metrics.jsonl"), '"step":2', '"step":6')
    -- a folder that holds checkpoints is not continued into without --overwrite
    has(err_of(run_quiet, tiny {"name=b", "steps=6"}, {runs = runs, resume = runs .. "/a"}),
        runs .. "/b already holds checkpoints")
  end)
end)

describe("an output file a user names (core.write_output)", function()
  local core = require "dormouse.core"
  local helpers = require "tests.lua.helpers"
  local function kind(path)
    local p = assert(io.popen("stat -c %F '" .. path .. "' 2>/dev/null"))
    local k = p:read("l")
    p:close()
    return k
  end

  it("writes a new or regular file through a temporary name, and a symlink's target, keeping the link", function()
    local dir = helpers.tmpdir()
    core.write_output(dir .. "/new.json", "one\n")
    assert.equal("one\n", helpers.read(dir .. "/new.json"))
    core.write_output(dir .. "/new.json", "two\n")
    assert.equal("two\n", helpers.read(dir .. "/new.json"))
    assert.is_true(os.execute("ln -s new.json '" .. dir .. "/link.json'"))
    core.write_output(dir .. "/link.json", "three\n")
    assert.equal("symbolic link", kind(dir .. "/link.json"))
    assert.equal("three\n", helpers.read(dir .. "/new.json"))
    assert.is_nil(io.open(dir .. "/new.json.tmp"))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("writes a device through and never replaces it; refuses a directory, a dangling link, a FIFO without reader",
     function()
    core.write_output("/dev/null", "nothing\n")
    assert.equal("character special file", kind("/dev/null"))
    helpers.has(helpers.err_of(core.write_output, "/dev/full", "x"), "/dev/full: write failed")
    assert.equal("character special file", kind("/dev/full"))
    local dir = helpers.tmpdir()
    helpers.has(helpers.err_of(core.write_output, dir, "x"), "is a directory")
    assert.is_true(os.execute("ln -s nowhere '" .. dir .. "/dangling'"))
    helpers.has(helpers.err_of(core.write_output, dir .. "/dangling", "x"), "symbolic link to nothing")
    assert.is_true(os.execute("mkfifo '" .. dir .. "/fifo'"))
    helpers.has(helpers.err_of(core.write_output, dir .. "/fifo", "x"), "a FIFO with no reader")
    assert.equal("fifo", kind(dir .. "/fifo"))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("dormouse meta - writes to standard output", function()
    local bin = arg and arg[-1]
    local p = assert(io.popen(string.format("'%s' meta - 2>&1", bin)))
    local text = p:read("a")
    local _, _, code = p:close()
    assert.equal(0, code)
    helpers.has(text, "function dm.")
  end)
end)

describe("a run folder in use", function()
  local core = require "dormouse.core"
  local helpers = require "tests.lua.helpers"

  it("refuses a second run on it, naming the holder's pid, and the first's folder is left as it was", function()
    local runs = helpers.tmpdir()
    local sets = {"steps=2", "eval.every=0", "checkpoint.every=2", "log.every=1", "schedule.warmup=0",
                  "eval.baseline={}", "name=busy"}
    helpers.run_quiet(helpers.tiny(sets), {runs = runs})
    local before = helpers.read(runs .. "/busy/log.txt")
    local fd = assert(core.lock_file(runs .. "/.busy.lock"))     -- as the first run's process holds it
    local err = helpers.err_of(helpers.run_quiet, helpers.tiny(sets), {runs = runs, overwrite = true})
    helpers.has(err, runs .. "/busy is in use by process", "/.busy.lock")
    assert.equal(before, helpers.read(runs .. "/busy/log.txt"))
    assert.truthy(io.open(runs .. "/busy/ckpt-2/meta.lua"))
    local again, holder = core.lock_file(runs .. "/.busy.lock")
    assert.is_nil(again)
    local stat = assert(io.open("/proc/self/stat"))
    assert.equal(stat:read("n"), holder)                          -- the pid the lock's file holds: ours
    stat:close()
    helpers.has(err, "process " .. holder .. " ")
    core.unlock_file(fd)
    helpers.run_quiet(helpers.tiny(sets), {runs = runs, overwrite = true})   -- free again: it runs
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)
