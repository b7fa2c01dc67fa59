-- small: the demo-sized model of docs/model.md (d 768, 64 experts of rank 16).
-- Its shape is also the schema's default shape.
return {
  name = "small",
  steps = 2000,
  batch = 8,
  seq = 512,

  model = {
    d = 768,
    heads = 12, head_dim = 64,
    max_iter = 2,
    experts = 64, top_k = 2,
    expert_rank = 16, shared_rank = 64,
    ffn = 2048,
    engram = {orders = {2, 3, 4}, rows = 65536, width = 32},
  },

  data = {eval_bytes = 81920},
  optim = {muon_lr = 1e-3, adamw_lr = 1e-3},
  schedule = {kind = "wsd", warmup = 100, decay = 0.2},
  eval = {every = 250, depths = {1}},
  checkpoint = {every = 500, keep = 3},
  log = {every = 10},
}
