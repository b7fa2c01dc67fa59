-- Pre-flight (issue 40): a run that would not fit the disk or host memory is refused before
-- anything is written, naming both numbers.
local dm = require "dormouse"
local core = require "dormouse.core"
local preflight = require "dormouse.preflight"
local helpers = require "tests.lua.helpers"
local has, err_of, tmpdir = helpers.has, helpers.err_of, helpers.tmpdir

describe("pre-flight", function()
  local state = {w = dm.zeros({1000}), b = dm.zeros({500}, {dtype = "bf16"})}   -- 5,000 bytes
  local optim = {["w.m"] = dm.zeros({1000}), step = dm.tensor({3}, {dtype = "i64"})}   -- 4,008

  it("counts a checkpoint's bytes and the checkpoints on disk at once", function()
    local cfg = {steps = 100, checkpoint = {every = 20, keep = 3}}
    local need = preflight.needs(cfg, "cuda", state, optim, 0, 0)
    assert.equal(9008, need.ckpt)
    assert.equal(4, need.at_once)                 -- keep 3, and the one written before the oldest goes
    assert.equal(4 * 9008, need.disk)
    assert.equal(9008, need.host)                  -- a CUDA run's tensors that are on the host (all, here)
    local on_device = {w = dm.zeros({1000}, {device = "meta"})}
    assert.equal(0, preflight.needs(cfg, "cuda", on_device, {}, 0, 0).host)
    assert.equal(4000, preflight.needs(cfg, "cpu", on_device, {}, 0, 0).host)   -- a CPU run's, all of them
    -- keep 0 keeps every one: 5 written (20, 40, ..., 100), 2 there already
    cfg.checkpoint.keep = 0
    assert.equal(5 * 9008, preflight.needs(cfg, "cuda", state, optim, 0, 2).disk)
    -- a resume at step 60 writes 80 and 100; the last is written even off the cadence
    assert.equal(2, preflight.needs({steps = 100, checkpoint = {every = 30, keep = 0}}, "cuda", state, optim, 60, 0).at_once)
  end)

  it("refuses naming both numbers", function()
    local need = {ckpt = 2e9, disk = 8e9, at_once = 4, host = 3e9}
    assert.is_nil(preflight.refusal(need, "runs", 9e9, 4e9))
    has(preflight.refusal(need, "runs", 5e9, 4e9), "need about 8.00 GB more in runs (4 of 2.00 GB each",
        "has 5.00 GB free")
    has(preflight.refusal(need, "runs", 9e9, 1e9), "keeps 3.00 GB of tensors in host memory and 1.00 GB is available")
    assert.is_nil(preflight.refusal(need, "runs", nil, nil))        -- nothing known: nothing refused
  end)

  -- tiny run NAME with core[probe] answering 1,000 bytes: its refusal; its folder must not exist
  local function refused_with(probe, name)
    local runs = tmpdir()
    local real = core[probe]
    core[probe] = function() return 1000 end
    local ok, err = pcall(helpers.run_quiet, helpers.tiny({"name=" .. name, "steps=4", "schedule.warmup=1"}), {runs = runs})
    core[probe] = real
    assert.is_false(ok)
    assert.is_nil(core.listdir(runs .. "/" .. name))
    return tostring(err)
  end

  it("refuses a run the disk cannot hold before its folder is made", function()
    has(refused_with("disk_free", "full"), "pre-flight: the run's checkpoints need about", " MB each on disk at once",
        "has 1.0 kB free")
    assert.truthy(core.disk_free(tmpdir()) > 0)
    assert.truthy(core.memory_available() > 0)
  end)

  it("refuses a run host memory cannot hold before its folder is made, in readable sizes", function()
    has(refused_with("memory_available", "small"), "pre-flight: the run keeps ",
        " MB of tensors in host memory and 1.0 kB is available")
  end)
end)
