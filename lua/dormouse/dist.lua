--[[
dormouse.dist — the ranks of a data-parallel job (docs/training.md, "Several GPUs and hosts").

  mpirun -np 2 dormouse run experiments/tiny.lua

One process a rank, started by Open MPI's mpirun on one host or several; a
run of one process is a job of one rank and touches no MPI. Every rank holds
the whole model and trains on its share of each batch: with `batch = B`, a
step reads a batch of B x size rows, rank r the rows r B .. r B + B - 1, so
the job's step is the step of one process with batch B x size. After the
backward the ranks average their gradients: the dense ones summed in place,
the Engram tables' sparse ones gathered as (row, gradient) pairs and summed
by row, so every rank applies the same update and the replicas stay equal.
The balancing counts are summed before the bias update.

Device tensors go over NCCL where the job runs on GPUs (dist.start_device):
on the one stream, so a captured step (a CUDA graph) holds the collectives;
without NCCL's library, or with DORMOUSE_NCCL=0, through the host over MPI
(said on the log). DORMOUSE_NCCL=1 asks for NCCL in a job of one process as
well: the step then runs its collectives with nothing to reduce, which
measures what the machinery costs.

  dist.init()                  the rank and the size, from mpirun's environment
  dist.start_device(device)    NCCL for the job's device tensors; a line for the log or nil
  dist.reduces()               whether the step runs collectives (several ranks, or NCCL asked for)
  dist.sum_(t)                 t summed over the ranks, in place (any device)
  dist.gather(t)               every rank's t (the first dimension may differ), in rank order, on the CPU
  dist.mean(x)                 a number's mean over the ranks
  dist.average_grads(opt)      the step's gradients averaged over the ranks
  dist.same(text, what)        refuses, naming the rank, when ranks were given different text
  dist.barrier(), dist.finalize()
]]
local core = require "dormouse.core"
local dm = require "dormouse"

local dist = {rank = 0, size = 1, nccl = false}

function dist.init()
  dist.rank, dist.size = core.dist_init()
  return dist
end

function dist.active() return dist.size > 1 end

function dist.reduces() return dist.size > 1 or dist.nccl end

-- DORMOUSE_NCCL: nil (NCCL for a job of several ranks on GPUs), "0" (never) or "1" (also alone)
local function nccl_wanted()
  local want = os.getenv("DORMOUSE_NCCL")
  if want == "" then want = nil end
  if want and want ~= "0" and want ~= "1" then
    error(string.format("DORMOUSE_NCCL must be 0 or 1, got '%s'", want), 0)
  end
  return want
end

