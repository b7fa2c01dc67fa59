--[[
stack — a plain stack of unshared blocks with a dense MLP instead of experts
and no Engram: the baseline a researcher compares the dormouse family with.
Written with the runtime's layers only (docs/models.md walks through it).

  h_0 = Emb[x]
  for l = 1 .. layers:                      each layer its own weights
      a   = h + KDA(rms(h))
      h   = a + W_2 silu(W_1 rms(a))
  loss = CE(Head(rmsf(h)))

The config's model table supplies d, heads, head_dim and max_iter (here: the
number of layers); `ffn` is the MLP's hidden width. A layer is nn.KDALayer
(lua/dormouse/nn/kda.lua).
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"

local Stack = nn.class("Stack")
Stack.masks = true      -- its losses honour opts.mask (nn.targets): it trains on records
function Stack:init(m)
  self:child("emb", nn.Embedding(256, m.d))
  self.layers = {}
  for l = 1, m.max_iter do self.layers[l] = self:child("layer" .. l, nn.KDALayer(m)) end
  self:child("rmsf", nn.RMSNorm(m.d))
  self:child("head", nn.Linear(m.d, 256))
end

-- The trainer's contract: forward(x [B, T+1], prefix, opts) returns at least loss
-- and fin (and fin_logits for sampling); periter and fin_D are optional. With
-- opts.state (segments, streaming: docs/models.md) it carries each layer's state
-- from it and returns its own as state; with opts.mask the loss covers the targets it keeps (nn.targets).
function Stack:forward(x, prefix, opts)
  local T = x:size(2) - 1
  local targets, kept = nn.targets(x, opts and opts.mask)
  local h = self.emb:forward(x:narrow(2, 1, T))
  local carried = opts and opts.state
  local state = carried and {} or nil
  for l, layer in ipairs(self.layers) do
    if carried then h, state[l] = layer:forward(h, carried[l] or {}) else h = layer:forward(h) end
  end
  local logits = self.head:forward(self.rmsf:forward(self:activation(h))):to(h.dtype)
  local ce = nn.cross_entropy(logits, targets, kept)
  return {loss = ce, fin = ce, periter = {ce}, fin_D = {}, fin_logits = logits, state = state}
end

return function(model_cfg) return Stack(model_cfg) end
