--[[
Generation's one-byte step over fixed buffers: the decoder.

B streams (slots) step together. Each slot's state (what the model's forward
carries: KDA's S, the short convolutions' last inputs), its newest byte and
the bytes before it (Engram's n-grams reach into them) live in tensors on the
model's device that a step reads and rewrites in place, and the next byte is
drawn there too (core.sample_bytes: eval.sample's draw), so a block of K
bytes runs with no host read inside it. On a GPU the block is captured once
as a CUDA graph and replayed: K bytes for about one launch's host cost. The
weights do not change while it runs: each parameter is cast to the compute
dtype once (nn.holding), not once a byte.

  local d = decode.new(model, B, {device =, temperature =, top_p =, block = K})
  d:put(slot, state, bytes, seed, count)   -- a stream whose prompt has run (batch-1 state)
  local rows = d:step()                    -- rows[slot]: the slot's next K bytes, a list
  d:free()

decode.speculative(model, B, opts) makes one that verifies a draft head's
byte a pass (below).

put's bytes end with the stream's newest byte, whose step has not run yet:
the state covers the bytes before it. count is how many of the stream's
bytes were drawn already: its next byte takes uniform number count of
dm.rand({n}, {seed = seed}) (0-based), as eval.sample's would. The same
logits give the same bytes as the host's pick (on the CPU to the bit; on a
GPU up to the last bit of exp), so a stream's text does not depend on the
block size or on the graph.
]]
local dm = require "dormouse"
local core = require "dormouse.core"
local segments = require "dormouse.segments"
local nn = require "dormouse.nn"

local decode = {}
local Decoder = {}
Decoder.__index = Decoder

-- bytes per block: on a GPU the captured block's length; on the CPU one (a byte a step, no waste)
decode.BLOCK = {cuda = 32, cpu = 1}

-- blocks run in this process: replayed from a captured graph, or run eagerly (the CPU, graph =
-- false, or a step that could not be captured, which also says so once on stderr); the last
-- captured graph's nodes (kernel launches, copies, products) a pass of the model (a byte a stream; a
-- speculative pass may give two); and the speculative passes' drafts, kept or not
decode.counters = {replayed = 0, eager = 0, captures = 0, failed_captures = 0, nodes_per_pass = nil, drafts = 0,
                   drafts_kept = 0}

local warned = {}
local function warn_once(key, msg)
  if not warned[key] then
    warned[key] = true
    io.stderr:write(msg, "\n")
  end
end

