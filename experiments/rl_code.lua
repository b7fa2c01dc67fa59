-- Reinforcement learning on tasks/code.lua (small Lua functions, each judged by four assertions run
-- in the sandbox) from a supervised model: the hard reward (a sample's pass, 1 or 0) against the soft
-- one (the share of its assertions that pass), three seeds each, the group baseline. pass@24 on the
-- eval line is the share of 128 held-out tasks whose greedy body passes its tests; exact@24 the share
-- that writes the reference body (docs/post-training.md, "Task sets").
--   dormouse run experiments/sft_addition.lua --set data.records=nil --set steps=300 --set name=base
--   dormouse post-train --base runs/base --env code --name code --sft-steps 1000 --rl-steps 0 \
--     --set 'eval.budgets={24}' --set eval.exact=128
--   dormouse sweep experiments/rl_code.lua --jobs 2
return {
  name = "rl_code",
  base = "experiments/sft_addition.lua",
  arms = {
    hard = {["rl.reward"] = "pass"},
    soft = {["rl.reward"] = "score"},
  },
  control = "hard",
  seeds = {1, 2, 3},
  set = {init = "runs/code-sft", ["data.records"] = "tasks/code.lua", steps = 100,
         ["rl.k"] = 8, ["rl.tasks"] = 8, ["rl.budget"] = 24, ["rl.stop"] = "\n",
         ["optim.muon_lr"] = 3e-4, ["optim.adamw_lr"] = 3e-4, ["schedule.warmup"] = 2,
         ["eval.every"] = 0, ["eval.exact"] = 128, ["eval.budgets"] = {24}, ["eval.sample"] = 0,
         ["checkpoint.every"] = 0, ["log.every"] = 10},
}
