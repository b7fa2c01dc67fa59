--[[
Kimi Delta Attention and its gate.

  o    = dm.kda(q, k, v, g, beta)
  o, S = dm.kda(q, k, v, g, beta, {initial_state = S0, output_final_state = true})
  g    = dm.kda_gate(f, A_log, dt_bias, {kind = "bounded", lb = -5})

q, k and g are [B, T, H, dk], v is [B, T, H, dv], beta [B, T, H]; S0 and the
final state S are [B, H, dk, dv]. Per batch row and head, step by step:

  S' = Diag(exp(g_t)) S      then      S = S' + beta_t k_t (v_t - S'^T k_t)^T,   o_t = S^T q_t

q is not scaled inside: scale it by dk^-1/2 first. The state and the gates
are float32 (float64 when q is f64); o has q's dtype; q, k and v share one
dtype. Passing a call's final state as the next call's initial state runs a
long sequence in segments, gradients flowing through the carried state.
Option algo picks the algorithm: "recurrent" (step by step), "chunked" (the
WY/UT form over chunks of 64 tokens, docs/kda.md §2) or "auto" (the
default: chunked on CUDA from T = 32 up in f32/bf16/f16 with dk, dv <= 64,
recurrent otherwise, e.g. on the CPU and for decoding). They agree up to
rounding. Option chunk (default 64) is the recurrent backward's checkpoint
interval: it trades that backward's memory against its time and never
changes a result.

The gate makes the log-decay g <= 0 from f ([..., H*dk] or [..., H, dk]),
A_log (one value per head, [H], as in FLA; nil for none) and dt_bias (H*dk
values), per channel with z = f + dt_bias:

  kind = "bounded"  (default)  g = lb * sigmoid(exp(A_log) * z),  in (lb, 0); lb < 0, default -5
  kind = "softplus"            g = -exp(A_log) * softplus(z)

g has f's shape, in float32 (float64 when f is f64), and is differentiable
in f, A_log and dt_bias.
]]
return function(dm, T, core)

-- opts checked against the keys a function takes; always reached from a
-- public function, so error level 3 is the user's code
local function options(opts, known, where)
  if opts == nil then return {} end
  if type(opts) ~= "table" then
    error(string.format("%s: options must be a table, got a %s", where, type(opts)), 3)
  end
  for key in pairs(opts) do
    if not known[key] then
      local names = {}
      for name in pairs(known) do names[#names + 1] = name end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (it takes %s)", where, tostring(key),
                          table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local KDA_OPTIONS = {initial_state = true, output_final_state = true, chunk = true, algo = true}
function dm.kda(q, k, v, g, beta, opts)
  opts = options(opts, KDA_OPTIONS, "kda")
  local chunk = opts.chunk
  if chunk ~= nil and (math.type(chunk) ~= "integer" or chunk < 1) then
    error(string.format("kda: chunk must be an integer >= 1, got %s", tostring(chunk)), 2)
  end
  local algo = opts.algo or "auto"                 -- the op's descriptor knows its names (vm/ops/kda.h)
  if type(algo) ~= "string" then
    error(string.format("kda: algo must be a name (\"auto\", ...), got %s", type(algo)), 2)
  end
  local o, s = core.call("kda", q, k, v, g, beta, opts.initial_state, {chunk or 0, algo})
  if opts.output_final_state then return o, s end
  return o
end

-- (dm.kda_gate comes from its descriptor: lua/dormouse/ops/generated.lua)

end
