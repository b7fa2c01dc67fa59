--[[
bench_decode_parts.lua — where b1's one-byte step spends its time, part by part, the way the decoder
runs it: each part at one row (B 1, T 1), bf16, its weights cast once, captured as a CUDA graph and
replayed; µs a replay (the median of seven timings of 100 replays), and the graph's nodes.

  dormouse run tests/gpu/bench_decode_parts.lua [ROWS]

ROWS (default 1) is the streams a pass: the MoE's assignments are ROWS x top_k. The parts: the
routed experts' four ops (moe_route, moe_sort, moe_experts, moe_combine) alone and together, the
whole MoE branch; KDA's ops at one position (its short convolution with a cache, q's l2norm, the
gate, the recurrence) and the whole KDA branch with a state; Engram's alpha; the row norms
(add_rmsnorm, rmsnorm); a d x d product and KDA's stacked one (d x 6,304); a cast and a copy of a
row (the floor of a node); last, the model's one-byte step in eval mode from a prompt's state.
DRY=1: the CPU, tiny, timed by the wall clock without graphs (the script itself).
]]
local dm = require "dormouse"
local nn = require "dormouse.nn"
local core = require "dormouse.core"
local common = require "tests.gpu.common"

local DRY = os.getenv("DRY") ~= nil
if not DRY and not common.gpu_or_skip(dm.cuda, "bench_decode_parts") then return end
local device = DRY and "cpu" or "cuda"
local rows = tonumber(arg and arg[1]) or 1
local REPLAYS, REPS = DRY and 5 or 100, DRY and 3 or 7

local cfg = require("dormouse.config").load(DRY and "experiments/tiny.lua" or "experiments/b1.lua",
                                              {"device=" .. device})
dm.manual_seed(1)
local model = nn.build({device = device, compute_dtype = DRY and "f32" or "bf16"},
                       require("dormouse.train").build_model, cfg, ".")
local moe = model.block.moe
local d, dt = cfg.model.d, DRY and "f32" or "bf16"
local copies = {}

-- fn's work a replay, in µs (dm.cuda.time: the median of REPS timings of REPLAYS replays, on the
-- device's clock; the CPU's wall clock under DRY), and the graph's nodes (0 on the CPU)
local function time(fn)
  return nn.holding(copies, function()
    return dm.no_grad(function()
      fn()                                   -- the casts once, the allocations settled
      if DRY then
        local t0 = core.now()
        for _ = 1, REPLAYS do fn() end
        return (core.now() - t0) / REPLAYS * 1e6, 0
      end
      local g = dm.cuda.graph(fn)
      local ms = dm.cuda.time(function() for _ = 1, REPLAYS do g:replay() end end, {reps = REPS, warmup = 1})
      local nodes = g:nodes()
      g:free()
      return ms / REPLAYS * 1e3, nodes
    end)
  end)
end

local x = dm.keep(dm.randn({1, rows, d}, {device = device, dtype = dt}))
local flat = dm.keep(x:reshape({rows, d}))
local logits = dm.keep(dm.randn({rows, moe.experts}, {device = device, dtype = "f32"}))
local idx, w, _ = dm.moe_route(logits, moe.lfb_bias, moe.top_k, moe.router_form)
local perm, offsets, inv = dm.moe_sort(idx, moe.experts)
dm.keep(idx); dm.keep(w); dm.keep(perm); dm.keep(offsets); dm.keep(inv)
local W = nn.holding(copies, function() return moe:compute_weights() end)
local y_rows = dm.keep(dm.moe_experts(flat, perm, offsets, W.Ug, W.Uu, W.cg, W.cu, W.D, moe.top_k, W.fp8))
local wc = dm.keep(w:to(W.D.dtype))
local lin = dm.keep(dm.randn({d, d}, {device = device, dtype = dt}))
-- KDA's six products of u stacked (nn.products: q, k, v, beta, the gate's and output gate's first factors)
local kda_stack = dm.keep(dm.randn({3 * cfg.model.heads * cfg.model.head_dim + cfg.model.heads +
                                    2 * cfg.model.head_dim, d}, {device = device, dtype = dt}))

