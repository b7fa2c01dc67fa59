--[[
The dormouse model family (docs/model.md), built from a resolved config's
`model` table:

  h_0      = Emb[x]
  for i = 1 .. max_iter:                 one Block, the same weights each time
      h_i  = Block(h_{i-1}, x)
  logits_i = Head(rmsf(h_i))
  CE_i     = cross-entropy of logits_i                      (periter)
  fin_D    = cross-entropy of Head(rmsf(mean_{i<=D} h_i))   (the model at depth D)
  loss     = (sum_i CE_i + fin) / (max_iter + 1)           fin = fin_{max_iter}
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"

local Dormouse = nn.class("Dormouse")
Dormouse.masks = true      -- its losses honour opts.mask (nn.targets): it trains on records

function Dormouse:init(m)
  self.cfg = m
  self.max_iter = m.max_iter
  self:child("emb", nn.Embedding(256, m.d))
  self:child("block", nn.Block(m))
  self:child("rmsf", nn.RMSNorm(m.d))
  self:child("head", nn.Linear(m.d, 256))
  if m.loom then                                    -- an arm: a zero gate per iteration on its normalised write
    self:param("loom_gate", nn.init.zeros({m.max_iter, m.d}))
  end
  if m.aux.future > 0 then                          -- an arm: the byte after next, from the fin readout's input
    self.future_weight = m.aux.future
    self:child("future_head", nn.Linear(m.d, 256))
  end
  if m.aux.jepa > 0 then                            -- an arm: a later position's representation, predicted
    self.jepa_weight, self.jepa_offset = m.aux.jepa, m.aux.jepa_offset
    self:child("jepa_in", nn.Linear(m.d, math.max(1, m.d // 4)))
    self:child("jepa_out", nn.Linear(math.max(1, m.d // 4), m.d))
  end
  if m.aux.draft > 0 then                           -- an arm: a draft of the byte after next, given the next
    self.draft_weight = m.aux.draft
    self:child("draft_head", nn.Linear(m.d, 256))
  end
end

-- After each optimiser step (dormouse.step's Step:run, outside a capture): the arms that act
-- on the weights. Returns the events of the step by name ({retract = 1}), or nil.
function Dormouse:after_step(step)
  local every = self.cfg.moe.retract_every
  if every > 0 and step % every == 0 then
    self.block.moe:retract()
    return {retract = 1}
  end
end

-- At each log window (the trainer, outside any captured step): the measures asked for and the
-- arms that act on them. opts.orthogonality: put the probe on the line. Returns measures by name
-- ({ortho = x}) and events ({retract = 1}), either nil.
function Dormouse:after_window(opts)
  local moe, when = self.block.moe, self.cfg.moe.retract_when
  if not moe or not (opts.orthogonality or when) then return nil end
  local ortho = moe:orthogonality()
  if when and ortho > when then
    moe:retract()
    return {ortho = ortho}, {retract = 1}
  end
  return {ortho = ortho}
end

--[[ QAT's format at `step` of a run of `steps` (nil before model.moe.qat_from of the run, or
when off): one format, or the ladder's fp8_e4m3, nvfp4, ternary in equal thirds of the rest. ]]
local LADDER = {"fp8_e4m3", "nvfp4", "ternary"}
local function qat_format(moe_cfg, step, steps)
  local from = math.floor(moe_cfg.qat_from * steps)
  if moe_cfg.qat == "off" or step <= from then return nil end
  if moe_cfg.qat ~= "ladder" then return moe_cfg.qat end
  return LADDER[math.min(3, (step - from - 1) * 3 // math.max(steps - from, 1) + 1)]
end

-- Before each training step (dormouse.step's Step:run): the arms that depend on the step.
-- Returns true when the step's computation differs from the step before (QAT's format changed),
-- which a captured graph cannot follow.
function Dormouse:before_step(step, steps)
  local format = qat_format(self.cfg.moe, step, steps)
  local moe = self.block.moe
  local changed = format ~= moe.qat
  moe.qat = format
  return changed
end

-- The arms that are on, each a phrase for the run's start (docs/arms.md)
function Dormouse:arms()
  local on = {}
  if self.loom_gate then on[#on + 1] = "LOOM: a zero gate per iteration on its normalised write (loom on the log line)" end
  if self.cfg.moe.retract_every > 0 then
    on[#on + 1] = string.format("retraction of Ug, Uu to orthonormal columns every %d steps (retract on the " ..
                                "log line)", self.cfg.moe.retract_every)
  end
  if self.cfg.moe.retract_when then
    on[#on + 1] = string.format("retraction of Ug, Uu to orthonormal columns at a log window whose ortho is above " ..
                                "%g (ortho and retract on the log line)", self.cfg.moe.retract_when)
  end
  if self.future_head then on[#on + 1] = string.format("future-byte head at weight %g (aux_future on the log line)",
                                                        self.future_weight) end
  if self.jepa_in then
    on[#on + 1] = string.format("JEPA: the representation %d bytes ahead predicted at weight %g (aux_jepa on the " ..
                                "log line)", self.jepa_offset, self.jepa_weight)
  end
  if self.block.msa then
    on[#on + 1] = string.format("MSA: each query reads its top %d past blocks of %d positions%s (msa_far on the " ..
                                "log line)", self.cfg.msa.top_k, self.cfg.msa.block,
                                self.cfg.msa.qk_norm and ", q and k RMS-normalised" or "")
  end
  if self.draft_head then
    on[#on + 1] = string.format("DSpark draft head at weight %g (aux_draft on the log line, draft_accept on the " ..
                                "eval line)", self.draft_weight)
  end
  local qat = self.cfg.moe.qat
  if qat ~= "off" then
    on[#on + 1] = string.format("QAT of the experts' factors after %g of the steps: %s (qat, the factors' " ..
                                "relative error, on the log line)", self.cfg.moe.qat_from,
                                qat == "ladder" and "fp8_e4m3, nvfp4, ternary in thirds" or qat)
  end
  if self.cfg.moe.aux_balance > 0 then
    on[#on + 1] = string.format("auxiliary balance loss at weight %g (aux_balance on the log line)",
                                self.cfg.moe.aux_balance)
  end
  local by_load = self.cfg.moe.update_by_load
  if by_load ~= "off" then
    on[#on + 1] = by_load == "active" and "each expert's Muon update only in a step it had rows" or
                  "each expert's Muon update scaled by min(1, its rows / the mean) of the step"
  end
  if self.cfg.moe.fp8 then
    on[#on + 1] = "fp8 banks: the expert kernels read Ug, Uu, D as E4M3 codes under f32 scales a block of 32, " ..
                  "encoded from the masters once a pass (fp8, the codes' relative error, on the log line)"
  end
  local lb = self.cfg.moe.littlebit
  if lb ~= "off" then
    on[#on + 1] = "LittleBit experts: Ug, Uu, D as row * sign(latent) * col, learned scales" ..
                  (lb == "residual" and ", plus a residual binary term" or "") ..
                  " (lb_flip, the share of signs flipped a step, on the log line)"
  end
  return on
end

-- the logits in h's dtype (f32), the norm and the product in the compute dtype
local function readout(self, h)
  return self.head:forward(self.rmsf:forward(self:activation(h))):to(h.dtype)
end

local ce = nn.cross_entropy        -- (logits, targets, kept): the mean over the kept targets (nn.targets)

-- the targets two bytes ahead, x[:, 3..T+1] (as nn.targets, the mask's entries for them with them)
local function targets_after_next(x, mask)
  local T = x:size(2) - 1
  return nn.targets(x:narrow(2, 2, T), mask and mask:narrow(2, 2, T - 1))
end

-- the future head's cross-entropy: from position t, the byte at t + 2 (the positions before the last)
local function future_ce(self, h, x, mask)
  local T = h:size(2)
  return dm.scope(function()
    local hs = h:narrow(2, 1, T - 1)
    local logits = self.future_head:forward(self.rmsf:forward(self:activation(hs))):to(h.dtype)
    return ce(logits, targets_after_next(x, mask))
  end)
end

--[[ JEPA (an arm, model.aux.jepa; docs/arms.md): a joint-embedding predictive loss on the fin
readout's input hbar. A small predictor (d -> d/4 -> d, silu between) maps hbar_t to a prediction
of hbar_{t+k}, k = model.aux.jepa_offset, whose value is held fixed (no gradient through the
target); the loss is 1 - cosine(prediction, target), the mean over the T - k positions that have
one; under a loss mask (records) over those whose own and target positions are both scored (0
when none is). Cosine, not a squared distance: the representation's scale is the readout's to
keep. ]]
local function jepa_loss(self, hbar, mask)
  local T, k = hbar:size(2), self.jepa_offset
  return dm.scope(function()
    local pred = self.jepa_out:forward(self.jepa_in:forward(hbar:narrow(2, 1, T - k)):silu())
    local target = hbar:narrow(2, k + 1, T - k):detach()
    local cos = (pred:l2norm(1e-6) * target:l2norm(1e-6):to(pred.dtype)):sum(-1):to(hbar.dtype)
    if not mask then return 1 - cos:mean() end
    local w = (mask:narrow(2, 1, T - k):to("f32") * mask:narrow(2, k + 1, T - k):to("f32")):to(hbar.dtype)
    return (w - w * cos):sum() / w:sum():clamp(1, math.huge)
  end)
end

--[[ DSpark (an arm, model.aux.draft; docs/arms.md): a draft head for speculative decoding. Once
the model has picked byte t+1 at position t, the head drafts byte t+2 from what is already there,
the fin readout's input at t plus the embedding of byte t+1, without another pass:
draft_t = W_draft rmsf(hbar_t + Emb[x_{t+1}]). Trained on the byte after next, weight gamma; at
evaluation its greedy draft is accepted where it equals the model's own greedy byte at t+1
(draft_accept: the share of drafts a greedy speculative decoder would keep). ]]
-- the draft's logits from the readout's input hbar [..., d] and the bytes picked next [...]
local function draft_of(self, hbar, next_bytes)
  local hs = hbar + self.emb:forward(next_bytes):to(hbar.dtype)
  return self.draft_head:forward(self.rmsf:forward(self:activation(hs))):to(hbar.dtype)
end

local function draft(self, hbar, inputs, x, mask)
  local T = hbar:size(2)
  return dm.scope(function()
    local logits = draft_of(self, hbar:narrow(2, 1, T - 1), inputs:narrow(2, 2, T - 1))
    return logits, ce(logits, targets_after_next(x, mask))
  end)
end

--[[ The draft head's logits [B, 256] for the byte after next_bytes [B] (u8), from the readout's
input hbar [B, d] at the position before them (out.hbar of a readout = "fin" pass); nil without
the head (model.aux.draft = 0). Speculative decoding drafts with it (dormouse.decode). ]]
function Dormouse:draft_logits(hbar, next_bytes)
  if not self.draft_head then return nil end
  local B = hbar:size(1)
  return draft_of(self, hbar:reshape({B, 1, hbar:size(hbar:dim())}), next_bytes:reshape({B, 1}))
    :reshape({B, 256})
end

-- the share of positions 1..T-1 where the draft's greedy byte is the model's greedy byte at t+1
local function accepted(draft_logits, fin_logits)
  local T = fin_logits:size(2)
  return dm.scope(function()
    local ours = fin_logits:narrow(2, 2, T - 1):argmax(-1)
    return draft_logits:argmax(-1):eq(ours):to("f32"):mean()
  end)
end

-- the logits of h and their cross-entropy; the readout's intermediates are dropped as it returns
local function scored(self, h, targets, kept)
  return dm.scope(function()
    local logits = readout(self, h)
    return logits, ce(logits, targets, kept)
  end)
end

--[[ x [B, T+1] bytes (inputs are x[:, 1..T], targets x[:, 2..T+1]); prefix
[B, ctx] the bytes before each row (Engram's n-grams reach into them).
opts.depths: the D of fin_D to report besides fin (e.g. {1, 2}).
opts.state: the state a previous segment of the same rows left (out.state),
or {} at a sequence's start: the pass then carries every iteration's KDA
state and convolution inputs from it, and returns its own as out.state
(docs/models.md, "Segments and streaming"). opts.readout = "fin": only the fin
readout's logits (out.fin_logits) and the state, no other readout, no loss and
no routing counts (generation's one-byte step). opts.counts = "add": the pass's
routing counts add to the step's so far instead of starting them again (a
step of several segments balances on all of them). opts.mask [B, T]: 1 where
a target is scored, 0 where not (a record's prompt, data.records): every loss is
then the mean over the scored targets (nn.targets).
Returns {loss, fin, periter = {CE_1 ...}, fin_D = {[D] = ...}, logits = {...}, fin_logits[, state]
[, extras = {name = scalar}: what the log line shows besides the loss (the arms' own terms)]
[, measures = {name = scalar}: without a tape, what the eval line shows besides the CE]}. ]]
function Dormouse:forward(x, prefix, opts)
  return nn.pass(self.pass, self, x, prefix, opts or {})   -- each parameter cast once for the iterations
end

--[[ LOOM (an arm, model.loom; docs/arms.md): iteration i's write w = h' - h into the residual
stream gets a gate of its own on its RMS-normalised form, h' + g_i rms(w), g_i [d] zero at
initialisation: the identity then, bit for bit (0 times a finite number added to h'). ]]
local function loom(self, h_in, h_out, i)
  return dm.scope(function()
    local w = h_out - h_in
    return h_out + dm.rmsnorm(w, nil) * self.loom_gate:narrow(1, i, 1):reshape({-1})
  end)
end

-- a table's keys, sorted: a state's parts in a fixed order (whatever the block carries, nn/block.lua)
local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

--[[ The block under dm.recompute (model.recompute) in a pass that carries state: the
recompute takes h and the state's tensors and returns one tensor, so h' and the next
state travel through it packed, flat, in h's dtype (f32, or f64 for a twin: the layout
read from the run, each part cast back to its dtype; a bf16 cache's round trip through
f32 is exact). ]]
local function recomputed_block(self, h, x, prefix, state)
  local keys, inputs = sorted_keys(state), {h}
  for _, k in ipairs(keys) do inputs[#inputs + 1] = state[k] end
  local layout
  local packed = dm.recompute(function(hi, ...)
    local given, st = {...}, {}
    for j, k in ipairs(keys) do st[k] = given[j] end
    local ho, so = self.block:forward(hi, x, prefix, st)
    local parts, lay = {ho:reshape({-1})}, {{key = "h", shape = ho:shape(), dtype = ho.dtype}}
    for _, k in ipairs(sorted_keys(so)) do
      parts[#parts + 1] = so[k]:reshape({-1}):to(ho.dtype)
      lay[#lay + 1] = {key = k, shape = so[k]:shape(), dtype = so[k].dtype}
    end
    layout = layout or lay
    return dm.cat(parts, 1)
  end, table.unpack(inputs))
  local at, h_out, s_out = 0, nil, {}
  for _, l in ipairs(layout) do
    local n = 1
    for _, e in ipairs(l.shape) do n = n * e end
    local t = packed:narrow(1, at + 1, n):reshape(l.shape):to(l.dtype)
    at = at + n
    if l.key == "h" then h_out = t else s_out[l.key] = t end
  end
  return h_out, s_out
end

function Dormouse:pass(x, prefix, opts)
  local T = x:size(2) - 1
  local inputs = x:narrow(2, 1, T)
  local targets, kept = nn.targets(x, opts.mask)
  if opts.counts ~= "add" then self.block.moe:new_pass(opts.readout ~= "fin") end   -- this pass's routing counts start
  if self.block.engram then self.block.engram:lookup(inputs, prefix) end   -- the pass's rows, made here too
  local h = self.emb:forward(inputs)
  if self.block.engram and not (self.cfg.recompute and dm.grad_enabled()) then
    self.block.engram:prepare(inputs, prefix, self.block.rms2:activation_dtype(h.dtype))  -- the iterations' kx, vx
  end
  local out = {periter = {}, fin_D = {}, logits = {}}
  local sum_h, total = nil, nil
  local wanted = {}
  for _, D in ipairs(opts.depths or {}) do wanted[D] = true end
  local carried = opts.state
  if carried and self.block.msa then carried = nil end   -- MSA keeps no past keys: a pass without state
  if carried then out.state = {} end
  local at = carried and opts.state_at
  if at then
    if not (math.type(at) == "integer" and at >= 1 and at < T) then
      error(string.format("forward: state_at must be a position inside the pass (1 .. %d), got %s", T - 1,
                          tostring(at)), 0)
    end
    if self.cfg.recompute and dm.grad_enabled() then error("forward: state_at is for passes without grad", 0) end
    out.state_at = {}
  end
  local chain = {}        -- the next iteration's first norm, made with this one's last add (Block:forward)
  for i = 1, self.max_iter do
    local h_in, at_state = h, nil
    chain.next = i < self.max_iter and not self.loom_gate        -- (LOOM changes h between the iterations)
    if carried and self.cfg.recompute and dm.grad_enabled() then
      h, out.state[i] = recomputed_block(self, h, inputs, prefix, carried[i] or {})
    elseif carried then
      h, out.state[i], at_state = self.block:forward(h, inputs, prefix, carried[i] or {}, at or nil, chain)
      if at then out.state_at[i] = at_state end
    elseif self.cfg.recompute then           -- the block's activations recomputed in the backward (dm.recompute)
      h = dm.recompute(function(hi) return self.block:forward(hi, inputs, prefix) end, h)
    else
      h = self.block:forward(h, inputs, prefix, nil, nil, chain)
    end
    if self.loom_gate then h = loom(self, h_in, h, i) end
    sum_h = sum_h and sum_h + h or h
    if opts.readout == "fin" then            -- generation: the fin readout's logits and the state, no losses
      if i == self.max_iter then
        out.hbar = sum_h * (1 / i)               -- the readout's input (a draft head reads it)
        out.fin_logits = readout(self, out.hbar)
      end
      goto next_iteration
    end
    out.logits[i], out.periter[i] = scored(self, h, targets, kept)
    total = total and total + out.periter[i] or out.periter[i]
    if wanted[i] or i == self.max_iter then
      local logits
      logits, out.fin_D[i] = scored(self, sum_h * (1 / i), targets, kept)
      if i == self.max_iter then out.fin_logits = logits end
    end
    ::next_iteration::
  end
  if opts.readout == "fin" then return out end
  out.fin = out.fin_D[self.max_iter]
  out.loss = (total + out.fin) * (1 / (self.max_iter + 1))
  local msa = self.block.msa
  local far = msa and msa:take_far()
  if far and dm.grad_enabled() then                -- MSA's attention on the past blocks, on the log line
    out.extras = out.extras or {}
    out.extras.msa_far = far
  end
  -- the experts' arms, on the log line: QAT's and the fp8 banks' error on the factors, LittleBit's
  -- share of latent signs that flipped
  for counter, field in pairs {qat = "qat_err", fp8 = "fp8_err", lb_flip = "lb_flip"} do
    local v = self.block.moe[field]
    if v and dm.grad_enabled() then
      out.extras = out.extras or {}
      out.extras[counter] = v
    end
  end
  local aux = self.block.moe.aux
  if aux and dm.grad_enabled() then                -- the auxiliary balance term, a mean over the iterations
    aux = aux * (1 / self.max_iter)
    out.extras = out.extras or {}
    out.extras.aux_balance = aux
    out.loss = out.loss + aux * self.cfg.moe.aux_balance
  end
  if self.loom_gate and dm.grad_enabled() then     -- the gates' size on the log line
    out.extras = out.extras or {}
    out.extras.loom = self.loom_gate:detach():abs():mean()
  end
  if self.draft_head and T >= 2 and dm.grad_enabled() then   -- training: the loss gets its term
    if carried then
      error("model.aux.draft: a pass by segments would lose each segment's last target (it lies in the " ..
            "next); set model.segment = nil or model.aux.draft = 0", 0)
    end
    local _, aux = draft(self, sum_h * (1 / self.max_iter), inputs, x, opts.mask)
    out.extras = out.extras or {}
    out.extras.aux_draft = aux
    out.loss = out.loss + aux * self.draft_weight
  elseif self.draft_head and T >= 2 and not carried then       -- an evaluation: what a decoder would keep
    local logits = draft(self, sum_h * (1 / self.max_iter), inputs, x, opts.mask)
    out.measures = {draft_accept = accepted(logits, out.fin_logits)}
  end
  if self.jepa_in and dm.grad_enabled() and T > self.jepa_offset then   -- training only: evals stay the pure CE
    if carried then
      error("model.aux.jepa: a pass by segments would lose each segment's last targets (they lie in the " ..
            "next); set model.segment = nil or model.aux.jepa = 0", 0)
    end
    local aux = jepa_loss(self, sum_h * (1 / self.max_iter), opts.mask)
    out.extras = out.extras or {}
    out.extras.aux_jepa = aux
    out.loss = out.loss + aux * self.jepa_weight
  end
  if self.future_head and dm.grad_enabled() and T >= 2 then   -- training only: evals stay the pure CE
    if carried then
      error("model.aux.future: a pass by segments would lose each segment's last target (it lies in the " ..
            "next); set model.segment = nil or model.aux.future = 0", 0)
    end
    local aux = future_ce(self, sum_h * (1 / self.max_iter), x, opts.mask)
    out.extras = out.extras or {}
    out.extras.aux_future = aux
    out.loss = out.loss + aux * self.future_weight
  end
  return out
end

-- The tensors a training pass leaves on the model for the step's end (the routing counts,
-- the Engram lookups the optimiser reads): a step that scopes each segment's pass keeps them.
function Dormouse:held()
  local out = {self.block.moe.counts, self.block.moe.drops}
  if self.block.engram then self.block.engram:held(out) end
  return out
end

-- A step by segments, as each segment's backward ends: the Engram rows' gradients join the
-- step's running sum (Engram:fold), so that a pass holds one sum whatever its number of segments.
function Dormouse:fold_sparse()
  if self.block.engram then self.block.engram:fold() end
end

-- The bytes before a segment that its forward reads (prefix): Engram's longest n-gram less one.
function Dormouse:context() return nn.Engram.context_for(self.cfg.engram.orders) end

-- Move the balancing bias on the last forward's routing counts (all
-- iterations together); returns those counts [E] and, with a capacity factor,
-- the assignments dropped [E]. reduce (a data-parallel job): sums the counts over the ranks.
function Dormouse:update_balance(reduce)
  return self.block.moe:update_balance(reduce)
end

-- The step's own counters for the log line (dormouse.step): Engram's lookups and distinct rows.
-- reduce: a data-parallel job's (dormouse.dist), or nil.
function Dormouse:step_counters(reduce)
  local engram = self.block.engram
  return engram and {engram = engram:step_counters(reduce)} or nil
end

-- Shapes that never wait for the device, for a step captured as a CUDA graph (Engram:set_static).
function Dormouse:set_static(on)
  if self.block.engram then self.block.engram:set_static(on) end
end

--[[ fn() → the loader's next x [B, T+1], prefix, k without taking it (train.lookahead):
Engram tables in host memory gather that batch's rows while this step runs. fn = nil
stops it. ]]

function Dormouse:set_lookahead(fn)
  local engram = self.block.engram
  if not engram then return end
  engram:set_lookahead(fn and function()
    local x, prefix, k = fn()
    return x:narrow(2, 1, x:size(2) - 1), prefix, k           -- the inputs, as forward reads them
  end)
end

--[[ Parameter counts: total, the Engram tables apart, and the parameters one
token uses in one iteration (the block's dense parts, its k routed experts,
one Engram row per sub-table, its embedding row and the head). ]]
function Dormouse:counts()
  local m = self.cfg
  local total = self:n_params()
  local engram = self.block.engram
  local tables = engram and engram.table:numel() or 0
  local moe = self.block.moe
  local per_expert = (moe.Ug:numel() + moe.Uu:numel() + moe.cg:numel() + moe.cu:numel() + moe.D:numel())
                     // m.experts
  local routed = per_expert * m.experts
  local block = self.block:n_params()
  local active = block - tables - routed + per_expert * m.top_k
               + (engram and engram.n_sub * engram.width or 0)
               + m.d + self.head:n_params() + self.rmsf:n_params()
  return {total = total, tables = tables, without_tables = total - tables, active = active,
          routed = routed}
end

return function(model_cfg) return Dormouse(model_cfg) end
