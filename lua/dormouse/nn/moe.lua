--[[
MoE — routed low-rank experts with a shared expert (docs/model.md):

  l      = W_r u                               router logits, float32 scores
  idx    = topk_k(l + lfb_bias)                the bias steers selection only
  w      = softmax(l[idx])                     over the k chosen
           (router = "sigmoid": s = sigmoid(l), idx = topk_k(s + lfb_bias), w = s[idx] / sum(s[idx]))
  expert e:  y_e = D[e] (silu((U_g[e]^T u) c_g[e]) · (U_u[e]^T u) c_u[e])
  shared:    y_s = the same form at rank r_s
  out    = W_write( y_s + sum_{e in idx} w_e y_e )

Dispatch is dropless by default: assignments are sorted by expert and the expert
products run grouped, with per-expert offsets (no host sync). With a capacity
factor (model.moe.capacity_factor), each expert's assignments past
ceil(factor · N k / E) get gate 0 and are counted (the log line's drops).
After each step update_balance() moves lfb_bias towards equal load.
]]
return function(nn, dm)

local schema = require "dormouse.schema"      -- the options' defaults (schema.default)

local MoE = nn.class("MoE")
local FACTORS = {"Ug", "Uu", "D"}      -- the experts' factors (QAT and LittleBit act on them)
MoE.banks = FACTORS                    -- the parameters a checkpoint may keep in a low-bit format (banks.lua)

function MoE:init(d, opts)
  local E, r, F = opts.experts, opts.rank, opts.ffn
  self.experts, self.top_k, self.gamma = E, opts.top_k, opts.lfb_gamma or schema.default("model.moe.lfb_gamma")
  self.capacity_factor = opts.capacity_factor     -- nil: dropless
  self.balance = opts.balance or schema.default("model.moe.balance")
  self.router_f32 = opts.router_dtype == "f32"
  self.router_sums = opts.router_dtype == "f32_sums"
  self.router_cosine = opts.router_cosine       -- nil: the logits W_r u; s: s cos(u, w_e)
  self.router_form = opts.router or schema.default("model.moe.router")
  self.aux_weight = opts.aux_balance or schema.default("model.moe.aux_balance")
  self.update_by_load = opts.update_by_load or schema.default("model.moe.update_by_load")
  self:child("router", nn.Linear(d, E, {std = opts.router_std}))
  self:param("Ug", nn.init.normal({E, d, r}, d ^ -0.5))
  self:param("Uu", nn.init.normal({E, d, r}, d ^ -0.5))
  self:param("cg", nn.init.ones({E, r}))
  self:param("cu", nn.init.ones({E, r}))
  self:param("D", nn.init.normal({E, r, F}, r ^ -0.5))
  local rs = opts.shared_rank
  self:child("sg", nn.Linear(d, rs))
  self:child("su", nn.Linear(d, rs))
  self:param("scg", nn.init.ones({rs}))
  self:param("scu", nn.init.ones({rs}))
  self:child("sd", nn.Linear(rs, F))
  self:child("write", nn.Linear(F, d, {std = F ^ -0.5 * (opts.out_factor or 1)}))   -- the branch's output
  self:buffer("lfb_bias", nn.init.zeros({E}))
  -- each expert's Muon update scale (update_by_load), rewritten in place by update_balance each step
  if self.update_by_load ~= "off" then self.update_scale = dm.keep(dm.ones({E}, {device = self.lfb_bias.device})) end
  self.littlebit = opts.littlebit ~= nil and opts.littlebit ~= "off" and opts.littlebit or nil
  if self.littlebit then self:littlebit_init(self.littlebit == "residual") end
  self.fp8 = opts.fp8 or nil
  if self.fp8 and self.littlebit then error("nn.MoE: fp8 banks with LittleBit: the factors are signs already", 2) end
end

--[[ LittleBit (an arm, model.moe.littlebit; docs/arms.md; arXiv 2506.13771): each factor X of
Ug, Uu [E, d, r] and D [E, r, F] is used as row * sign(X) * col, the latent X's signs under a
learned scale per row ([E, m, 1]) and per column ([E, 1, n]); the per-rank scales cg, cu stay.
The sign's gradient is passed straight through to the latent. "residual" adds a second term of
the same form on a latent of its own, X_res, which starts as what the first term leaves,
X - row * sign(X) * col. Each term's scales start at the rank-1 fit of its latent's |X| from
the marginals, row_i col_j = mean_j |X_ij| mean_i |X_ij| / mean |X|. Nothing is drawn: the
control's parameters are drawn as before. ]]
local function marginal_scales(X)
  local E, m, n = X:size(1), X:size(2), X:size(3)
  local A = X:abs()
  local row = A:sum_to({E, m, 1}) * (1 / n)
  local col = A:sum_to({E, 1, n}) * (1 / m) / (A:sum_to({E, 1, 1}) * (1 / (m * n)) + 1e-30)
  return row, col
end

local function binary_term(latent, row, col)    -- the op passes sign's gradient straight through
  return dm.littlebit(latent, nn.like(row, latent), nn.like(col, latent))
end

function MoE:littlebit_init(residual)
  if residual then self.banks = {"Ug", "Uu", "D", "Ug_res", "Uu_res", "D_res"} end
  dm.no_grad(function()
    for _, name in ipairs(FACTORS) do
      local X = self[name]
      local row, col = marginal_scales(X)
      self:param(name .. "_row", row:contiguous())
      self:param(name .. "_col", col:contiguous())
      if residual then            -- the residual latents are banks too (checkpoint.banks)
        local R = (X - row * X:sign() * col):contiguous()
        local rrow, rcol = marginal_scales(R)
        self:param(name .. "_res", R)
        self:param(name .. "_res_row", rrow:contiguous())
        self:param(name .. "_res_col", rcol:contiguous())
      end
    end
  end)
end

-- The factor `name`'s LittleBit form from its latent w (the compute copy of the bank)
function MoE:binarised(name, w)
  local v = binary_term(w, self[name .. "_row"], self[name .. "_col"])
  local res = self[name .. "_res"]
  if res then
    v = v + binary_term(nn.like(res, w), self[name .. "_res_row"], self[name .. "_res_col"])
  end
  return v
end

--[[ LittleBit's counter (lb_flip on the log line): the share of the latents' signs, on the first 8
experts' factors, that differ from the last training pass's (0 at the first). Device tensors only:
the previous signs are kept and overwritten in place. ]]
function MoE:littlebit_flips()
  return dm.no_grad(function()
    local k = math.min(8, self.experts)
    local flips, total = nil, 0
    self.lb_signs = self.lb_signs or {}
    for _, name in ipairs(FACTORS) do
      local now = self[name]:narrow(1, 1, k):sign()
      local before = self.lb_signs[name]
      if before then
        local changed = now:ne(before):to("f32"):sum()
        flips = flips and flips + changed or changed
        before:copy_(now)
      else
        self.lb_signs[name] = dm.keep(now)
      end
      total = total + now:numel()
    end
    return flips and dm.keep(flips * (1 / total)) or dm.keep(dm.zeros({}, {device = self.lfb_bias.device}))
  end)
end

-- A new forward pass of the model: its routing counts start again (counting = false: a pass that
-- counts nothing, generation's step, whose counts nothing reads; routing() then gives nil).
-- update_balance (after the backward) ends the pass.
function MoE:new_pass(counting)
  if dm.recomputing() then return end          -- a recompute around the whole pass: the forward's state stands
  self.qat_err, self.lb_flip, self.fp8_err, self.aux = nil, nil, nil, nil
  self.uncounted = counting == false or nil
  if self.uncounted then self.counts, self.drops = nil, nil; return end
  self.counts = dm.zeros({self.experts}, {dtype = "i64", device = self.lfb_bias.device})
  self.drops = self.capacity_factor and dm.zeros({self.experts}, {dtype = "i64", device = self.lfb_bias.device})
end

--[[ The expert banks in the compute dtype. Inside nn.pass they are cast once
for the pass and shared by its iterations (the same weights each time): one
bf16 copy of the banks is saved for backward, not one per iteration, and the
iterations' gradients meet in that copy before they reach the f32 masters.
Outside a pass each call casts afresh. In f32 (or for f64 twins), the masters. ]]
function MoE:compute_weights()
  local W
  if self.fp8 then return self:fp8_banks() end
  if self.compute_dtype == "f32" or self.Ug.dtype ~= "f32" then
    W = {Ug = self.Ug, Uu = self.Uu, cg = self.cg, cu = self.cu, D = self.D}
  else
    W = {Ug = self:compute(self.Ug), Uu = self:compute(self.Uu), cg = self:compute(self.cg), cu = self:compute(self.cu),
         D = self:compute(self.D)}
  end
  if self.qat then self:fake_quantized(W) end
  if self.littlebit then self:binarised_banks(W) end
  return W
end

-- The banks in W replaced by their LittleBit form, once a pass (nn.pass_once: shared by its
-- iterations, as the compute copy is; a recomputed block binarises afresh)
function MoE:binarised_banks(W)
  if not self.lb_flip and dm.grad_enabled() and not dm.recomputing() then self.lb_flip = self:littlebit_flips() end
  for _, name in ipairs(FACTORS) do
    local w = W[name]
    W[name] = nn.pass_once(self[name], "littlebit", function() return self:binarised(name, w) end)
  end
end

--[[ QAT (an arm, model.moe.qat; docs/arms.md): the factors Ug, Uu, D through the format
self.qat (set by the model before each step), their gradient passed straight through to the
weights. The scales cg, cu stay as they are. The pass's first call also measures the format's
relative error, ||q(W) - W|| / ||W||, on the first 8 experts' factors (the log line's qat). ]]
function MoE:fake_quantized(W)
  local err2, norm2
  for _, name in ipairs(FACTORS) do
    local w = W[name]
    -- the pass's iterations read one copy of the banks (nn.pass): they share its quantised form too,
    -- made once (a recomputed block casts afresh, and quantises afresh)
    W[name] = nn.pass_once(self[name], "qat:" .. self.qat, function()
      local q = dm.fake_quantize(w, self.qat)
      if not self.qat_err and dm.grad_enabled() then      -- measured on a sample: the first 8 experts
        local k = math.min(8, self.experts)
        local held, qs = w:detach():narrow(1, 1, k):to("f32"), q:detach():narrow(1, 1, k):to("f32")
        local e, n = (qs - held):pow(2):sum(), held:pow(2):sum()
        err2, norm2 = err2 and err2 + e or e, norm2 and norm2 + n or n
      end
      return q
    end)
  end
  if err2 then self.qat_err = dm.keep((err2 / norm2):sqrt()) end
end

--[[ fp8 banks (an arm, model.moe.fp8; docs/arms.md): the factors Ug, Uu, D as E4M3 codes under
f32 scales a block of 32 (dm.bank_fp8), made from the masters once a pass in place of the compute
copy: the expert kernels read the codes and form the weights as they load them. Each factor's
place in the graph is a stand-in of the compute copy's shape (dm.stand_in, no values), through
which its gradient reaches the master as a cast's would: QAT at fp8_e4m3 from the first step,
without the 16-bit copy. The pass's first call measures the codes' relative error against the
masters on the first 8 experts (the log line's fp8). ]]
local function fp8_factor(dt)
  return function(p)
    local codes, scales = dm.bank_fp8(p, dt)
    return {dm.stand_in(p, dt, nn.copy_grad_dtype(p, dt)), codes, scales}
  end
end

function MoE:fp8_banks()
  local dt = (self.compute_dtype == "f32" or self.Ug.dtype ~= "f32") and self.Ug.dtype or self.compute_dtype
  local W = {cg = self:compute(self.cg), cu = self:compute(self.cu), fp8 = {}}
  local measure = not self.fp8_err and dm.grad_enabled() and not dm.recomputing()
  local err2, norm2
  for _, name in ipairs(FACTORS) do
    local made = nn.pass_once(self[name], "fp8:" .. dt, fp8_factor(dt))
    W[name], W.fp8[name] = made[1], {made[2], made[3]}
    if measure then
      dm.no_grad(function()
        local k, n = math.min(8, self.experts), self[name]:size(3)
        local held = self[name]:narrow(1, 1, k):to("f32")
        local codes, scales = made[2]:narrow(1, 1, k), made[3]:narrow(1, 1, k)
        local block = codes:size(3) // scales:size(3)          -- the codes' block (vm/ops/moe.h)
        local back = dm.quant_decode(codes, scales, "fp8_e4m3", block, codes:size(3)):narrow(3, 1, n)
        local e, m2 = (back - held):pow(2):sum(), held:pow(2):sum()
        err2, norm2 = err2 and err2 + e or e, norm2 and norm2 + m2 or m2
      end)
    end
  end
  if err2 then self.fp8_err = dm.keep((err2 / norm2):sqrt()) end
  return W
end

--[[ The auxiliary balance term of one call (model.moe.aux_balance): E sum_e f_e P_e, f_e = counts_e
/ (N k) the share of the call's assignments to e (no gradient), P_e the mean over the N tokens of
e's router probability: softmax(logits) over the E experts for the softmax router, sigmoid(logits)
renormalised over them for the sigmoid one. 1 when both are uniform. ]]
function MoE:balance_term(scores, counts)
  local N, E = scores:size(1), self.experts
  local p
  if self.router_form == "softmax" then p = scores:softmax(-1)
  else
    local s = scores:sigmoid()
    p = s / s:sum(-1, true)
  end
  local f = counts:to(scores.dtype) * (1 / (N * self.top_k))
  return (p:mean(1) * f):sum() * E
end

-- The routed experts' products (bf16 tensor-core kernels on the GPU) and their
-- gated combine, in the weights' dtype; the result in x's.
local function routed_experts(self, W, x, perm, offsets, inv, w)
  local xs = x:to(W.D.dtype)
  local rows = dm.moe_experts(xs, perm, offsets, W.Ug, W.Uu, W.cg, W.cu, W.D, self.top_k, W.fp8)
  return dm.moe_combine(rows, inv, w:to(W.D.dtype)):to(x.dtype)
end

--[[ F padded to a multiple of 8 for the products in the compute dtype: rows of
F = 5,461 bf16 elements start anywhere in 16 bytes, and cuBLAS then takes its
unaligned kernels for the write and shared-down products (forward and
backward). The padded columns are zeros (the weights' padded rows and columns
are zeros and take no gradient), so the results are those of F columns. ]]
local function ffn_pad(self, x)
  local F = self.D:size(3)
  if self.compute_dtype == "f32" or x.dtype ~= self.compute_dtype or F % 8 == 0 then return 0 end
  return 8 - F % 8
end

-- t with n zero slices more along dim (the last by default)
local function padded(t, n, dim)
  dim = dim or t:dim()
  local shape = t:shape()
  shape[dim] = n
  return dm.cat({t, dm.zeros(shape, {dtype = t.dtype, device = t.device})}, dim)
end

-- weight w in h's dtype with pad zero slices more along dim: made once a pass (nn.pass_once), so the
-- iterations share it (and its gradient meets there) and the decoder's bytes reuse it
local function padded_weight(w, h, pad, dim)
  return nn.pass_once(w, string.format("padded %s %d %d", h.dtype, pad, dim or 0),
                      function(p) return padded(nn.like(p, h), pad, dim) end)
end

-- W_write(routed + y_s), y_s = sd(h): through F + pad columns when pad > 0 (without grad routed is
-- added into y_s's first F columns in place, instead of padded and added: two launches fewer)
local function write_out(self, routed, h, pad)
  if pad == 0 then return self.write:forward(routed + self.sd:forward(h)) end
  local shared = self:project(h, padded_weight(self.sd.weight, h, pad, 1))          -- [N, F + pad]
  local summed
  if dm.grad_enabled() then summed = padded(routed, pad) + shared
  else summed = shared; shared:narrow(2, 1, routed:size(2)):add_(routed) end
  return self:project(summed, padded_weight(self.write.weight, h, pad))
end

--[[ The products of x [N, d] for the router and the shared expert (nn.products: one, stacked, in
generation's one-byte step): {the router's scores (router_scores), sg x times scg, su x times scu}. ]]
function MoE:products(x)
  local shared = {{self.sg, scale = self.scg}, {self.su, scale = self.scu}}
  if self.router_cosine or self.router_f32 or self.router_sums then   -- a product of its own
    local scores = self:router_scores(x)
    return {scores, table.unpack(nn.products(x, shared))}
  end
  local out = nn.products(x, {self.router, shared[1], shared[2]})
  out[1] = self:router_scores(x, out[1])
  return out
end

-- The router's logits, in float32 (the master's dtype: f64 in a float64 twin): W_r u, its product in
-- the compute dtype (`logits` when made already, MoE:products), or (router_dtype = f32) in f32, or
-- (f32_sums) from the compute dtype's operands with the sums kept in f32; or, with router_cosine = s,
-- s cos(u, w_e) from the row and the router's rows at unit length, in f32.
local COSINE_EPS = 1e-6
function MoE:router_scores(x, logits)
  local w = self.router.weight
  if self.router_cosine then
    return dm.linear(x:to(w.dtype):l2norm(COSINE_EPS), w:l2norm(COSINE_EPS)) * self.router_cosine
  end
  if self.router_f32 then return dm.linear(x:to(w.dtype), w) end
  if self.router_sums then               -- in the dtype the product would take (nn.products'), sums in f32
    local cd = self.compute_dtype
    local dt = cd ~= "f32" and x.dtype == "f32" and cd or x.dtype
    local sixteen = dt == "bf16" or dt == "f16"
    local xd = x:to(dt)
    return dm.matmul(xd, nn.like(w, xd), {transpose_b = true, out = sixteen and "f32" or nil}):to(self.lfb_bias.dtype)
  end
  return (logits or self.router:forward(x)):to(self.lfb_bias.dtype)
end

-- The step's intermediates (routing, expert rows, the shared expert) are
-- dropped when it returns (dm.scope); what backward needs the tape holds.
function MoE:forward(u)
  local B, T, d = u:size(1), u:size(2), u:size(3)
  local x = u:reshape({B * T, d})
  local W = self:compute_weights()
  local out, counts, drops, aux = dm.scope(function()
    -- the router's and the shared expert's products of x (one, stacked, in generation's one-byte step)
    local scores, gs, us = table.unpack(self:products(x))
    local idx, w, counts = dm.moe_route(scores, self.lfb_bias, self.top_k, self.router_form)
    local perm, offsets, inv = dm.moe_sort(idx, self.experts)
    local drops
    if self.capacity_factor then                -- each expert's rows past its capacity: gate 0, counted
      w, drops = dm.moe_capacity(w, idx, inv, offsets, self.capacity_factor)
    end
    local routed = routed_experts(self, W, x, perm, offsets, inv, w)
    local h = dm.silu_mul(gs, us)
    local aux = self.aux_weight > 0 and dm.grad_enabled() and self:balance_term(scores, counts) or nil
    return write_out(self, routed, h, ffn_pad(self, x)), counts, drops, aux
  end)
  if aux then self.aux = self.aux and dm.keep(self.aux + aux) or dm.keep(aux) end   -- summed over the iterations
  if not (dm.recomputing() or self.uncounted) then   -- summed over the step's iterations, each counted once
    -- without new_pass the first call's counts are the sum: kept out of the scope
    -- it returns to (a recomputed call's ends with it)
    if self.counts then self.counts:add_(counts) else self.counts = dm.keep(counts) end
    if drops then
      if self.drops then self.drops:add_(drops) else self.drops = dm.keep(drops) end
    end
  end
  return out:reshape({B, T, d})
end

-- Retraction (an arm, model.moe.retract_every; docs/arms.md): Ug and Uu pulled back to orthonormal
-- columns, each expert's [d, r] factor W replaced by its polar factor W (W^T W)^-1/2. The inverse
-- square root of the Gram matrix G = W^T W (r x r, batched over experts) comes from the coupled
-- Newton-Schulz iteration Y <- Y T, Z <- T Z, T = (3 I - Z Y) / 2 from Y = G / ||G||_F, Z = I
-- (every eigenvalue of Y in (0, 1]: it converges), so (G / c)^-1/2 = Z and G^-1/2 = Z / sqrt(c).
-- the r x r identity as a [1, r, r] tensor (it broadcasts over the experts)
local function identity(r, dtype, device)
  local rows = {}
  for i = 1, r do
    rows[i] = {}
    for j = 1, r do rows[i][j] = i == j and 1 or 0 end
  end
  return dm.tensor({rows}, {dtype = dtype, device = device})
end

local RETRACT_STEPS = 14                 -- the iteration's steps: orthonormal to 1e-6 in f32 from a random init

function MoE:retract()
  dm.no_grad(function()
    dm.scope(function()
      for _, name in ipairs {"Ug", "Uu"} do
        local W = self[name]
        local E, r = W:size(1), W:size(3)
        local I = identity(r, W.dtype, W.device)
        local G = W:transpose(2, 3):matmul(W)
        local c = G:square():sum_to({E, 1, 1}):sqrt()
        local Y, Z = G / c, I
        for _ = 1, RETRACT_STEPS do
          local T = I * 1.5 - Z:matmul(Y) * 0.5
          Y, Z = Y:matmul(T), T:matmul(Z)
        end
        W:copy_(W:matmul(Z) / c:sqrt())
      end
    end)
  end)
end

--[[ The orthogonality probe (log.orthogonality, model.moe.retract_when): how far Ug's and Uu's
columns are from orthonormal, ||W^T W - I||_F for each expert's [d, r] factor W, over its expected
value for random columns of the init's scale (entries N(0, 1/d): diagonal terms of variance 2/d,
the rest 1/d, so sqrt(r (r + 1) / d)), the mean over the experts and both factors: 1 at a random
init and 0 orthonormal, whatever d and r (a raw distance's scale moves with them). ]]
function MoE:orthogonality()
  return dm.no_grad(function()
    return dm.scope(function()
      local total, n = 0, 0
      for _, name in ipairs {"Ug", "Uu"} do
        local W = self[name]:to("f32")
        local E, d, r = W:size(1), W:size(2), W:size(3)
        local I = identity(r, "f32", W.device)
        local D = W:transpose(2, 3):matmul(W) - I
        total = total + (D:square():sum_to({E, 1, 1}):sqrt():sum():item() / math.sqrt(r * (r + 1) / d))
        n = n + E
      end
      return total / n
    end)
  end)
end

-- The probe protocol (docs/models.md, "Probes"): this module's routing counts [E] over its
-- calls since the pass began (a forward's every iteration), or nil before any.
function MoE:routing() return self.counts end

-- Loss-free balancing, on the whole step's counts (every iteration's routing):
-- lfb_bias[e] += gamma · sign(mean_load − load[e]); with balance = "proportional"
-- gamma · (mean_load − load[e]) / mean_load, which pushes a busy expert down by its
-- excess but lifts a starved one by gamma at most; with balance = "log"
-- gamma · log((mean_load + 1) / (load[e] + 1)), the same size for a load k times the
-- mean as for one k times under it. Returns the counts used and, with a capacity
-- factor, the step's dropped assignments per expert.
function MoE:update_balance(reduce)
  local counts, drops = self.counts, self.drops
  if not counts then return nil end
  self.counts, self.drops = nil, nil
  if reduce then counts = reduce(counts) end     -- a data-parallel job: every rank's counts, summed
  dm.no_grad(function()                        -- on the device, no sync
    if self.balance == "proportional" then      -- the step in proportion to each expert's load error
      local load = counts:to(self.lfb_bias.dtype)
      local mean = load:sum() * (1 / self.experts)
      self.lfb_bias:add_((mean - load) / (mean + 1e-12) * self.gamma)
    elseif self.balance == "log" then           -- symmetric in the load's ratio to the mean
      local load = counts:to(self.lfb_bias.dtype)
      local mean = load:sum() * (1 / self.experts)
      self.lfb_bias:add_(((mean + 1) / (load + 1)):log() * self.gamma)
    else
      dm.moe_balance_(self.lfb_bias, counts, self.gamma)
    end
    if self.update_scale then self:set_update_scale(counts) end
  end)
  return counts, drops
end

-- update_scale from the step's counts (update_by_load): an expert's share of the rows, min(1, load /
-- mean), or whether it had any (active); Muon multiplies each expert's update by it
function MoE:set_update_scale(counts)
  local load = counts:to("f32")
  local s
  if self.update_by_load == "active" then s = load:gt(0):to("f32")
  else s = (load / (load:sum() * (1 / self.experts) + 1e-12)):clamp(0, 1) end
  self.update_scale:copy_(s)
end

-- The update scales Muon takes for parameter `name` of this module (a bank of the experts: Ug, Uu, D,
-- and LittleBit's residual latents), or nil
function MoE:muon_scales(name)
  if not self.update_scale then return nil end
  for _, bank in ipairs(self.banks) do
    if bank == name then return self.update_scale end
  end
end

nn.MoE = MoE

end
