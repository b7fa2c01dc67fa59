--[[
The weight-shared block, applied max_iter times:

  a   = h + KDA(rms1(h))        [a = a + MSA(rms_msa(a)): an arm, model.msa]
  b   = a + Engram(rms2(a), x)
  h'  = b + MoE(rms3(b))
]]
return function(nn, dm)

local Block = nn.class("Block")

function Block:init(m)
  local d = m.d
  local init = m.init or {}
  -- the branches' output projections: their fan-in std, times (3 max_iter)^-1/2 with init.branch_out = "depth"
  local out_factor = init.branch_out == "depth" and (3 * m.max_iter) ^ -0.5 or 1
  self:child("rms1", nn.RMSNorm(d))
  self:child("kda", nn.KDA(d, m.heads, m.head_dim, nn.KDA.options(m, out_factor)))
  if #m.engram.orders > 0 then                      -- engram.orders = {} turns Engram off
    self:child("rms2", nn.RMSNorm(d))
    self:child("engram", nn.Engram(d, {orders = m.engram.orders, heads = m.engram.hash_heads,
                                       rows = m.engram.rows, width = m.engram.width, ram = m.engram.ram,
                                       std = init.engram_std, out_factor = out_factor,
                                       output = m.engram.output, dilation = m.engram.dilation,
                                       alpha_gain = m.engram.alpha_gain, conv = init.engram_conv}))
  end
  if m.msa.top_k > 0 then                           -- an arm: block top-k sparse attention (docs/arms.md)
    self:child("rms_msa", nn.RMSNorm(d))
    self:child("msa", nn.MSA(d, m.heads, m.head_dim, {block = m.msa.block, top_k = m.msa.top_k, qk_norm = m.msa.qk_norm}))
  end
  self:child("rms3", nn.RMSNorm(d))
  self:child("moe", nn.MoE(d, {experts = m.experts, top_k = m.top_k, rank = m.expert_rank,
                               shared_rank = m.shared_rank, ffn = m.ffn, lfb_gamma = m.moe.lfb_gamma,
                               capacity_factor = m.moe.capacity_factor, out_factor = out_factor,
                               balance = m.moe.balance, router_dtype = m.moe.router_dtype,
                               aux_balance = m.moe.aux_balance, update_by_load = m.moe.update_by_load,
                               router_std = m.moe.router_std, router_cosine = m.moe.router_cosine,
                               router = m.moe.router, littlebit = m.moe.littlebit,
                               fp8 = m.moe.fp8}))
end

-- Each branch runs in the compute dtype and is added back into the f32
-- residual stream (nn.residual); its intermediates are dropped as it returns
-- (dm.scope): what the backward needs, the tape holds.
-- state (optional): this iteration's state from the previous segment, {S, q, k, v}
-- of the KDA branch and {e} of Engram's convolution in one table (entries nil:
-- zeros); given, the call returns h' and this segment's state, and with `at` the
-- state after position `at` of the pass too (a verify pass of generation).
-- chain (optional, a table the iterations of a pass share): chain.u, rms1(h) made by the
-- iteration before (its last add); chain.next, true when the next iteration's rms1 of this
-- call's output is wanted, made with this call's last add and left in chain.u (else chain.u
-- is cleared).
function Block:forward(h, x, prefix, state, at, chain)
  if self.engram then self.engram:lookup(x, prefix) end     -- the pass's rows, made outside the branch's scope
  if self.msa and state then
    error("model.msa keeps no state across passes (no cache of past keys): it takes whole sequences, not " ..
          "segments or streamed generation; set model.msa.top_k = 0 for those", 0)
  end
  -- each branch's residual add and the next branch's norm in one op (nn.residual's next); u: that norm's output
  local last = self.engram and self.rms2 or self.rms3
  local a, u, ks, ks_at = nn.residual(h, self.rms1, function(v) return self.kda:forward(v, state, at) end,
                                      {u = chain and chain.u, next = self.msa and self.rms_msa or last})
  if self.msa then
    a, u = nn.residual(a, self.rms_msa, function(v) return self.msa:forward(v) end, {u = u, next = last})
  end
  local b, es, es_at = a, nil, nil
  if self.engram then
    b, u, es, es_at = nn.residual(a, self.rms2, function(v)
      return self.engram:forward(v, x, prefix, state and {e = state.e}, at)
    end, {u = u, next = self.rms3})
  end
  local out, u_next = nn.residual(b, self.rms3, function(v) return self.moe:forward(v) end,
                                  {u = u, next = chain and chain.next and self.rms1 or nil})
  if chain then chain.u = u_next end
  if not state then return out end
  ks.e = es and es.e
  if ks_at then ks_at.e = es_at and es_at.e end
  return out, ks, ks_at
end

nn.Block = Block

end