function dist.start_device(device)
  local want = nccl_wanted()
  if device ~= "cuda" then
    if want == "1" then error("DORMOUSE_NCCL=1: NCCL carries cuda tensors; this run is on " .. device, 0) end
    return nil
  end
  if dist.nccl then return nil end
  if want == "0" or (dist.size == 1 and want ~= "1") then
    return dist.size > 1 and "dist: device tensors go through the host over MPI (DORMOUSE_NCCL=0)" or nil
  end
  local ok, info = core.nccl_start()
  if not ok then
    if want == "1" then error("DORMOUSE_NCCL=1: " .. info, 0) end
    return "dist: device tensors go through the host over MPI, slowly: " .. info
  end
  dist.nccl = true
  return string.format("dist: NCCL %d.%d.%d carries the device tensors of %d rank%s, on the step's stream",
                       info // 10000, info // 100 % 100, info % 100, dist.size, dist.size == 1 and "" or "s")
end

function dist.barrier() if dist.size > 1 then core.dist_barrier() end end

-- The job's end: NCCL's communicator, then MPI's finalize (every rank calls it once its work is done)
function dist.finalize()
  if dist.nccl then core.nccl_finalize(); dist.nccl = false end
  if dist.size > 1 then core.dist_finalize() end
end

function dist.sum_(t)
  if not dist.reduces() then return t end
  if t.device == "cuda" and dist.nccl then
    local c = t:contiguous()
    core.nccl_reduce({c}, false)
    if c ~= t then t:copy_(c) end
    return t
  end
  if dist.size == 1 then return t end
  if t.device == "cpu" then
    local c = t:contiguous()
    core.dist_sum(c)
    if c ~= t then t:copy_(c) end
    return t
  end
  local host = t:to("cpu"):contiguous()
  core.dist_sum(host)
  t:copy_(host)
  return t
end

function dist.gather(t)
  local host = t.device == "cpu" and t:contiguous() or t:to("cpu"):contiguous()
  if dist.size == 1 then return {host} end
  return core.dist_gather(host)
end

function dist.mean(x)
  if dist.size == 1 then return x end
  local t = dm.tensor({x}, {dtype = "f64"})
  core.dist_sum(t)
  return t:item() / dist.size
end

-- The text's bytes from every rank, in rank order
local function gather_text(text)
  local t = dm.tensor({text:byte(1, -1)}, {dtype = "i32"})
  if #text == 0 then t = dm.zeros({0}, {dtype = "i32"}) end
  local out = {}
  for r, part in ipairs(dist.gather(t)) do
    local bytes = part:numel() > 0 and part:totable() or {}
    out[r] = string.char(table.unpack(bytes))
  end
  return out
end

function dist.same(text, what)
  if dist.size == 1 then return end
  for r, other in ipairs(gather_text(text)) do
    if other ~= text then
      error(string.format("dist: rank %d was given another %s than rank %d: every rank of a job runs the same " ..
                          "command", r - 1, what, dist.rank), 0)
    end
  end
end

-- The Engram tables' sparse gradients: every rank's (rows, gradient) pairs, summed by row
local function average_sparse(opt)
  for _, g in ipairs(opt.groups) do
    if g.kind == "sparse_adam" then
      for _, e in ipairs(g.entries) do
        local rows, grad = e.module:sparse_grad()
        local width = e.tensor:size(2)
        if not rows then
          rows = dm.zeros({0}, {dtype = "i64"})
          grad = dm.zeros({0, width}, {dtype = e.tensor.dtype})
        end
        local all_rows, all_grads = dist.gather(rows), dist.gather(grad)
        local device, n = e.tensor.device, 0
        for i = 1, #all_rows do
          n = n + all_rows[i]:numel()
          all_rows[i], all_grads[i] = all_rows[i]:to(device), all_grads[i]:to(device)
        end
        if n > 0 then                              -- (no rank looked up a row: no gradient, as alone)
          local summed_rows, summed = e.module.unique_sum(all_rows, all_grads)
          e.module:replace_sparse_grad(summed_rows, summed * (1 / dist.size))
        end
      end
    end
  end
end

function dist.average_grads(opt)
  if not dist.reduces() then return end
  dm.no_grad(function()
    -- a parameter no rank's rows reached keeps no gradient, as in one process; one that some
    -- reached gets zeros on the others
    local has = dm.tensor((function()
      local flags = {}
      for i, p in ipairs(opt.params) do flags[i] = p.grad and 1 or 0 end
      return flags
    end)(), {dtype = "i32"})
    core.dist_sum(has)
    local any = has:totable()
    local on_device = {}                           -- NCCL's: averaged in place as one group
    for i, p in ipairs(opt.params) do
      if any[i] > 0 then
        if not p.grad then p.grad = dm.zeros(p:shape(), {dtype = p.dtype, device = p.device}) end
        -- summed across the ranks in the master's dtype (a gradient kept in the compute dtype is widened)
        if p.grad.dtype ~= p.dtype then p.grad = p.grad:to(p.dtype) end
        if dist.nccl and p.device == "cuda" then   -- (decided alike on every rank: the group's order is theirs)
          if not p.grad:is_contiguous() then p.grad = p.grad:contiguous() end
          on_device[#on_device + 1] = p.grad
        else
          dist.sum_(p.grad):mul_(1 / dist.size)
        end
      end
    end
    if #on_device > 0 then core.nccl_reduce(on_device, true) end
    if dist.size > 1 then average_sparse(opt) end   -- (one rank's rows are the job's)
  end)
end

return dist
