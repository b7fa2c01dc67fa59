-- Learning quality, the structural differences from a reference implementation of the
-- same spec (docs/training.md, "Learning quality"): small over its 2,000 steps, three
-- seeds an arm, against the control (the spec's forms).
--   dormouse sweep experiments/quality_structure.lua
return {
  base = "experiments/small.lua",
  arms = {
    control = {},
    engram_projection = {["model.engram.output"] = "projection"},
    no_output_bias = {["model.kda.output_bias"] = false},
    softplus_gate = {["model.kda.gate"] = "softplus"},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
