-- A run started from a checkpoint's weights (init, --init): the weights as saved, everything else
-- fresh; the model keys that define the weights and the tensors' shapes checked, each refusal named.
local dm = require "dormouse"
local json = require "dormouse.json"
local train = require "dormouse.train"
local helpers = require "tests.lua.helpers"

local BASE = {"steps=6", "log.every=3", "eval.every=6", "checkpoint.every=0", "dtype=f32", "eval.sample=0",
              "schedule.warmup=2"}

local function evals(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = json.decode(line)
    if r.kind == "eval" then out[#out + 1] = r end
  end
  return out
end

local function meta_of(path)
  return require("dormouse.ckpt").load_meta(path)
end

describe("a run from a checkpoint's weights (init)", function()
  local dir
  setup(function()
    dir = helpers.tmpdir()
    helpers.run_quiet(helpers.tiny(BASE, {"name=base"}), {runs = dir})
  end)

  it("starts at the checkpoint's held-out loss, then trains with its own optimiser and schedule", function()
    local cfg = helpers.tiny(BASE, {"name=tuned", "init=" .. dir .. "/base", "steps=8", "optim.adamw_lr=3e-4",
                                    "optim.muon_lr=3e-4", "model.moe.lfb_gamma=2e-3"})
    local res = helpers.run_quiet(cfg, {runs = dir})
    assert.equal(8, res.step)
    local base, tuned = evals(dir .. "/base"), evals(dir .. "/tuned")
    assert.equal(0, tuned[1].step)
    assert.is_true(math.abs(tuned[1].bpb_fin - base[#base].bpb_fin) <= 1e-6,
                   tuned[1].bpb_fin .. " vs " .. base[#base].bpb_fin)
    assert.equal(8, tuned[#tuned].step)
    assert.are_not.equal(tuned[1].bpb_fin, tuned[#tuned].bpb_fin)
    local m = meta_of(dir .. "/tuned/ckpt-8")
    assert.equal(dir .. "/base", m.init.run)
    assert.equal(6, m.init.step)
    assert.truthy(m.init.checksum:match("^%x+$"))
    helpers.has(helpers.read(dir .. "/tuned/log.txt"), "init: the model's weights from " .. dir .. "/base/ckpt-6")
  end)

  it("refuses a model key that defines the weights, naming it, and leaves nothing on disk", function()
    local cfg = helpers.tiny(BASE, {"name=wider", "init=" .. dir .. "/base", "model.experts=16"})
    local err = helpers.err_of(helpers.run_quiet, cfg, {runs = dir})
    helpers.has(err, "the model differs from the checkpoint's in 1 key", "model.experts", "model.moe.lfb_gamma")
    assert.is_nil(io.open(dir .. "/wider/log.txt"))
  end)

  it("refuses a folder that is not there or holds no checkpoint", function()
    local err = helpers.err_of(helpers.run_quiet, helpers.tiny(BASE, {"name=x", "init=" .. dir .. "/nope"}),
                               {runs = dir})
    helpers.has(err, "cannot start from " .. dir .. "/nope: there is no such run folder")
    err = helpers.err_of(helpers.run_quiet, helpers.tiny(BASE, {"name=y", "init=" .. dir .. "/base/ckpt-3"}),
                         {runs = dir})
    helpers.has(err, "is not a complete checkpoint of", "ckpt-6")
  end)

  it("names every tensor whose shape differs, with both shapes", function()
    local state = {a = dm.zeros({2, 3}), b = dm.zeros({4}), c = dm.zeros({1})}
    local saved = {a = dm.zeros({3, 3}), b = dm.zeros({5}), c = dm.zeros({1})}
    local err = helpers.err_of(train.check_tensors, saved, state, "x.safetensors")
    helpers.has(err, "x.safetensors: 2 tensors unlike the model's", "tensor 'a' is f32 [3, 3], the model's is f32 [2, 3]",
                "tensor 'b' is f32 [5], the model's is f32 [4]")
  end)

  it("is a flag of dormouse run, refused beside --resume", function()
    local bin = arg and arg[-1]
    local code, out = helpers.sh(string.format("'%s' run experiments/tiny.lua --init %s/base --resume %s/base",
                                               bin, dir, dir))
    assert.are_not.equal(0, code)
    helpers.has(out, "--init starts a new run from a checkpoint's weights: not with --resume")
    code, out = helpers.sh(string.format("'%s' run --help", bin))
    helpers.has(out, "--init RUN")
  end)
end)
