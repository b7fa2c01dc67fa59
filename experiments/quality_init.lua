-- Learning quality, the initialisation choices (docs/training.md, "Learning quality"):
-- small over its 2,000 steps, three seeds an arm, each choice alone and then all
-- together, judged on the held-out bpb_fin against the control.
--   dormouse sweep experiments/quality_init.lua            (on the GPU: about an hour)
--   dormouse sweep experiments/quality_init.lua --set steps=300    (a short look)
return {
  base = "experiments/small.lua",
  arms = {
    control = {},
    branch_out = {["model.init.branch_out"] = "depth"},
    engram_std = {["model.init.engram_std"] = 1},
    dt_bias = {["model.init.dt_bias"] = "log_uniform"},
    conv = {["model.init.conv"] = "uniform"},
    all = {["model.init.branch_out"] = "depth", ["model.init.engram_std"] = 1,
           ["model.init.dt_bias"] = "log_uniform", ["model.init.conv"] = "uniform"},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
