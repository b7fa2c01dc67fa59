-- The expert arms against the control at b1 (docs/arms.md): LittleBit's one-bit experts and the
-- fp8 banks, 500 steps of b1 on the default corpus (about one pass over it), three seeds an arm,
-- judged on the held-out bpb_fin. A short run: it says whether an arm costs at b1's width early
-- in training, not at the end.
--   dormouse sweep experiments/arms_b1.lua --arms fp8 --jobs 3   (three b1 runs share one H200: ~15-21 GiB each)
return {
  base = "experiments/b1.lua",
  arms = {
    control = {},
    littlebit = {["model.moe.littlebit"] = "sign"},
    fp8 = {["model.moe.fp8"] = true},
  },
  seeds = {1, 2, 3},
  set = {steps = 500, ["schedule.warmup"] = 100, ["eval.every"] = 250, ["eval.windows"] = 8,
         ["log.every"] = 50, ["checkpoint.every"] = 0},
}
