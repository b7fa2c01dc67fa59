--[[
byteflow — bytes grouped into patches by a causal coding-rate rule, a stack of
layers over the patches, and byte layers around it (an arm: docs/arms.md, the
A/B against plain bytes in experiments/byteflow_ab.lua).

  e_t  = Emb[x_t]
  l    = Enc(e)                          encoder layers over the bytes
  P_p  = l at patch p's last byte        the patch: what the encoder saw up to its end
  G    = Glob(P)                         max_iter layers over the patches
  c_t  = G at the patch before t's own   (zeros in a row's first patch)
  h    = Dec(l + W_c rms(c))             decoder layers over the bytes
  loss = CE(Head(rmsf(h)))

Every layer is nn.KDALayer (d, heads, head_dim, kda, ffn). The patches: byte
t opens a new patch when the open one holds patch.max_len bytes, or at least
patch.min_len and the byte before t is a break (dm.patch_index, vm/ops/patch.h).
A byte value v is a break when knowing it saves little on the next byte's
code: gain(v) = H(next) - H(next | prev = v), in bits, from byte bigram counts
on the first patch.sample bytes of the train split (add-1/2). The breaks are
the bytes of lowest gain, as many as bring the sample's mean patch to
patch.mean bytes; they are fitted once, before the first step
(model:prepare), and kept in the checkpoint (the buffer `breaks`).

Causality: whether byte t opens a patch depends on the bytes before t, so the
patches before t's own end before t, and c_t reads nothing at or after t:
the prediction of x_{t+1} at t reads x_1..x_t only (tests/lua/byteflow_spec.lua
changes a byte and compares every earlier position's logits, bit for bit).
The global layers run over ceil(T / min_len) patch slots, the most T bytes
can make; slots past a row's patches hold zeros and come after every real
one, so they change nothing before them. The log line counts `patch`, the
mean bytes a patch over the window.
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"
local schema = require "dormouse.schema"

local keys = {
  {"patch", "ByteFlow's patches (docs/arms.md)", {
    {"mean", schema.number{above = 1}, 4, "the mean bytes a patch the breaks are fitted to, on the sample"},
    {"min_len", schema.integer{min = 1}, 2, "a patch holds at least this many bytes (but a row's last)"},
    {"max_len", schema.integer{min = 1}, 8, "and at most this many"},
    {"sample", schema.integer{min = 2}, 1048576, "bytes of the train split the breaks are fitted on"},
    {"encoder", schema.integer{min = 0}, 1, "byte layers before the patches"},
    {"decoder", schema.integer{min = 0}, 1, "byte layers after them"},
  }},
}

local ByteFlow = nn.class("ByteFlow")
ByteFlow.masks = true      -- its losses honour opts.mask (nn.targets): it trains on records
function ByteFlow:init(m)
  local p = m.patch
  if p.max_len < p.min_len then
    error(string.format("model.patch: max_len (%d) must be at least min_len (%d)", p.max_len, p.min_len), 0)
  end
  if p.mean < p.min_len or p.mean > p.max_len then
    error(string.format("model.patch: mean (%g) must lie within min_len (%d) and max_len (%d)", p.mean,
                        p.min_len, p.max_len), 0)
  end
  self.patch, self.d = p, m.d
  self:child("emb", nn.Embedding(256, m.d))
  local function layers(name, n)
    local list = {}
    for l = 1, n do list[l] = self:child(name .. l, nn.KDALayer(m)) end
    return list
  end
  self.enc, self.glob, self.dec = layers("enc", p.encoder), layers("glob", m.max_iter), layers("dec", p.decoder)
  self:child("ctx_norm", nn.RMSNorm(m.d))
  self:child("ctx", nn.Linear(m.d, m.d))
  self:child("rmsf", nn.RMSNorm(m.d))
  self:child("head", nn.Linear(m.d, 256))
  local device = nn.building()
  self:buffer("breaks", dm.zeros({256}, {dtype = "u8", device = device}))   -- none until prepare
end

function ByteFlow:arms()
  local p = self.patch
  return {string.format("byteflow (patches of %d to %d bytes, fitted to a mean of %g; %d encoder, %d global, " ..
                        "%d decoder layers)", p.min_len, p.max_len, p.mean, #self.enc, #self.glob, #self.dec)}
end

-- ---- the breaks ---------------------------------------------------------------------------

-- gain[v + 1] = H(next) - H(next | prev = v) in bits, from the bigrams of `text` (add-1/2)
local function coding_gain(text)
  local pair, first, uni = {}, {}, {}
  for v = 0, 65535 do pair[v] = 0 end
  for v = 0, 255 do first[v], uni[v] = 0, 0 end
  local n, prev = #text, nil
  for at = 1, n, 4096 do
    local chunk = {text:byte(at, math.min(n, at + 4095))}
    for _, b in ipairs(chunk) do
      uni[b] = uni[b] + 1
      if prev then pair[prev * 256 + b] = pair[prev * 256 + b] + 1; first[prev] = first[prev] + 1 end
      prev = b
    end
  end
  local a, log2 = 0.5, math.log(2)
  local function entropy(count, total)
    local h = 0
    for b = 0, 255 do
      local q = (count(b) + a) / (total + 256 * a)
      h = h - q * math.log(q) / log2
    end
    return h
  end
  local h0, gain = entropy(function(b) return uni[b] end, n), {}
  for v = 0, 255 do gain[v + 1] = h0 - entropy(function(b) return pair[v * 256 + b] end, first[v]) end
  return gain
end

-- the sample's mean bytes a patch with the k bytes of lowest gain as breaks
local function mean_patch(sample, order, k, p)
  local flags = {}
  for v = 1, 256 do flags[v] = 0 end
  for i = 1, k do flags[order[i]] = 1 end
  local patches = dm.scope(function()      -- the ids (9 bytes a sample byte) go as it returns
    local x = sample:reshape({1, -1})
    local _, _, count = dm.patch_index(x, dm.tensor(flags, {dtype = "u8"}), p.min_len, p.max_len,
                                       (x:size(2) + p.min_len - 1) // p.min_len)
    return count:item()
  end)
  return sample:size(1) / patches, flags
end

--[[ model:prepare(corpus): fit the breaks on the first patch.sample bytes of the train
split (the trainer calls it before the first step of a run; a resume loads the checkpoint's).
Returns a phrase for the run's log; self.fitted = {breaks = k, mean = the sample's mean
bytes a patch, sample = its bytes}. ]]
function ByteFlow:prepare(corpus)
  local p = self.patch
  local n = math.min(p.sample, corpus:train_size())
  if n < 2 then error(string.format("byteflow: the train split holds %d bytes; the breaks need at least 2", n), 0) end
  local text = corpus:bytes(0, n)
  local gain = coding_gain(text)
  local order = {}
  for v = 1, 256 do order[v] = v end
  table.sort(order, function(i, j) return gain[i] < gain[j] or (gain[i] == gain[j] and i < j) end)
  local sample = dm.tensor(text)
  -- the fewest breaks that bring the mean to p.mean or under (the mean falls as breaks are added), or one
  -- fewer when that is nearer
  local lo, hi = 0, 256
  while lo < hi do
    local mid = (lo + hi) // 2
    if mean_patch(sample, order, mid, p) <= p.mean then hi = mid else lo = mid + 1 end
  end
  local k = lo
  local mean, flags = mean_patch(sample, order, k, p)
  if k > 0 then
    local fewer, fewer_flags = mean_patch(sample, order, k - 1, p)
    if math.abs(fewer - p.mean) < math.abs(mean - p.mean) then k, mean, flags = k - 1, fewer, fewer_flags end
  end
  nn.release(sample)
  self.breaks:copy_(dm.tensor(flags, {dtype = "u8"}):to(self.breaks.device))
  self.fitted = {breaks = k, mean = mean, sample = n}
  return string.format("byteflow: %d byte values are breaks, %.2f bytes a patch on the first %d bytes", k, mean, n)
end

-- ---- the forward --------------------------------------------------------------------------

-- rows of t [B, S, d] as a table [1 + B S, d] with a zero row first (the ids of dm.patch_index)
local function with_zero_row(t)
  local d = t:size(3)
  return dm.cat({dm.zeros({1, d}, {dtype = t.dtype, device = t.device}), t:reshape({-1, d})}, 1)
end

-- The trainer's contract (docs/models.md): forward(x [B, T+1], prefix, opts) returns loss, fin and
-- fin_logits; extras.patch is the batch's mean bytes a patch. opts.mask: as nn.targets.
function ByteFlow:forward(x, prefix, opts)
  local B, T, p = x:size(1), x:size(2) - 1, self.patch
  local bytes = x:narrow(2, 1, T)
  local targets, kept = nn.targets(x, opts and opts.mask)
  local pool, ctx, count = dm.patch_index(bytes, self.breaks, p.min_len, p.max_len, (T + p.min_len - 1) // p.min_len)
  local l = self.emb:forward(bytes)
  for _, layer in ipairs(self.enc) do l = layer:forward(l) end
  local g = dm.embedding(pool, with_zero_row(l))
  for _, layer in ipairs(self.glob) do g = layer:forward(g) end
  local c = dm.embedding(ctx, with_zero_row(g))
  local h = l + dm.scope(function()
    return self.ctx:forward(self.ctx_norm:forward(self.ctx_norm:activation(c))):to(l.dtype)
  end)
  for _, layer in ipairs(self.dec) do h = layer:forward(h) end
  local logits = self.head:forward(self.rmsf:forward(self:activation(h))):to(h.dtype)
  local ce = nn.cross_entropy(logits, targets, kept)
  local per_patch = dm.full({}, B * T, {device = count.device}) / count:to("f32"):sum()
  return {loss = ce, fin = ce, periter = {ce}, fin_D = {}, fin_logits = logits, extras = {patch = per_patch}}
end

return {keys = keys, build = function(model_cfg) return ByteFlow(model_cfg) end}
