-- The dormouse model family: counts pinned, float64 agreement, a new architecture in Lua.
local dm = require "dormouse"
local nn = require "dormouse.nn"
local config = require "dormouse.config"
local train = require "dormouse.train"

local function build(file, overrides, device)
  local cfg = config.load(file, overrides)
  dm.manual_seed(cfg.seed)
  return nn.build({device = device or "cpu"}, train.build_model, cfg, "."), cfg
end

-- one batch of 2 rows of 33 bytes from the default corpus (the arms' tests)
local function tiny_batch()
  local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
  local x, prefix = corpus:batch(3, {batch = 2, seq = 33, seed = 5, ctx = 2})
  corpus:close()
  return x, prefix
end

-- the log of 6 tiny steps (a line every 3) with one arm's override
local function arm_log(override)
  local helpers = require "tests.lua.helpers"
  local runs = helpers.tmpdir()
  local sets = {"steps=6", "log.every=3", "eval.every=0", "checkpoint.every=0", "name=arm"}
  for _, o in ipairs(type(override) == "table" and override or {override}) do sets[#sets + 1] = o end
  helpers.run_quiet(helpers.tiny(sets), {runs = runs})
  local f = assert(io.open(runs .. "/arm/log.txt"))
  local log = f:read("a")
  f:close()
  os.execute("rm -rf '" .. runs .. "'")
  return log
end

-- the tiny config with these settings is refused, its error naming each of the phrases
local function refused(sets, ...)
  local helpers = require "tests.lua.helpers"
  helpers.has(helpers.err_of(helpers.tiny, sets), ...)
end

-- a run with the arm names it at the start (the phrase) and counts it on the log line (counter at step 6)
local function named_and_counted(override, phrase, counter)
  local log = arm_log(override)
  require("tests.lua.helpers").has(log, "arms: " .. phrase)
  assert.truthy(log:find("step      6 [^\n]- " .. counter .. " 0%.%d+"), log)
  return log
end

describe("b1", function()
  it("has its parameter counts, pinned, on the meta device (no memory)", function()
    collectgarbage(); collectgarbage()         -- what earlier files left goes now, not during the build
    local cpu = dm.memory("cpu").current
    local m = build("experiments/b1.lua", nil, "meta")
    local c = m:counts()
    assert.are.equal(dm.memory("cpu").current, cpu)
    assert.are.equal(1067277248, c.total)            -- about 1.07B
    assert.are.equal(402651680, c.tables)            -- about 403M in the Engram tables (3 primes near 2^22, de 32)
    assert.are.equal(664625568, c.without_tables)
    assert.are.equal(38868352, c.active)             -- per token per iteration (Engram's W_e among them)
  end)
end)

describe("tiny", function()
  it("gives the same loss and gradients in float32 and float64 (rtol 1e-4)", function()
    local m32 = build("experiments/tiny.lua")
    local m64 = build("experiments/tiny.lua"):cast("f64")
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x, prefix = corpus:batch(3, {batch = 2, seq = 33, seed = 5, ctx = 2})
    local l32 = m32:forward(x, prefix).loss
    l32:backward()                                    -- one backward per tape: run them in turn
    local l64 = m64:forward(x, prefix).loss
    l64:backward()
    assert.is_true(math.abs(l32:item() - l64:item()) <= 1e-4 * math.abs(l64:item()))
    local p64 = {}
    for _, p in ipairs(m64:named_parameters()) do p64[p.name] = p.tensor end
    -- the Engram table's gradient is sparse: its touched rows and their gradient
    local rows32, t32 = m32.block.engram:sparse_grad()
    local rows64, t64 = m64.block.engram:sparse_grad()
    assert.is_true(dm.allclose(rows32, rows64, {rtol = 0, atol = 0}))
    assert.is_true((t32:to("f64") - t64):abs():max():item() <= 1e-4 * t64:abs():max():item())
    assert.is_nil(m32.block.engram.table.grad)                -- the dense gradient is never made
    local checked = 0
    for _, p in ipairs(m32:named_parameters()) do
      if p.name == "block.engram.table" then goto continue end
      local g32, g64 = p.tensor.grad, p64[p.name].grad
      assert.is_truthy(g32, p.name .. " has no gradient")
      local err = (g32:to("f64") - g64):abs():max():item()
      local scale = g64:abs():max():item()
      assert.is_true(err <= 1e-4 * scale + 1e-7, string.format("%s: %.3g over %.3g", p.name, err, scale))
      checked = checked + 1
      ::continue::
    end
    assert.is_true(checked > 30)
    corpus:close()
  end)
end)

describe("the Engram tables", function()
  it("are updated on the rows a step touched only, with their Adam moments", function()
    local m, cfg = build("experiments/tiny.lua", {"schedule.warmup=0"})
    local opt = dm.optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x, prefix = corpus:batch(0, {batch = 2, seq = 16, seed = 1, ctx = 2})
    local before = m.block.engram.table:clone()
    local state = opt:state()
    local m0 = state["block.engram.table.m"]:clone()
    m:forward(x, prefix).loss:backward()
    local rows = m.block.engram:sparse_grad():totable()
    opt:step(1)
    opt:zero_grad()
    local touched = {}
    for _, r in ipairs(rows) do touched[r] = true end
    local after, m1 = m.block.engram.table, opt:state()["block.engram.table.m"]
    local changed, kept = 0, 0
    for r = 0, after:size(1) - 1 do
      local same = dm.allclose(after:narrow(1, r + 1, 1), before:narrow(1, r + 1, 1), {rtol = 0, atol = 0})
                   and dm.allclose(m1:narrow(1, r + 1, 1), m0:narrow(1, r + 1, 1), {rtol = 0, atol = 0})
      if touched[r] then assert.is_false(same, "touched row " .. r .. " did not move"); changed = changed + 1
      else assert.is_true(same, "untouched row " .. r .. " moved"); kept = kept + 1 end
    end
    assert.is_true(changed > 10 and kept > 100)
    corpus:close()
  end)
end)

describe("the Engram tables over micro-batches", function()
  it("hand the optimiser one summed gradient a step, so clipping reaches the update", function()
    local m, cfg = build("experiments/tiny.lua", {"schedule.warmup=0"})
    local opt = dm.optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    dm.scope(function()
      for k = 0, 1 do                                -- two micro-batches: two lookups, two entries
        local x, prefix = corpus:batch(k, {batch = 2, seq = 16, seed = 1, ctx = 2})
        m:forward(x, prefix).loss:backward()
      end
      local norm = require("dormouse.core").clip_grads(opt:grads(), 1e-3)
      assert.is_true(norm > 1e-2)
      local _, g = m.block.engram:sparse_grad()      -- what the update reads: the clipped sum
      local left = require("dormouse.core").clip_grads(opt:grads(), 0)
      assert.is_true(math.abs(left - 1e-3) <= 1e-6, string.format("norm after clipping %.6g", left))
      assert.is_true(g:abs():max():item() <= 1e-3)
    end)
    opt:zero_grad()
    corpus:close()
  end)
end)

describe("without Engram", function()
  it("builds and trains when model.engram.orders is empty", function()
    local m, cfg = build("experiments/tiny.lua", {"model.engram.orders={}", "schedule.warmup=0"})
    assert.is_nil(m.block.engram)
    assert.are.equal(0, m:counts().tables)
    local opt = dm.optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local x, prefix = corpus:batch(0, {batch = 2, seq = 16, seed = 1})
    local out = m:forward(x, prefix)
    out.loss:backward()
    assert.is_false(opt:step(1).skipped)
    corpus:close()
  end)
end)

describe("a new architecture", function()
  it("is one Lua file (models/stack.lua) and trains", function()
    local m, cfg = build("experiments/stack.lua", {"steps=12", "schedule.warmup=2"})
    local opt = dm.optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local corpus = dm.data.open(dm.data.default_corpus(), {eval_bytes = 4096})
    local first, last
    for step = 1, cfg.steps do
      dm.scope(function()
        local x, prefix = corpus:batch(step, {batch = 4, seq = 64, seed = 1})
        local out = m:forward(x, prefix)
        out.loss:backward()
        opt:step(step)
        opt:zero_grad()
        last = out.loss:item()
        first = first or last
      end)
    end
    assert.is_true(last < first - 0.5, string.format("loss %.3f -> %.3f", first, last))
    corpus:close()
  end)
end)

describe("model.arch", function()
  it("naming no model file says which ones there are and the nearest", function()
    local ok, err = pcall(build, "experiments/tiny.lua", {"model.arch=dormose"})
    assert.is_false(ok)
    assert.is_truthy(err:find("did you mean 'dormouse'? models/ holds byteflow, dormouse, stack", 1, true), err)
  end)
end)

describe("model.moe.capacity_factor", function()
  local helpers = require "tests.lua.helpers"
  local function steps(dir, name)
    local out = {}
    for l in io.lines(dir .. "/" .. name .. "/log.txt") do
      if l:match("^step") then out[#out + 1] = l end
    end
    return out
  end

  it("drops each expert's assignments past its capacity and counts them on the log line; one that drops " ..
     "nothing trains bit for bit as dropless", function()
    local dir = helpers.tmpdir()
    local base = {"steps=6", "log.every=2", "eval.every=0", "checkpoint.every=0"}
    helpers.run_quiet(helpers.tiny(base, {"name=dropless"}), {runs = dir})
    helpers.run_quiet(helpers.tiny(base, {"name=roomy", "model.moe.capacity_factor=8"}), {runs = dir})
    helpers.run_quiet(helpers.tiny(base, {"name=tight", "model.moe.capacity_factor=0.5"}), {runs = dir})
    local dropless, roomy, tight = steps(dir, "dropless"), steps(dir, "roomy"), steps(dir, "tight")
    assert.equal(3, #tight)
    for i = 1, 3 do
      assert.equal(dropless[i]:match("loss %S+  bpb %S+"), roomy[i]:match("loss %S+  bpb %S+"))
      assert.equal(dropless[i]:match("gnorm %S+"), roomy[i]:match("gnorm %S+"))
      assert.equal("0", roomy[i]:match("drops (%d+)"))
      assert.equal("0", dropless[i]:match("drops (%d+)"))
      -- at 0.5 an expert keeps ceil(0.5 N k / E) rows: at least half the assignments go, two steps a window
      local drops = tonumber(tight[i]:match("drops (%d+)"))
      assert.is_true(drops >= 2 * 2 * (4 * 64 * 2) / 2, tight[i])
      assert.are_not.equal(dropless[i]:match("gnorm %S+"), tight[i]:match("gnorm %S+"))
    end
    local f = assert(io.open(dir .. "/tight/metrics.jsonl"))
    assert.truthy(f:read("a"):find('"moe_drops":%d'))
    f:close()
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

describe("model.init", function()
  local function params(overrides)
    local m = build("experiments/tiny.lua", overrides)
    local out = {}
    for _, p in ipairs(m:named_parameters()) do out[p.name] = p.tensor end
    return out
  end
  local function differ(a, b)
    local names = {}
    for name, t in pairs(a) do
      if not dm.allclose(t, b[name], {rtol = 0, atol = 0}) then names[#names + 1] = name end
    end
    table.sort(names)
    return names
  end
  local base = params()

  it("defaults to the choices the A/B made (pinned; docs/training.md, \"Learning quality\")", function()
    local cfg = config.load("experiments/tiny.lua")
    local m = cfg.model
    assert.same({branch_out = "fan_in", engram_std = 0.02, dt_bias = "log_uniform", conv = "normal",
                 a_log = "uniform", engram_conv = "uniform"}, config.plain(m.init))
    assert.same({"softplus", "projection", true, "softmax", "adamw", "sparse"},
                {m.kda.gate, m.engram.output, m.engram.alpha_gain, m.moe.router, cfg.optim.gates,
                 cfg.optim.engram_adam})
    assert.is_nil(m.engram.dilation)                     -- the form's own: 1 for projection
    assert.equal(1, build("experiments/tiny.lua").block.engram.dilation)
  end)

  it("branch_out = depth scales the three branch outputs by (3 max_iter)^-1/2 and touches nothing else", function()
    local p = params {"model.init.branch_out=depth"}
    assert.same({"block.engram.we.weight", "block.kda.wo.weight", "block.moe.write.weight"}, differ(base, p))
    local spec = params {"model.engram.output=spec"}             -- the spec form's output is W_v
    assert.same({"block.engram.wv.weight", "block.kda.wo.weight", "block.moe.write.weight"},
                differ(spec, params {"model.engram.output=spec", "model.init.branch_out=depth"}))
    for _, name in ipairs(differ(base, p)) do
      assert.is_true(dm.allclose(p[name], base[name] * (3 * 2) ^ -0.5, {rtol = 1e-6, atol = 0}), name)
    end
  end)

  it("engram_std sets the tables' std, conv = uniform draws U(-1/2, 1/2), each touching its own", function()
    local p = params {"model.init.engram_std=1"}
    assert.same({"block.engram.table"}, differ(base, p))
    assert.is_true(dm.allclose(p["block.engram.table"], base["block.engram.table"] * 50, {rtol = 1e-6, atol = 0}))
    local q = params {"model.init.conv=uniform"}
    assert.same({"block.kda.conv_k", "block.kda.conv_q", "block.kda.conv_v"}, differ(base, q))
    for _, name in ipairs {"block.kda.conv_k", "block.kda.conv_q", "block.kda.conv_v"} do
      assert.is_true(q[name]:abs():max():item() <= 0.5)
    end
  end)

  it("dt_bias = log_uniform gives softplus(dt_bias) in [1e-3, 1e-1]", function()
    local dt = (params {"model.init.dt_bias=log_uniform"}["block.kda.dt_bias"]:exp() + 1):log()
    assert.is_true(dt:min():item() >= 1e-3 * (1 - 1e-5) and dt:max():item() <= 1e-1 * (1 + 1e-5))
    assert.is_true(dt:max():item() / dt:min():item() > 10)    -- spread over the range, not one value
  end)

  it("a_log = uniform draws A = exp(A_log) uniform on [1, 16]; log_uniform, log A uniform on [0, ln 16]", function()
    local p = params {"model.init.a_log=log_uniform"}
    assert.equal("block.kda.A_log", table.concat(differ(base, p), " "))
    local A = base["block.kda.A_log"]:exp()
    assert.is_true(A:min():item() >= 1 - 1e-5 and A:max():item() <= 16 * (1 + 1e-5))
    local logA = p["block.kda.A_log"]
    assert.is_true(logA:min():item() >= 0 and logA:max():item() <= math.log(16) + 1e-6)
  end)

  -- the log-decay g at f = 0, per channel, of a tiny model's KDA under these settings
  local function start_decay(sets)
    local kda = build("experiments/tiny.lua", sets).block.kda
    return dm.no_grad(dm.kda_gate, dm.zeros({kda.dt_bias:numel()}), kda.A_log, kda.dt_bias,
                      {kind = kda.gate, lb = kda.gate_lb})
  end

  it("dt_bias = decay starts either gate at g = -A dt, the softplus gate's start with log_uniform's dt", function()
    local want = start_decay {"model.kda.gate=softplus", "model.init.dt_bias=log_uniform", "model.init.a_log=uniform"}
    local A = build("experiments/tiny.lua", {"model.init.a_log=uniform"}).block.kda.A_log:exp()
    local dt = -want:reshape({A:numel(), -1}) / A:reshape({-1, 1})
    assert.is_true(dt:min():item() >= 1e-3 * (1 - 1e-4) and dt:max():item() <= 1e-1 * (1 + 1e-4))
    for _, gate in ipairs {"softplus", "bounded"} do
      local got = start_decay {"model.kda.gate=" .. gate, "model.init.dt_bias=decay", "model.init.a_log=uniform"}
      assert.is_true(dm.allclose(got, want, {rtol = 1e-4, atol = 1e-7}), gate)
    end
    local saturated = start_decay {"model.kda.gate=bounded", "model.init.dt_bias=log_uniform"}   -- saturated
    assert.is_false(dm.allclose(saturated, want, {rtol = 1e-2, atol = 0}))
  end)

  it("refuses dt_bias = decay where the bounded gate cannot reach -16 dt", function()
    refused({"model.init.dt_bias=decay", "model.kda.gate=bounded", "model.kda.gate_lb=-1.5"}, "model.init.dt_bias = decay",
            "model.kda.gate_lb = -1.5", "-1.6")
    assert.is_true(pcall(config.load, "experiments/tiny.lua", {"model.init.dt_bias=decay", "model.kda.gate_lb=-1.5"}))
  end)

  it("engram_conv = uniform draws Engram's convolution from U(-1/2, 1/2), before it nothing moves", function()
    local zeros = params {"model.init.engram_conv=zeros"}
    assert.equal(0, zeros["block.engram.conv"]:abs():max():item())
    local p = base
    local moved = table.concat(differ(zeros, p), " ")
    assert.truthy(moved:find("block.engram.conv", 1, true))
    for _, before in ipairs {"block.kda", "block.engram.wk", "block.engram.wv", "emb."} do   -- drawn before it
      assert.is_nil(moved:find(before, 1, true), before)
    end
    assert.is_true(p["block.engram.conv"]:abs():max():item() <= 0.5 and p["block.engram.conv"]:abs():min():item() > 0)
  end)

  it("branch_out = depth with engram.output = projection scales W_e, the branch's output, and not W_v", function()
    local plain = params {"model.engram.output=projection"}
    local deep = params {"model.engram.output=projection", "model.init.branch_out=depth"}
    assert.same({"block.engram.we.weight", "block.kda.wo.weight", "block.moe.write.weight"}, differ(plain, deep))
  end)
end)

describe("the balancing options", function()
  it("balance = proportional moves each bias by gamma times its relative load error; sign stays the default",
     function()
    local m = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4, lfb_gamma = 0.1,
                         balance = "proportional"})
    m.counts = dm.tensor({6, 2, 0, 0}, {dtype = "i64"})        -- mean 2
    m:update_balance()
    assert.is_true(dm.allclose(m.lfb_bias, dm.tensor({-0.2, 0, 0.1, 0.1}), {rtol = 1e-6, atol = 1e-7}))
    local s = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4, lfb_gamma = 0.1})
    s.counts = dm.tensor({6, 2, 0, 0}, {dtype = "i64"})
    s:update_balance()
    assert.is_true(dm.allclose(s.lfb_bias, dm.tensor({-0.1, 0, 0.1, 0.1}), {rtol = 1e-6, atol = 1e-7}))
    assert.equal("sign", config.load("experiments/tiny.lua").model.moe.balance)
  end)

  it("balance = log moves each bias by gamma log((mean + 1) / (load + 1)): as far up for a starved expert as down for a busy one",
     function()
    local m = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4, lfb_gamma = 0.1,
                         balance = "log"})
    m.counts = dm.tensor({11, 2, 2, 1}, {dtype = "i64"})       -- mean 4: (mean + 1) / (load + 1) = 5/12, 5/3, 5/3, 5/2
    m:update_balance()
    local want = {0.1 * math.log(5 / 12), 0.1 * math.log(5 / 3), 0.1 * math.log(5 / 3), 0.1 * math.log(5 / 2)}
    assert.is_true(dm.allclose(m.lfb_bias, dm.tensor(want), {rtol = 1e-6, atol = 1e-7}))
    m.counts = dm.tensor({3, 3, 3, 3}, {dtype = "i64"})        -- balanced: no step
    m:update_balance()
    assert.is_true(dm.allclose(m.lfb_bias, dm.tensor(want), {rtol = 1e-6, atol = 1e-7}))
    m.counts = dm.tensor({0, 0, 0, 0}, {dtype = "i64"})        -- nothing routed: no step, no NaN
    m:update_balance()
    assert.is_true(dm.allclose(m.lfb_bias, dm.tensor(want), {rtol = 1e-6, atol = 1e-7}))
  end)

  it("router_dtype = f32 runs the router's product in f32 under another compute dtype; router_std sets its init",
     function()
    local seen = {}
    local linear = dm.linear
    local ok, err = pcall(function()
      local m = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4, router_dtype = "f32",
                           router_std = 1e-3}):compute_in("f64")   -- on the CPU f64 stands in for bf16
      assert.is_true(m.router.weight:abs():max():item() < 1e-2)
      dm.linear = function(x, w) seen[#seen + 1] = x.dtype .. "/" .. w.dtype; return linear(x, w) end
      dm.scope(function() m:forward(dm.randn({1, 3, 8}, {seed = 1, dtype = "f64"})) end)
    end)
    dm.linear = linear
    assert.is_true(ok, err)
    assert.equal("f32/f32", seen[1])               -- the router first, in f32
    assert.equal("f64/f64", seen[2])               -- the rest in the compute dtype
  end)

  it("router_dtype = f32_sums: the product of the compute dtype's operands, its f32 sums not rounded", function()
    local m = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4,
                         router_dtype = "f32_sums"}):compute_in("bf16")
    local x = dm.randn({5, 8}, {seed = 2}):to("bf16")
    local want = dm.linear(x:to("f32"), m.router.weight:to("bf16"):to("f32"))   -- exact products, f32 sums
    local got = dm.no_grad(function() return m:router_scores(x) end)
    assert.equal("f32", got.dtype)
    assert.is_true(dm.allclose(got, want, {rtol = 1e-6, atol = 1e-6}))
    -- the compute dtype's product rounds them: the sums are what this option keeps
    local rounded = dm.no_grad(function() return m.router:forward(x):to("f32") end)
    assert.is_false(dm.allclose(rounded, want, {rtol = 1e-6, atol = 1e-6}))
    -- in a float64 twin the product stays in f64 (as the compute dtype's router does)
    local twin = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4,
                            router_dtype = "f32_sums"}):cast("f64")
    local x64 = dm.randn({5, 8}, {seed = 3, dtype = "f64"})
    local s64 = dm.no_grad(function() return twin:router_scores(x64) end)
    assert.equal("f64", s64.dtype)
    assert.is_true(dm.allclose(s64, dm.linear(x64, twin.router.weight), {rtol = 1e-15, atol = 0}))
    -- the router learns through it: its gradient reaches the f32 master
    local scores = m:router_scores(x)
    scores:sum():backward()
    assert.is_true(m.router.weight.grad:abs():sum():item() > 0)
  end)
