-- The record's remaining questions on small (docs/arms.md): the JEPA arm at two weights, Muon's
-- Newton-Schulz at 3 and 4 steps against 5, Muon's momentum in bf16 (rounded to nearest or
-- stochastically), AdamW's and the Engram tables' moments in 8 bits; small over its 2,000 steps
-- on the embedded corpus, three seeds an arm, judged on held-out bpb_fin.
--   dormouse sweep experiments/instruments_small.lua --jobs 14
return {
  name = "instruments_small",
  base = "experiments/small.lua",
  arms = {
    control = {},
    jepa_01 = {["model.aux.jepa"] = 0.1},
    jepa_03 = {["model.aux.jepa"] = 0.3},
    ns_3 = {["optim.ns_steps"] = 3},
    ns_4 = {["optim.ns_steps"] = 4},
    momentum_bf16 = {["optim.momentum_dtype"] = "bf16"},
    momentum_bf16_stochastic = {["optim.momentum_dtype"] = "bf16_stochastic"},
    adamw_8bit = {["optim.adamw_moments"] = "8bit"},
    engram_8bit = {["optim.engram_moments"] = "8bit"},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
