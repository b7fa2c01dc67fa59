--[[
The schema of an experiment: every key a config may hold, its type, its
default and one line of documentation. dormouse.config checks experiment
files against it; `dormouse config` prints it.

A row is {name, type, default, doc} or, for a nested section,
{name, doc, {rows...}}. A row marked `progress = true` says how far a run
goes or how it is observed, not what it computes: a resume may change it.
A row marked `form = true` says how the optimiser's state is stored (its
dtype or its 8-bit code): a resume may change it, the state converted on load.
A model row marked `tune = true` leaves the model's weights meaning what they
meant (how a pass is run, balanced or initialised): a run started from a
checkpoint's weights (`init`) may change it, and no other model key.

Types: integer, number, boolean, string, enum{...}, list(elem [, length]),
optional(t). Numeric types take bounds: integer{min = 1}, number{below = 1}
(min/max inclusive, above/below exclusive).
]]
local schema = {}

---------------------------------------------------------------- types

local Type = {}
Type.__index = Type

-- How a value shows in messages and listings: strings quoted, lists in braces.
local function show(v)
  if type(v) == "string" then return (string.format("%q", v):gsub("\\\n", "\\n")) end
  if math.type(v) == "float" then
    if v ~= v or v == math.huge or v == -math.huge then return tostring(v) end
    for digits = 15, 17 do                       -- the shortest form that reads back exactly
      local s = string.format("%." .. digits .. "g", v)
      if tonumber(s) == v then
        s = s:gsub("e([+-])0*(%d)", "e%1%2")           -- 1e-08 -> 1e-8
        return (s:find("[%.eEn]") and s) or s .. ".0"
      end
    end
  end
  if type(v) == "table" then
    local parts = {}
    for i = 1, #v do parts[i] = show(v[i]) end
    return "{" .. table.concat(parts, ", ") .. "}"
  end
  return tostring(v)
end
schema.show = show

local function is_list(v)
  if type(v) ~= "table" then return false end
  local n = 0
  for _ in pairs(v) do n = n + 1 end
  return n == #v
end
schema.is_list = is_list

-- "got ..." in a message: the Lua type and the value.
local function got(v)
  if v == nil then return "nil" end
  if type(v) == "table" then
    return is_list(v) and "list " .. show(v) or "table"
  end
  if type(v) == "number" or type(v) == "boolean" or type(v) == "string" then
    return type(v) .. " " .. show(v)
  end
  return type(v)
end
schema.got = got

local function new_type(fields) return setmetatable(fields, Type) end

function schema.is_type(x) return getmetatable(x) == Type end

-- integer{min = 1}: a copy of a numeric type with bounds.
function Type.__call(self, bounds)
  assert(self.kind == "integer" or self.kind == "number", "only numeric types take bounds")
  local t = new_type({kind = self.kind})
  for _, b in ipairs {"min", "max", "above", "below"} do t[b] = bounds[b] end
  return t
end

local function bounds_text(t)
  local lo = t.min and "[" .. show(t.min) or t.above and "(" .. show(t.above)
  local hi = t.max and show(t.max) .. "]" or t.below and show(t.below) .. ")"
  if lo and hi then return " in " .. lo .. ", " .. hi end
  if t.min then return " >= " .. show(t.min) end
  if t.above then return " > " .. show(t.above) end
  if t.max then return " <= " .. show(t.max) end
  if t.below then return " < " .. show(t.below) end
  return ""
end

local plural = {integer = "integers", number = "numbers", string = "strings", boolean = "booleans"}

-- The words for what the type accepts: "integer >= 1", "list of 2 numbers in [0, 1)".
local function values_text(t)
  local vals = {}
  for i, v in ipairs(t.values) do vals[i] = show(v) end
  return table.concat(vals, ", ")
end

function Type:describe()
  local k = self.kind
  if k == "integer" or k == "number" then return k .. bounds_text(self) end
  if k == "enum" then return "one of " .. values_text(self) end
  if k == "list" then
    local e = self.elem
    local words = plural[e.kind] and plural[e.kind] .. bounds_text(e) or e:describe()
    return "list of " .. (self.length and self.length .. " " or "") .. words
  end
  if k == "optional" then return self.inner:describe() .. " or nil" end
  return k
end

