-- b1: the 1B preset of docs/model.md — about 1.07 billion parameters
-- (403M of them in the Engram tables), about 39M active per token and
-- iteration. 8 x 1024 = 8,192 bytes a step: about 16 assignments per expert.
-- On a card under ~24 GB: --set model.engram.ram=true puts the tables in host memory.
return {
  name = "b1",
  steps = 50000,
  batch = 8,
  seq = 1024,
  dtype = "bf16",

  model = {
    d = 2048,
    heads = 32, head_dim = 64,
    max_iter = 4,                   -- train deeper than you infer (the fin depth verdict)
    experts = 1024, top_k = 2,
    expert_rank = 64, shared_rank = 192,
    ffn = 5461,
    engram = {orders = {3, 4, 5}, rows = 4194304, width = 32, ram = false},
    -- dropless: a capacity of 2.0 dropped most assignments; the balancing step in proportion to
    -- the load error keeps the 1,024 experts in use (docs/training.md, "Balance at b1")
    moe = {capacity_factor = nil, balance = "proportional"},
  },

  data = {eval_bytes = 81920},
  optim = {muon_lr = 5e-4, adamw_lr = 5e-4},
  schedule = {kind = "wsd", warmup = 2000, decay = 0.2},
  eval = {every = 1000, depths = {1, 2, 3}},
  checkpoint = {every = 5000, keep = 3},
  log = {every = 10},
}
