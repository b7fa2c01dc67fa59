-- tiny: the test model of docs/model.md (seconds on a CPU). The runtime's
-- own tests train it; `dormouse config experiments/tiny.lua` shows the rest.
return {
  name = "tiny",
  steps = 40,
  batch = 4,
  seq = 64,
  dtype = "f32",                    -- exact enough to compare against float64 oracles

  model = {
    d = 64,
    heads = 2, head_dim = 32,
    max_iter = 2,
    experts = 8, top_k = 2,
    expert_rank = 8, shared_rank = 16,
    ffn = 128,
    engram = {orders = {2, 3}, rows = 1024, width = 8},
  },

  data = {eval_bytes = 4096},
  optim = {muon_lr = 3e-3, adamw_lr = 3e-3},
  schedule = {kind = "wsd", warmup = 4, decay = 0.2},
  eval = {every = 20, depths = {1}},
  checkpoint = {every = 20, keep = 2},
  log = {every = 5},
}
