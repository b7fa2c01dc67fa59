-- demo: the model family at a size that trains on two CPU cores in a few
-- minutes (`make demo`) and beats the order-3 byte n-gram model on the
-- held-out split of the embedded corpus (the King James Bible).
return {
  name = "demo",
  steps = 400,
  batch = 8,
  seq = 128,
  dtype = "f32",

  model = {
    d = 128,
    heads = 4, head_dim = 32,
    max_iter = 2,
    experts = 8, top_k = 2,
    expert_rank = 16, shared_rank = 32,
    ffn = 256,
    engram = {orders = {2, 3}, rows = 65536, width = 16},   -- order 2 indexed directly
  },

  data = {eval_bytes = 65536},
  optim = {muon_lr = 3e-3, adamw_lr = 3e-3},
  schedule = {kind = "wsd", warmup = 20, decay = 0.25},
  eval = {every = 100, windows = 64, baseline = {3, 5},
          tasks = "tasks/kjv.lua"},  -- correct@64/256/1024: verses completed from their opening words
  checkpoint = {every = 200, keep = 1},
  log = {every = 20},
}
