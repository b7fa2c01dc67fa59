-- Learning quality (docs/training.md, "Learning quality"): each form where a reference implementation
-- of the same model differed from this one's earlier defaults, alone against them, all together, and
-- the winners together (which became the defaults). small over its 2,000 steps on the embedded corpus,
-- three seeds an arm, judged on held-out bpb_fin; the table's train column is the last log window's
-- training loss (a held-out figure far above it is memorising).
--   dormouse sweep experiments/quality.lua --arms gate_softplus,gate_bounded,router_softmax,gates_muon,engram_out,engram_tables,small_inits,all --jobs 14
--   dormouse sweep experiments/quality.lua --arms winners,winners_router,winners_inits --jobs 12
local before = {                       -- the control: the forms before the A/B (set for every arm)
  ["model.kda.gate"] = "bounded", ["model.init.dt_bias"] = "zeros", ["model.init.a_log"] = "log_uniform",
  ["model.engram.output"] = "spec", ["model.engram.alpha_gain"] = false, ["model.init.engram_conv"] = "zeros",
  ["model.moe.router"] = "sigmoid", ["checkpoint.every"] = 0,
}
local gate_softplus = {["model.kda.gate"] = "softplus", ["model.init.dt_bias"] = "log_uniform",
                       ["model.init.a_log"] = "uniform"}
local router_softmax = {["model.moe.router"] = "softmax", ["model.moe.router_dtype"] = "f32"}
local gates_muon = {["optim.gates"] = "muon"}
local engram_out = {["model.engram.output"] = "projection", ["model.engram.dilation"] = 1,
                    ["model.engram.alpha_gain"] = true, ["model.init.engram_conv"] = "uniform"}
local engram_tables = {["model.init.engram_std"] = 1, ["optim.engram_adam"] = "dense"}
local small_inits = {["model.init.branch_out"] = "depth", ["model.init.conv"] = "uniform",
                     ["model.kda.output_bias"] = false}

local function merged(...)
  local out = {}
  for _, arm in ipairs {...} do for k, v in pairs(arm) do out[k] = v end end
  return out
end

return {
  name = "quality",
  base = "experiments/small.lua",
  arms = {
    control = {},
    gate_softplus = gate_softplus,              -- -exp(A_log) softplus(f + dt_bias), dt log-uniform, A uniform [1, 16]
    gate_bounded = {["model.init.dt_bias"] = "decay", ["model.init.a_log"] = "uniform"},   -- the same start, bounded
    router_softmax = router_softmax,
    gates_muon = gates_muon,
    engram_out = engram_out,
    engram_tables = engram_tables,
    small_inits = small_inits,
    all = merged(gate_softplus, router_softmax, gates_muon, engram_out, engram_tables, small_inits),
    winners = merged(gate_softplus, engram_out),                       -- the defaults that followed
    winners_router = merged(gate_softplus, engram_out, router_softmax),   -- and with the router chosen at b1
    winners_inits = merged(gate_softplus, engram_out, small_inits),
  },
  seeds = {1, 2, 3},
  set = before,
}
