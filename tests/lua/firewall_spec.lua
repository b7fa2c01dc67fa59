-- The NaN firewall's edges (issue 18, finding 3): the final window, an all-skipped
-- window's line, and non-finite weights in a checkpoint.
local core = require "dormouse.core"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"
local tmpdir, has, err_of, read = helpers.tmpdir, helpers.has, helpers.err_of, helpers.read

local function tiny(overrides)
  return helpers.tiny({"steps=4", "eval.every=0", "checkpoint.keep=0", "schedule.warmup=1", "eval.windows=2",
                       "eval.baseline={}"}, overrides)
end

-- train.run with the head's weight poisoned by NaN once the model is built: every step's loss is NaN
local function run_poisoned(cfg, opts)
  local setup = train.setup
  train.setup = function(...)
    local model, opt = setup(...)
    require("dormouse").no_grad(function() model.head.weight:fill_(0 / 0) end)
    return model, opt
  end
  local ok, err = pcall(helpers.run_quiet, cfg, opts)
  train.setup = setup
  if not ok then error(err, 0) end
  return err
end

describe("the NaN firewall", function()
  it("ends a run whose final (here only) window skipped steps, non-zero and without its checkpoint", function()
    local runs = tmpdir()
    has(err_of(run_poisoned, tiny {"name=one", "log.every=4", "checkpoint.every=0"}, {runs = runs}),
        "NaN firewall", "4 of the 4 steps of the final log window", "without a checkpoint")
    assert.is_nil(core.listdir(runs .. "/one/ckpt-4"))
  end)

  it("logs an all-skipped window's loss as missing, never 0", function()
    local runs = tmpdir()
    pcall(run_poisoned, tiny {"name=miss", "log.every=2", "checkpoint.every=0"}, {runs = runs})
    local log = read(runs .. "/miss/log.txt")
    assert.is_truthy(log:match("step +2  loss %-?nan  bpb %-?nan"), log)
    assert.is_nil(log:find("loss 0.0000", 1, true))
    has(read(runs .. "/miss/metrics.jsonl"), '"loss":null')
  end)

  it("writes no checkpoint of non-finite weights: the run stops there, naming the tensor", function()
    local runs = tmpdir()
    -- step 2 is applied with a finite loss, then the head's weight turns NaN (as an update from a
    -- poisoned optimiser state would): the checkpoint after it is refused and the one before kept
    local setup = train.setup
    train.setup = function(...)
      local model, opt = setup(...)
      model.after_step = function(m, step)
        if step == 2 then require("dormouse").no_grad(function() m.head.weight:fill_(0 / 0) end) end
      end
      return model, opt
    end
    local ok, err = pcall(helpers.run_quiet, tiny {"name=w", "log.every=2", "checkpoint.every=1"}, {runs = runs})
    train.setup = setup
    assert.is_false(ok)
    has(tostring(err), "NaN firewall: the parameter 'head.weight' holds non-finite values", "after step 2",
        "no checkpoint of that state was written", "The newest checkpoint, " .. runs .. "/w/ckpt-1, passed")
    assert.is_nil(core.listdir(runs .. "/w/ckpt-2"))
    assert.is_truthy(core.listdir(runs .. "/w/ckpt-1"))
  end)

  it("refuses to resume from a checkpoint whose weights or optimiser state are not finite, naming the tensor",
     function()
    local runs = tmpdir()
    local cfg = tiny {"name=r", "log.every=2", "checkpoint.every=2", "steps=2"}
    helpers.run_quiet(cfg, {runs = runs})
    local dm = require "dormouse"
    local path = runs .. "/r/ckpt-2"
    for _, case in ipairs {{"model", "head.weight", "model.safetensors"}, {"optim", "step", nil}} do
      local c = dm.ckpt.load(path)
      local name = case[2]
      if case[1] == "optim" then                       -- the first float state by name
        local names = {}
        for n, t in pairs(c.optim) do if t.dtype == "f32" then names[#names + 1] = n end end
        table.sort(names)
        name = names[1]
      end
      c[case[1]][name]:fill_(0 / 0)
      local other = tmpdir()                            -- the same run's name, in a folder of its own
      local poisoned = other .. "/r"
      dm.ckpt.save(poisoned, 2, c)
      has(err_of(train.run, tiny {"name=r", "log.every=2", "checkpoint.every=2", "steps=4"},
                 {runs = other, resume = poisoned, quiet = true, silent = true, root = "."}),
          "ckpt-2/" .. (case[3] or "optim.safetensors"), "'" .. name .. "'", "non-finite")
    end
  end)

  it("leaves a resumable checkpoint when a learning rate of 1e3 poisons the run", function()
    local runs = tmpdir()
    local cfg = tiny {"name=lr", "steps=40", "log.every=2", "checkpoint.every=1", "checkpoint.keep=2",
                      "optim.muon_lr=1e3", "optim.adamw_lr=1e3"}
    local ok, err = pcall(helpers.run_quiet, cfg, {runs = runs})
    assert.is_false(ok, "a learning rate of 1e3 ends the run")
    has(tostring(err), "NaN firewall")
    local dm = require "dormouse"
    local path = dm.ckpt.latest(runs .. "/lr")
    assert.is_truthy(path, "a checkpoint is left")
    local c = dm.ckpt.load(path)
    assert.is_nil(train.first_nonfinite(c.model))
    assert.is_nil(train.first_nonfinite(c.optim))
    -- and it resumes (the restore's checks pass; the steps after it may stop the run again)
    local _, rerr = pcall(train.run, cfg, {runs = runs, resume = runs .. "/lr", quiet = true, silent = true,
                                           root = "."})
    assert.is_falsy(tostring(rerr):find("non-finite values (NaN or inf); resume from", 1, true), rerr)
    has(read(runs .. "/lr/log.txt"), "resumed from " .. path)
  end)

  it("writes a due checkpoint after the next applied step, never after a skipped one", function()
    local runs = tmpdir()
    local setup = train.setup
    train.setup = function(...)                    -- step 5's loss (the 5th forward) is NaN: skipped
      local model, opt = setup(...)
      local forward, calls = model.forward, 0
      model.forward = function(m, ...)
        local out = forward(m, ...)
        calls = calls + 1
        if calls == 5 then out.loss = out.loss * (0 / 0) end
        return out
      end
      return model, opt
    end
    local ok, err = pcall(helpers.run_quiet, tiny {"name=d", "steps=7", "log.every=2", "checkpoint.every=1",
                                                     "checkpoint.keep=0"}, {runs = runs})
    train.setup = setup
    assert.is_true(ok, tostring(err))
    for step = 1, 7 do
      local kept = core.listdir(runs .. "/d/ckpt-" .. step) ~= nil
      assert.equal(step ~= 5, kept, "ckpt-" .. step)
    end
    has(read(runs .. "/d/log.txt"), "checkpoint of step 5 deferred: the NaN firewall skipped that step")
  end)
end)
