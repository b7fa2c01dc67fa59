--[[
Engram — hashed byte n-gram memory (docs/model.md):

  e_t   = the rows of the n-grams ending at t, one per order and hash head
  kx    = W_k e_t ,  vx = W_v e_t
  alpha = sigmoid( dot(rmsnorm(u_t), rmsnorm(kx_t)) / sqrt(d) )
  vt    = alpha · vx
  out   = W_e causal_conv(vt)          output = "projection" (the default): a plain convolution,
                                       kernel 4, dilation 1; W_e d x d, the branch's output
  out   = vt + silu( causal_conv(rmsnorm(vt)) )      output = "spec", the first spec's form:
                                       dilation = max order (W_v the branch's output)

model.engram.dilation sets the convolution's dilation; model.init.engram_conv draws it from
U(-1/2, 1/2) (the default) or starts it at zeros; model.engram.alpha_gain (on by default) puts a
learned gain w [d] (ones) in alpha's dot, sigmoid(sum_i w_i rmsnorm(u)_i rmsnorm(kx)_i / sqrt(d))
(one gain on each norm would multiply to the same w). docs/model.md, docs/training.md.
]]
return function(nn, dm)

local schema = require "dormouse.schema"      -- the options' defaults (schema.default)
local core_error = require("dormouse.core").error

local Engram = nn.class("Engram")

-- opts.ram on a CPU run means nothing (host and device are one) and is ignored;
-- tests set this to run the host-table path there all the same.
Engram.ram_on_cpu = false

function Engram:init(d, opts)
  self.layout = dm.engram_layout {orders = opts.orders, heads = opts.heads or 1, rows = opts.rows}
  self.width = opts.width
  local subtables = #opts.orders * (opts.heads or 1)
  self.n_sub = subtables
  -- The table is a parameter that the tape never sees whole: each forward reads
  -- its touched rows into a compact leaf, and the optimiser's sparse Adam
  -- updates those rows alone (sparse_grad below). Its dense gradient is never made.
  -- opts.ram keeps the table (and so its Adam moments) in host memory: the
  -- optimiser hands this module the moments (host_table below), and a
  -- dm.HostTable gathers each training step's rows on the host (the next
  -- batch's while this step runs, when a lookahead is set), copies them to
  -- the device and applies their gradient with a multi-threaded host Adam.
  self.ram = opts.ram and (self.device ~= "cpu" or Engram.ram_on_cpu) or false
  local shape, std = {self.layout.total_rows, opts.width}, opts.std or schema.default("model.init.engram_std")
  self:param("table", self.ram and nn.build({device = "cpu"}, nn.init.normal, shape, std) or nn.init.normal(shape, std))
  self.table:requires_grad(false)
  self.entries = {}
  self.prefetches = {used = 0, missed = 0}       -- training lookups that found their prefetch, or not
  self.output = opts.output or schema.default("model.engram.output")
  local projected = self.output == "projection"   -- W_e after a plain convolution (an option: not the spec's)
  self:child("wk", nn.Linear(subtables * opts.width, d))
  self:child("wv", nn.Linear(subtables * opts.width, d,                   -- the branch's output, or W_e is
                             {std = (subtables * opts.width) ^ -0.5 * (projected and 1 or opts.out_factor or 1)}))
  if not projected then self:child("norm", nn.RMSNorm(d)) end     -- the spec form's rmsnorm(vt)
  self:param("conv", opts.conv == "uniform" and nn.init.uniform({d, 4}, -0.5, 0.5) or nn.init.zeros({d, 4}))
  self.dilation = opts.dilation or (projected and 1 or opts.orders[#opts.orders])
  if projected then self:child("we", nn.Linear(d, d, {std = d ^ -0.5 * (opts.out_factor or 1)})) end
  if opts.alpha_gain then self:param("alpha_gain", nn.init.ones({d})) end
end

-- The bytes before a row that n-grams of these orders read (the longest less one); the one place
-- this is worked out (the loaders' ctx, the planner, a model's context())
function Engram.context_for(orders) return #orders > 0 and orders[#orders] - 1 or 0 end

-- The table rows this batch reads: [B, T, subtables].
function Engram:rows(x, prefix) return dm.engram_index(x, prefix, self.layout) end

-- The probe protocol (docs/models.md, "Probes"): the rows the inputs x [B, T] (prefix: the bytes
-- before them) look up, [B, T, subtables].
function Engram:lookups(x, prefix) return self:rows(x, prefix) end

--[[ ram: the table's dm.HostTable over the optimiser's Adam moments m, v (its
state, so that checkpoints keep them); optim's SparseAdam makes it and
applies each step's gradient through it. Returns it. ]]
function Engram:host_table(m, v)
  if self.host then self.host:close() end
  self.host = dm.HostTable{weight = self.table, m = m, v = v, threads = 0, device = self.device}
  self.pending = nil
  return self.host
end

--[[ fn() → the next training batch's x [B, T], prefix [B, P] and its number k,
without taking it (the model's set_lookahead); nil: none. With a host table,
each training lookup prefetches the rows of that batch. ]]
function Engram:set_lookahead(fn) self.lookahead = fn end

-- The host table's counters, and how many training lookups found their prefetch.
function Engram:counters()
  local c = self.host and self.host:counters() or {}
  c.prefetch_used, c.prefetch_missed = self.prefetches.used, self.prefetches.missed
  return c
end

local function same_shape(a, b)
  if a == nil or b == nil then return a == b end
  return table.concat(a:shape(), ",") == table.concat(b:shape(), ",")
end

local function same_bytes(a, b)
  return a == nil or dm.allclose(a, b, {rtol = 0, atol = 0})
end

-- Is the prefetch p the batch x? The loader has moved exactly one batch past
-- it since (k is the batch the lookahead shows now) and the shapes agree; on
-- the CPU the bytes are compared too (on a device that would wait for it).
local function prefetched(p, x, prefix, k)
  if not (p and p.k and k and k == p.k + 1) then return false end
  if not (same_shape(p.x, x) and same_shape(p.prefix, prefix)) then return false end
  return x.device ~= "cpu" or (same_bytes(x, p.x) and same_bytes(prefix, p.prefix))
end

-- A training lookup through the host table: the prefetch of x when there is
-- one, else a gather now (dropping a prefetch of another batch); then the
-- prefetch of the next batch, whose unique rows and gather run on a host
-- thread while this step runs. Its indices come from the CPU tensors the
-- lookahead gives: engram_index gives the same rows on every backend.
function Engram:host_lookup(x, prefix)
  local ht, p = self.host, self.pending
  local nx, nprefix, nk
  if self.lookahead then nx, nprefix, nk = self.lookahead() end
  self.pending = nil
  local compact, inverse, rows
  if prefetched(p, x, prefix, nk) then
    compact, inverse, rows = ht:take()
    self.prefetches.used = self.prefetches.used + 1
  else
    if p then ht:take() end              -- a prefetch of another batch: taken and dropped
    compact, inverse, rows = ht:gather(self:rows(x, prefix))
    self.prefetches.missed = self.prefetches.missed + 1
  end
  if nx then
    ht:prefetch(self:rows(nx, nprefix))
    self.pending = {x = dm.keep(nx), prefix = nprefix and dm.keep(nprefix), k = nk}
  end
  return {x = x, rows = rows, inverse = inverse, compact = compact}
end

-- The rows x touches: distinct rows, each lookup's place among them, and those
-- rows as a compact leaf [U, width]. The iterations of one forward share them
-- (the same x), so their gradients meet in one compact.grad. Lookups without
-- grad (eval, sampling) read a table in host memory directly, leaving the
-- host table's prefetch in flight for the next training step. A pass of at
-- most 4 bytes a row without grad (generation's step and verify pass)
-- gathers each lookup's row as it is: too few lookups for the sort that
-- finds the distinct ones to pay.
function Engram:lookup(x, prefix)
  self.summed = nil                                 -- a backward may follow: sparse_grad sums again
  local c = self.current
  if c and c.x == x then return c end
  local training = dm.grad_enabled()
  if self.host and training then
    c = self:host_lookup(x, prefix)
  elseif not training and x:size(2) <= 4 and not self.ram then   -- a few bytes a row (generation): no sort
    local idx = self:rows(x, prefix)                -- [B, T, nsub]: each lookup its own row of the compact
    local rows = idx:reshape({idx:numel()})
    c = {x = x, rows = rows, in_order = true, compact = dm.no_grad(dm.embedding, rows, self.table)}
  elseif self.static and not self.ram then          -- shapes that never wait: a captured step
    local rows, inverse, _, n = dm.engram_unique(self:rows(x, prefix), {padded = true})
    c = {x = x, rows = rows, inverse = inverse, n = n, compact = dm.no_grad(dm.embedding, rows, self.table)}
  else
    local rows, inverse = dm.engram_unique(self:rows(x, prefix))
    if self.ram then rows = rows:to("cpu") end
    local compact = dm.no_grad(dm.embedding, rows, self.table)
    if self.ram then compact = compact:to(x.device) end
    c = {x = x, rows = rows, inverse = inverse, compact = compact}
  end
  if training then
    c.compact:requires_grad(true)
    self.entries[#self.entries + 1] = c
    local k = self.counted or {rows = 0, lookups = 0}       -- the step's, for the log line (step_counters)
    if c.n then k.rows = c.n                                -- the static form: one lookup a step, n on the device
    else k.rows = k.rows + c.rows:numel() end
    k.lookups = k.lookups + c.inverse:numel()
    self.counted = k
  end
  self.current = c
  return c
end

--[[ The static form (a step captured as a CUDA graph): lookups keep every
shape fixed, the distinct rows padded to the number of lookups with their
count n on the device (dm.engram_unique's padded form); the sparse Adam then
reads n there. Tables in host memory have no static form. ]]
function Engram:set_static(on) self.static = on or nil end

-- Distinct rows and the gradients summed on them, from lists of rows [n_i] and gradients
-- [n_i, width] (2 to 64 of each: dm.cat's inputs).
local function unique_sum(rows, grads)
  local all_rows, inverse = dm.engram_unique(dm.cat(rows, 1))
  if inverse.device ~= grads[1].device then inverse = inverse:to(grads[1].device) end   -- host rows
  return all_rows, dm.engram_sparse_grad(dm.cat(grads, 1), inverse, all_rows:size(1))
end

Engram.unique_sum = unique_sum

-- This step's sparse gradient: rows [U] and grads [U, width], summed over the
-- micro-batches and segments of the step, and in the static form the count n
-- of real rows (a one-element device tensor); nil when there is none.
function Engram:sparse_grad()
  local rows, grads, ns = {}, {}, {}
  if self.folded then rows[1], grads[1] = self.folded.rows, self.folded.g end
  for _, c in ipairs(self.entries) do
    local g = c.compact.grad
    if g then rows[#rows + 1], grads[#grads + 1], ns[#ns + 1] = c.rows, g, c.n end
  end
  if #rows == 0 then return nil end
  if #rows == 1 then return rows[1], grads[1], ns[1] end
  if #ns > 0 then
    core_error("Engram: the static form (graph mode) takes one micro-batch a step, got " .. #rows)
  end
  -- The sum is made once (until the next lookup) and handed out again: clipping
  -- scales it in place, and the update must read that tensor, not a fresh sum.
  if not self.summed then
    local all_rows, g = unique_sum(rows, grads)
    self.summed = {rows = all_rows, g = g}
  end
  return self.summed.rows, self.summed.g
end

--[[ Fold the lookups whose gradient is in (their backward has run) into the
step's running sum, and let their rows and gradients go. A step by segments
calls this as each segment's backward ends (the model's fold_sparse), so a
pass holds one running sum whatever its number of segments, instead of every
segment's rows and gradients until the optimiser reads them (and joins more
than dm.cat takes). The sum is the one sparse_grad makes, in another order. ]]
function Engram:fold()
  local done, rest = {}, {}
  for _, c in ipairs(self.entries) do
    if c.compact:is_freed() then                    -- a lookup whose pass's scope let it go: nothing to fold
      if self.current == c then self.current = nil end
    elseif c.compact.grad and not c.n then done[#done + 1] = c
    else rest[#rest + 1] = c end
  end
  self.entries = rest
  if #done == 0 then return end
  local rows, grads = {}, {}
  if self.folded then rows[1], grads[1] = self.folded.rows, self.folded.g end
  for _, c in ipairs(done) do rows[#rows + 1], grads[#grads + 1] = c.rows, c.compact.grad end
  local all_rows, g
  if #rows == 1 then
    all_rows, g = rows[1], grads[1]:clone()         -- the first: its gradient goes with its compact
  else
    all_rows, g = dm.no_grad(unique_sum, rows, grads)
  end
  if self.folded and all_rows ~= self.folded.rows then self.folded.rows:free() end
  if self.folded then self.folded.g:free() end
  for _, c in ipairs(done) do
    if c.rows ~= all_rows then c.rows:free() end
    c.inverse:free()
    c.compact:free()                                 -- and its gradient
    if self.current == c then self.current = nil end
  end
  self.folded = {rows = dm.keep(all_rows), g = dm.keep(g)}
  self.summed = nil
end

--[[ This step's training lookups (counted as they are made: every micro-batch and segment)
and the distinct rows they read, for the log line: {rows = a number, or in the static form a
one-element tensor on the device (read at log time), lookups = a number}, or nil before any.
reduce (a data-parallel job: dormouse.dist, after the gradients were averaged): the job's, the
distinct rows of the summed sparse gradient over every rank's lookups (each rank makes as many
as this one). ]]
function Engram:step_counters(reduce)
  local k = self.counted
  if not k then return nil end
  if reduce then
    local summed = self:sparse_grad()
    return {rows = summed and summed:numel() or 0, lookups = k.lookups * reduce.size}
  end
  return {rows = k.rows, lookups = k.lookups}
end

-- The tensors this step's training lookups hold for the optimiser (Dormouse:held).
function Engram:held(out)
  for _, c in ipairs(self.entries) do
    for _, key in ipairs {"rows", "inverse", "compact", "n"} do
      if c[key] then out[#out + 1] = c[key] end
    end
  end
  if self.folded then out[#out + 1], out[#out + 2] = self.folded.rows, self.folded.g end
  return out
end

function Engram:clear_sparse()
  self.entries, self.current, self.summed, self.folded, self.counted = {}, nil, nil, nil, nil
end

-- The step's sparse gradient replaced by rows [U] and grads [U, width] (a data-parallel job's:
-- every rank's, summed by row; dormouse.dist)
function Engram:replace_sparse_grad(rows, g)
  local counted = self.counted                     -- the step's lookups stay counted
  self:clear_sparse()
  self.folded = {rows = dm.keep(rows), g = dm.keep(g)}
  self.counted = counted
end

--[[ kx = W_k e and vx = W_v e of the lookup c, in dtype (the table and its gradients stay f32):
{kx, vx}. e is the bytes' rows alone and the block's weights are the same in every iteration, so
the iterations of a pass can share them (Engram:prepare). ]]
function Engram:keys_values(c, dtype)
  local B, T = c.x:size(1), c.x:size(2)
  local rows = c.in_order and c.compact or dm.embedding(c.inverse, c.compact)   -- in_order: already the lookups'
  local e = rows:to(dtype):reshape({B, T, self.n_sub * self.width})
  return nn.products(e, {self.wk, self.wv})
end

-- c's shared keys and values (the pass's, Engram:prepare) when a pass in dtype may read them: live,
-- and made on the tape when this pass records one (a recomputed block's run in the backward makes
-- its own)
local function shared_kv(c, dtype)
  local kv = c.kv
  if kv and kv[1].dtype == dtype and not kv[1]:is_freed() and (kv.grad or not dm.grad_enabled())
     and not dm.recomputing() then
    return kv
  end
end

--[[ A pass's lookup of x (prefix: the bytes before it) and its keys and values in dtype, made
once for the pass's iterations, which read them (Engram:forward) and whose gradients meet in them:
three of four iterations' products saved, forward and backward. They live in the caller's scope,
as the pass's activations do. A recomputed block (model.recompute) makes its own instead. ]]
function Engram:prepare(x, prefix, dtype)
  local c = self:lookup(x, prefix)
  c.kv = self:keys_values(c, dtype)            -- afresh each pass: an earlier pass's may have had its backward
  c.kv.grad = dm.grad_enabled()
  return c
end

-- The lookup's tensors outlive the forward (the optimiser reads compact's
-- gradient); the rest is dropped as it returns (dm.scope). state (optional):
-- {e = the convolution's last inputs from the previous segment (nil: zeros)};
-- given, the call returns the output and this segment's {e}, and with `at` the
-- {e} after position `at` as well.
function Engram:forward(u, x, prefix, state, at)
  local c = self:lookup(x, prefix)
  return dm.scope(function()
    local kv = shared_kv(c, u.dtype) or self:keys_values(c, u.dtype)
    local kx, vx = kv[1], kv[2]
    local alpha = dm.engram_alpha(u, kx, {gain = self.alpha_gain and nn.like(self.alpha_gain, u)})
    local vt = vx * alpha:unsqueeze(-1)
    local conv = nn.like(self.conv, vt)
    local projected = self.output == "projection"
    local opts = {dilation = self.dilation, silu = not projected}
    if state then opts.cache, opts.return_cache = state.e, true end
    local input = projected and vt or self.norm:forward(vt)       -- W_e conv(vt), or vt + silu(conv(rmsnorm(vt)))
    local y, cache = dm.causal_conv1d(input, conv, opts)
    local at_state = state and at and {e = nn.conv_cache_at(state.e, input, at, cache:size(2))} or nil
    if projected then return self.we:forward(y), state and {e = cache} or nil, at_state end
    return vt + y, state and {e = cache} or nil, at_state
  end)
end

nn.Engram = Engram

end
