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
    assert.is_nil(core.ckpt_listdir(runs .. "/one/ckpt-4"))
  end)

  it("logs an all-skipped window's loss as missing, never 0", function()
    local runs = tmpdir()
    pcall(run_poisoned, tiny {"name=miss", "log.every=2", "checkpoint.every=0"}, {runs = runs})
    local log = read(runs .. "/miss/log.txt")
    assert.is_truthy(log:match("step +2  loss %-?nan  bpb %-?nan"), log)
    assert.is_nil(log:find("loss 0.0000", 1, true))
    has(read(runs .. "/miss/metrics.jsonl"), '"loss":null')
  end)

  it("refuses to resume from a checkpoint whose weights are not finite, naming the tensor", function()
    local runs = tmpdir()
    -- the first window skips all its steps but is not the last: its checkpoint is written, then the
    -- second window ends the run
    has(err_of(run_poisoned, tiny {"name=w", "log.every=2", "checkpoint.every=2"}, {runs = runs}),
        "two log windows in a row")
    assert.is_truthy(read(runs .. "/w/ckpt-2/meta.lua"))
    has(err_of(train.run, tiny {"name=w", "log.every=2", "checkpoint.every=2"},
               {runs = runs, resume = runs .. "/w", quiet = true, silent = true, root = "."}),
        "ckpt-2/model.safetensors", "'head.weight'", "non-finite")
  end)
end)
