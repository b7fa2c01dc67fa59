-- Balance at b1 over 10,000 steps (docs/training.md, "Balance at b1"): whether experts kept in use pay
-- once the run is long enough for capacity to matter. The collapsed router (loss-free balancing by
-- sign, f32 router) against the auxiliary loss at 3e-3 under the proportional step, on the corpus of
-- tools/english-corpus.sh (a run of 10,000 steps reads 82 MB of its 68 MB: a little past once).
-- About 15 minutes a run alone on one H100, so a run spans calls: checkpoints every 1,000 steps,
-- and the sweep resumes each run from its newest one.
--   tools/english-corpus.sh && dormouse sweep experiments/balance_b1_long.lua --jobs 2
return {
  name = "balance_b1_long",
  base = "experiments/b1.lua",
  arms = {
    collapsed = {["model.moe.balance"] = "sign", ["model.moe.router_dtype"] = "f32"},
    aux_3e3_proportional = {["model.moe.router_dtype"] = "f32", ["model.moe.aux_balance"] = 3e-3},
  },
  seeds = {1},
  set = {steps = 10000, ["schedule.warmup"] = 200, ["data.path"] = "corpora/english.txt.zst",
         ["eval.every"] = 1000, ["eval.depths"] = {}, ["checkpoint.every"] = 1000},
}
