-- Does loss-free balancing help the demo model? With and without it, two seeds each, judged on
-- the held-out bpb_fin: a sweep that runs on a CPU in a few minutes (docs/first-hour.md).
--   dormouse sweep experiments/sweep_demo.lua --steps 100
return {
  base = "experiments/demo.lua",
  arms = {
    control = {},
    no_lfb = {["model.moe.lfb_gamma"] = 0},
  },
  seeds = {1, 2},
  set = {},
}
