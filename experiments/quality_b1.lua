-- Learning quality at b1: 400 steps (B 8, T 1024, lr 5e-4, warm-up 40) on the embedded corpus, the
-- defaults against the forms before small's A/B (docs/training.md, "Learning quality"); held-out
-- bpb_fin on the whole held-out split. A change to the model or its optimiser is checked here too.
--   dormouse sweep experiments/quality_b1.lua --jobs 2           (~14-21 GiB a run)
--   dormouse sweep experiments/quality_b1.lua --arms router_softmax --jobs 2
return {
  name = "quality_b1",
  base = "experiments/b1.lua",
  arms = {
    control = {},
    before = {["model.kda.gate"] = "bounded", ["model.init.dt_bias"] = "zeros", ["model.init.a_log"] = "log_uniform",
              ["model.engram.output"] = "spec", ["model.engram.alpha_gain"] = false,
              ["model.init.engram_conv"] = "zeros"},
    router_softmax = {["model.moe.router"] = "softmax", ["model.moe.router_dtype"] = "f32"},   -- small: -0.012
  },
  seeds = {1, 2},
  set = {steps = 400, ["schedule.warmup"] = 40, ["eval.every"] = 0, ["eval.depths"] = {}, ["checkpoint.every"] = 0},
}
