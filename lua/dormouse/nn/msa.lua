--[[
MSA — block top-k sparse softmax attention over past blocks, an extra branch
of the block (an arm, model.msa; docs/arms.md):

  q, k, v      = W_q u, W_k u, W_v u                 H heads of dh, as KDA's
  (qk_norm)    q, k = rms(q) g_q, rms(k) g_k         per head, gains [dh] from ones
  kbar_j       = the mean of k over block j          (blocks of `block` positions)
  for the query at t, in block b(t):
    the past blocks it reads  = the top_k blocks j < b(t) by q_t . kbar_j
    its keys                  = those blocks' positions, and block b(t)'s up to t
    o_t = softmax(q_t . k_s / sqrt(dh) over those s) v
  out          = W_o o                               W_o zero at initialisation

The selection takes no gradient (the attention over what it selects does),
as in NSA and MoBA. W_o starts at zero, so the branch adds exactly 0 and the
model is the control's, bit for bit, until it learns; the other weights are
drawn from a generator of their own, so the control's draws are untouched.
This form computes the full [T, T] scores and masks them: the same function
as a sparse kernel, at the dense cost (no kernel of its own yet). A sequence
that is not whole blocks is padded at its end (causal: nothing before moves).
It keeps no state across passes: the model then returns none, so generation
runs full passes and segments are refused.
The counter: far, the share of the attention that goes to the past blocks.
With qk_norm the scores are bounded by the gains (|q . k| / sqrt(dh) <=
sqrt(dh) g_q g_k): raw q and k can grow until the softmax saturates, the
usual cause of attention logit blow-ups (the gains start at ones, nothing is
drawn, so the control's draws are untouched as before).
]]
return function(nn, dm)

local MSA = nn.class("MSA")

-- a normal draw from a generator of its own (seeded from the run's seed), not the global one
local function own_normal(shape, std, salt)
  local seed = dm.rng_state()
  return dm.randn(shape, {device = (nn.building()), seed = seed * 1000003 + salt}):mul_(std)
end

function MSA:init(d, heads, head_dim, opts)
  self.heads, self.head_dim, self.block, self.top_k = heads, head_dim, opts.block, opts.top_k
  local hd = heads * head_dim
  for i, name in ipairs {"wq", "wk", "wv"} do
    self:child(name, nn.Linear(d, hd, {weight = own_normal({hd, d}, d ^ -0.5, i)}))
  end
  self:child("wo", nn.Linear(hd, d, {zero = true}))
  if opts.qk_norm then
    self:child("q_norm", nn.RMSNorm(head_dim))
    self:child("k_norm", nn.RMSNorm(head_dim))
  end
end

-- [B, T, H*dh] -> [B, H, T, dh]
local function split_heads(t, H)
  local B, T = t:size(1), t:size(2)
  return t:reshape({B, T, H, -1}):transpose(2, 3)
end

-- The masks of a length-T sequence in blocks of n, on device (constants, u8):
-- past [T, nb]: block j lies before t's block; near [T, T]: s in t's block and s <= t;
-- owner [T]: each position's block (0-based, i64)
local function masks(T, n, device)
  local nb, blocks = T // n, {}
  for t = 0, T - 1 do blocks[t + 1] = t // n end
  local owner = dm.tensor(blocks, {dtype = "i64", device = device})
  local pos = dm.arange(T, {dtype = "i64", device = device})
  local past = dm.arange(nb, {dtype = "i64", device = device}):reshape({1, nb}):lt(owner:reshape({T, 1}))
  local near = owner:reshape({1, T}):eq(owner:reshape({T, 1})):mul(pos:reshape({1, T}):le(pos:reshape({T, 1})))
  return past, near, owner
end

-- the top_k past blocks of each query by its block scores sb [B, H, T, nb] (past: [T, nb]): a u8 mask
local function selected(sb, past, k)
  local neg = dm.full({}, -math.huge, {dtype = sb.dtype, device = sb.device})
  local s = dm.where(past, sb, neg)
  local chosen = dm.zeros(sb:shape(), {dtype = "u8", device = sb.device})
  for _ = 1, k do                                    -- k rounds of the row's largest (k is small)
    local best = s:max(-1, true)
    local hit = s:ge(best):mul(past:expand(sb:shape()))    -- a past block at the maximum (ties: each)
    chosen = dm.maximum(chosen, hit)
    s = dm.where(hit, neg:expand(sb:shape()), s)
  end
  return chosen
end

-- u [B, T, d] with zero rows after it up to whole blocks: the attention is causal, so rows after
-- the last change nothing before them (the last block's mean is read by no query as a past block)
local function padded(u, n)
  local T = u:size(2)
  if T % n == 0 then return u, T end
  local shape = u:shape()
  shape[2] = n - T % n
  return dm.cat({u, dm.zeros(shape, {dtype = u.dtype, device = u.device})}, 2), T
end

function MSA:forward(x)
  local u, T_in = padded(x, self.block)
  local B, T, H, n = u:size(1), u:size(2), self.heads, self.block
  return dm.scope(function()
    local q = split_heads(self.wq:forward(u), H)
    local k = split_heads(self.wk:forward(u), H)
    if self.q_norm then q, k = self.q_norm:forward(q), self.k_norm:forward(k) end
    local v = split_heads(self.wv:forward(u), H)
    local key = T .. ":" .. u.device                     -- made once a shape: a captured graph reads them again
    self.masks = self.masks or {}
    local m = self.masks[key]
    if not m then
      m = {masks(T, n, u.device)}
      for _, t in ipairs(m) do dm.keep(t) end
      self.masks[key] = m
    end
    local past, near, owner = m[1], m[2], m[3]
    local nb = T // n
    local kbar = k:reshape({B, H, nb, n, -1}):mean(4)                       -- [B, H, nb, dh]
    local sb = dm.no_grad(function() return q:detach():matmul(kbar:detach():transpose(3, 4)) end)
    local sd = q.dtype == "f64" and "f64" or "f32"                       -- scores in f32 (f64 for a twin)
    local chosen = selected(sb:to(sd), past, self.top_k)                    -- [B, H, T, nb]
    local reads = dm.maximum(chosen:index_select(4, owner + 1), near:expand({B, H, T, T}))   -- [B, H, T, T]
    local scores = q:matmul(k:transpose(3, 4)):to(sd) * (1 / math.sqrt(self.head_dim))
    local neg = dm.full({}, -math.huge, {dtype = sd, device = u.device})
    local attn = dm.where(reads, scores, neg):softmax(-1)
    if dm.grad_enabled() then                        -- the share of the attention on the past blocks
      local far = (attn:detach() * chosen:index_select(4, owner + 1):to(sd)):sum() * (1 / (B * H * T))
      self.far_sum = dm.keep(self.far_sum and self.far_sum + far or far)
      self.far_n = (self.far_n or 0) + 1
    end
    local o = attn:to(v.dtype):matmul(v):transpose(2, 3):reshape({B, T, -1})
    if T_in < T then o = o:narrow(2, 1, T_in) end
    return self.wo:forward(o)
  end)
end

-- the pass's counter: the mean over its iterations of the attention's share on past blocks
function MSA:take_far()
  local far = self.far_sum and self.far_sum * (1 / self.far_n)
  self.far_sum, self.far_n = nil, nil
  return far
end

nn.MSA = MSA

end
