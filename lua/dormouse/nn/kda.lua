--[[
KDA — Kimi Delta Attention (docs/model.md), per head, state dk × dv in float32:

  q, k, v = silu(conv4(W u)),  q, k l2-normalised,  q scaled by dk^-1/2
  beta    = sigmoid(W_b u)
  g       = -exp(A_log) · softplus(W_g2 W_g1 u + dt_bias)     (gate = "bounded": lb · sigmoid(exp(A_log) · (.)))
  S_t     = Diag(exp(g_t)) S_{t-1} + beta_t k_t (v_t - S'^T k_t)^T ;  o_t = S_t^T q_t
  out     = W_o( rmsnorm_head(o) · sigmoid(W_o2 W_o1 u + b_o) )
]]
return function(nn, dm)

local schema = require "dormouse.schema"      -- the options' defaults (schema.default)

local KDA = nn.class("KDA")

-- The decay rates A = exp(A_log) per head lie in A_RANGE; dt, the gate's step at initialisation
-- (init.dt_bias = "log_uniform" or "decay"), is log-uniform in DT_RANGE (schema.kda_init owns both).
KDA.A_RANGE, KDA.DT_RANGE = schema.kda_init.a_range, schema.kda_init.dt_range

-- The deepest log-decay a channel starts at under init.dt_bias = "decay": -deepest_start()
KDA.deepest_start = schema.kda_deepest_start

--[[ dt_bias for the gate to start at g = -A dt per channel (f = 0), dt [H*dk] > 0, A [H, 1]:
the inverse softplus of dt for the softplus form, -A softplus(dt_bias) = -A dt; for the bounded
form lb sigmoid(A dt_bias) = -A dt, so dt_bias = logit(A dt / -lb) / A. ]]
local function dt_bias_for(self, gate, dt, A)
  if gate == "softplus" then return dt + (-(-dt):exp() + 1):log() end   -- dt + log(1 - e^-dt)
  local p = dt:reshape({self.heads, self.head_dim}) * A * (-1 / self.gate_lb)
  return ((p / (-p + 1)):log() / A):reshape({self.heads * self.head_dim})
end

-- KDA's options from a model config m (its kda and init tables); out_factor scales W_o's std
function KDA.options(m, out_factor)
  local init = m.init or {}
  return {gate = m.kda.gate, gate_lb = m.kda.gate_lb, output_bias = m.kda.output_bias,
          init = {conv = init.conv, dt_bias = init.dt_bias, a_log = init.a_log, out_factor = out_factor}}
end

function KDA:init(d, heads, head_dim, opts)
  opts = opts or {}
  local hd = heads * head_dim
  self.heads, self.head_dim = heads, head_dim
  -- q's scale dk^-1/2 inside its l2norm where it is a power of two (the bits of the norm and then the
  -- product: a power of two scales without rounding), else a product of its own (q_scale 1)
  local e = math.log(head_dim ^ -0.5, 2)
  self.q_scale = e == math.floor(e) and head_dim ^ -0.5 or 1
  self.gate = opts.gate or schema.default("model.kda.gate")
  self.gate_lb = opts.gate_lb or schema.default("model.kda.gate_lb")
  self:child("wq", nn.Linear(d, hd))
  self:child("wk", nn.Linear(d, hd))
  self:child("wv", nn.Linear(d, hd))
  local init = opts.init or {}
  -- the short convolutions: N(0, 0.5^2), or U(-1/2, 1/2) (init.conv = "uniform")
  local function conv_weight()
    if init.conv == "uniform" then return nn.init.uniform({hd, 4}, -0.5, 0.5) end
    return nn.init.normal({hd, 4}, 0.5)
  end
  self:param("conv_q", conv_weight())
  self:param("conv_k", conv_weight())
  self:param("conv_v", conv_weight())
  self:child("wb", nn.Linear(d, heads))
  self:child("wg1", nn.Linear(d, head_dim))
  self:child("wg2", nn.Linear(head_dim, hd))
  -- decay rates spread over heads: exp(A_log) in A_RANGE, log-uniform (A_log ~ U(0, ln 16)) or
  -- uniform (init.a_log = "uniform": A_log = log U(1, 16), as FLA's KDA layer draws it)
  local A_lo, A_hi = KDA.A_RANGE[1], KDA.A_RANGE[2]
  if init.a_log == "uniform" then
    self:param("A_log", nn.init.uniform({heads}, A_lo, A_hi):log())
  else
    self:param("A_log", nn.init.uniform({heads}, math.log(A_lo), math.log(A_hi)))
  end
  -- zeros; or, for dt ~ log-uniform on DT_RANGE: its inverse softplus (log_uniform, as Mamba and FLA),
  -- or the value that starts this gate at g = -A dt (decay: the same as log_uniform for softplus)
  if init.dt_bias == "log_uniform" or init.dt_bias == "decay" then
    local dt = nn.init.uniform({hd}, math.log(KDA.DT_RANGE[1]), math.log(KDA.DT_RANGE[2])):exp()
    local gate = init.dt_bias == "decay" and self.gate or "softplus"
    self:param("dt_bias", dt_bias_for(self, gate, dt, self.A_log:detach():exp():reshape({heads, 1})))
  else
    self:param("dt_bias", nn.init.zeros({hd}))
  end
  self:child("o_norm", nn.RMSNorm(head_dim))
  self:child("wo1", nn.Linear(d, head_dim))
  self:child("wo2", nn.Linear(head_dim, hd, {bias = opts.output_bias ~= false}))
  self:child("wo", nn.Linear(hd, d, {std = hd ^ -0.5 * (init.out_factor or 1)}))   -- the branch's output
end

-- silu(conv4(x)); with a state, the conv reads the inputs before x from state[name] (nil: zeros)
-- and leaves its own last inputs in carry[name] for the next segment (and in carry_at[name] the
-- ones after position `at`)
local function short_conv(x, w, state, carry, name, carry_at, at)
  if not carry then return dm.causal_conv1d(x, nn.like(w, x), {silu = true}) end
  local y
  y, carry[name] = dm.causal_conv1d(x, nn.like(w, x), {silu = true, cache = state[name], return_cache = true})
  if carry_at then carry_at[name] = nn.conv_cache_at(state[name], x, at, carry[name]:size(2)) end
  return y
end

-- dm.kda over the first `at` positions, then the rest from the state there: the output and the
-- states after position `at` and after the last
local function kda_split(q, k, v, g, beta, S, at)
  local T = q:size(2)
  local function part(t, from, len) return t:narrow(2, from, len) end
  local o1, s_at = dm.kda(part(q, 1, at), part(k, 1, at), part(v, 1, at), part(g, 1, at), part(beta, 1, at),
                          {initial_state = S, output_final_state = true})
  local o2, s_end = dm.kda(part(q, at + 1, T - at), part(k, at + 1, T - at), part(v, at + 1, T - at),
                           part(g, at + 1, T - at), part(beta, at + 1, T - at),
                           {initial_state = s_at, output_final_state = true})
  return dm.cat({o1, o2}, 2), s_end, s_at
end

--[[ u [B, T, d] in the compute dtype. q, k, v, o and the output gate stay in
u's dtype; the gates g and beta are float32 (docs/model.md).
state (optional): what a previous segment left, {S = [B, H, dk, dv] f32, q, k, v =
the short convolutions' last inputs}, any of them nil (zeros); given, the call
returns the output and this segment's state of the same form, and with `at`
(1 <= at < T) the state after position `at` as well. ]]
function KDA:forward(u, state, at)
  local B, T = u:size(1), u:size(2)
  local H, dh = self.heads, self.head_dim
  local heads = {B, T, H, dh}
  local carry = state and {} or nil
  local carry_at = state and at and {} or nil
  local function conv(x, name)
    return short_conv(x, self["conv_" .. name], state, carry, name, carry_at, at)
  end
  -- the products of u: one, with the weights stacked, in generation's one-byte step (nn.products)
  local pq, pk, pv, pb, pg, po = table.unpack(nn.products(u, {self.wq, self.wk, self.wv, self.wb, self.wg1,
                                                              self.wo1}))
  local q = conv(pq, "q"):reshape(heads):l2norm(1e-6, self.q_scale)
  if self.q_scale == 1 then q = q * dh ^ -0.5 end
  local k = conv(pk, "k"):reshape(heads):l2norm(1e-6)
  local v = conv(pv, "v"):reshape(heads)
  local beta = pb:to(self.A_log.dtype):sigmoid()
  local f = self.wg2:forward(pg):reshape(heads)
  local g = dm.kda_gate(f, self.A_log, self.dt_bias, {kind = self.gate, lb = self.gate_lb})
  local o, final
  if carry_at then
    o, final, carry_at.S = kda_split(q, k, v, g, beta, state.S, at)
  else
    o, final = dm.kda(q, k, v, g, beta, {initial_state = state and state.S, output_final_state = true})
  end
  local gate = self.wo2:forward(po):sigmoid()
  local out = self.wo:forward(self.o_norm:forward(o):reshape({B, T, H * dh}) * gate)
  if carry then carry.S = final end
  return out, carry, carry_at
end

nn.KDA = KDA

--[[ A plain layer of KDA and a dense MLP, each a residual branch (models/stack.lua,
models/byteflow.lua): m gives d, heads, head_dim, kda and ffn (the MLP's width).

  a  = h + KDA(rms(h))
  h' = a + W_2 silu(W_1 rms(a))
]]
local KDALayer = nn.class("KDALayer")
function KDALayer:init(m)
  self:child("rms1", nn.RMSNorm(m.d))
  self:child("kda", nn.KDA(m.d, m.heads, m.head_dim, nn.KDA.options(m)))
  self:child("rms2", nn.RMSNorm(m.d))
  self:child("up", nn.Linear(m.d, m.ffn))
  self:child("down", nn.Linear(m.ffn, m.d))
end
-- each branch in the compute dtype, added back into the f32 stream (nn.residual);
-- state: the KDA branch's from the previous segment (returned with h when given)
function KDALayer:forward(h, state)
  local a, carried = nn.residual(h, self.rms1, function(u) return self.kda:forward(u, state) end)
  return nn.residual(a, self.rms2, function(u) return self.down:forward(self.up:forward(u):silu()) end), carried
end
nn.KDALayer = KDALayer

end
