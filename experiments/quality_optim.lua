-- Learning quality, the optimiser (docs/training.md, "Learning quality"): Muon+ (each
-- orthogonalised update l2-normalised by column, row or both before its scale) against plain
-- Muon, the Engram tables by a dense Adam, and Muon's momentum in bf16; small over its 2,000 steps,
-- three seeds an arm.
--   dormouse sweep experiments/quality_optim.lua
return {
  base = "experiments/small.lua",
  arms = {
    control = {},
    colrow = {["optim.muon_plus"] = "colrow"},
    col = {["optim.muon_plus"] = "col"},
    row = {["optim.muon_plus"] = "row"},
    engram_dense = {["optim.engram_adam"] = "dense"},
    -- Muon's momentum in bf16, rounded to nearest or stochastically: half its memory and its passes'
    -- traffic (docs/performance.md, "The optimiser, part by part")
    momentum_bf16 = {["optim.momentum_dtype"] = "bf16"},
    momentum_bf16_stochastic = {["optim.momentum_dtype"] = "bf16_stochastic"},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
