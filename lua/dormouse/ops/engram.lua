--[[
Engram: hashed byte n-gram memory (docs/model.md; vm/ops/engram.h has the
arithmetic).

  dm.engram_layout{orders = {3, 4, 5}, heads = 1, rows = 4194304}
      → {orders, heads, rows, total_rows, max_order, n_sub, sub = {{order, head,
         direct, offset, size}, ...}, offsets, sizes, primes}
      One physical table of total_rows rows holds n_sub = #orders * heads
      sub-tables (order by order, head by head). An order with 256^n <= rows
      is indexed directly (256^n rows, the n bytes in base 256); the others
      hash into the largest primes <= rows, a distinct one each.
  dm.engram_index(x, prefix, layout)    → idx [B, T, n_sub] i64
      x [B, T] bytes (u8, i32 or i64), prefix [B, P] the bytes before each row
      (nil: none; bytes before it read as 0). Rows count from 0, like
      embedding ids: dm.embedding(idx, table) is the lookup.
  dm.engram_unique(idx)                 → rows [U], inverse (idx's shape), counts [U], n [1]
      rows: the distinct rows, increasing; inverse: each lookup's id in rows
      (from 0, for dm.embedding(inverse, compact)); counts: lookups per row;
      n: U as a one-element i64 tensor on idx's device.
  dm.engram_unique(idx, {padded = true, bound = R})
      the static form, that never waits for the device (a step captured as
      a CUDA graph): rows and counts of numel(idx) entries, the first U as
      above and the rest row 0 with count 0; U is only in n.
  dm.engram_sparse_grad(g, inverse, n)  → [n, de]: g [M, de] summed per unique
      row, in lookup order (deterministic; the same bits on every backend).
  dm.engram_alpha(u, kx, {eps = 1e-6, gain = w})  → alpha (u's shape without its last dim)
      sigmoid(sum_i w_i rmsnorm(u)_i rmsnorm(kx)_i / sqrt(d)); w [d] optional.
  dm.engram_adam(table, m, v, rows, grads, {lr =, betas = {b1, b2}, eps =, step =, n =})
      Adam on the rows named only (distinct, increasing: engram_unique's
      rows); the others' weights and moments are neither read nor written.

  dm.HostTable{weight = W, m = M, v = V, threads = 8, device = "cpu"}
  dm.HostTable{rows = R, width = de, std = 0.02, threads = 8}      (makes W, M, V)
      The table and its Adam moments in host memory (engram_ram):
        ht:prefetch(idx)            start gathering the rows of the next batch
        ht:take()                   → rows [U, de] (on device), local (idx's shape, ids
                                      into rows from 0), unique [U] (the rows' numbers)
        ht:gather(idx)              prefetch + take
        ht:apply(grads, {lr =, betas =, eps =, step =})   grads [U, de] of the last take
        ht:counters()               {steps, lookups, unique, unique_fraction, gather_ms, ...}
        ht:threads([n])             the Adam thread count (sets it when given)
        ht:close()
      ht.weight, ht.m, ht.v are the tensors (save and load them like any).

A step with sparse gradients (the table's dense gradient would be
total_rows x de: 1.6 GB at b1):

  local idx = dm.engram_index(x, prefix, layout)
  local rows, inverse = dm.engram_unique(idx)              -- or rows, inverse, unique = ht:take()
  local compact = dm.embedding(rows, table):detach()       -- [U, de], a leaf
  compact:requires_grad(true)
  local e = dm.embedding(inverse, compact):reshape({B, T, layout.n_sub * de})
  ... loss:backward() ...
  dm.no_grad(dm.engram_adam, table, m, v, rows, compact.grad, {lr = lr, step = t})   -- or ht:apply(compact.grad, ...)

For gradients reduced in a fixed order on every backend, make e itself the
leaf and reduce its gradient: dm.engram_sparse_grad(e.grad:reshape({-1, de}), inverse, U).
]]
return function(dm, T, core)

local function fail(fmt, ...) core.error(string.format(fmt, ...)) end

local function check_opts(opts, where, known)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail("%s: options must be a table, got a %s", where, type(opts)) end
  for k in pairs(opts) do
    if not known[k] then fail("%s: unknown option '%s'", where, tostring(k)) end
  end
  return opts
end

function dm.engram_layout(opts)
  check_opts(opts, "engram_layout", {orders = true, heads = true, rows = true})
  if type(opts.orders) ~= "table" then fail("engram_layout: orders must be a list of integers") end
  if math.type(opts.rows) ~= "integer" then
    fail("engram_layout: rows must be an integer, got %s", tostring(opts.rows))
  end
  local heads = opts.heads or 1
  if math.type(heads) ~= "integer" then fail("engram_layout: heads must be an integer, got %s", tostring(heads)) end
  return core.engram_layout(opts.orders, heads, opts.rows)
end

local function check_layout(layout, where)
  if type(layout) ~= "table" or not layout.orders or not layout.total_rows then
    fail("%s: the layout must be a table from dm.engram_layout", where)
  end
end

function dm.engram_index(x, prefix, layout)
  check_layout(layout, "engram_index")
  return core.call("engram_index", x, prefix, {layout.heads, layout.rows, list = layout.orders})
end

-- opts: a bound (number), or {bound =, padded =}
function dm.engram_unique(idx, opts)
  if type(opts) == "number" then opts = {bound = opts} end
  local o = check_opts(opts, "engram_unique", {bound = true, padded = true})
  return core.call("engram_unique", idx, {o.bound or 0, o.padded and 1 or 0})
end

function dm.engram_sparse_grad(g, inverse, n_unique)
  return core.call("engram_sparse_grad", g, inverse, {n_unique})
end

function dm.engram_alpha(u, kx, opts)
  local o = check_opts(opts, "engram_alpha", {eps = true, gain = true})
  return core.call("engram_alpha", u, kx, o.gain, {o.eps or 1e-6})
end

local ADAM = {lr = true, betas = true, eps = true, step = true, n = true}

local function adam_args(o, where)
  if type(o.lr) ~= "number" then fail("%s: lr must be a number", where) end
  if math.type(o.step) ~= "integer" then fail("%s: step must be an integer (from 1)", where) end
  local betas = o.betas or {0.9, 0.95}
  return o.lr, betas[1], betas[2], o.eps or 1e-8, o.step
end

function dm.engram_adam(table, m, v, rows, grads, opts)
  local o = check_opts(opts, "engram_adam", ADAM)
  local lr, b1, b2, eps, step = adam_args(o, "engram_adam")
  core.engram_adam(table, m, v, rows, grads, o.n or rows:size(1), lr, b1, b2, eps, step)
end

-- ---- host tables -------------------------------------------------------------------------------

local HostTable = {}
HostTable.__index = HostTable

local HOST = {weight = true, m = true, v = true, rows = true, width = true, std = true, threads = true,
              device = true}

function dm.HostTable(opts)
  local o = check_opts(opts, "HostTable", HOST)
  local w = o.weight
  if w == nil then
    if math.type(o.rows) ~= "integer" or math.type(o.width) ~= "integer" then
      fail("HostTable: give weight, or rows and width (integers)")
    end
    w = dm.randn({o.rows, o.width}) * (o.std or 0.02)
  end
  local m = o.m or dm.zeros_like(w)
  local v = o.v or dm.zeros_like(w)
  local self = {weight = w, m = m, v = v}
  self._h = core.hostable_new(w, m, v, o.threads or 1, o.device or "cpu")
  return setmetatable(self, HostTable)
end

function HostTable:prefetch(idx) core.hostable_prefetch(self._h, idx) end
function HostTable:take() return core.hostable_take(self._h) end
function HostTable:gather(idx) return core.hostable_gather(self._h, idx) end
function HostTable:counters() return core.hostable_counters(self._h) end
function HostTable:threads(n) return core.hostable_threads(self._h, n) end
function HostTable:close() core.hostable_close(self._h) end

function HostTable:apply(grads, opts)
  local o = check_opts(opts, "HostTable:apply", ADAM)
  local lr, b1, b2, eps, step = adam_args(o, "HostTable:apply")
  core.hostable_apply(self._h, grads, lr, b1, b2, eps, step)
end

function HostTable:__tostring()
  local c = self:counters()
  return string.format("HostTable(%d x %d, %d threads, %d steps, last %d of %d rows unique)",
                       self.weight:size(1), self.weight:size(2), self:threads(), c.steps, c.unique, c.lookups)
end

HostTable.__close = HostTable.close

end
