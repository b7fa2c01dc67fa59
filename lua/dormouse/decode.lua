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
-- false, or a step that could not be captured, which also says so once on stderr)
decode.counters = {replayed = 0, eager = 0, captures = 0, failed_captures = 0}

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

-- One byte for every slot, block position k (0-based): the forward of the newest bytes, the
-- state written back in place, the prefix moved on by one byte, the next byte drawn into out[k]
-- and made the newest. Nothing here waits for the device.
function Decoder:one(k)
  local B, ctx = self.B, self.ctx
  dm.scope(function()
    local out = self.model:forward(self.x, self.prefix, {state = self.state, readout = "fin"})
    segments.each(out.state, function(i, key, t)
      local into = self.state[i] and self.state[i][key]
      if not into or not same_shape(into, t) or into.dtype ~= t.dtype then
        error(string.format("decode: the step's state %s.%s has shape [%s], the buffers' [%s]: the model's state " ..
                            "must keep its shape from byte to byte", tostring(i), tostring(key),
                            table.concat(t:shape(), ", "), into and table.concat(into:shape(), ", ") or "none"), 0)
      end
      if into ~= t then into:copy_(t) end
    end)
    local l = out.fin_logits
    l = l:narrow(2, l:size(2), 1):reshape({B, l:size(3)}):to("f32"):contiguous()
    if ctx > 1 then
      self.prefix:copy_(dm.cat({self.prefix:narrow(2, 2, ctx - 1), self.x:narrow(2, 1, 1)}, 2))
    elseif ctx == 1 then
      self.prefix:copy_(self.x:narrow(2, 1, 1))
    end
    local drawn = self.out:narrow(1, k + 1, 1):reshape({B})
    core.sample_bytes(drawn, l, self.seeds, self.counts, self.temperature, self.top_p, k)
    self.x:narrow(2, 1, 1):copy_(drawn:reshape({B, 1}))
  end)
end

-- The block's work: K bytes a slot, then every count moved on by K.
function Decoder:body()
  for k = 0, self.K - 1 do self:one(k) end
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
  self.state = nil
  for _, t in ipairs {self.x, self.prefix, self.seeds, self.counts, self.out} do t:free() end
end

return decode
