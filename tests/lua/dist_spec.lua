-- A data-parallel job on CPU ranks (mpirun -np 2): the step of one process with the job's whole
-- batch, a rank killed ending the job with its name, a resume continuing byte for byte, refusals.
local dm = require "dormouse"
local helpers = require "tests.lua.helpers"

local bin = arg and arg[-1]
assert(bin and io.open(bin, "rb"), "dist_spec: cannot find the dormouse binary (arg[-1] = " .. tostring(bin) .. ")")
local cwd = io.popen("pwd"):read("l")                     -- the repository root (ctest's PWD may be another)
if bin:sub(1, 1) ~= "/" then bin = cwd .. "/" .. bin end    -- the runs go in a folder of their own
local has_mpirun = os.execute("command -v mpirun >/dev/null 2>&1")

-- root may start MPI jobs (a container's CI runs as root); 2 ranks on however many cores there are
local MPIRUN = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 " ..
               "timeout 300 mpirun -np %d "

local function tiny_run(runs, ranks, extra)
  local cmd = (ranks > 1 and string.format(MPIRUN, ranks) or "timeout 300 ") ..
              string.format("'%s' run experiments/tiny.lua --quiet --sample 0 --set eval.every=0 " ..
                            "--set eval.baseline={} --set log.every=10 %s", bin, extra)
  return helpers.sh(string.format("cd '%s' && %s", runs, cmd))
end

-- the largest difference between two checkpoints' tensors, each as its norm relative to the first's
local function difference(a_path, b_path)
  local a, b = dm.ckpt.load(a_path), dm.ckpt.load(b_path)
  local worst, where = 0, nil
  for _, part in ipairs {"model", "optim"} do
    for name, t in pairs(a[part]) do
      local x, y = t:to("f64"), b[part][name]:to("f64")
      local rel = ((x - y) * (x - y)):sum():item() ^ 0.5 / math.max((x * x):sum():item() ^ 0.5, 1e-30)
      if rel > worst then worst, where = rel, part .. ":" .. name end
    end
  end
  return worst, where
end

describe("a data-parallel job on CPU ranks", function()
  local dir
  before_each(function()
    dir = helpers.tmpdir()
    -- the runs' folders under dir; the experiments and models from the repository
    os.execute(string.format("ln -s '%s/experiments' '%s/experiments' && ln -s '%s/models' '%s/models'",
                             cwd, dir, cwd, dir))
  end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("takes the step of one process whose batch is the ranks' batches together", function()
    if not has_mpirun then pending("mpirun is not installed (Debian: openmpi-bin)") return end
    local common = "--set steps=20 --set checkpoint.every=20"
    local code, out = tiny_run(dir, 2, common .. " --set batch=2 --set name=two")
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("data parallel: 2 ranks over MPI, each 2 rows of a step's 4 (this is rank 0)", 1, true), out)
    code, out = tiny_run(dir, 1, common .. " --set batch=4 --set name=one")
    assert.are.equal(0, code, out)
    code, out = tiny_run(dir, 1, common .. " --set batch=2 --set name=half")
    assert.are.equal(0, code, out)
    -- f32 steps: the ranks sum their gradients in another order than one process's batch does
    local diff, where = difference(dir .. "/runs/one/ckpt-20", dir .. "/runs/two/ckpt-20")
    assert.is_true(diff < 1e-4, string.format("2 ranks against 1: %.3e at %s", diff, tostring(where)))
    local other = difference(dir .. "/runs/one/ckpt-20", dir .. "/runs/half/ckpt-20")
    assert.is_true(other > 1e-2, string.format("1 rank of batch 2 against batch 4: only %.3e", other))
    -- rank 0 wrote the run; the ranks' balancing biases and tables are in its checkpoint, compared above
    assert.are.equal("two", dm.ckpt.load(dir .. "/runs/two/ckpt-20").meta.config.name)
    assert.are.equal(2, dm.ckpt.load(dir .. "/runs/two/ckpt-20").meta.ranks)
    -- the job's Engram counters on its log line: the distinct rows of every rank's lookups
    local log = helpers.read(dir .. "/runs/two/log.txt")
    local rows, uniq = log:match("step +20 .-engram rows (%d+) uniq ([%d.]+)")
    assert.is_truthy(rows, log)
    assert.is_true(tonumber(rows) > 0 and tonumber(uniq) > 0 and tonumber(uniq) <= 1, log)
  end)

  it("ends the job when a rank is killed, naming it, and a resume continues byte for byte", function()
    if not has_mpirun then pending("mpirun is not installed (Debian: openmpi-bin)") return end
    local common = "--set steps=160 --set checkpoint.every=40 --set checkpoint.keep=0 --set batch=2"
    -- rank 1 kills itself (SIGKILL) once rank 0 has written ckpt-80
    local killer = string.format("(cd '%s' && for i in $(seq 1 600); do [ -d runs/k/ckpt-80 ] && break; sleep 0.05; " ..
      "done; for p in $(pgrep -f 'name=k$'); do tr '\\0' '\\n' < /proc/$p/environ | " ..
      "grep -q '^OMPI_COMM_WORLD_RANK=1$' && kill -9 $p; done) &", dir)
    os.execute(killer)
    local code, out = tiny_run(dir, 2, common .. " --set name=k")
    assert.are_not.equal(0, code)
    assert.is_truthy(out:find("process rank 1", 1, true), out)
    assert.is_truthy(io.open(dir .. "/runs/k/ckpt-80/meta.lua"), "ckpt-80")
    code, out = tiny_run(dir, 2, common .. " --resume runs/k")
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("resumed from runs/k/ckpt-", 1, true), out)
    code, out = tiny_run(dir, 2, common .. " --set name=whole")
    assert.are.equal(0, code, out)
    for _, file in ipairs {"model.safetensors", "optim.safetensors"} do
      assert.are.equal(helpers.read(dir .. "/runs/whole/ckpt-160/" .. file), helpers.read(dir .. "/runs/k/ckpt-160/" .. file),
                       file .. " differs from the uninterrupted run's")
    end
    -- one process cannot resume a job's checkpoints: the batch of a step would change
    code, out = tiny_run(dir, 1, (common:gsub("steps=160", "steps=200")) .. " --resume runs/whole")
    assert.are_not.equal(0, code)
    assert.is_truthy(out:find("written by a job of 2 ranks (a step of 2 x batch rows) and this job has 1; resume it " ..
                              "with mpirun -np 2", 1, true), out)
  end)

  it("ends the job when a rank stops answering, after the collective's deadline", function()
    if not has_mpirun then pending("mpirun is not installed (Debian: openmpi-bin)") return end
    local script = dir .. "/stall.lua"
    local f = assert(io.open(script, "w"))
    f:write([[
local dm = require "dormouse"
local dist = require("dormouse.dist").init()
if dist.rank == 1 then os.execute("sleep 20") end
local t = dist.sum_(dm.tensor({1, 2}, {dtype = "f64"}))
print("summed", t:totable()[1])
dist.finalize()
]])
    f:close()
    local code, out = helpers.sh("DORMOUSE_DIST_TIMEOUT=1 " .. string.format(MPIRUN, 2) .. "'" .. bin .. "' run " .. script)
    assert.are_not.equal(0, code)
    assert.is_truthy(out:find("dist: rank 0 of 2 waited 1 s for a sum over the ranks: another rank stopped answering",
                              1, true), out)
    assert.is_nil(out:find("summed", 1, true), out)       -- rank 0 never finished the sum: it ended the job
  end)

  it("refuses what a job of several ranks cannot run yet, by name", function()
    if not has_mpirun then pending("mpirun is not installed (Debian: openmpi-bin)") return end
    local code, out = tiny_run(dir, 2, "--set steps=2 --set schedule.warmup=1 --set data.records=tasks/addition.lua")
    assert.are_not.equal(0, code)
    assert.is_truthy(out:find("a data-parallel job (2 ranks) cannot run data.records", 1, true), out)
    assert.is_nil(io.open(dir .. "/runs/tiny/log.txt"), "a refused job writes nothing")
  end)
end)

describe("NCCL for device tensors", function()
  it("is refused by name where it cannot carry anything, before the run writes a file", function()
    local dir = helpers.tmpdir()
    local function run(env)
      return helpers.sh(string.format("cd '%s' && %s timeout 120 '%s' run '%s/experiments/tiny.lua' --quiet " ..
                                      "--set steps=2 --set schedule.warmup=1 --set name=n", dir, env, bin, cwd))
    end
    local code, out = run("DORMOUSE_NCCL=1")
    assert.are_not.equal(0, code)
    helpers.has(out, "DORMOUSE_NCCL=1: NCCL carries cuda tensors; this run is on cpu")
    code, out = run("DORMOUSE_NCCL=yes")
    assert.are_not.equal(0, code)
    helpers.has(out, "DORMOUSE_NCCL must be 0 or 1, got 'yes'")
    assert.is_nil(require("dormouse.core").listdir(dir .. "/runs/n"))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("says why it cannot start, without raising, where its library or a device is missing", function()
    local core = require "dormouse.core"
    local ok, why = core.nccl_start()
    if ok then                                         -- (a machine with NCCL and a GPU: tests/gpu/check_nccl.lua)
      core.nccl_finalize()
      pending("NCCL started here: tests/gpu/check_nccl.lua checks it")
      return
    end
    assert.truthy(why:find("NCCL", 1, true), why)
  end)
end)