end)

describe("the structural options", function()
  local function grads_agree(overrides)
    local helpers = require "tests.lua.helpers"
    local x, prefix = tiny_batch()
    local names = helpers.grads_match(build("experiments/tiny.lua", overrides),
                                      build("experiments/tiny.lua", overrides):cast("f64"),
                                      function(m) return m:forward(x, prefix).loss end)
    return table.concat(names, " ")
  end

  it("engram.output: W_e after a plain convolution, or the spec's form, float32 against float64", function()
    local names = grads_agree {"model.engram.output=projection"}
    assert.truthy(names:find("block.engram.we.weight", 1, true))
    assert.is_nil(names:find("block.engram.norm", 1, true))          -- the projection form has no rmsnorm(vt)
    local spec = grads_agree {"model.engram.output=spec"}
    assert.truthy(spec:find("block.engram.norm.gain", 1, true))
    assert.is_nil(spec:find("block.engram.we", 1, true))
  end)

  it("engram's dilation, alpha's gain and a drawn convolution, float32 against float64", function()
    local names = grads_agree {"model.engram.output=projection", "model.engram.dilation=1",
                               "model.engram.alpha_gain=true", "model.init.engram_conv=uniform"}
    assert.truthy(names:find("block.engram.alpha_gain", 1, true))
    assert.truthy(grads_agree({"model.engram.output=spec"}):find("block.engram.alpha_gain", 1, true))
    assert.is_nil(grads_agree({"model.engram.alpha_gain=false"}):find("alpha_gain", 1, true))
    local m = build("experiments/tiny.lua", {"model.engram.dilation=2"})
    assert.equal(2, m.block.engram.dilation)
    assert.equal(3, build("experiments/tiny.lua", {"model.engram.output=spec"}).block.engram.dilation)  -- the largest order
  end)

  it("alpha's gain is a gain: ones give the loss without it, bit for bit, and it sits with AdamW", function()
    local x, prefix = tiny_batch()
    local on = build("experiments/tiny.lua")
    local off = build("experiments/tiny.lua", {"model.engram.alpha_gain=false"})
    dm.no_grad(function() assert.equal(off:forward(x, prefix).loss:item(), on:forward(x, prefix).loss:item()) end)
    local groups = require "dormouse.optim.groups"
    for _, e in ipairs(on:named_parameters()) do
      if e.name == "block.engram.alpha_gain" then assert.same({"adamw", "gain"}, {groups.classify(e)}) end
    end
  end)

  it("router_cosine = s: logits s cos(u, w_e), in [-s, s], float32 against float64", function()
    grads_agree {"model.moe.router_cosine=10"}
    refused({"model.moe.router_cosine=10", "model.moe.router_dtype=f32_sums"},   -- its logits are f32 anyway
            "model.moe.router_cosine takes its logits in f32", "router_dtype = f32_sums is not read with it")
    local m = build("experiments/tiny.lua", {"model.moe.router_cosine=10"})
    local moe = m.block.moe
    local x = dm.randn({5, m.cfg.d}, {seed = 3}) * 40
    local got = dm.no_grad(function() return moe:router_scores(x) end)
    local w = moe.router.weight
    for t = 1, 5 do
      local row = x:narrow(1, t, 1)
      for e = 1, moe.experts do
        local we = w:narrow(1, e, 1)
        local cos = (row * we):sum():item() / math.sqrt((row * row):sum():item() * (we * we):sum():item())
        assert.near(10 * cos, got:narrow(1, t, 1):narrow(2, e, 1):item(), 1e-4)
      end
    end
    assert.is_true(got:abs():max():item() <= 10 + 1e-4)
    local plain = build("experiments/tiny.lua")
    assert.is_nil(plain.block.moe.router_cosine)
    local want = dm.no_grad(function() return plain.block.moe.router:forward(x) end)
    assert.is_true(dm.allclose(dm.no_grad(function() return plain.block.moe:router_scores(x) end), want))
  end)

  it("router = softmax: the top k of logits + bias, softmax gates, float32 against float64", function()
    grads_agree {"model.moe.router=softmax"}
    grads_agree {"model.moe.router=softmax", "model.moe.router_dtype=f32"}
    grads_agree {"model.moe.router=softmax", "model.moe.router_dtype=f32_sums"}
    local x, prefix = tiny_batch()
    local soft = build("experiments/tiny.lua", {"model.moe.router=softmax"})
    local plain = build("experiments/tiny.lua", {"model.moe.router=sigmoid"})
    dm.no_grad(function()
      assert.are_not.equal(plain:forward(x, prefix).loss:item(), soft:forward(x, prefix).loss:item())
    end)
    -- the gates by hand: softmax over each token's k chosen logits, chosen by logits + bias
    local logits = dm.tensor({{0.5, -1, 2, 0.25}})
    local idx, w = dm.moe_route(logits, dm.tensor({0, 3, -1, 0}), 2, "softmax")
    assert.same({{1, 2}}, idx:totable())       -- 0-based: expert 1 (-1 + 3) then 2 (2 - 1) over 0 (0.5)
    local e = {math.exp(-1), math.exp(2)}
    assert.is_true(dm.allclose(w, dm.tensor({{e[1] / (e[1] + e[2]), e[2] / (e[1] + e[2])}}), {rtol = 1e-6, atol = 0}))
    -- the defaults (docs/training.md, "Balance at b1"): the softmax router everywhere, and b1 balances
    -- in proportion to the load error
    assert.equal("softmax", config.load("experiments/tiny.lua").model.moe.router)
    assert.equal("sign", config.load("experiments/tiny.lua").model.moe.balance)
    assert.equal("proportional", config.load("experiments/b1.lua").model.moe.balance)
    assert.equal("compute", config.load("experiments/b1.lua").model.moe.router_dtype)
  end)

  it("moe.aux_balance: E sum f_e P_e by hand, in the loss at its weight, float32 against float64", function()
    for _, form in ipairs {"sigmoid", "softmax"} do
      local m = nn.MoE(8, {experts = 4, top_k = 2, rank = 2, shared_rank = 2, ffn = 4, aux_balance = 0.5,
                           router = form}):compute_in("f64")
      local scores = dm.randn({5, 4}, {seed = 3, dtype = "f64"})
      local counts = dm.tensor({4, 3, 2, 1}, {dtype = "i64"})
      local s, want = scores:totable(), 0
      for e = 1, 4 do
        local P = 0
        for t = 1, 5 do
          local row, p = s[t], nil
          local z = 0
          for j = 1, 4 do z = z + (form == "softmax" and math.exp(row[j]) or 1 / (1 + math.exp(-row[j]))) end
          p = (form == "softmax" and math.exp(row[e]) or 1 / (1 + math.exp(-row[e]))) / z
          P = P + p / 5
        end
        want = want + ({4, 3, 2, 1})[e] / 10 * P
      end
      assert.is_true(math.abs(m:balance_term(scores, counts):item() - 4 * want) < 1e-12, form)
    end
    local names = grads_agree {"model.moe.aux_balance=0.01"}
    assert.truthy(names:find("block.moe.router.weight", 1, true))
    local x, prefix = tiny_batch()
    local on, off = build("experiments/tiny.lua", {"model.moe.aux_balance=0.5"}), build("experiments/tiny.lua")
    dm.scope(function()
      local a, b = on:forward(x, prefix), off:forward(x, prefix)
      local term = a.extras.aux_balance:item()
      assert.is_true(term >= 1 - 1e-6)                      -- at least 1: its value at a perfect balance
      assert.is_true(math.abs(a.loss:item() - (b.loss:item() + 0.5 * term)) < 1e-5)
      assert.is_nil(b.extras and b.extras.aux_balance)
    end)
    dm.no_grad(function()                                 -- evals stay the pure CE
      assert.equal(off:forward(x, prefix).loss:item(), on:forward(x, prefix).loss:item())
    end)
  end)

  it("moe.aux_balance is named and counted, and refused with recompute or segments", function()
    local log = arm_log("model.moe.aux_balance=0.01")          -- the term is 1 at a perfect balance, more off it
    require("tests.lua.helpers").has(log, "arms: auxiliary balance loss at weight 0.01")
    assert.truthy(log:find("step      6 [^\n]- aux_balance 1%.%d+"), log)
    refused({"model.moe.aux_balance=0.01", "model.recompute=true"}, "model.moe.aux_balance", "model.recompute")
    refused({"model.moe.aux_balance=0.01", "model.segment=8", "seq=16"}, "model.moe.aux_balance", "model.segment")
  end)

  it("optim.gates = muon gives KDA's gate projections to Muon, their biases stay with AdamW", function()
    local groups = require "dormouse.optim.groups"
    local m = build("experiments/tiny.lua")
    local by, mu = {}, {}
    for _, e in ipairs(m:named_parameters()) do
      by[e.name] = (groups.classify(e))
      mu[e.name] = (groups.classify(e, {gates = "muon"}))
    end
    for _, name in ipairs {"wb", "wg1", "wg2", "wo1", "wo2"} do
      assert.equal("adamw", by["block.kda." .. name .. ".weight"], name)
      assert.equal("muon", mu["block.kda." .. name .. ".weight"], name)
    end
    assert.equal("adamw", mu["block.kda.wo2.bias"])
    assert.equal("adamw", mu["block.moe.router.weight"])
    local optim = require "dormouse.optim"
    local cfg = config.load("experiments/tiny.lua", {"optim.gates=muon"})
    local opt = optim.new(m, cfg.optim, cfg.schedule, cfg.steps, {quiet = true})
    local in_muon = {}
    for _, g in ipairs(opt.groups) do
      for _, e in ipairs(g.entries) do in_muon[e.name] = g.name == "muon" or nil end
    end
    assert.is_true(in_muon["block.kda.wg2.weight"])
    assert.is_nil(in_muon["block.kda.wo2.bias"])
  end)

  it("aux.future: a head on the byte after next, in the training loss only, float32 against float64", function()
    local names = grads_agree {"model.aux.future=0.1"}
    assert.truthy(names:find("future_head.weight", 1, true))
    assert.is_nil(grads_agree({}):find("future_head", 1, true))        -- off: no head at all
    local m = build("experiments/tiny.lua", {"model.aux.future=0.1"})
    local plain = build("experiments/tiny.lua")
    local x, prefix = tiny_batch()
    dm.no_grad(function()                          -- evals stay the pure CE: the same numbers without the head
      local a, b = m:forward(x, prefix), plain:forward(x, prefix)
      assert.equal(b.loss:item(), a.loss:item())
      assert.is_nil(a.extras)
    end)
    local on = dm.scope(function() return m:forward(x, prefix).extras.aux_future:item() end)
    assert.is_true(on > 0)
    local segments = require "dormouse.segments"
    local helpers = require "tests.lua.helpers"
    helpers.has(helpers.err_of(segments.backward, m, x, prefix, 8, 1), "model.aux.future", "model.segment")
  end)

  it("aux.jepa: a later representation predicted, 1 - cosine to a held target, in the training loss only",
     function()
    local names = grads_agree {"model.aux.jepa=0.5", "model.aux.jepa_offset=3"}     -- float32 against float64
    assert.truthy(names:find("jepa_in.weight", 1, true))
    assert.is_nil(grads_agree({}):find("jepa", 1, true))                            -- off: no predictor
    local m = build("experiments/tiny.lua", {"model.aux.jepa=0.5", "model.aux.jepa_offset=3"})
    local plain = build("experiments/tiny.lua")
    local x, prefix = tiny_batch()
    local pure = dm.no_grad(function()             -- evals stay the pure CE: the same numbers without it
      local a, b = m:forward(x, prefix), plain:forward(x, prefix)
      assert.equal(b.loss:item(), a.loss:item())
      assert.is_nil(a.extras)
      return a.loss:item()
    end)
    dm.scope(function()
      local out = m:forward(x, prefix)
      local aux = out.extras.aux_jepa:item()
      assert.is_true(aux > 0 and aux < 2)          -- 1 - cosine
      assert.is_true(math.abs(out.loss:item() - (pure + 0.5 * aux)) < 1e-5)
      out.loss:backward()
      assert.is_true(m.jepa_in.weight.grad:abs():max():item() > 0)
    end)
    -- under a loss mask (records) the positions whose own and target positions are scored: all
    -- scored is the plain mean, none scored adds nothing, a part another mean
    dm.scope(function()
      local T = x:size(2) - 1
      local function jepa_of(mask) return m:forward(x, prefix, {mask = mask}).extras.aux_jepa:item() end
      local plain_aux = m:forward(x, prefix).extras.aux_jepa:item()
      assert.is_true(math.abs(jepa_of(dm.ones({x:size(1), T}, {dtype = "u8"})) - plain_aux) < 1e-6)
      assert.equal(0, jepa_of(dm.zeros({x:size(1), T}, {dtype = "u8"})))
      local half = dm.cat({dm.zeros({x:size(1), T // 2}, {dtype = "u8"}), dm.ones({x:size(1), T - T // 2}, {dtype = "u8"})}, 2)
      assert.is_true(math.abs(jepa_of(half) - plain_aux) > 1e-6)
    end)
    local segments = require "dormouse.segments"
    local helpers = require "tests.lua.helpers"
    helpers.has(helpers.err_of(segments.backward, m, x, prefix, 8, 1), "model.aux.jepa", "model.segment")
    local log = arm_log("model.aux.jepa=0.1")
    helpers.has(log, "arms: JEPA: the representation 8 bytes ahead predicted at weight 0.1")
    assert.truthy(log:find("step      3 .- aux_jepa %d"), log)
  end)

  it("aux.future is named at the start and counted on the log line", function()
    local helpers = require "tests.lua.helpers"
    local log = arm_log("model.aux.future=0.1")
    helpers.has(log, "arms: future-byte head at weight 0.1", "gnorm")
    assert.truthy(log:find("step      3 .- aux_future %d"), log)
    assert.is_nil(log:match("eval[^\n]*aux_future"), log)
  end)

  it("aux.draft: DSpark's draft head, in the training loss only; its accept rate at evaluation", function()
    local names = grads_agree {"model.aux.draft=0.1"}
    assert.truthy(names:find("draft_head.weight", 1, true))
    local m = build("experiments/tiny.lua", {"model.aux.draft=0.1"})
    local plain = build("experiments/tiny.lua")
    local x, prefix = tiny_batch()
    dm.no_grad(function()
      local a, b = m:forward(x, prefix), plain:forward(x, prefix)
      assert.equal(b.loss:item(), a.loss:item())   -- evals stay the pure CE
      assert.is_nil(a.extras)
      -- the accept rate by hand: the draft's greedy byte against the model's own at t+1
      local T = 33
      local hs = a.fin_logits                      -- [B, T, 256]
      local want = 0
      local ours = hs:narrow(2, 2, T - 1):argmax(-1):totable()
      local hbar
      do                                           -- the fin readout's input again, as the pass makes it
        local h, sum = m.emb:forward(x:narrow(2, 1, T)), nil
        for _ = 1, m.max_iter do h = m.block:forward(h, x:narrow(2, 1, T), prefix); sum = sum and sum + h or h end
        hbar = sum * (1 / m.max_iter)
      end
      local d = m.draft_head:forward(m.rmsf:forward(hbar:narrow(2, 1, T - 1) + m.emb:forward(x:narrow(2, 2, T - 1))))
      local drafted = d:argmax(-1):totable()
      for i = 1, 2 do for t = 1, T - 1 do if drafted[i][t] == ours[i][t] then want = want + 1 end end end
      assert.near(want / (2 * (T - 1)), a.measures.draft_accept:item(), 1e-6)
    end)
    local on = dm.scope(function() return m:forward(x, prefix).extras.aux_draft:item() end)
    assert.is_true(on > 0)
    local segments = require "dormouse.segments"
    local helpers = require "tests.lua.helpers"
    helpers.has(helpers.err_of(segments.backward, m, x, prefix, 8, 1), "model.aux.draft", "model.segment")
    helpers.has(helpers.err_of(helpers.tiny, {"model.segment=16", "seq=32", "model.aux.draft=0.1"}),
                "model.aux.draft = 0")
  end)

  it("aux.draft is named at the start, counted on the log line and measured on the eval line", function()
    local helpers = require "tests.lua.helpers"
    local log = arm_log({"model.aux.draft=0.1", "eval.every=6", "eval.windows=4", "eval.baseline={}"})
    helpers.has(log, "arms: DSpark draft head at weight 0.1")
    assert.truthy(log:find("step      3 .- aux_draft %d"), log)
    assert.truthy(log:find("eval      6 [^\n]- draft_accept 0%.%d+"), log)
  end)

  it("kda.output_bias = false: the output gate's projection has no bias", function()
    local names = grads_agree {"model.kda.output_bias=false"}
    assert.is_nil(names:find("block.kda.wo2.bias", 1, true))
    assert.truthy(names:find("block.kda.wo2.weight", 1, true))
  end)
end)

describe("LOOM (model.loom)", function()
  it("is the identity at initialisation, bit for bit; its gates learn, by AdamW; named and counted", function()
    local x, prefix = tiny_batch()
    local plain, loom = build("experiments/tiny.lua"), build("experiments/tiny.lua", {"model.loom=true"})
    dm.scope(function()
      local a, b = plain:forward(x, prefix), loom:forward(x, prefix)
      assert.equal(a.loss:item(), b.loss:item())
      assert.equal(0, b.extras.loom:item())
      b.loss:backward()
      assert.is_true(loom.loom_gate.grad:abs():max():item() > 0)
    end)
    local groups = require "dormouse.optim.groups"
    local why = {}
    for _, e in ipairs(groups.assign(loom:named_parameters()).adamw) do why[e.name] = e.why end
    assert.equal("gate", why.loom_gate)
    local helpers = require "tests.lua.helpers"
    local log = arm_log("model.loom=true")
    helpers.has(log, "arms: LOOM: a zero gate per iteration on its normalised write")
    assert.truthy(log:find("step      6 [^\n]- loom 0%.%d+"), log)
  end)

  it("the future head learns with AdamW, as the head does", function()
    local groups = require "dormouse.optim.groups"
    local by = groups.assign(build("experiments/tiny.lua", {"model.aux.future=0.1"}):named_parameters())
    local names = {}
    for _, e in ipairs(by.adamw) do names[e.name] = e.why end
    assert.equal("head", names["future_head.weight"])
  end)
end)

describe("retraction (model.moe.retract_every)", function()
  it("replaces each expert's Ug and Uu by its polar factor: orthonormal columns, W = U P with P symmetric", function()
    local m = nn.MoE(32, {experts = 3, top_k = 1, rank = 4, shared_rank = 2, ffn = 4})
    dm.no_grad(function() m.Ug:copy_(dm.randn({3, 32, 4}, {seed = 3}) * 0.3 + 0.05) end)   -- not orthonormal
    local before = m.Ug:detach():clone()
    m:retract()
    local U = m.Ug
    local eye = dm.tensor({{{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}}})
    assert.is_true((U:transpose(2, 3):matmul(U) - eye):abs():max():item() < 1e-5)
    local P = U:transpose(2, 3):matmul(before)
    assert.is_true((P - P:transpose(2, 3)):abs():max():item() < 1e-5)
    assert.is_true((m.Uu:transpose(2, 3):matmul(m.Uu) - eye):abs():max():item() < 1e-5)
  end)

  it("is named at the start and counted on the log line; off, the model takes no action after a step", function()
    local helpers = require "tests.lua.helpers"
    local log = arm_log("model.moe.retract_every=2")
    helpers.has(log, "arms: retraction of Ug, Uu to orthonormal columns every 2 steps")
    assert.truthy(log:find("step      3 [^\n]- retract 1 "), log)            -- step 2 of 1..3
    assert.truthy(log:find("step      6 [^\n]- retract 2 "), log)            -- steps 4 and 6
    assert.is_nil(build("experiments/tiny.lua"):after_step(2))
  end)

  it("has a probe of the factors' distance from orthonormal: 1 at a random init whatever d and r, 0 retracted",
     function()
    for _, shape in ipairs {{64, 4}, {256, 16}, {1024, 32}} do
      local m = nn.MoE(shape[1], {experts = 8, top_k = 1, rank = shape[2], shared_rank = 2, ffn = 4})
      local ortho = m:orthogonality()
      assert.is_true(math.abs(ortho - 1) < 0.1, string.format("d %d, r %d: %.4f", shape[1], shape[2], ortho))
      m:retract()
      assert.is_true(m:orthogonality() < 1e-3)
    end
  end)

  it("with model.moe.retract_when, retracts at a log window whose probe is above it; log.orthogonality shows it",
     function()
    local helpers = require "tests.lua.helpers"
    local log = arm_log({"model.moe.retract_when=0.5"})
    helpers.has(log, "arms: retraction of Ug, Uu to orthonormal columns at a log window whose ortho is above 0.5")
    assert.truthy(log:find("step      3 [^\n]- ortho 0%.9%d+ [^\n]- retract 1 "), log)   -- near the init: retracted
    assert.truthy(log:find("step      6 [^\n]- ortho 0%.[0-4]%d+ "), log)                  -- 3 steps after: near 0
    assert.is_nil(log:find("step      6 [^\n]- retract"), log)
    local shown = arm_log({"log.orthogonality=true"})
    assert.truthy(shown:find("step      6 [^\n]- ortho 0%.%d+ "), shown)
    assert.is_nil(arm_log({}):find("ortho", 1, true))                                       -- off by default
  end)
end)

describe("QAT (model.moe.qat)", function()
  local function batch()
    local x, prefix = tiny_batch()
    return x, prefix
  end

  it("forwards the factors' quantised values and passes their gradient straight through", function()
    local x, prefix = tiny_batch()
    local m = build("experiments/tiny.lua", {"model.moe.qat=nvfp4", "model.moe.qat_from=0"})
    local twin = build("experiments/tiny.lua")                 -- the same weights, the factors replaced
    assert.is_true(m:before_step(1, 10))
    assert.equal("nvfp4", m.block.moe.qat)
    dm.no_grad(function()
      for _, name in ipairs {"Ug", "Uu", "D"} do twin.block.moe[name]:copy_(dm.quantize(m.block.moe[name], "nvfp4")) end
    end)
    local function loss_of(model)
      return dm.scope(function()
        local out = model:forward(x, prefix)
        out.loss:backward()
        return out.loss:item(), out.extras and out.extras.qat:item()
      end)
    end
    local la, err = loss_of(m)
    local lb = loss_of(twin)
    assert.equal(lb, la)
    assert.is_true(err > 0.01 and err < 0.3, tostring(err))      -- nvfp4 on normal weights: some per cent
    do
      for _, name in ipairs {"Ug", "Uu", "D", "cg"} do
        local ga, gb = m.block.moe[name].grad, twin.block.moe[name].grad
        assert.is_true((ga - gb):abs():max():item() <= 1e-6 * gb:abs():max():item(), name)
      end
    end
  end)

  it("climbs the ladder fp8_e4m3, nvfp4, ternary over the steps after qat_from; off, nothing changes", function()
    local m = build("experiments/tiny.lua", {"model.moe.qat=ladder", "model.moe.qat_from=0.7"})
    local seen = {}
    for step = 1, 100 do m:before_step(step, 100); seen[step] = m.block.moe.qat or "-" end
    assert.same({"-", "fp8_e4m3", "fp8_e4m3", "nvfp4", "nvfp4", "ternary", "ternary"},
                {seen[70], seen[71], seen[80], seen[81], seen[90], seen[91], seen[100]})
    local plain = build("experiments/tiny.lua")
    assert.is_false(plain:before_step(1, 10))
    assert.is_nil(plain.block.moe.qat)
    local x, prefix = tiny_batch()
    assert.is_nil(dm.scope(function() return plain:forward(x, prefix).extras end))
  end)

  it("is named at the start and counted on the log line; a graph it would outdate is refused", function()
    local helpers = require "tests.lua.helpers"
    local log = arm_log({"model.moe.qat=ladder", "model.moe.qat_from=0.5"})
    helpers.has(log, "arms: QAT of the experts' factors after 0.5 of the steps: fp8_e4m3, nvfp4, ternary in thirds")
    assert.is_nil(log:match("step      3 [^\n]- qat "), log)                 -- steps 1..3: not yet
    assert.truthy(log:find("step      6 [^\n]- qat 0%.%d+"), log)
    helpers.has(helpers.err_of(helpers.tiny, {"graph=true", "model.moe.qat=ternary"}),
                "graph = true with model.moe.qat = ternary", "model.moe.qat_from = 0")
    assert.is_true((pcall(helpers.tiny, {"graph=true", "model.moe.qat=ternary", "model.moe.qat_from=0"})))
    helpers.has(helpers.err_of(helpers.tiny, {"model.moe.qat=int4"}), "fp8_e4m3", "ladder")
  end)
end)

describe("fp8 banks (model.moe.fp8)", function()
  -- the loss and every parameter's gradient of a model, after one forward and backward of x
  local function run(model, x, prefix)
    local loss, extras = dm.scope(function()
      local out = model:forward(x, prefix)
      out.loss:backward()
      return out.loss:item(), out.extras and out.extras.fp8 and out.extras.fp8:item()
    end)
    local grads = {}
    for _, e in ipairs(model:named_parameters()) do grads[e.name] = e.tensor.grad and e.tensor.grad:clone() end
    return loss, grads, extras
  end

  it("computes what QAT at fp8_e4m3 from the first step computes: the loss and every gradient, bit for bit", function()
    local x, prefix = tiny_batch()
    local m = build("experiments/tiny.lua", {"model.moe.fp8=true"})
    local qat = build("experiments/tiny.lua", {"model.moe.qat=fp8_e4m3", "model.moe.qat_from=0"})
    qat:before_step(1, 10)
    local la, ga, err = run(m, x, prefix)
    local lb, gb = run(qat, x, prefix)
    assert.equal(lb, la)
    assert.is_true(err > 0.005 and err < 0.05, tostring(err))    -- E4M3 under block scales: a few per cent
    local n = 0
    for name, g in pairs(gb) do
      assert.is_true(ga[name] ~= nil, name)
      assert.equal(0, (ga[name] - g):abs():max():item(), name)
      n = n + 1
    end
    assert.is_true(n > 10 and ga["block.moe.Ug"] ~= nil)
    -- and not the control's: the codes are not the masters
    local lc = run(build("experiments/tiny.lua"), x, prefix)
    assert.are_not.equal(lc, la)
  end)

  it("makes codes and stand-ins of the factors' shapes (a stand-in is NaN to any reader); bad ones are refused", function()
    local w = dm.randn({2, 3, 4})
    local s = dm.stand_in(w, "f32")
    assert.same({2, 3, 4}, s:shape())
    assert.is_true(s:sum():item() ~= s:sum():item())
    local codes, scales = dm.bank_fp8(w, "bf16")
    assert.same({2, 3, 32}, codes:shape())
    assert.same({2, 3, 1}, scales:shape())
    assert.equal("u8", codes.dtype)
    local helpers = require "tests.lua.helpers"
    helpers.has(helpers.err_of(function() return dm.bank_fp8(w, "f64") end), "no wider than x's")
    helpers.has(helpers.err_of(function() return dm.moe_experts(w, nil, nil, w, w, w, w, w, 1, {Ug = {codes, scales}}) end),
                "Uu's pair is missing")
  end)

  it("is named at the start and counted on the log line; QAT and LittleBit with it are refused", function()
    named_and_counted({"model.moe.fp8=true"}, "fp8 banks: the expert kernels read Ug, Uu, D as E4M3 codes", "fp8")
    refused({"model.moe.fp8=true", "model.moe.qat=nvfp4"}, "model.moe.fp8 with model.moe.qat = nvfp4")
    refused({"model.moe.fp8=true", "model.moe.littlebit=sign"}, "model.moe.fp8 with model.moe.littlebit = sign")
  end)
end)

describe("LittleBit (model.moe.littlebit)", function()
  -- the factor's LittleBit form by hand: row * sign(X) * col (+ the residual term)
  local function by_hand(moe, name)
    local function term(X, row, col) return row * X:sign() * col end
    local v = term(moe[name], moe[name .. "_row"], moe[name .. "_col"])
    if moe[name .. "_res"] then v = v + term(moe[name .. "_res"], moe[name .. "_res_row"], moe[name .. "_res_col"]) end
    return v
  end

  for _, form in ipairs {"sign", "residual"} do
    it("forwards " .. form .. "'s binary factors and passes the sign's gradient straight through", function()
      local x, prefix = tiny_batch()
      local m = build("experiments/tiny.lua", {"model.moe.littlebit=" .. form})
      local twin = build("experiments/tiny.lua")                  -- the same draws; its factors set by hand
      local moe, tm = m.block.moe, twin.block.moe
      dm.no_grad(function()
        for _, name in ipairs {"Ug", "Uu", "D"} do tm[name]:copy_(by_hand(moe, name)) end
      end)
      local function loss_of(model)
        return dm.scope(function()
          local out = model:forward(x, prefix)
          out.loss:backward()
          return out.loss:item()
        end)
      end
      assert.equal(loss_of(twin), loss_of(m))
      local function near(a, b, what)
        assert.is_true((a - b):abs():max():item() <= 1e-6 * b:abs():max():item(), what)
      end
      for _, name in ipairs {"Ug", "Uu", "D"} do
        local g = tm[name].grad
        near(moe[name].grad, g * moe[name .. "_row"] * moe[name .. "_col"], name)        -- straight through
        local row = moe[name .. "_row"]
        near(row.grad, (g * moe[name]:sign() * moe[name .. "_col"]):sum_to(row:shape()), name .. "_row")
        if form == "residual" then
          near(moe[name .. "_res"].grad, g * moe[name .. "_res_row"] * moe[name .. "_res_col"], name .. "_res")
        end
      end
    end)
  end

  it("starts each term's scales at the rank-1 fit of |X| and the residual latent at what the first leaves", function()
    local moe = build("experiments/tiny.lua", {"model.moe.littlebit=residual"}).block.moe
    local plain = build("experiments/tiny.lua").block.moe
    assert.equal(0, (moe.Ug - plain.Ug):abs():max():item())         -- the control's draws, untouched
    local X, E = moe.D, moe.D:size(1)
    local A = X:abs()
    local fit = A:sum_to({E, X:size(2), 1}) * A:sum_to({E, 1, X:size(3)}) / A:sum_to({E, 1, 1})
    local got = moe.D_row * moe.D_col
    assert.is_true((got - fit):abs():max():item() <= 1e-5 * fit:abs():max():item())
    local R = X - moe.D_row * X:sign() * moe.D_col
    assert.is_true((moe.D_res - R):abs():max():item() <= 1e-6)
    local e = (by_hand(moe, "D") - X):pow(2):sum():item() / X:pow(2):sum():item()
    local e1 = (moe.D_row * X:sign() * moe.D_col - X):pow(2):sum():item() / X:pow(2):sum():item()
    assert.is_true(e < e1 and e1 < 0.5, e .. " " .. e1)             -- the residual term halves the error or better
  end)

  it("puts the scales with AdamW and the residual latents with the banks under Muon", function()
    local groups = require "dormouse.optim.groups"
    local m = build("experiments/tiny.lua", {"model.moe.littlebit=residual"})
    local seen = {}
    for _, e in ipairs(m:named_parameters()) do seen[e.name] = (groups.classify(e)) end
    assert.equal("adamw", seen["block.moe.Ug_row"])
    assert.equal("adamw", seen["block.moe.D_res_col"])
    assert.equal("muon", seen["block.moe.D_res"])
    assert.equal("muon", seen["block.moe.Ug"])
  end)

  it("stores its banks, the residual latents too, as binary signs and loads its forward back bit for bit", function()
    local helpers = require "tests.lua.helpers"
    local probe = require "dormouse.probe"
    local runs = helpers.tmpdir()
    local function trained(name, format)
      helpers.run_quiet(helpers.tiny({"steps=2", "schedule.warmup=1", "log.every=2", "eval.every=0",
                                      "checkpoint.every=0", "name=" .. name, "model.moe.littlebit=residual",
                                      "checkpoint.banks=" .. format}), {runs = runs})
      return runs .. "/" .. name .. "/ckpt-2"
    end
    local x, prefix = tiny_batch()
    local losses, sizes = {}, {}
    for _, format in ipairs {"f32", "binary"} do
      local dir = trained(format, format)
      local m = probe.load(dir, ".")
      losses[format] = dm.no_grad(function() return m:forward(x, prefix).loss:item() end)
      sizes[format] = #helpers.read(dir .. "/model.safetensors")
      if format == "binary" then
        local raw = helpers.read(dir .. "/model.safetensors")
        helpers.has(raw:sub(9, 8 + string.unpack("<I8", raw)), '"block.moe.D_res.codes":{"dtype":"U8"')
      end
    end
    assert.equal(losses.f32, losses.binary)
    -- a bank of rows of n: 4 bytes an element in f32; ceil(n / 8) bytes of signs and ceil(n / 32)
    -- f32 scales a row in binary (the headers aside)
    local banks, want = require "dormouse.banks", 0
    local m = probe.load(runs .. "/f32/ckpt-2", ".")
    local state = train.named_state(m)
    for _, name in ipairs(banks.names(m)) do
      local t = state[name]
      local n = t:size(-1)
      want = want + 4 * t:numel() - t:numel() // n * (math.ceil(n / 8) + 4 * math.ceil(n / 32))
    end
    assert.equal(6, #banks.names(m))
    local saved = sizes.f32 - sizes.binary
    assert.is_true(math.abs(saved - want) < 2048, saved .. " " .. want)
    os.execute("rm -rf '" .. runs .. "'")
  end)

  it("is named at the start and counted on the log line; QAT or retraction with it is refused", function()
    named_and_counted({"model.moe.littlebit=sign"}, "LittleBit experts: Ug, Uu, D as row * sign(latent) * col", "lb_flip")
    refused({"model.moe.littlebit=sign", "model.moe.qat=nvfp4"}, "model.moe.littlebit = sign with model.moe.qat = nvfp4")
    refused({"model.moe.littlebit=residual", "model.moe.retract_every=10"}, "model.moe.retract_every = 0")
  end)
end)

describe("MSA (model.msa)", function()
  -- the branch's function by plain loops in double: per head and query, the top-k past blocks by
  -- q . mean(k over the block), then a softmax over their positions and the query's block up to it
  local function reference(m, u)
    local W = {}
    for _, name in ipairs {"wq", "wk", "wv", "wo"} do W[name] = m[name].weight:to("f64"):totable() end
    local x = u:totable()
    local B, T, d, H, dh, n, k = #x, #x[1], #x[1][1], m.heads, m.head_dim, m.block, m.top_k
    local function proj(w, row) local out = {} for i = 1, #w do local a = 0 for j = 1, #row do a = a + w[i][j] * row[j] end out[i] = a end return out end
    local out = {}
    for b = 1, B do
      local q, kk, v = {}, {}, {}
      for t = 1, T do q[t], kk[t], v[t] = proj(W.wq, x[b][t]), proj(W.wk, x[b][t]), proj(W.wv, x[b][t]) end
      if m.q_norm then                               -- qk_norm: each head's q and k RMS-normalised, times its gain
        local gq, gk = m.q_norm.gain:to("f64"):totable(), m.k_norm.gain:to("f64"):totable()
        local function rms(vec, g)
          for h = 0, H - 1 do
            local ss = 0
            for e = 1, dh do ss = ss + vec[h * dh + e] ^ 2 end
            local r = 1 / math.sqrt(ss / dh + m.q_norm.eps)
            for e = 1, dh do vec[h * dh + e] = vec[h * dh + e] * r * g[e] end
          end
        end
        for t = 1, T do rms(q[t], gq); rms(kk[t], gk) end
      end
      local o = {}
      for t = 1, T do o[t] = {} end
      for h = 0, H - 1 do
        local function dot(a, c) local s = 0 for e = 1, dh do s = s + a[h * dh + e] * c[h * dh + e] end return s end
        local nb = math.ceil(T / n)
        local kbar = {}
        for j = 0, nb - 1 do                         -- a short last block's mean counts its padding as zeros
          local mean = {}
          for e = 1, H * dh do mean[e] = 0 end
          for s = j * n + 1, math.min(T, (j + 1) * n) do for e = 1, H * dh do mean[e] = mean[e] + kk[s][e] / n end end
          kbar[j] = mean
        end
        for t = 1, T do
          local bt = (t - 1) // n
          local cand = {}
          for j = 0, bt - 1 do cand[#cand + 1] = {j, dot(q[t], kbar[j])} end
          table.sort(cand, function(a, c) return a[2] > c[2] end)
          local reads = {}
          for i = 1, math.min(k, #cand) do for s = cand[i][1] * n + 1, (cand[i][1] + 1) * n do reads[#reads + 1] = s end end
          for s = bt * n + 1, t do reads[#reads + 1] = s end
          local mx, w, z = -math.huge, {}, 0
          for i, s in ipairs(reads) do w[i] = dot(q[t], kk[s]) / math.sqrt(dh); mx = math.max(mx, w[i]) end
          for i in ipairs(reads) do w[i] = math.exp(w[i] - mx); z = z + w[i] end
          for e = 1, dh do
            local a = 0
            for i, s in ipairs(reads) do a = a + w[i] / z * v[s][h * dh + e] end
            o[t][h * dh + e] = a
          end
        end
      end
      out[b] = {}
      for t = 1, T do out[b][t] = proj(W.wo, o[t]) end
    end
    return dm.tensor(out, {dtype = "f64"})
  end

  it("is its definition in float64 (short last blocks, k of 1 and 2, qk_norm), identity at initialisation", function()
    for _, k in ipairs {1, 2, -2} do                 -- -2: top 2 with q and k RMS-normalised
      local m = nn.MSA(6, 2, 3, {block = 4, top_k = math.abs(k), qk_norm = k < 0})
      assert.equal(0, m.wo.weight:abs():max():item())           -- W_o zero: the branch adds 0
      dm.no_grad(function()
        m.wo.weight:copy_(dm.randn({6, 6}, {seed = 9}) * 0.5)
        if m.q_norm then                             -- gains away from their ones
          m.q_norm.gain:copy_(dm.rand({3}, {seed = 10}) + 0.5)
          m.k_norm.gain:copy_(dm.rand({3}, {seed = 11}) + 0.5)
        end
      end)
      local u = dm.randn({2, 10, 6}, {seed = 4, dtype = "f64"}) * 2
      local got, want = m:forward(u), reference(m, u)
      assert.is_true((got - want):abs():max():item() < 1e-12, tostring((got - want):abs():max():item()))
    end
  end)

  it("leaves the control's draws and loss as they are at initialisation; its weights learn", function()
    local x, prefix = tiny_batch()
    local plain = build("experiments/tiny.lua")
    local p = {}
    for _, e in ipairs(plain:named_parameters()) do p[e.name] = e.tensor end
    for _, qk in ipairs {"false", "true"} do
      local on = build("experiments/tiny.lua", {"model.msa.top_k=2", "model.msa.block=8", "model.msa.qk_norm=" .. qk})
      for _, e in ipairs(on:named_parameters()) do
        if p[e.name] then assert.equal(0, (p[e.name] - e.tensor):abs():max():item(), e.name) end
      end
      dm.scope(function()
        local a, b = plain:forward(x, prefix), on:forward(x, prefix)
        assert.equal(a.loss:item(), b.loss:item())
        assert.is_true(b.extras.msa_far:item() > 0)
        b.loss:backward()
        assert.is_true(on.block.msa.wo.weight.grad:abs():max():item() > 0)
      end)
      plain:zero_grad()
    end
    local helpers = require "tests.lua.helpers"
    local log = arm_log({"model.msa.top_k=2", "model.msa.block=16"})
    helpers.has(log, "arms: MSA: each query reads its top 2 past blocks of 16 positions")
    helpers.has(arm_log({"model.msa.top_k=1", "model.msa.block=16", "model.msa.qk_norm=true"}),
                "top 1 past blocks of 16 positions, q and k RMS-normalised")
    assert.truthy(log:find("step      6 [^\n]- msa_far 0%.%d+"), log)
    helpers.has(helpers.err_of(helpers.tiny, {"model.segment=16", "seq=32", "model.msa.top_k=1"}),
                "model.msa.top_k = 0")
  end)
end)

describe("the control, every arm off", function()
  -- tiny's loss at initialisation and over its first 2 steps, as the tree computed them before the
  -- first arm existed (commit 38ac55e's parent, run again on the same binary: the same bits). Here
  -- they are held to 1e-6: OpenBLAS picks its kernels by the CPU, and another CPU rounds otherwise.
  -- Every arm's key off against the defaults is held bit for bit.
  local INIT = 6.1384658813476562
  local STEPS = {6.0994386672973633, 6.0621547698974609}          -- with steps = 2: the same first steps
  local function near(want, got, what) assert.is_true(math.abs(got - want) <= 1e-6 * want, what .. ": " .. got) end
  local OFF = {"model.aux.future=0", "model.aux.draft=0", "model.loom=false", "model.moe.retract_every=0",
               "model.moe.qat=off", "model.moe.littlebit=off", "model.msa.top_k=0", "checkpoint.banks=f32",
               "model.moe.fp8=false", "model.moe.aux_balance=0", "model.aux.jepa=0"}
  -- the forms of that tree, which later A/Bs changed as defaults (docs/training.md, "Learning quality",
  -- "The router at b1")
  local BEFORE = {"model.kda.gate=bounded", "model.init.dt_bias=zeros", "model.init.a_log=log_uniform",
                  "model.engram.output=spec", "model.engram.alpha_gain=false", "model.init.engram_conv=zeros",
                  "model.moe.router=sigmoid"}
  local function before(sets)
    local out = {table.unpack(BEFORE)}
    for _, s in ipairs(sets) do out[#out + 1] = s end
    return out
  end

  it("computes what the model computed before the arms, bit for bit, with every arm's key off", function()
    local seen = {}
    for k, overrides in ipairs {before {}, before(OFF)} do
      local m = build("experiments/tiny.lua", overrides)
      local x, prefix = tiny_batch()
      local init = dm.no_grad(function() return m:forward(x, prefix).loss:item() end)
      near(INIT, init, "the loss at initialisation")
      assert.same({}, m:arms())
      local o = {"steps=2", "schedule.warmup=1"}
      for _, v in ipairs(overrides) do o[#o + 1] = v end
      local r = train.prepare(config.load("experiments/tiny.lua", o), {root = "."})
      local losses = {init}
      for step = 1, 2 do
        r.step = step
        losses[step + 1] = train.step(r).loss
        near(STEPS[step], losses[step + 1], "step " .. step)
      end
      seen[k] = losses
    end
    assert.same(seen[1], seen[2])                  -- every arm's key off: the defaults' bits
  end)
end)

describe("low-bit banks in checkpoints (checkpoint.banks)", function()
  local helpers = require "tests.lua.helpers"
  local probe = require "dormouse.probe"
  local banks = require "dormouse.banks"

  it("writes the banks as codes and scales, F8_E4M3 where they are E4M3, and loads their values back", function()
    local runs = helpers.tmpdir()
    local function trained(name, format)
      helpers.run_quiet(helpers.tiny({"steps=2", "schedule.warmup=1", "log.every=2", "eval.every=0", "checkpoint.every=0", "name=" .. name,
                                      "checkpoint.banks=" .. format}), {runs = runs})
      return runs .. "/" .. name .. "/ckpt-2"
    end
    local plain_dir = trained("plain", "f32")
    local plain = probe.load(plain_dir, ".")
    local sizes = {}
    local f32_size = #helpers.read(plain_dir .. "/model.safetensors")
    for _, format in ipairs {"fp8_e4m3", "nvfp4", "ternary", "binary"} do
      local dir = trained(format, format)
      local m = probe.load(dir, ".")
      local want, got = train.named_state(plain), train.named_state(m)
      local is_bank = {}
      for _, name in ipairs(banks.names(plain)) do is_bank[name] = true end
      assert.same({"block.moe.Ug", "block.moe.Uu", "block.moe.D"}, banks.names(plain))
      for name, t in pairs(want) do                     -- the same run: banks as their codes' values, the rest as is
        local expect = is_bank[name] and dm.quantize(t, format) or t
        assert.equal(0, (got[name] - expect):abs():max():item(), format .. " " .. name)
      end
      local raw = helpers.read(dir .. "/model.safetensors")
      sizes[format] = #raw
      local header = raw:sub(9, 8 + string.unpack("<I8", raw))
      if format == "fp8_e4m3" then
        helpers.has(header, '"block.moe.Ug.codes":{"dtype":"F8_E4M3"', '"block.moe.Ug.scales":{"dtype":"F32"')
      elseif format == "nvfp4" then
        helpers.has(header, '"block.moe.D.codes":{"dtype":"U8"', '"block.moe.D.scales":{"dtype":"F8_E4M3"')
      end
      assert.is_nil(header:find('"block.moe.Ug":', 1, true))
    end
    assert.is_true(sizes.fp8_e4m3 < f32_size and sizes.nvfp4 < sizes.fp8_e4m3 and sizes.ternary < sizes.nvfp4 and
                   sizes.binary < sizes.ternary)
    -- a resume from such a checkpoint says that it continues from the codes' values
    local cfg = helpers.tiny({"steps=3", "schedule.warmup=1", "log.every=3", "eval.every=0", "checkpoint.every=0", "name=nvfp4",
                              "checkpoint.banks=nvfp4"})
    helpers.run_quiet(cfg, {runs = runs, resume = runs .. "/nvfp4"})
    helpers.has(helpers.read(runs .. "/nvfp4/log.txt"), "resume: the experts' banks were saved as nvfp4")
    os.execute("rm -rf '" .. runs .. "'")
  end)
end)

describe("optim.engram_adam = dense", function()
  it("moves every row with a moment each step (the sparse Adam: the step's rows), the first step alike", function()
    local helpers = require "tests.lua.helpers"
    local function two_steps(o)
      local r = train.prepare(helpers.tiny({"steps=3", "schedule.warmup=1"}, o), {root = "."})
      r.step = 1; train.step(r)
      local t1 = r.model.block.engram.table:clone()
      r.step = 2; train.step(r)
      local t = r.model.block.engram.table
      local moved = (t - t1):abs():sum_to({t:size(1), 1}):gt(0):to("f64"):sum():item()
      r.loader:close(); r.corpus:close()
      return t1, moved
    end
    local s1, sparse_moved = two_steps {}
    local d1, dense_moved = two_steps {"optim.engram_adam=dense"}
    assert.is_true(dm.allclose(d1, s1, {rtol = 1e-5, atol = 1e-7}), "the first step differs")
    assert.is_true(dense_moved > sparse_moved, dense_moved .. " vs " .. sparse_moved)
    assert.equal("sparse", config.load("experiments/tiny.lua").optim.engram_adam)
    local SparseAdam = require "dormouse.optim.sparse"
    local on_host = setmetatable({hosts = {true}, params = {}, dense = true}, SparseAdam)
    require("tests.lua.helpers").has(require("tests.lua.helpers").err_of(on_host.apply_dense, on_host, 1),
                                     'engram_adam = "dense" needs the Engram tables on the device')
  end)
end)

describe("one input's products, and Engram's keys and values once a pass", function()
  local function linear(d_in, d_out, seed, opts)
    dm.manual_seed(seed)
    return nn.build({device = "cpu", compute_dtype = "f64"}, nn.Linear, d_in, d_out, opts)
  end

  it("nn.products stacks the products of one row without grad, scales folded in: the layers' own values", function()
    local a, b, c = linear(6, 3, 1), linear(6, 5, 2), linear(6, 2, 3)
    local s = dm.randn({5}, {seed = 4, dtype = "f64"})
    local parts = {a, {b, scale = s}, c}
    for _, rows in ipairs {1, 3} do
      local x = dm.randn({1, rows, 6}, {seed = 5, dtype = "f64"})
      local got = dm.no_grad(nn.products, x, parts)
      local want = {a:forward(x), b:forward(x) * s, c:forward(x)}
      for i = 1, 3 do
        assert.same(want[i]:shape(), got[i]:shape())
        assert.is_true(dm.allclose(want[i], got[i], {rtol = 1e-14, atol = 1e-14}), "part " .. i .. ", rows " .. rows)
      end
    end
  end)

  it("nn.products with grad, or over a layer with a bias, is each layer's forward: gradients reach every weight",
     function()
    local a, b = linear(4, 3, 1), linear(4, 2, 2, {bias = true})
    local x = dm.randn({1, 1, 4}, {seed = 3, dtype = "f64"})
    local got = dm.no_grad(nn.products, x, {a, b})
    assert.is_true(dm.allclose(b:forward(x), got[2], {rtol = 0, atol = 0}))   -- the bias's layer: its own product
    local y = nn.products(x, {a, b})
    ;(y[1]:sum() + y[2]:sum()):backward()
    assert.is_not_nil(a.weight.grad)
    assert.is_not_nil(b.weight.grad)
    assert.is_not_nil(b.bias.grad)
  end)

  it("a pass's shared keys and values train as each iteration's own would (model.recompute makes its own), f64",
     function()
    local x, prefix = tiny_batch()
    local shared = build("experiments/tiny.lua"):cast("f64")
    local own = build("experiments/tiny.lua", {"model.recompute=true"}):cast("f64")
    dm.scope(function()
      local l1 = shared:forward(x, prefix).loss
      l1:backward()
      local l2 = own:forward(x, prefix).loss
      l2:backward()
      assert.is_true(math.abs(l1:item() - l2:item()) <= 1e-13 * math.abs(l2:item()))
      local mine = {}
      for _, p in ipairs(own:named_parameters()) do mine[p.name] = p.tensor end
      local compared = 0
      for _, p in ipairs(shared:named_parameters()) do
        local g1, g2 = p.tensor.grad, mine[p.name].grad
        if g1 then
          compared = compared + 1
          local err = (g1 - g2):abs():max():item()
          assert.is_true(err <= 1e-12 * (g2:abs():max():item() + 1e-30), p.name .. ": " .. err)
        end
      end
      assert.is_true(compared > 10)
      local kv = shared.block.engram.current.kv
      assert.is_truthy(kv and kv.grad)                     -- the plain pass shared them
      assert.is_nil(own.block.engram.current.kv)           -- the recomputed one did not
    end)
  end)
end)
