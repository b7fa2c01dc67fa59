-- Supervised fine-tuning on spans: a model learns tasks/addition.lua's sums ("a+b=" answered by
-- a+b and a newline), the loss on the answers' bytes only (docs/post-training.md, "Supervised
-- fine-tuning on spans"). From scratch on a CPU in about 6 minutes; from a base with --init:
--   dormouse run experiments/sft_addition.lua
--   dormouse run experiments/sft_addition.lua --init runs/BASE   (a base of this model's keys)
-- The eval line gives bpb_fin over the held-out answers and exact@8, the share of 128 held-out
-- sums the model writes out greedily within 8 bytes.
return {
  name = "sft_addition",
  steps = 1500,
  batch = 16,
  seq = 128,
  dtype = "f32",

  model = {
    d = 128,
    heads = 4, head_dim = 32,
    max_iter = 2,
    experts = 8, top_k = 2,
    expert_rank = 16, shared_rank = 32,
    ffn = 256,
    engram = {orders = {2, 3}, rows = 4096, width = 16},
  },

  data = {records = "tasks/addition.lua", eval_records = 256},
  optim = {muon_lr = 3e-3, adamw_lr = 3e-3},
  schedule = {kind = "wsd", warmup = 50, decay = 0.2},
  eval = {every = 250, depths = {}, exact = 128, budgets = {8}, sample = 40},
  checkpoint = {every = 500, keep = 2},
  log = {every = 50},
}
