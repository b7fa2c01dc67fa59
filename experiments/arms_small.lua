-- The model's optional arms against the control (docs/arms.md): small over its 2,000 steps,
-- three seeds an arm, judged on the held-out bpb_fin (the evals are the pure CE).
--   dormouse sweep experiments/arms_small.lua [--jobs 6]   (six runs at once share one GPU)
return {
  base = "experiments/small.lua",
  arms = {
    control = {},
    future_byte = {["model.aux.future"] = 0.1},
    retract_100 = {["model.moe.retract_every"] = 100},
    loom = {["model.loom"] = true},
    dspark = {["model.aux.draft"] = 0.1},
    qat_ladder = {["model.moe.qat"] = "ladder"},
    msa = {["model.msa.top_k"] = 2, ["model.msa.block"] = 64},
    msa_qknorm = {["model.msa.top_k"] = 2, ["model.msa.block"] = 64, ["model.msa.qk_norm"] = true},
    littlebit = {["model.moe.littlebit"] = "sign"},
    littlebit_res = {["model.moe.littlebit"] = "residual"},
    fp8 = {["model.moe.fp8"] = true},
  },
  seeds = {1, 2, 3},
  set = {["checkpoint.every"] = 0},
}
