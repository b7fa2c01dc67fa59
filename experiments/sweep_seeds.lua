-- Does loss-free balancing help? The small preset with and without it,
-- three seeds each, judged on the held-out bpb_fin:
--   dormouse sweep experiments/sweep_seeds.lua [--set steps=300 ...]
return {
  base = "experiments/small.lua",
  arms = {
    control = {},
    no_lfb = {["model.moe.lfb_gamma"] = 0},
  },
  seeds = {1, 2, 3},
  set = {steps = 300},
}