-- KDA's and Engram's inputs at one position a stream, as the decoder's step has them
local kda, H, dk = model.block.kda, cfg.model.heads, cfg.model.head_dim
local hd = H * dk
local xs = dm.keep(x:reshape({rows, 1, d}))                  -- the streams as KDA's state has them: B rows, T 1
local function rnd(shape, dtype) return dm.keep(dm.randn(shape, {device = device, dtype = dtype or dt})) end
local conv_w = dm.keep(kda.conv_q:detach():to(dt))
local conv_x, conv_cache = rnd({rows, 1, hd}), rnd({rows, conv_w:size(2) - 1, hd})
local q_in = rnd({rows, 1, H, dk})
local f_in = rnd({rows, 1, H, dk})
local g_in = dm.keep(dm.kda_gate(f_in, kda.A_log, kda.dt_bias, {kind = kda.gate, lb = kda.gate_lb}))
local beta = dm.keep(rnd({rows, 1, H}, "f32"):sigmoid())
local S = rnd({rows, H, dk, dk}, "f32")
local kda_state = {S = S, q = conv_cache, k = conv_cache, v = conv_cache}
local h32 = rnd({1, rows, d}, "f32")
local norm = model.block.rms1
local engram = model.block.engram
local alpha_gain = engram and engram.alpha_gain and dm.keep(engram.alpha_gain:detach():to(dt))

local parts = {
  {"moe_route", function() dm.moe_route(logits, moe.lfb_bias, moe.top_k, moe.router_form) end},
  {"moe_sort", function() dm.moe_sort(idx, moe.experts) end},
  {"moe_experts", function() dm.moe_experts(flat, perm, offsets, W.Ug, W.Uu, W.cg, W.cu, W.D, moe.top_k, W.fp8) end},
  {"moe_combine", function() dm.moe_combine(y_rows, inv, wc) end},
  {"the four together", function()
    local i, ww = dm.moe_route(logits, moe.lfb_bias, moe.top_k, moe.router_form)
    local p, o, v = dm.moe_sort(i, moe.experts)
    dm.moe_combine(dm.moe_experts(flat, p, o, W.Ug, W.Uu, W.cg, W.cu, W.D, moe.top_k, W.fp8), v, ww:to(W.D.dtype))
  end},
  {"the MoE branch (router to write)", function() moe:forward(x) end},
  {"KDA: a short convolution with its cache", function()
    dm.causal_conv1d(conv_x, conv_w, {silu = true, cache = conv_cache, return_cache = true})
  end},
  {"KDA: q's l2norm", function() q_in:l2norm(1e-6, kda.q_scale) end},
  {"KDA: kda_gate", function() dm.kda_gate(f_in, kda.A_log, kda.dt_bias, {kind = kda.gate, lb = kda.gate_lb}) end},
  {"KDA: kda, one position with a state", function()
    dm.kda(q_in, q_in, q_in, g_in, beta, {initial_state = S, output_final_state = true})
  end},
  {"the KDA branch (products to W_o)", function() kda:forward(xs, kda_state) end},
  {"Engram: engram_alpha", engram and function() dm.engram_alpha(x, x, {gain = alpha_gain}) end},
  {"add_rmsnorm (f32 stream, bf16 branch)", function() norm:add_forward(h32, x) end},
  {"rmsnorm", function() norm:forward(x) end},
  {"a d x d product", function() dm.linear(flat, lin) end},
  {"KDA's stacked product (d x 6,304 at b1)", function() dm.linear(flat, kda_stack) end},
  {"a cast to f32", function() flat:to("f32") end},
  {"a copy of the rows", function() flat:clone() end},
}
print(string.format("b1's decode parts at %d row%s (%s, %s), µs a replay of a captured graph", rows,
                    rows == 1 and "" or "s", DRY and "tiny, the CPU's wall clock" or "bf16", device))
print(string.format("| %-40s | %9s | %5s |", "part", "µs", "nodes"))
print("|---|---|---|")
for _, p in ipairs(parts) do
  if not p[2] then goto skip end                  -- a part the model lacks
  local us, nodes = time(p[2])
  print(string.format("| %-40s | %9.1f | %5d |", p[1], us, nodes))
  ::skip::
end

-- last, the model in eval mode from here: its one-byte step as the decoder runs it (ROWS streams, one
-- byte each, from the state a prompt left, the fin readout), without the draw and the prefix's move
model:eval()
local ctx = model:context()
local function stream_bytes(n) return dm.keep(dm.zeros({rows, n}, {dtype = "u8", device = device})) end
local state = dm.no_grad(function() return model:forward(stream_bytes(9), stream_bytes(ctx), {state = {}}).state end)
local x1, prefix = stream_bytes(2), stream_bytes(ctx)
local us, nodes = time(function() model:forward(x1, prefix, {state = state, readout = "fin"}) end)
print(string.format("| %-40s | %9.1f | %5d |", "the model's one-byte step (no draw)", us, nodes))