local function same_shape(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  return true
end

local function keep_zeros(shape, dtype, device)
  return dm.keep(dm.zeros(shape, {dtype = dtype, device = device}))
end

--[[ opts: device ("cpu"), temperature (1), top_p (0.95), block (decode.BLOCK[device]), graph
(true on a GPU: capture the block; false runs it eagerly, the same bytes). ]]
function decode.new(model, B, opts)
  opts = opts or {}
  local device = opts.device or "cpu"
  local self = setmetatable({model = model, B = B, device = device, ctx = model.context and model:context() or 0,
                             temperature = opts.temperature or 1, top_p = opts.top_p or 0.95}, Decoder)
  self.K = opts.block or decode.BLOCK[device] or decode.BLOCK.cuda
  self.use_graph = device ~= "cpu" and opts.graph ~= false
  self.x = keep_zeros({B, 2}, "u8", device)                 -- the newest byte and a target slot
  self.prefix = keep_zeros({B, self.ctx}, "u8", device)
  self.seeds = keep_zeros({B}, "i64", device)
  self.counts = keep_zeros({B}, "i64", device)
  self.out = keep_zeros({self.K, B}, "u8", device)          -- row k: the block's k-th bytes
  self.blocks = 0
  self.copies = {}            -- the parameters' compute-dtype casts, made by the first block, kept (nn.holding)
  return self
end

-- a state (batch 1, or nil for a slot not put yet) as buffers of batch B: made at the first put
function Decoder:state_buffers(rows)
  if self.state then return self.state end
  self.state = {}
  segments.each(rows, function(i, k, t)
    local shape = t:shape()
    shape[1] = self.B
    self.state[i] = self.state[i] or {}
    self.state[i][k] = keep_zeros(shape, t.dtype, self.device)
  end)
  return self.state
end

-- slot's stream: its state (batch 1; copied, the caller keeps it), bytes (newest last), seed, count
function Decoder:put(slot, state, bytes, seed, count)
  local buffers = self:state_buffers(state)
  segments.each(state, function(i, k, t) buffers[i][k]:narrow(1, slot, 1):copy_(t) end)
  local m = #bytes
  local row = {}
  for a = m - self.ctx, m - 1 do row[#row + 1] = a >= 1 and bytes[a] or 0 end
  dm.scope(function()
    self.x:narrow(1, slot, 1):copy_(dm.tensor({{bytes[m], 0}}, {dtype = "u8"}))
    if self.ctx > 0 then self.prefix:narrow(1, slot, 1):copy_(dm.tensor({row}, {dtype = "u8"})) end
    self.seeds:narrow(1, slot, 1):copy_(dm.tensor({seed}, {dtype = "i64"}))
    self.counts:narrow(1, slot, 1):copy_(dm.tensor({count}, {dtype = "i64"}))
  end)
end

-- the tensors of a state in a set (their handles' keys)
local function tensor_set(state)
  local set = {}
  if state then segments.each(state, function(_, _, t) set[t] = true end) end
  return set
end

-- Free the tensors of `state` that neither `kept` (a tensor_set) nor the slots' buffers hold.
function Decoder:free_state_but(state, kept)
  self.buffer_set = self.buffer_set or tensor_set(self.state)        -- (the buffers never change)
  local buffers = self.buffer_set
  segments.each(state, function(_, _, t) if not (kept[t] or buffers[t]) then t:free() end end)
end

--[[ One byte for every slot, block position k (0-based), from `state` and `prefix` (the slots'
buffers, or what the byte before returned): the forward of the newest bytes, the next byte drawn
into out[k] and made the newest. Returns the state after the byte and the prefix moved on by one
byte (new tensors, but for a model that reads no bytes before a row: its prefix as given); the
block copies the last of them into the buffers, so that a byte costs no copy of the state
(Decoder:body). Nothing here waits for the device. ]]
function Decoder:one(k, state, prefix)
  local B, ctx = self.B, self.ctx
  return dm.scope(function()
    local out = self.model:forward(self.x, prefix, {state = state, readout = "fin"})
    segments.each(out.state, function(i, key, t)
      local into = self.state[i] and self.state[i][key]
      if not into or not same_shape(into, t) or into.dtype ~= t.dtype then
        error(string.format("decode: the step's state %s.%s has shape [%s], the buffers' [%s]: the model's state " ..
                            "must keep its shape from byte to byte", tostring(i), tostring(key),
                            table.concat(t:shape(), ", "), into and table.concat(into:shape(), ", ") or "none"), 0)
      end
    end)
    local l = out.fin_logits
    l = l:narrow(2, l:size(2), 1):reshape({B, l:size(3)}):to("f32"):contiguous()
    local moved = prefix
    if ctx > 1 then
      moved = dm.cat({prefix:narrow(2, 2, ctx - 1), self.x:narrow(2, 1, 1)}, 2)
    elseif ctx == 1 then
      moved = self.x:narrow(2, 1, 1):clone()              -- (a copy: the next byte replaces x's)
    end
    local drawn = self.out:narrow(1, k + 1, 1):reshape({B})
    core.sample_bytes(drawn, l, self.seeds, self.counts, self.temperature, self.top_p, k)
    self.x:narrow(2, 1, 1):copy_(drawn:reshape({B, 1}))
    return out.state, moved
  end)
end

-- The block's work: K bytes a slot, each reading the state and prefix the byte before left; the
-- last byte's copied into the buffers once (the next block, or a replay of this one, starts
-- there), then every count moved on by K.
function Decoder:body()
  local state, prefix = self.state, self.prefix
  for k = 0, self.K - 1 do
    local next_state, next_prefix = self:one(k, state, prefix)
    if state ~= self.state then self:free_state_but(state, tensor_set(next_state)) end
    if prefix ~= self.prefix and prefix ~= next_prefix then prefix:free() end
    state, prefix = next_state, next_prefix
  end
  segments.each(state, function(i, key, t)
    local into = self.state[i][key]
    if into ~= t then into:copy_(t) end
  end)
  self:free_state_but(state, {})
  if prefix ~= self.prefix then
    self.prefix:copy_(prefix)
    prefix:free()
  end
  self.counts:add_(self.K)
end

-- A block: K more bytes for every slot; rows[slot] lists them. The first block on a GPU runs
-- eagerly (its allocations settle), the second is captured and every later one replays it.
function Decoder:step()
  if not self.state then error("decode: step before any slot was put", 0) end
  return nn.holding(self.copies, self.block_bytes, self)
end

function Decoder:block_bytes()
  self.blocks = self.blocks + 1
  local c = decode.counters
  if not self.graph and self.use_graph and self.blocks >= 2 then
    local ok, g = pcall(dm.cuda.graph, function() self:body() end)
    if ok then
      self.graph, c.captures = g, c.captures + 1
      c.nodes_per_pass = g:nodes() / self.K
    else
      self.use_graph, c.failed_captures = false, c.failed_captures + 1
      warn_once("capture", "decode: the one-byte step could not be captured as a CUDA graph, so it runs " ..
                           "eagerly (slower): " .. tostring(g))
    end
  end
  if self.graph then
    self.graph:replay()                       -- (a capture runs nothing: its block runs here too)
    c.replayed = c.replayed + 1
  else
    self:body()
    c.eager = c.eager + 1
  end
  return self:rows()
end

-- the block's bytes read back: rows[slot] = the slot's K bytes
function Decoder:rows()
  local cols = self.out:to("cpu"):totable()  -- [K][B]
  local rows = {}
  for slot = 1, self.B do
    local r = {}
    for k = 1, self.K do r[k] = cols[k][slot] end
    rows[slot] = r
  end
  return rows
end

-- whether a CUDA graph replays the blocks (for the sample command's line and the tests)
function Decoder:captured() return self.graph ~= nil end

function Decoder:free()
  if self.graph then self.graph:free(); self.graph = nil end
  nn.release_copies(self.copies)
  segments.free(self.state)
  self.state, self.buffer_set = nil, nil
  for _, t in ipairs {self.x, self.prefix, self.seeds, self.counts, self.out, self.qlog} do t:free() end
end

--[[ Speculative decoding (opts.speculative; a model with a draft head, model.aux.draft > 0): each
pass verifies a drafted byte. A slot holds its pending byte y (drawn, not yet passed through the
model), a drafted byte d after it with the draft's logits, and the state before y. One pass of [y, d]
gives the model's distribution p after y and p2 after d, and the states after y and after d
(opts.state_at = 1). d is kept with probability min(1, p(d) / q(d)) (q the draft's distribution):
then the next pending byte is drawn from p2 and the state is the one after d; else it is drawn from
the rest, max(0, p - q) normalised, and the state is the one after y. So every pass emits y, and d
too when it is kept, and the bytes come from the model's own distribution (Leviathan et al.'s
speculative sampling, a draft of one byte); the draft of the next pass comes from the readout's
input at the kept position and the new pending byte. Temperature 0 keeps d when it is the model's
most likely byte, and then gives the greedy bytes. The nucleus is not truncated (top_p must be 1).
Each pass takes four uniform numbers a slot (counts + 4k ...): a speculative run's text is not the
plain one's for the same seed, only its distribution. ]]
local Speculator = setmetatable({}, {__index = Decoder})
Speculator.__index = Speculator

function decode.speculative(model, B, opts)
  opts = opts or {}
  if not (model.draft_logits and model.draft_head) then
    error("decode: speculative decoding needs a model with a draft head (models/dormouse.lua with " ..
          "model.aux.draft > 0)", 0)
  end
  if (opts.top_p or 1) ~= 1 then
    error("decode: speculative decoding samples the whole distribution: top_p must be 1, got " ..
          tostring(opts.top_p), 0)
  end
  local self = decode.new(model, B, opts)
  setmetatable(self, Speculator)
  self.top_p = 1
  self.x:free()
  self.out:free()
  self.x = keep_zeros({B, 3}, "u8", self.device)            -- the pending byte, the drafted one, a target slot
  self.qlog = keep_zeros({B, 256}, "f32", self.device)      -- the draft's logits for the drafted byte
  self.out = keep_zeros({self.K, 3, B}, "u8", self.device)  -- pass k: the pending bytes, the drafts, kept or not
  return self
end

-- probabilities from logits [B, V] at the temperature: the softmax, or at 0 the first maximum's one-hot
local function probs(logits, temperature)
  if temperature > 0 then return (logits * (1 / temperature)):softmax(2) end
  local V = logits:size(2)
  local first = logits:argmax(2):reshape({logits:size(1), 1})            -- 1-based
  local at = dm.arange(1, V + 1, {dtype = "i64", device = logits.device}):reshape({1, V})
  return at:eq(first):to("f32")
end

-- byte draws of rows of logits [B, V] at slot counts + 4k + lane
function Speculator:draw(logits, temperature, k, lane)
  local out = dm.zeros({self.B}, {dtype = "u8", device = self.device})
  core.sample_bytes(out, logits:to("f32"):contiguous(), self.seeds, self.counts, temperature, 1, 4 * k + lane)
  return out
end

-- slot's stream: as Decoder:put, the newest byte already drawn. One plain pass of it (batch 1, not
-- captured) gives the pending byte after it and that byte's draft, the slot's first pass's inputs.
function Speculator:put(slot, state, bytes, seed, count)
  local ctx, T = self.ctx, self.temperature
  local buffers = self:state_buffers(state)
  local m = #bytes
  local function row(from, to)
    local r = {}
    for a = from, to do r[#r + 1] = a >= 1 and bytes[a] or 0 end
    return r
  end
  dm.scope(function()
    local x = dm.tensor({{bytes[m], 0}}, {dtype = "u8"}):to(self.device)
    local prefix = dm.tensor({row(m - ctx, m - 1)}, {dtype = "u8"}):to(self.device)
    if ctx == 0 then prefix = dm.zeros({1, 0}, {dtype = "u8", device = self.device}) end
    local out = self.model:forward(x, prefix, {state = state, readout = "fin"})
    local seeds = dm.tensor({seed}, {dtype = "i64"}):to(self.device)
    local counts = dm.tensor({count}, {dtype = "i64"}):to(self.device)
    local function draw(logits, offset)
      local o = dm.zeros({1}, {dtype = "u8", device = self.device})
      core.sample_bytes(o, logits:to("f32"):reshape({1, 256}):contiguous(), seeds, counts, T, 1, offset)
      return o
    end
    local y = draw(out.fin_logits:narrow(2, 1, 1), 0)
    local qlog = self.model:draft_logits(out.hbar:narrow(2, 1, 1):reshape({1, out.hbar:size(3)}), y)
    local d = draw(qlog, 1)
    segments.each(out.state, function(i, key, t) buffers[i][key]:narrow(1, slot, 1):copy_(t) end)
    self.x:narrow(1, slot, 1):copy_(dm.cat({y:reshape({1, 1}), d:reshape({1, 1}),
                                            dm.zeros({1, 1}, {dtype = "u8", device = self.device})}, 2))
    if ctx > 0 then
      local r = row(m - ctx + 1, m)                            -- the bytes before y: the prompt's last ctx
      self.prefix:narrow(1, slot, 1):copy_(dm.tensor({r}, {dtype = "u8"}))
    end
    self.qlog:narrow(1, slot, 1):copy_(qlog:to("f32"))
    self.seeds:narrow(1, slot, 1):copy_(seeds)
    self.counts:narrow(1, slot, 1):copy_(counts + 2)
  end)
end

-- cond [B] (u8) shaped to broadcast over a tensor of `dims` dimensions
local function per_row(cond, dims)
  local shape = {cond:size(1)}
  for _ = 2, dims do shape[#shape + 1] = 1 end
  return cond:reshape(shape)
end

-- One verify pass for every slot, block position k (0-based): pass k's pending bytes, drafts and
-- verdicts into out[k]; the slots' next pending bytes, drafts, states and prefixes in place.
function Speculator:one(k)
  local B, ctx, T = self.B, self.ctx, self.temperature
  dm.scope(function()
    local out = self.model:forward(self.x, self.prefix, {state = self.state, state_at = 1, readout = "fin"})
    local L = out.fin_logits:to("f32")
    local p1 = L:narrow(2, 1, 1):reshape({B, 256})
    local p2 = L:narrow(2, 2, 1):reshape({B, 256})
    local y, d = self.x:narrow(2, 1, 1), self.x:narrow(2, 2, 1)         -- [B, 1]
    local p, q = probs(p1, T), probs(self.qlog, T)
    local at = d:to("i64") + 1
    local keep_p = (p:gather(2, at) / q:gather(2, at)):clamp(0, 1)       -- [B, 1]
    local verdict = self:draw(dm.cat({keep_p, 1 - keep_p}, 2):log(), 1, k, 0)   -- 0: kept
    local kept = verdict:eq(0)                                            -- [B] u8
    local after_d = self:draw(p2, T, k, 1)
    local rest = self:draw((p - q):clamp(0, math.huge):log(), 1, k, 2)
    local pending = dm.where(kept, after_d, rest)
    segments.each(out.state, function(i, key, t)
      local into, at_y = self.state[i][key], out.state_at[i][key]
      into:copy_(dm.where(per_row(kept, t:dim()), t, at_y))
    end)
    local hbar = out.hbar
    local h = dm.where(per_row(kept, 2), hbar:narrow(2, 2, 1):reshape({B, hbar:size(3)}),
                       hbar:narrow(2, 1, 1):reshape({B, hbar:size(3)}))
    local qlog = self.model:draft_logits(h, pending):to("f32")
    local draft = self:draw(qlog, T, k, 3)
    if ctx > 0 then                  -- the bytes before the next pending one: y's, and d's when kept
      local seq = dm.cat({self.prefix, y, d}, 2)                          -- [B, ctx + 2]
      self.prefix:copy_(dm.where(per_row(kept, 2), seq:narrow(2, 3, ctx), seq:narrow(2, 2, ctx)))
    end
    local rec = self.out:narrow(1, k + 1, 1):reshape({3, B})
    rec:narrow(1, 1, 1):copy_(y:reshape({1, B}))
    rec:narrow(1, 2, 1):copy_(d:reshape({1, B}))
    rec:narrow(1, 3, 1):copy_(kept:reshape({1, B}))
    self.x:narrow(2, 1, 1):copy_(pending:reshape({B, 1}))
    self.x:narrow(2, 2, 1):copy_(draft:reshape({B, 1}))
    self.qlog:copy_(qlog)
  end)
end

function Speculator:body()
  for k = 0, self.K - 1 do self:one(k) end
  self.counts:add_(4 * self.K)
end

-- the block's bytes read back: rows[slot] = each pass's pending byte, and its draft when kept
function Speculator:rows()
  local rec = self.out:to("cpu"):totable()   -- [K][3][B]
  local rows = {}
  for slot = 1, self.B do
    local r = {}
    for k = 1, self.K do
      r[#r + 1] = rec[k][1][slot]
      if rec[k][3][slot] == 1 then r[#r + 1] = rec[k][2][slot] end
    end
    rows[slot] = r
    decode.counters.drafts = decode.counters.drafts + self.K           -- (a slot stepping idle counts too)
    decode.counters.drafts_kept = decode.counters.drafts_kept + (#r - self.K)
  end
  return rows
end

return decode