-- check(v) -> the value (integral floats become integers) or nil, "expected ..., got ..."
-- For list elements the message carries the "[i]" to append to the key.
function Type:check(v)
  local k = self.kind
  local function fail() return nil, "expected " .. self:describe() .. ", got " .. got(v) end
  if k == "optional" then
    if v == nil then return nil end
    local out, err, at = self.inner:check(v)
    if err and not at and err:match("^expected ") then return fail() end   -- say "or nil"
    return out, err, at
  elseif k == "integer" or k == "number" then
    if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then return fail() end
    if k == "integer" then
      if math.tointeger(v) == nil then return fail() end
      v = math.tointeger(v)
    end
    if (self.min and v < self.min) or (self.max and v > self.max)
       or (self.above and v <= self.above) or (self.below and v >= self.below) then
      return fail()
    end
    return v
  elseif k == "boolean" or k == "string" then
    if type(v) ~= k then return fail() end
    return v
  elseif k == "enum" then
    for _, allowed in ipairs(self.values) do
      if v == allowed then return v end
    end
    if type(v) == "string" then
      return nil, show(v) .. " is not allowed; allowed: " .. values_text(self)
    end
    return fail()
  elseif k == "list" then
    if not is_list(v) or (self.length and #v ~= self.length) then
      if is_list(v) then return nil, "expected " .. self:describe() .. ", got a list of " .. #v .. ": " .. show(v) end
      local hint = type(v) == "number" and " (write {" .. show(v) .. "})" or ""
      return nil, "expected " .. self:describe() .. ", got " .. got(v) .. hint
    end
    local out = {}
    for i = 1, #v do
      local e, err = self.elem:check(v[i])
      if err then return nil, err, "[" .. i .. "]" end
      out[i] = e
    end
    return out
  end
  error("unknown type kind " .. tostring(k))
end

-- A type accepts strings: a bare --set value such as name=2024 stays text.
function Type:takes_strings()
  local t = self.kind == "optional" and self.inner or self
  return t.kind == "string" or t.kind == "enum"
end

local integer = new_type({kind = "integer"})
local number = new_type({kind = "number"})
local boolean = new_type({kind = "boolean"})
local string_t = new_type({kind = "string"})
local function enum(values) return new_type({kind = "enum", values = values}) end
local function list(elem, length) return new_type({kind = "list", elem = elem, length = length}) end
local function optional(inner) return new_type({kind = "optional", inner = inner}) end

schema.integer, schema.number, schema.boolean, schema.string = integer, number, boolean, string_t
schema.enum, schema.list, schema.optional = enum, list, optional

---------------------------------------------------------------- the keys

-- An op's enum attribute, spelled as its descriptor declares it ("format=a|b|c" in the op's attrs,
-- vm/ops/*.c): the names a key that chooses among them takes, never a copy of them.
local function op_spellings(op_name, attr)
  for _, op in ipairs(require("dormouse.core").ops()) do
    if op.name == op_name and op.spellings[attr] then return op.spellings[attr] end
  end
  error(string.format("schema: the op %s declares no spelled attribute %s", op_name, attr))
end

local int, num, bool, str = integer, number, boolean, string_t
local positive = int{min = 1}
local fraction = num{min = 0, max = 1}

-- Defaults are the spec's reference values, with the shape of the `small`
-- preset (docs/model.md) so that a file naming only a few keys is a real model.
local rows = {
  {"name", optional(str), nil, "run name: logs and checkpoints go to runs/NAME (nil = the experiment file's base name)"},
  {"seed", int{min = 0}, 1, "seed of the parameter init and the data order"},
  {"init", optional(str), nil, "a run folder (its newest checkpoint) or RUN/ckpt-STEP whose model weights this " ..
   "run starts from, a fine-tune: the optimiser, schedule, data and step start fresh, and the model keys must " ..
   "be the checkpoint's but those marked tune (docs/training.md, \"Fine-tuning from a checkpoint\")"},
  {"steps", positive, 2000, "optimiser steps in the whole run (the schedule spans them)", progress = true},
  {"batch", positive, 8, "sequences per micro-batch"},
  {"seq", positive, 512, "bytes per training sequence"},
  {"grad_accum", positive, 1, "micro-batches accumulated into one optimiser step"},
  {"device", enum {"auto", "cpu", "cuda"}, "auto", "where to train: auto = cuda when a GPU is found, else cpu (printed at start)"},
  {"dtype", enum {"bf16", "f32"}, "bf16", "dtype of matrix products, f32 accumulate (masters, KDA state, gates stay f32)"},
  {"graph", optional(bool), nil, "capture the training step as one CUDA graph and replay it (nil = when it can: " ..
   "cuda, grad_accum 1, Engram tables on the device)", progress = true},
  {"ce_ceiling", num{above = 0}, 100, "a log window's mean training loss above this ends the run there"},

  {"model", "the model family of docs/model.md", {
    {"arch", str, "dormouse", "the model file: models/ARCH.lua, a function from this table to a module (or {keys, build})"},
    {"d", positive, 768, "model width d"},
    {"heads", positive, 12, "KDA heads H"},
    {"head_dim", positive, 64, "KDA head dim dh (dk = dv = dh)"},
    {"max_iter", positive, 2, "iterations of the weight-shared block"},
    {"recompute", bool, false, "recompute each iteration's block in the backward instead of keeping its " ..
     "activations (less memory, one more forward of the block)", tune = true},
    {"segment", optional(positive), nil, "bytes per segment: longer rows (training and eval) run as segments " ..
     "with the state carried, the gradient exact, memory flat in the length (nil = whole rows)", tune = true},
    {"experts", positive, 64, "routed experts E"},
    {"top_k", positive, 2, "experts chosen per token k"},
    {"expert_rank", positive, 16, "rank r of a routed expert"},
    {"shared_rank", positive, 64, "rank r_s of the shared expert"},
    {"ffn", positive, 2048, "expert output space F (the ffn space)"},
    {"kda", "Kimi Delta Attention", {
      {"gate", enum {"bounded", "softplus"}, "softplus", "decay gate: softplus = -exp(A_log)*softplus(.), " ..
       "bounded = lb*sigmoid(exp(A_log)*(.)) (docs/training.md, \"Learning quality\")"},
      {"gate_lb", num{below = 0}, -5, "lower bound lb of the bounded gate, g in (lb, 0)"},
      {"output_bias", bool, true, "a bias on the output gate's projection (W_o2)"},
    }},
    {"engram", "hashed byte n-gram memory", {
      {"orders", list(int{min = 1, max = 8}), {2, 3, 4}, "byte n-gram orders, ascending ({} turns Engram off)"},
      {"rows", positive, 65536, "rows R per order (hashed orders round it to a prime)"},
      {"width", positive, 32, "row width de"},
      {"hash_heads", positive, 1, "hash heads K per hashed order"},
      {"ram", bool, false, "keep the tables in host memory (gathered rows, host-side sparse Adam)", tune = true},
      {"output", enum {"spec", "projection"}, "projection", "the branch's output: projection = W_e conv(vt), a " ..
       "d x d projection after a plain convolution; spec = vt + silu(conv(rmsnorm(vt))), the first spec's form"},
      {"dilation", optional(positive), nil, "the output convolution's dilation (nil = the form's: 1 for " ..
       "projection, the largest order for spec)"},
      {"alpha_gain", bool, true, "a learned gain (ones at init) on the channels of alpha's dot of the two " ..
       "RMS-normalised vectors"},
    }},
    {"msa", "block top-k sparse attention over past blocks, an extra branch (an arm; docs/arms.md)", {
      {"top_k", int{min = 0}, 0, "past blocks each query reads (0 = off)"},
      {"block", positive, 64, "positions a block (a sequence's last block may be short)"},
      {"qk_norm", bool, false, "RMS-normalise q and k per head (gains from ones) before the scores"},
    }},
    {"loom", bool, false, "an arm: iteration i's write w into the residual stream gets a zero-initialised " ..
     "gate on its RMS-normalised form, h' + g_i rms(w) (docs/arms.md)"},
    {"aux", "auxiliary heads, arms of the model (docs/arms.md)", {
      {"future", num{min = 0}, 0, "weight of a head predicting the byte after next from the fin readout's " ..
       "input, added to the training loss (0 = off; evals stay the pure CE)"},
      {"draft", num{min = 0}, 0, "weight of DSpark's draft head: the byte after next from the fin readout's " ..
       "input and the next byte's embedding, for speculative decoding (0 = off; draft_accept on the eval line)"},
      {"jepa", num{min = 0}, 0, "weight of a joint-embedding predictive loss: a small predictor maps the fin " ..
       "readout's input at t to its (stop-gradient) value at t + jepa_offset, 1 - cosine (0 = off; aux_jepa " ..
       "on the log line; evals stay the pure CE)"},
      {"jepa_offset", positive, 8, "how many bytes ahead model.aux.jepa predicts the representation"},
    }},
    {"init", "initialisation choices the spec leaves open (docs/training.md, \"Learning quality\")", {
      {"branch_out", enum {"fan_in", "depth"}, "fan_in", "std of the branches' output projections (KDA W_o, " ..
       "Engram W_v, the experts' W_write): fan_in^-1/2, or that times (3 max_iter)^-1/2", tune = true},
      {"engram_std", num{above = 0}, 0.02, "std of the Engram tables' rows at initialisation", tune = true},
      {"dt_bias", enum {"zeros", "log_uniform", "decay"}, "log_uniform", "KDA's dt_bias: zeros; log_uniform: the " ..
       "inverse softplus of dt ~ log-uniform [1e-3, 1e-1] (Mamba, FLA); decay: the value at which the gate " ..
       "(either form) starts at g = -exp(A_log) dt for such a dt", tune = true},
      {"a_log", enum {"log_uniform", "uniform"}, "uniform", "KDA's decay rates A = exp(A_log) per head: " ..
       "uniform on [1, 16] (A_log = log U(1, 16)), or log-uniform on [1, 16] (A_log ~ U(0, ln 16))", tune = true},
      {"engram_conv", enum {"zeros", "uniform"}, "uniform", "Engram's output convolution: U(-1/2, 1/2), or zeros", tune = true},
      {"conv", enum {"normal", "uniform"}, "normal", "KDA's short convolutions: N(0, 0.5^2), or U(-1/2, 1/2)", tune = true},
    }},
    {"moe", "routed low-rank experts with a shared expert", {
      {"lfb_gamma", num{min = 0}, 1e-3, "loss-free balancing step: bias += gamma*sign(mean_load - load)", tune = true},
      {"balance", enum {"sign", "proportional", "log"}, "sign", "the balancing step: gamma*sign(mean_load - load), " ..
       "gamma*(mean_load - load)/mean_load (proportional: in proportion to the load error), or " ..
       "gamma*log((mean_load + 1)/(load + 1)) (log: symmetric in the load's ratio to the mean)", tune = true},
      {"router_dtype", enum {"compute", "f32", "f32_sums"}, "compute", "the router's product: in the compute " ..
       "dtype (its scores rounded to it, then cast to f32); f32: in f32 from an f32 copy of its input; " ..
       "f32_sums: from the compute dtype's operands with its f32 sums kept, not rounded (the 16-bit " ..
       "product's speed)", tune = true},
      {"router_std", optional(num{above = 0}), nil, "std of the router's weights at initialisation (nil = d^-1/2)", tune = true},
      {"router_cosine", optional(num{above = 0}), nil, "an arm: the router's logits s cos(u, w_e), the token's " ..
       "row and each expert's router row at unit length, so that the logits stay in [-s, s] and the balancing " ..
       "bias keeps its hold as the router trains (nil = off: the logits W_r u)", tune = true},
      {"router", enum {"sigmoid", "softmax"}, "softmax", "the router's form: softmax = the top k of " ..
       "logits + bias (the bias in logit units), gates a softmax over the k chosen logits; sigmoid = the " ..
       "top k of sigmoid(logits) + bias, gates s / sum s (docs/training.md, \"Balance at b1\")"},
      {"aux_balance", num{min = 0}, 0, "weight of an auxiliary balance loss, E sum_e f_e P_e (f_e the share " ..
       "of a pass's assignments to expert e, P_e its mean router probability), averaged over the iterations " ..
       "and added to the training loss (0 = off; aux_balance on the log line)", tune = true},
      {"update_by_load", enum {"off", "active", "share"}, "off", "each expert's Muon update (Ug, Uu, D; not its " ..
       "decay) scaled by its rows in the step: off; active: 0 for an expert without a row, else 1; share: " ..
       "min(1, its rows / the mean). Muon orthogonalises a starved expert's gradient, or an idle one's fading " ..
       "momentum, to a full-size update (docs/training.md, \"Balance at b1\")", tune = true},
      {"retract_every", int{min = 0}, 0, "an arm: every N optimiser steps, Ug and Uu pulled back to orthonormal " ..
       "columns (each expert's polar factor; 0 = off)", tune = true},
      {"retract_when", optional(num{above = 0}), nil, "an arm: Ug and Uu pulled back to orthonormal columns at a " ..
       "log window whose orthogonality probe (ortho on the log line: 1 for random columns of the init's scale, 0 " ..
       "orthonormal) is above this (nil = off)", tune = true},
      {"qat", enum {"off", "ladder", table.unpack(op_spellings("quantize", "format"))}, "off",
       "an arm: the experts' factors Ug, Uu, D fake-quantised (straight through) from qat_from of the run on, " ..
       "in one format, or ladder: fp8_e4m3, nvfp4, ternary in equal thirds of that span (docs/arms.md)", tune = true},
      {"qat_from", fraction, 0.85, "the fraction of the run's steps after which model.moe.qat begins", tune = true},
      {"littlebit", enum {"off", "sign", "residual"}, "off", "an arm: the experts' factors Ug, Uu, D as " ..
       "row * sign(latent) * col with learned row and column scales (LittleBit), residual: plus a second " ..
       "such term on a latent of its own (docs/arms.md)"},
      {"fp8", bool, false, "an arm: the expert kernels read Ug, Uu, D as fp8 E4M3 codes under f32 scales a " ..
       "block of 32, encoded from the masters each pass (no 16-bit copy of the banks); the same products as " ..
       "model.moe.qat = fp8_e4m3 from the first step (docs/arms.md)", tune = true},
      {"capacity_factor", optional(num{above = 0}), nil, "nil = dropless; else assignments over factor*T*k/E per expert are dropped and counted", tune = true},
    }},
  }},

  {"data", "the byte corpus", {
    {"path", optional(str), nil, "corpus file (raw bytes or .zst), folder or glob; nil = the embedded default corpus"},
    {"sources", optional(list(str)), nil, "a mixture instead of data.path: files, folders or globs, each a source; " ..
     "each training row reads one source, drawn by data.weights from the run's seed (docs/training.md, \"Corpora\")"},
    {"weights", optional(list(num{above = 0})), nil, "data.sources' weights, one a source (nil = equal); a source " ..
     "draws its weight over the weights' sum of the rows"},
    {"eval", optional(str), nil, "a held-out source (file, folder or glob): its last eval_bytes are the held-out " ..
     "split, and every byte of the training sources trains; nil = the tail of each source"},
    {"eval_bytes", positive, 81920, "bytes held out for evaluation, never trained on: the corpus's last, each " ..
     "source's tail shared by weight, or data.eval's last"},
    {"ctx", optional(positive), nil, "bytes per eval sequence (nil = seq)"},
    {"records", optional(str), nil, "prompt/response records for supervised fine-tuning, instead of the corpus: " ..
     "JSONL ({\"prompt\": ..., \"response\": ...} a line) or a task file (tasks/addition.lua), or several " ..
     "separated by commas; rows are packed from whole records and the loss covers the response bytes only " ..
     "(docs/post-training.md)"},
    {"eval_records", positive, 256, "records held out at the end of each file of data.records, never trained on"},
  }},

  {"optim", "Muon for 2-D matrices, AdamW for the rest, Adam for the Engram tables", {
    {"muon_lr", num{min = 0}, 1e-3, "Muon peak learning rate (update scaled by 0.2*sqrt(max(rows, cols)))"},
    {"adamw_lr", num{min = 0}, 1e-3, "AdamW peak learning rate (embedding, head, gains, biases, router, scales)"},
    {"betas", list(num{min = 0, below = 1}, 2), {0.9, 0.95}, "AdamW and Engram Adam betas {beta1, beta2}"},
    {"eps", num{above = 0}, 1e-8, "AdamW and Engram Adam epsilon"},
    {"weight_decay", num{min = 0}, 0.1, "decoupled weight decay of the Muon matrices"},
    {"adamw_weight_decay", num{min = 0}, 0.0, "decoupled weight decay of the AdamW group (never the Engram tables)"},
    {"ns_dtype", optional(enum {"f32", "bf16"}), nil, "Newton-Schulz dtype (nil = bf16 on the GPU, f32 on the CPU)"},
    {"engram_lr_mult", num{min = 0}, 5, "Engram tables' Adam lr as a multiple of adamw_lr (no weight decay)"},
    {"gates", enum {"adamw", "muon"}, "adamw", "KDA's gate projections (W_b, W_g1, W_g2, W_o1, W_o2): in the " ..
     "AdamW group, or Muon's with its weight decay"},
    {"engram_adam", enum {"sparse", "dense"}, "sparse", "the tables' Adam: the touched rows only (the spec), or " ..
     "dense: every row's moments decay and every row moves each step (not the spec's; tables on the device)"},
    {"adamw_moments", enum {"f32", "8bit"}, "f32", "the AdamW group's moments: f32, or 8bit: 8 bits a value with " ..
     "an f32 scale a block of 256, rounded stochastically (25.4% of the memory)", form = true},
    {"engram_moments", enum {"f32", "8bit"}, "f32", "the Engram tables' Adam moments: f32, or 8bit: 8 bits a value " ..
     "with an f32 scale a row, rounded stochastically (28% of the memory at rows of 32; the sparse Adam of " ..
     "tables on the device)", form = true},
    {"momentum", num{min = 0, below = 1}, 0.95, "Muon momentum"},
    {"nesterov", bool, true, "Nesterov form of the Muon momentum"},
    {"momentum_dtype", enum {"f32", "bf16", "bf16_stochastic"}, "f32", "Muon momentum buffers: f32, or bf16 (half " ..
     "their memory; for small cards) rounded to nearest, or bf16 rounded stochastically (unbiased: small " ..
     "gradients are not lost under half a bf16 step)", form = true},
    {"ns_steps", positive, 5, "Newton-Schulz steps per Muon update"},
    {"ns_coeffs", enum {"quintic", "polar_express"}, "quintic", "Newton-Schulz coefficients: quintic (3.4445, -4.7750, 2.0315) or Polar Express"},
    {"muon_plus", enum {"none", "col", "row", "colrow"}, "none", "Muon+: the orthogonalised update l2-normalised " ..
     "by column, by row, or both before its scale (none = plain Muon)"},
    {"clip", num{min = 0}, 1.0, "global gradient-norm clip (0 = off)"},
    {"grad_dtype", enum {"compute", "f32"}, "compute", "the gradient of a parameter the model reads in its " ..
     "compute dtype: compute keeps it in that dtype (the optimisers read it as it comes, with no widening " ..
     "pass; a second gradient in a step is summed in f32), f32 widens it at once"},
  }},

  {"schedule", "the learning-rate schedule (one shape for every group)", {
    {"kind", enum {"wsd", "cosine", "constant"}, "wsd", "wsd: warm-up, stable, 1-sqrt decay; cosine: warm-up, cosine; constant: warm-up, flat"},
    {"warmup", int{min = 0}, 100, "linear warm-up steps"},
    {"decay", fraction, 0.2, "wsd: fraction of the steps in the final decay"},
    {"floor", fraction, 0.0, "learning rate at the end of wsd or cosine, as a fraction of the peak"},
  }},

  {"eval", "held-out evaluation", {
    {"every", int{min = 0}, 250, "steps between evals (0 = only at the end)", progress = true},
    {"windows", optional(positive), nil, "ctx-byte sequences read per eval (nil = the whole held-out split)", progress = true},
    {"depths", list(positive), {}, "depths D < max_iter whose fin_D is reported too (fin itself always is)", progress = true},
    {"baseline", list(int{min = 1, max = 8}), {3, 5}, "byte n-gram orders (Kneser-Ney, fit on the train split) printed beside bpb_fin", progress = true},
    {"baseline_bytes", int{min = 0}, 8388608, "the n-gram baselines fit on this many bytes of the train split, " ..
     "in pieces spread evenly over it (a corpus of gigabytes starts in seconds); 0 or a smaller split: all of it",
     progress = true},
    {"sample", int{min = 0}, 160, "bytes sampled after each eval for the report (temperature 0.8; 0 = none)", progress = true},
    {"tasks", optional(str), nil, "a task file (tasks/kjv.lua; found here, else in the install): each eval puts " ..
     "correct@B, the fraction solved within B greedy bytes, on its line (nil = none; docs/training.md)", progress = true},
    {"budgets", list(positive), {64, 256, 1024}, "the byte budgets B of eval.tasks' correct@B, exact@B and pass@B", progress = true},
    {"exact", int{min = 0}, 64, "held-out records (data.records) whose response is generated greedily at each " ..
     "eval: exact@B, the share produced within B bytes, on the eval line, and for records with tests pass@B, the " ..
     "share whose output passes them (0 = none)", progress = true},
  }},

  {"rl", "reinforcement learning against verifiers, on data.records' tasks (docs/post-training.md)", {
    {"k", int{min = 0}, 0, "samples a task each step; > 0: each step is a policy-gradient step on the model's own " ..
     "samples, scored by the verifier, instead of a supervised one (0 = none)"},
    {"tasks", positive, 16, "tasks a step (drawn from the training records by the seed and the step)"},
    {"budget", positive, 32, "bytes a sample at most"},
    {"stop", optional(str), nil, "a sample ends where its text ends with this (e.g. \"\\n\"; nil = at the budget)"},
    {"temperature", num{above = 0}, 1.0, "the samples' temperature (top-p 0.95)"},
    {"advantage", enum {"group", "fork"}, "group", "group: each sample's reward less its task's mean (GRPO's " ..
     "baseline); fork: each byte credited with V(after it) - V(before it), each V the mean reward of rl.forks " ..
     "continuations from that prefix (fork-replay)"},
    {"forks", positive, 4, "continuations from each fork point (rl.advantage = fork)"},
    {"bytes_penalty", num{min = 0}, 0.0, "lambda: the reward is the verifier's score less lambda times the bytes used"},
    {"kl", num{min = 0}, 0.0, "weight of KL(policy || the model the run started from, init), estimated on the " ..
     "sampled bytes (0 = none; > 0 needs init)"},
    {"verifier", optional(enum {"exact", "numeric", "code"}), nil, "the verifier of the samples (nil = each " ..
     "record's own: code (its tests in the sandbox) for a record with tests, else exact (the output begins with " ..
     "the record's response))"},
    {"reward", enum {"pass", "score"}, "pass", "the verifier's credit in the reward: pass (1 or 0, hard) or score " ..
     "(partial credit in [0, 1], soft: the share of the answer's bytes right before the first wrong one, of a " ..
     "list of tests passed)"},
  }},

  {"checkpoint", "checkpoints", {
    {"every", int{min = 0}, 500, "steps between checkpoints (0 = only at the end)", progress = true},
    {"keep", int{min = 0}, 3, "newest checkpoints kept on disk (0 = all)", progress = true},
    {"banks", enum {"f32", table.unpack(op_spellings("quantize", "format"))}, "f32",
     "the experts' banks in model.safetensors: the f32 masters, or a low-bit format's codes and scales " ..
     "(a resume from those continues from their values; docs/arms.md)", progress = true},
  }},

  {"log", "the log line", {
    {"every", positive, 10, "steps per log line (the window of its counters)", progress = true},
    {"tensorboard", bool, false, "also write the metrics as TensorBoard event files in runs/NAME/tb", progress = true},
    {"orthogonality", bool, false, "the experts' factors' distance from orthonormal columns on the log line (ortho: " ..
     "||U^T U - I||_F over its value for random columns of the init's scale, sqrt(r (r + 1) / d); 1 at a random " ..
     "init, 0 orthonormal, at every d and r)", progress = true},
  }},

  {"guard", "the utilisation floor: the experts' use watched window by window (docs/training.md)", {
    {"busiest", optional(fraction), nil, "a log window whose busiest expert holds more than this share of the " ..
     "assignments is past the floor (nil = not watched)", progress = true},
    {"dead", optional(int{min = 0}), nil, "a log window with more experts than this without an assignment is " ..
     "past the floor (nil = not watched)", progress = true},
    {"windows", positive, 3, "log windows past the floor in a row that trip the guard", progress = true},
    {"action", enum {"flag", "stop"}, "flag", "flag: the log line says so while it lasts; stop: the run " ..
     "writes its checkpoint and stops (exit 1)", progress = true},
  }},
}

-- Checks across keys, run once every key is valid: each returns a message or nil.
-- A run name names the folder runs/NAME, so it is one plain path component.
schema.RUN_NAME_MAX = 100

-- KDA's initialisation ranges (nn/kda.lua draws from them; a check below bounds the gate by them):
-- the decay rates A = exp(A_log) per head lie in a_range; dt, the gate's step at initialisation
-- (init.dt_bias = "log_uniform" or "decay"), is log-uniform in dt_range (as in Mamba and FLA)
schema.kda_init = {a_range = {1, 16}, dt_range = {1e-3, 1e-1}}

-- the deepest log-decay a channel starts at under init.dt_bias = "decay": -kda_deepest_start()
function schema.kda_deepest_start() return schema.kda_init.a_range[2] * schema.kda_init.dt_range[2] end
function schema.run_name_error(name)
  if type(name) == "string" and #name <= schema.RUN_NAME_MAX and name:match("^[%w_][%w._%-]*$") then return nil end
  return ("name: %s is not a run name: letters, digits, '.', '_' and '-', not starting with '.' or '-', at most %d " ..
          "characters (it names the folder runs/NAME)"):format(show(name), schema.RUN_NAME_MAX)
end

--[[ Keys added after runs were made, with what the code did before each existed: a checkpoint's
config that does not name one reads it so (config.upgrade), so that a model saved before a default
changed loads as it trained, and a resume of it is told which key now differs. A function takes the
checkpoint's config as saved and gives the value (nil: none). ]]
schema.introduced = {
  ["model.init.a_log"] = "log_uniform",
  ["model.init.engram_conv"] = "zeros",
  ["model.engram.alpha_gain"] = false,
  -- nil meant the largest order for both forms; it still does for spec, and a checkpoint of either
  -- form made since names alpha_gain (a nil dilation is not written)
  ["model.engram.dilation"] = function(c)
    local e = c.model.engram
    if e.alpha_gain == nil and e.output == "projection" then return e.orders[#e.orders] end
  end,
  ["model.moe.router"] = "sigmoid",
  ["model.moe.aux_balance"] = 0,
  ["model.moe.update_by_load"] = "off",
  ["optim.gates"] = "adamw",
  ["optim.adamw_moments"] = "f32",
  ["optim.engram_moments"] = "f32",
  ["optim.grad_dtype"] = "f32",
}

-- Keys that configs once had and no code reads any more: a config (an older
-- checkpoint's, an experiment file, --set) may still name them; each is dropped
-- with a note, once, and left out of resume's comparison.
schema.retired = {
  ["model.kda.chunk"] = "the chunked KDA kernels take chunks of DM_KDA_CHUNK = 64 rows, fixed (vm/ops/kda.h)",
}

-- Whether model.moe.qat changes the experts' products during a run (a captured graph holds one)
function schema.qat_changes(c)
  local m = c.model.moe
  return m.qat ~= "off" and (m.qat == "ladder" or m.qat_from > 0)
end

schema.checks = {
  function(c) return schema.run_name_error(c.name) end,
  function(c)
    if c.graph == true and schema.qat_changes(c) then
      return ("graph = true with model.moe.qat = %s from %g of the run: the format changes during the run and a " ..
              "captured graph holds one; set graph = nil (eager) or model.moe.qat_from = 0 with one format")
             :format(c.model.moe.qat, c.model.moe.qat_from)
    end
  end,
  function(c)
    local m = c.model.moe
    if m.littlebit == "off" then return nil end
    if m.qat ~= "off" then
      return ("model.moe.littlebit = %s with model.moe.qat = %s: the factors are signs under learned scales " ..
              "already; set one of them to off"):format(m.littlebit, m.qat)
    end
    if m.retract_every > 0 then
      return ("model.moe.littlebit = %s with model.moe.retract_every = %d: retraction would move the latents, " ..
              "whose signs are the weights; set model.moe.retract_every = 0"):format(m.littlebit, m.retract_every)
    end
  end,
  function(c)
    local m = c.model.moe
    if not m.fp8 then return nil end
    if m.qat ~= "off" or m.littlebit ~= "off" then
      return ("model.moe.fp8 with model.moe.%s = %s: the fp8 banks are the factors' own values in E4M3; set " ..
              "one of them off"):format(m.qat ~= "off" and "qat" or "littlebit", m.qat ~= "off" and m.qat or m.littlebit)
    end
  end,
  function(c)                                    -- segments are exact only where nothing spans a segment
    if not (c.model.segment and c.model.segment < c.seq) then return nil end
    if c.model.moe.capacity_factor then
      return ("model.segment (%d) with model.moe.capacity_factor: the capacity counts a segment's rows, not " ..
              "the row's, so the drops differ from the whole pass; set one of them to nil"):format(c.model.segment)
    end
    if c.model.msa.top_k > 0 then
      return ("model.segment (%d) with model.msa: the branch keeps no past keys across segments; set " ..
              "model.segment = nil or model.msa.top_k = 0"):format(c.model.segment)
    end
    for _, head in ipairs {"future", "draft", "jepa"} do
      if c.model.aux[head] > 0 then
        return ("model.segment (%d) with model.aux.%s: the head's last target in each segment lies in the " ..
                "next; set model.segment = nil or model.aux.%s = 0"):format(c.model.segment, head, head)
      end
    end
  end,
  function(c)                                    -- the cosine router's logits are f32 whatever router_dtype says
    local m = c.model.moe
    if m and m.router_cosine and m.router_dtype ~= "compute" then
      return ("model.moe.router_cosine takes its logits in f32 from unit rows: model.moe.router_dtype = %s " ..
              "is not read with it; leave router_dtype at compute"):format(m.router_dtype)
    end
  end,
  function(c)                                    -- 8-bit table moments: the sparse Adam, tables on the device
    if c.optim.engram_moments ~= "8bit" then return nil end
    if c.model.engram and c.model.engram.ram then
      return "optim.engram_moments = 8bit keeps the moments on the device beside the tables; model.engram.ram = true " ..
             "keeps the tables in host memory, whose Adam keeps f32 moments: set one of them back"
    end
    if c.optim.engram_adam == "dense" then
      return "optim.engram_moments = 8bit takes the tables' sparse Adam, not optim.engram_adam = dense"
    end
  end,
  function(c)                                    -- the bounded gate must reach the starting decays asked of it
    local m = c.model
    if not (m.init.dt_bias == "decay" and m.kda.gate == "bounded") then return nil end
    local deepest = schema.kda_deepest_start()
    if m.kda.gate_lb > -deepest then
      return ("model.init.dt_bias = decay starts the gate at g = -exp(A_log) dt, down to %g, below the bounded " ..
              "gate's lower bound model.kda.gate_lb = %s; set gate_lb under %g or dt_bias to another " ..
              "choice"):format(-deepest, show(m.kda.gate_lb), -deepest)
    end
  end,
  function(c)                                    -- the balance term is taped in the forward, once a pass
    local w = c.model.moe.aux_balance
    if w > 0 and c.model.recompute then
      return "model.moe.aux_balance with model.recompute: the term would be recomputed without its tape; set " ..
             "one of them off"
    end
    if w > 0 and c.model.segment and c.model.segment < c.seq then
      return ("model.moe.aux_balance with model.segment (%d): the term counts a pass's assignments, and a " ..
              "segment's pass adds to the row's; set model.segment = nil or aux_balance = 0"):format(c.model.segment)
    end
  end,
  function(c)
    if c.model.top_k > c.model.experts then
      return ("model.top_k (%d) exceeds model.experts (%d)"):format(c.model.top_k, c.model.experts)
    end
  end,
  function(c)
    local o = c.model.engram.orders
    for i = 2, #o do
      if o[i] <= o[i - 1] then
        return "model.engram.orders must be strictly ascending, got " .. show(o)
      end
    end
  end,
  function(c)
    for _, depth in ipairs(c.eval.depths) do
      if depth > c.model.max_iter then
        return ("eval.depths holds %d, beyond model.max_iter (%d)"):format(depth, c.model.max_iter)
      end
    end
  end,
  function(c)
    local s = c.schedule
    if s.warmup > c.steps then
      return ("schedule.warmup (%d) exceeds steps (%d); lower it too (--set schedule.warmup=N)"):format(s.warmup, c.steps)
    end
    if s.kind == "wsd" and s.warmup + math.ceil(s.decay * c.steps) > c.steps then
      return ("schedule.warmup (%d) and schedule.decay (%s of %d steps) overlap; lower one of them"):format(s.warmup, show(s.decay), c.steps)
    end
  end,
}

---------------------------------------------------------------- the tree

-- root: the section tree. nodes[dotted] = a section or a leaf; leaves: every
-- leaf in schema order. A leaf: {name, key, type, default, doc, progress, tune, index}.
local function build(rows_, prefix, section, nodes, leaves)
  nodes, leaves = nodes or schema.nodes, leaves or schema.leaves
  section.children, section.order = {}, {}
  for _, row in ipairs(rows_) do
    local name = row[1]
    local key = prefix == "" and name or prefix .. "." .. name
    local node
    if schema.is_type(row[2]) then
      node = {name = name, key = key, type = row[2], default = row[3], doc = row[4],
              progress = row.progress or false, tune = row.tune or false, form = row.form or false,
              parent = section}
      local ok, err = row[2]:check(row[3])
      assert(err == nil and (ok ~= nil or row[3] == nil), "schema: bad default for " .. key .. ": " .. tostring(err))
      leaves[#leaves + 1] = node
      node.index = #leaves
    else
      node = {name = name, key = key, doc = row[2], section = true, parent = section}
      build(row[3], key, node, nodes, leaves)
    end
    assert(not nodes[key], "schema: duplicate key " .. key)
    section.children[name] = node
    section.order[#section.order + 1] = node
    nodes[key] = node
  end
end

schema.leaves, schema.nodes = {}, {}
schema.root = {key = "", doc = "the run"}
build(rows, "", schema.root)

-- A key's default ("model.moe.lfb_gamma"): what a layer built without the option takes, so the
-- schema stays its one owner
function schema.default(key)
  local node = schema.nodes[key]
  if not node or node.section then error("schema.default: no key '" .. tostring(key) .. "'", 2) end
  return node.default
end

--[[ schema.with_model_keys(rows, where) -> {root, nodes, keys}: the schema with a
model file's own keys under model (rows as the schema's: {name, type,
default, doc}, or a section {name, doc, {rows}}), for one resolve; the
schema itself is not changed. A name the runtime's model section has is
refused, naming the file (where). ]]
function schema.with_model_keys(model_rows, where)
  local base = schema.nodes.model
  for _, row in ipairs(model_rows) do
    if type(row) ~= "table" or type(row[1]) ~= "string" or not row[1]:match("^[%a_][%w_]*$") then
      error(where .. ": keys: each entry is {name, type, default, doc} or {name, doc, {entries}}", 0)
    end
    if base.children[row[1]] then
      error(string.format("%s: key '%s' is the runtime's own (model.%s); a model's keys need other names",
                          where, row[1], row[1]), 0)
    end
    if not schema.is_type(row[2]) and type(row[3]) ~= "table" then
      error(string.format("%s: key '%s': its type is not one of dormouse.schema's (schema.integer, " ..
                          "schema.number, schema.boolean, schema.string, schema.enum{...}, schema.list(t), " ..
                          "schema.optional(t))", where, row[1]), 0)
    end
  end
  local nodes = setmetatable({}, {__index = schema.nodes})
  local own = {key = "model", doc = base.doc}
  local ok, err = pcall(build, model_rows, "model", own, nodes, {})
  if not ok then error(where .. ": " .. tostring(err):gsub("^schema: ", ""), 0) end
  local model = {name = "model", key = "model", doc = base.doc, section = true, parent = schema.root,
                 children = {}, order = {}}
  for _, node in ipairs(base.order) do
    model.children[node.name] = node
    model.order[#model.order + 1] = node
  end
  for _, node in ipairs(own.order) do
    node.parent = model
    model.children[node.name] = node
    model.order[#model.order + 1] = node
  end
  nodes.model = model
  local keys = {}              -- the model's own dotted keys (for "did you mean")
  for key in pairs(nodes) do keys[#keys + 1] = key end
  table.sort(keys)
  local root = {key = "", doc = schema.root.doc, children = {}, order = {}}
  for _, node in ipairs(schema.root.order) do
    local n = node.name == "model" and model or node
    root.children[n.name] = n
    root.order[#root.order + 1] = n
  end
  return {root = root, nodes = nodes, keys = keys}
end

return schema
