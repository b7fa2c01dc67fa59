--[[
Routed experts: the pieces of a mixture-of-experts layer.

  local idx, w, counts = dm.moe_route(logits, bias, k)
      logits [N, E]: the router's scores before the sigmoid; bias [E] or nil,
      the balancing bias (it steers the choice only and takes no gradient).
      idx [N, k] the chosen experts, best first; w [N, k] their gates
      sigmoid(logits) renormalised over the k (differentiable in logits);
      counts [E] how many tokens chose each expert.
  local idx, w, counts = dm.moe_route(logits, bias, k, "softmax")
      the softmax form: the k largest logits + bias chosen (the bias in logit
      units), their gates a softmax over the k chosen logits.
  local perm, offsets, inv = dm.moe_sort(idx, E)
      the N*k assignments sorted by expert (stable): perm [N*k], offsets [E+1]
      (expert e owns sorted rows offsets[e] .. offsets[e+1]-1), inv [N*k].
  local y_rows = dm.moe_experts(u, perm, offsets, Ug, Uu, cg, cu, D, k)
      u [N, d] through each assignment's expert, rows in sorted order [N*k, F]:
      (silu((u Ug[e]) * cg[e]) * ((u Uu[e]) * cu[e])) D[e], with Ug, Uu
      [E, d, r], cg, cu [E, r], D [E, r, F].
  local y_rows = dm.moe_experts(u, perm, offsets, Ug, Uu, cg, cu, D, k, fp8)
      the same products from fp8 banks: fp8 = {Ug = {codes, scales}, Uu = ..., D = ...},
      each factor's dm.bank_fp8; Ug, Uu and D then give the shapes and the gradients'
      place only (dm.stand_in: their values are not read).
  local codes, scales = dm.bank_fp8(W, dtype)
      W [E, m, n] as E4M3 codes u8 [E, m, nq] under f32 scales [E, m, nq / 32] (blocks
      of 32 along the rows, nq = n rounded up to 32), W's values rounded to dtype first
      (the compute dtype: the kernels' weights are then quantize's of the compute copy)
  local y = dm.moe_combine(y_rows, inv, w)          [N, F], each token's k rows weighted by w
  local w2, drops = dm.moe_capacity(w, idx, inv, offsets, factor)
      capacity = ceil(factor * N * k / E) rows per expert; later tokens past it
      get gate 0 (they pass through the residual); drops [E] counts them.
  dm.moe_counters(counts)     {busiest_share =, entropy = (nats), entropy_max = log E, dead =}
  dm.moe_balance_(bias, counts, gamma)
      loss-free balancing, in place: bias += gamma * sign(mean(counts) - counts)

Expert ids and the sort's perm, offsets and inv are i64 values counting from
0 (ids, like byte values, not Lua positions); the ops make and read them and
nothing needs converting. Every shape is fixed by N, k and E, so nothing
waits for the device.
]]
return function(dm, T, core)

local function count(v, where, what, lo)
  if math.type(v) ~= "integer" and not (type(v) == "number" and v == math.floor(v)) then
    error(string.format("%s: %s must be a whole number, got %s", where, what, tostring(v)), 3)
  end
  if v < lo then
    error(string.format("%s: %s must be at least %d, got %s", where, what, lo, tostring(v)), 3)
  end
  return v
end

function dm.moe_experts(u, perm, offsets, ug, uu, cg, cu, d, k, fp8)
  local attrs = {count(k, "moe_experts", "k", 1)}
  if fp8 == nil then
    return core.call("moe_experts", u, perm, offsets, ug, uu, cg, cu, d, nil, nil, nil, nil, nil, nil, attrs)
  end
  local q = {}
  for i, name in ipairs {"Ug", "Uu", "D"} do
    local pair = type(fp8) == "table" and fp8[name]
    if type(pair) ~= "table" or not dm.is_tensor(pair[1]) or not dm.is_tensor(pair[2]) then
      error(string.format("moe_experts: fp8 must be {Ug = {codes, scales}, Uu = ..., D = ...} (dm.bank_fp8's); " ..
                          "%s's pair is missing", name), 2)
    end
    q[2 * i - 1], q[2 * i] = pair[1], pair[2]
  end
  return core.call("moe_experts", u, perm, offsets, ug, uu, cg, cu, d, q[1], q[2], q[3], q[4], q[5], q[6], attrs)
end

-- (dm.bank_fp8 comes from its descriptor: ops/generated.lua)

function dm.moe_capacity(w, idx, inv, offsets, factor)
  if type(factor) ~= "number" or factor < 0 then
    error(string.format("moe_capacity: the capacity factor must be a number >= 0, got %s", tostring(factor)), 2)
  end
  local experts = offsets:numel() - 1
  local capacity = math.ceil(factor * w:numel() / math.max(experts, 1))
  return core.call("moe_capacity", w, idx, inv, offsets, {capacity})
end

function dm.moe_counters(counts)
  local s = core.call("moe_counters", counts):totable()
  return {busiest_share = s[1], entropy = s[2], entropy_max = math.log(counts:numel()),
          dead = math.tointeger(s[3])}
end

end
