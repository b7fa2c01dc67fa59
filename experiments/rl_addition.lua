-- Reinforcement learning from the supervised model of experiments/sft_addition.lua: the two
-- advantage estimates at the same wall-clock (about 140 s a run on one CPU core: the group baseline
-- takes 300 steps, fork-replay, 16x the sampling a step, 20), three seeds each. exact@8 on the eval
-- line is the greedy pass rate on the 256 held-out sums (docs/post-training.md, "Reinforcement
-- learning"); the eval at step 0 is the supervised model's.
--   dormouse run experiments/sft_addition.lua && dormouse sweep experiments/rl_addition.lua
return {
  name = "rl_addition",
  base = "experiments/sft_addition.lua",
  arms = {
    group = {["rl.advantage"] = "group", steps = 300},
    fork = {["rl.advantage"] = "fork", steps = 20},
  },
  control = "group",
  seeds = {1, 2, 3},
  set = {init = "runs/sft_addition", ["rl.k"] = 8, ["rl.tasks"] = 16, ["rl.budget"] = 8, ["rl.stop"] = "\n",
         ["optim.muon_lr"] = 3e-4, ["optim.adamw_lr"] = 3e-4, ["schedule.warmup"] = 2,
         ["eval.every"] = 0, ["eval.exact"] = 256, ["eval.sample"] = 0, ["checkpoint.every"] = 0,
         ["log.every"] = 10},
}
