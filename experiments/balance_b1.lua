-- Balance at b1 (docs/training.md, "Learning quality"): what keeps b1's 1,024 experts in use.
-- 400 steps of b1 on the embedded corpus an arm (warm-up 40), one seed: the table gives each
-- arm's held-out bpb_fin and its last log window's busiest share and dead experts; each run's
-- log has them over time. Then the arms that hold the balance earn their three seeds.
--   dormouse sweep experiments/balance_b1.lua           (on the H200: a few minutes an arm)
return {
  base = "experiments/b1.lua",
  arms = {
    control = {},
    gamma_1e2 = {["model.moe.lfb_gamma"] = 1e-2},
    gamma_1e4 = {["model.moe.lfb_gamma"] = 1e-4},
    proportional = {["model.moe.balance"] = "proportional"},
    proportional_1e2 = {["model.moe.balance"] = "proportional", ["model.moe.lfb_gamma"] = 1e-2},
    router_f32 = {["model.moe.router_dtype"] = "f32"},
    router_small = {["model.moe.router_std"] = 1e-3},
  },
  seeds = {1},
  set = {steps = 400, ["schedule.warmup"] = 40, ["checkpoint.every"] = 0},
}
