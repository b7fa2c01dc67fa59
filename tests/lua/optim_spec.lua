local dm = require "dormouse"
local nn = require "dormouse.nn"
local core = require "dormouse.core"
local optim = require "dormouse.optim"
local schedule = require "dormouse.optim.schedule"
local groups = require "dormouse.optim.groups"
local ckpt = require "dormouse.ckpt"

-- the error of fn(), which must contain every part and be located in this file
local function expect_error(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  err = tostring(err)
  for _, part in ipairs {...} do
    assert.is_truthy(err:find(part, 1, true), "message '" .. err .. "' lacks '" .. part .. "'")
  end
  assert.is_truthy(err:find("optim_spec.lua:%d+: "), "not located in the spec: " .. err)
  return err
end

local function near(a, b, tol) return math.abs(a - b) <= (tol or 1e-12) end

-- A model with one of everything the rules know about.
local Engram = nn.class("Engram")
function Engram:init() self:param("table", nn.init.normal({64, 8}, 0.02)) end

local Toy = nn.class("Toy")
function Toy:init()
  self:child("emb", nn.Embedding(256, 16))
  self:child("l1", nn.Linear(16, 32, {bias = true}))
  self:child("norm", nn.RMSNorm(32))
  self:child("router", nn.Linear(32, 8))
  self:param("Ug", nn.init.normal({8, 32, 4}, 0.1))
  self:param("cg", nn.init.ones({8, 4}))
  self:child("wb", nn.Linear(32, 2))
  self:param("conv_q", nn.init.normal({32, 4}, 0.5))
  self:param("A_log", nn.init.zeros({2}))
  self:param("dt_bias", nn.init.zeros({32}))
  self:child("engram", Engram())
  self:child("head", nn.Linear(32, 256))
end

local function names(list)
  local out = {}
  for _, e in ipairs(list) do out[#out + 1] = e.name end
  return table.concat(out, " ")
end

describe("optim groups", function()
  it("assigns matrices and banks to Muon, the rest to AdamW, the Engram table apart", function()
    dm.manual_seed(1)
    local by = groups.assign(Toy():named_parameters())
    assert.are.equal("Ug l1.weight", names(by.muon))        -- a module's own parameters come first
    assert.are.equal("cg conv_q A_log dt_bias emb.weight l1.bias norm.gain router.weight wb.weight head.weight",
                     names(by.adamw))
    assert.are.equal("engram.table", names(by.engram))
    local why = {}
    for _, e in ipairs(by.adamw) do why[e.name] = e.why end
    assert.are.same({["emb.weight"] = "embedding", ["l1.bias"] = "bias", ["norm.gain"] = "gain",
                     ["router.weight"] = "router", cg = "scale", ["wb.weight"] = "gate", conv_q = "conv",
                     A_log = "A_log", dt_bias = "bias", ["head.weight"] = "head"}, why)
  end)

  it("prints a table of the groups with counts, lr and names", function()
    dm.manual_seed(1)
    local opt = optim.new(Toy(), {muon_lr = 0.02, adamw_lr = 3e-3}, {kind = "constant", warmup = 0}, 10, {quiet = true})
    local text = opt:describe()
    assert.is_truthy(text:find("group%s+tensors%s+params%s+lr%s+wd%s+names"))
    -- muon: l1.weight 512 + Ug 1024 = 1536 parameters, lr 0.02, wd 0.1
    assert.is_truthy(text:find("muon%s+2%s+1%.5K%s+2%.00e%-02%s+0%.1%s+Ug, l1%.weight"), text)
    assert.is_truthy(text:find("adamw%s+10%s"), text)
    -- the Engram table: 5x the AdamW lr, no weight decay
    assert.is_truthy(text:find("engram%s+1%s+512%s+1%.50e%-02%s+0%s+engram%.table"), text)
  end)

  it("abbreviates long name lists", function()
    local many = {}
    for i = 1, 40 do many[i] = {name = "block.layer" .. i .. ".weight", tensor = dm.zeros({2, 2})} end
    local text = groups.describe({{name = "muon", entries = many, lr = 1, weight_decay = 0}})
    assert.is_truthy(text:find("%(%+%d+ more%)"), text)
  end)
end)

describe("optim schedules", function()
  it("wsd: linear warm-up, stable, then a 1 - sqrt decay to the floor", function()
    local f = schedule.new({kind = "wsd", warmup = 10, decay = 0.2, floor = 0.1}, 100)
    assert.is_true(near(f(1), 0.1))
    assert.is_true(near(f(5), 0.5))
    assert.is_true(near(f(10), 1))
    assert.is_true(near(f(50), 1))
    assert.is_true(near(f(80), 1))                          -- the decay starts after step 80
    assert.is_true(near(f(90), 0.1 + 0.9 * (1 - math.sqrt(0.5))))
    assert.is_true(near(f(100), 0.1))
    assert.is_true(near(f(150), 0.1))                       -- past the end: the floor
  end)

  it("cosine: warm-up then half a cosine to the floor", function()
    local f = schedule.new({kind = "cosine", warmup = 10, floor = 0}, 110)
    assert.is_true(near(f(10), 1))
    assert.is_true(near(f(35), (1 + math.cos(math.pi * 0.25)) / 2))
    assert.is_true(near(f(60), 0.5))
    assert.is_true(near(f(110), 0))
  end)

  it("constant: warm-up then 1; no warm-up starts at 1", function()
    local f = schedule.new({kind = "constant", warmup = 4}, 10)
    assert.is_true(near(f(2), 0.5) and near(f(4), 1) and near(f(10), 1))
    assert.is_true(near(schedule.new({kind = "wsd", warmup = 0, decay = 0.5}, 10)(1), 1))
  end)

  it("refuses bad settings and steps", function()
    expect_error(function() schedule.new({kind = "linear"}, 10) end, "unknown kind 'linear' (wsd, cosine, constant)")
    expect_error(function() schedule.new({warmpu = 3}, 10) end, "unknown key 'warmpu'")
    expect_error(function() schedule.new({decay = 1.5}, 10) end, "decay must be a fraction in [0, 1], got 1.5")
    expect_error(function() schedule.new({warmup = -1}, 10) end, "warmup must be an integer >= 0, got -1")
    expect_error(function() schedule.new({}, 0) end, "steps must be an integer >= 1, got 0")
    local f = schedule.new({}, 10)
    expect_error(function() f(0) end, "step must be an integer >= 1, got 0")
    expect_error(function() f(1.5) end, "step must be an integer >= 1, got 1.5")
  end)
end)

-- y = x W*^T + b*: a model whose one Linear is `name` (head -> AdamW, proj -> Muon)
local Reg = nn.class("Reg")
function Reg:init(name) self.name = name; self:child(name, nn.Linear(8, 4, {bias = true})) end
function Reg:forward(x) return self[self.name]:forward(x) end

local function regression(name, ocfg, steps)
  dm.manual_seed(3)
  local model = Reg(name)
  local x = dm.randn({64, 8})
  local w, b = dm.randn({4, 8}), dm.randn({4})
  local y = dm.linear(x, w) + b
  local opt = optim.new(model, ocfg, {kind = "cosine", warmup = 5, floor = 0}, steps, {quiet = true})
  local first, last
  for step = 1, steps do
    dm.scope(function()
      local d = model:forward(x) - y
      local loss = (d * d):mean()
      loss:backward()
      local r = opt:step(step)
      assert.is_false(r.skipped)
      opt:zero_grad()
      first = first or loss:item()
      last = loss:item()
    end)
  end
  return first, last, opt
end

describe("optim training", function()
  it("a toy regression converges with AdamW", function()
    local first, last, opt = regression("head", {adamw_lr = 0.1, clip = 0}, 300)
    assert.are.equal("adamw", opt.groups[1].name)
    assert.is_true(last < first * 1e-3, ("loss %g -> %g"):format(first, last))
  end)

  it("a toy regression converges with Muon", function()
    local first, last, opt = regression("proj", {muon_lr = 0.1, adamw_lr = 0.1, weight_decay = 0, clip = 0}, 300)
    assert.are.equal("muon", opt.groups[1].name)
    assert.are.equal("proj.weight", opt.groups[1].entries[1].name)
    assert.is_true(last < first * 1e-3, ("loss %g -> %g"):format(first, last))
  end)

  it("also with Polar Express and bf16 Newton-Schulz", function()
    local first, last = regression("proj", {muon_lr = 0.1, adamw_lr = 0.1, weight_decay = 0, clip = 0,
                                            ns_coeffs = "polar_express", ns_dtype = "bf16"}, 300)
    assert.is_true(last < first * 1e-2, ("loss %g -> %g"):format(first, last))
  end)

  it("grad_dtype: a parameter read in bf16 keeps its gradient in bf16, the f32 one's values; two reads widen it", function()
    local function grads(grad_dtype, reads)
      dm.manual_seed(5)
      local m = nn.build({device = "cpu", compute_dtype = "bf16"}, function() return nn.Linear(6, 4) end)
      optim.new(m, {grad_dtype = grad_dtype}, {}, 10, {quiet = true})
      local x = dm.randn({3, 6}, {seed = 6}):to("bf16")
      local y = nn.pass(function()                       -- read twice in one pass: one copy
        return m:forward(x) + m:forward(x * 2)
      end)
      local loss = y:to("f32"):square():sum()
      if reads == 2 then loss = loss + m:forward(x):to("f32"):sum() end   -- outside the pass: a second copy
      loss:backward()
      return m.weight.grad
    end
    local kept, wide = grads("compute", 1), grads("f32", 1)
    assert.equal("bf16", kept.dtype)
    assert.equal("f32", wide.dtype)
    assert.equal(0, (kept:to("f32") - wide):abs():max():item())
    local kept2, wide2 = grads("compute", 2), grads("f32", 2)
    assert.equal("f32", kept2.dtype)
    assert.equal(0, (kept2 - wide2):abs():max():item())
  end)

  it("grad_dtype = compute keeps f32 gradients under an f64 or f16 compute dtype (the optimisers take f32 and bf16)", function()
    for _, cd in ipairs {"f64", "f16"} do
      dm.manual_seed(5)
      local m = nn.build({device = "cpu", compute_dtype = cd}, function() return nn.Linear(6, 4) end)
      local opt = optim.new(m, {}, {}, 10, {quiet = true})
      local x = dm.randn({3, 6}, {seed = 6}):to(cd)
      local loss = nn.pass(function() return m:forward(x) end):to("f32"):square():sum()
      loss:backward()
      assert.equal("f32", m.weight.grad.dtype)
      opt:step(1)
    end
  end)

  it("with bf16 momentum buffers: the first step as with f32 ones, the buffers rounded, then close", function()
    local function run(dtype, steps)
      local first, last, opt = regression("proj", {muon_lr = 0.1, adamw_lr = 0.1, weight_decay = 0, clip = 0,
                                                   momentum_dtype = dtype}, steps)
      return opt, first, last
    end
    local a, b = run("f32", 1), run("bf16", 1)
    local ma, mb = a.groups[1].state.momentum[1], b.groups[1].state.momentum[1]
    assert.are.equal("bf16", mb.dtype)
    assert.is_true(dm.allclose(mb, ma:to("bf16"), {rtol = 0, atol = 0}), "the buffer is the f32 one rounded")
    -- the update reads the sum before it is rounded: the same parameters after one step
    assert.is_true(dm.allclose(a.groups[1].params[1], b.groups[1].params[1], {rtol = 0, atol = 0}))
    local _, first, last = run("bf16", 300)
    assert.is_true(last < first * 1e-3, ("loss %g -> %g"):format(first, last))
  end)

  it("with bf16 momentum rounded stochastically: unbiased where rounding to nearest drops the gradient", function()
    -- buf 1 + g 0.501 at momentum 0.5: 1.001, between bf16's 1 and 1.0078125
    local function momentum_after(sround, step, salt)
      local p = dm.zeros({128, 128})
      local b = dm.full({128, 128}, 1, {dtype = "bf16"})
      p.grad = dm.full({128, 128}, 0.501)
      core.muon_step({p}, {b}, {lr = 0, momentum = 0.5, nesterov = false, weight_decay = 0, ns_steps = 1,
                                coeffs = "quintic", ns_dtype = "f32", momentum_sround = sround,
                                sround_salt = salt or 3, step = step})
      return b:to("f32"):reshape({128 * 128}):totable()
    end
    local exact = dm.tensor({0.5 * 1 + 0.501}):totable()[1]       -- in f32
    for _, v in ipairs(momentum_after(false, 1)) do assert.are.equal(1, v) end
    local a, up, sum = momentum_after(true, 1), 0, 0
    for _, v in ipairs(a) do
      assert.is_true(v == 1 or v == 1.0078125, tostring(v))
      if v > 1 then up = up + 1 end
      sum = sum + v
    end
    local share = (exact - 1) / 0.0078125                            -- 0.128: the chance of rounding up
    assert.is_true(math.abs(up / #a - share) < 0.015, ("rounded up %d of %d"):format(up, #a))
    assert.is_true(math.abs(sum / #a - exact) < 1e-4, ("mean %.7f against %.7f"):format(sum / #a, exact))
    local function differing(x, y)
      local d = 0
      for i = 1, #x do if x[i] ~= y[i] then d = d + 1 end end
      return d
    end
    assert.are.equal(0, differing(a, momentum_after(true, 1)))         -- the same step: the same bits
    assert.is_true(differing(a, momentum_after(true, 2)) > 1000)       -- another step, another draw
    assert.is_true(differing(a, momentum_after(true, 1, 4)) > 1000)    -- another group's salt
    expect_error(function() momentum_after(true, 0) end, "muon: stochastic rounding needs the update's count")
  end)

  it("fits a regression with AdamW's moments in 8 bits, as with f32 ones", function()
    local f_first, f_last = regression("head", {adamw_lr = 0.1, clip = 0}, 300)
    local first, last, opt = regression("head", {adamw_lr = 0.1, clip = 0, adamw_moments = "8bit"}, 300)
    assert.are.equal("u8", opt.groups[1].state.m8[1].dtype)
    assert.are.equal(f_first, first)
    assert.is_true(last < first * 1e-3, ("loss %g -> %g (f32 moments: %g)"):format(first, last, f_last))
  end)

  it("trains with optim.momentum_dtype = bf16_stochastic, its buffers bf16", function()
    local first, last, opt = regression("proj", {muon_lr = 0.1, adamw_lr = 0.1, weight_decay = 0, clip = 0,
                                                 momentum_dtype = "bf16_stochastic"}, 300)
    assert.are.equal("bf16", opt.groups[1].state.momentum[1].dtype)
    assert.is_true(last < first * 1e-3, ("loss %g -> %g"):format(first, last))
  end)

  it("keeps its state past the scope it was made in", function()
    dm.manual_seed(4)
    local model = Reg("proj")
    local opt = dm.scope(function() return optim.new(model, {}, {warmup = 0}, 10, {quiet = true}) end)
    for _, t in pairs(opt:state()) do assert.is_false(t:is_freed()) end
    dm.scope(function()
      local d = model:forward(dm.randn({3, 8}))
      local loss = (d * d):mean()
      loss:backward()
      opt:step(1)
    end)
    assert.are.equal(1, opt.t)
  end)
end)

describe("optim clipping and the NaN firewall", function()
  local function with_grads(value)
    dm.manual_seed(5)
    local model = Reg("proj")
    local opt = optim.new(model, {clip = 1.0, muon_lr = 0, adamw_lr = 0}, {warmup = 0}, 10, {quiet = true})
    model.proj.weight.grad = dm.full({4, 8}, value)
    model.proj.bias.grad = dm.full({4}, value)
    return model, opt
  end

  it("returns the norm before clipping and scales the gradients to the limit", function()
    local model, opt = with_grads(0.5)
    local r = opt:step(1)
    assert.is_true(near(r.grad_norm, math.sqrt(36 * 0.25)))          -- 3
    assert.is_false(r.skipped)
    -- AdamW's gradients are scaled in place; Muon's as its momentum pass reads them
    assert.is_true(near(model.proj.bias.grad:totable()[1], 0.5 / 3, 1e-7))
    assert.are.equal(0.5, model.proj.weight.grad:totable()[1][1])
  end)

  it("updates as if every gradient had been clipped first, bit for bit (eager and on device scalars)", function()
    local function run(clip_inside, async)
      dm.manual_seed(5)
      local model = Reg("proj")
      local opt = optim.new(model, {clip = clip_inside and 1.0 or 0, muon_lr = 0.02, adamw_lr = 0.01}, {warmup = 0},
                            10, {quiet = true})
      for step = 1, 3 do
        model.proj.weight.grad = dm.randn({4, 8}, {seed = step}) * 2
        model.proj.bias.grad = dm.randn({4}, {seed = 10 + step}) * 2
        if not clip_inside then                      -- clipped by hand first, as dm.clip_scale does
          local grads, sumsq = {model.proj.weight.grad, model.proj.bias.grad}, dm.zeros({1}, {dtype = "f64"})
          core.clip_grads_async(grads, 1.0, sumsq)
        end
        if async then opt:prepare(step); opt:step_async() else opt:step(step) end
      end
      return model, opt
    end
    for _, async in ipairs {false, true} do
      local a, oa = run(true, async)
      local b, ob = run(false, async)
      assert.is_true(dm.allclose(a.proj.weight, b.proj.weight, {rtol = 0, atol = 0}), "the Muon matrix differs")
      assert.is_true(dm.allclose(a.proj.bias, b.proj.bias, {rtol = 0, atol = 0}), "the AdamW bias differs")
      assert.is_true(dm.allclose(oa.groups[1].state.momentum[1], ob.groups[1].state.momentum[1], {rtol = 0, atol = 0}))
    end
  end)

  it("skips a step whose gradient is not finite and leaves everything as it was", function()
    for _, bad in ipairs {0 / 0, math.huge} do
      local model, opt = with_grads(0.5)
      model.proj.bias.grad = dm.tensor({1, bad, 1, 1})
      local before = model.proj.weight:clone()
      opt.groups[1].lr = 1                                            -- an update would show
      local r = opt:step(1)
      assert.is_true(r.skipped)
      assert.is_false(r.grad_norm == r.grad_norm and r.grad_norm < math.huge)
      assert.are.equal(0, opt.t)
      assert.is_true(dm.allclose(model.proj.weight, before, {rtol = 0, atol = 0}))
      assert.is_true(near(model.proj.weight.grad:totable()[1][1], 0.5))   -- not clipped
    end
  end)
end)

describe("optim state", function()
  local function grads_for(model, seed)
    for _, e in ipairs(model:named_parameters()) do
      e.tensor.grad = dm.randn(e.tensor:shape(), {seed = seed})
    end
  end

  local function copy_of(model)
    dm.manual_seed(99)
    local twin = Toy()
    local src = model:named_parameters()
    dm.no_grad(function()
      for i, e in ipairs(twin:named_parameters()) do e.tensor:copy_(src[i].tensor) end
    end)
    return twin
  end

  it("round-trips through optim.safetensors and continues identically", function()
    dm.manual_seed(6)
    local a = Toy()
    local cfg = {muon_lr = 0.02, adamw_lr = 1e-2, weight_decay = 0.1}
    local opt_a = optim.new(a, cfg, {warmup = 2}, 20, {quiet = true})
    for step = 1, 3 do grads_for(a, step); opt_a:step(step) end
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p '" .. dir .. "'")
    ckpt.save_tensors(dir .. "/optim.safetensors", opt_a:state())
    local b = copy_of(a)
    local opt_b = optim.new(b, cfg, {warmup = 2}, 20, {quiet = true})
    opt_b:load_state((ckpt.load_tensors(dir .. "/optim.safetensors")))
    os.execute("rm -rf '" .. dir .. "'")
    assert.are.equal(3, opt_b.t)
    for step = 4, 5 do
      grads_for(a, step); opt_a:step(step)
      grads_for(b, step); opt_b:step(step)
    end
    local pb = b:named_parameters()
    for i, e in ipairs(a:named_parameters()) do
      assert.is_true(dm.allclose(e.tensor, pb[i].tensor, {rtol = 0, atol = 0}), e.name)
    end
    local keys = {}
    for k in pairs(opt_a:state()) do keys[#keys + 1] = k end
    table.sort(keys)
    assert.are.equal(1 + 2 + 2 * 10 + 2, #keys)   -- step, 2 Muon momenta, m and v of 10 AdamW and 1 Engram tensors
  end)

  it("loads an f32 momentum into bf16 buffers (a run resumed with optim.momentum_dtype = bf16)", function()
    dm.manual_seed(6)
    local a = Toy()
    local opt_a = optim.new(a, {}, {warmup = 2}, 20, {quiet = true})
    for step = 1, 2 do grads_for(a, step); opt_a:step(step) end
    local opt_b = optim.new(copy_of(a), {momentum_dtype = "bf16"}, {warmup = 2}, 20, {quiet = true})
    local sa = opt_a:state()
    opt_b:load_state(sa)
    local sb = opt_b:state()
    assert.are.equal("bf16", sb["l1.weight.momentum"].dtype)
    assert.is_true(dm.allclose(sb["l1.weight.momentum"], sa["l1.weight.momentum"]:to("bf16"), {rtol = 0, atol = 0}))
    assert.are.equal("f32", sb["l1.bias.m"].dtype)
  end)

  it("keeps the AdamW group's moments in 8 bits (adamw_moments = 8bit): codes, scales, and a resume from or to f32",
     function()
    dm.manual_seed(8)
    local a = Toy()
    local twin = copy_of(a)
    local opt = optim.new(a, {adamw_moments = "8bit"}, {warmup = 2}, 20, {quiet = true})
    local ref = optim.new(twin, {}, {warmup = 2}, 20, {quiet = true})
    for step = 1, 3 do
      grads_for(a, step); opt:step(step)
      grads_for(twin, step); ref:step(step)
    end
    local sq, sf = opt:state(), ref:state()
    assert.are.equal("u8", sq["emb.weight.m8"].dtype)
    assert.same({16}, sq["emb.weight.m_scale"]:shape())           -- 256 x 16 = 4,096 values: 16 blocks
    assert.same({1}, sq["l1.bias.v_scale"]:shape())
    assert.is_nil(sq["emb.weight.m"])
    -- the decoded moments follow the f32 run's (the same gradients) within their codes' precision
    local function decoded(state, key, signed)
      local values = dm.zeros(state[key .. "8"]:shape())
      core.code8_unpack(values, state[key .. "8"], state[key .. "_scale"], signed)
      return values
    end
    local m = decoded(sq, "head.weight.m", true)
    local r = decoded(sq, "head.weight.v", false)
    local mf, rf = sf["head.weight.m"], sf["head.weight.v"]:sqrt()
    assert.is_true(((m - mf):abs():max():item()) <= 0.2 * mf:abs():max():item())
    assert.is_true(((r - rf):abs():max():item()) <= 0.1 * rf:max():item())
    -- f32 state into an 8-bit run, and 8-bit state into an f32 one: each converted on load
    local to_8bit = optim.new(copy_of(a), {adamw_moments = "8bit"}, {warmup = 2}, 20, {quiet = true})
    to_8bit:load_state(sf)
    local back = decoded(to_8bit:state(), "head.weight.m", true)
    assert.is_true(((back - mf):abs():max():item()) <= 0.07 * mf:abs():max():item())
    local to_f32 = optim.new(copy_of(a), {}, {warmup = 2}, 20, {quiet = true})
    to_f32:load_state(sq)
    assert.is_true(dm.allclose(to_f32:state()["head.weight.m"], m, {rtol = 0, atol = 0}))
    assert.is_true(dm.allclose(to_f32:state()["head.weight.v"], r * r, {rtol = 1e-6, atol = 0}))
    assert.are.equal(3, to_f32.t)
    local bad = {}
    for key, t in pairs(sf) do bad[key] = t end
    bad["head.weight.m"] = dm.zeros({3})
    expect_error(function() to_8bit:load_state(bad) end, "optim state 'head.weight.m': shape [3] but the parameter's is")
  end)

  it("resumes a run with the state stored in another form (the form keys), converted and said", function()
    local helpers = require "tests.lua.helpers"
    local train = require "dormouse.train"
    local runs = helpers.tmpdir()
    local common = {"steps=4", "schedule.warmup=1", "checkpoint.every=2", "eval.every=0", "name=forms"}
    helpers.run_quiet(helpers.tiny(common), {runs = runs})
    local forms = {"optim.adamw_moments=8bit", "optim.engram_moments=8bit", "optim.momentum_dtype=bf16_stochastic"}
    local cfg = helpers.tiny(common, forms)
    cfg.steps = 6
    helpers.run_quiet(cfg, {runs = runs, resume = runs .. "/forms"})
    local log = helpers.read(runs .. "/forms/log.txt")
    for _, key in ipairs {"adamw_moments was f32, now 8bit", "engram_moments was f32, now 8bit",
                          "momentum_dtype was f32, now bf16_stochastic"} do
      assert.is_truthy(log:find("resume: optim." .. key .. ": the optimiser's state is converted on load", 1, true), key)
    end
    local c = dm.ckpt.load(runs .. "/forms/ckpt-6")
    assert.are.equal("u8", c.optim["block.engram.table.m8"].dtype)
    assert.are.equal("bf16", c.optim["block.kda.wq.weight.momentum"].dtype)
    -- and back: the 8-bit state into f32 moments; a key that is not a form key still refuses
    cfg = helpers.tiny(common)
    cfg.steps = 8
    helpers.run_quiet(cfg, {runs = runs, resume = runs .. "/forms"})
    assert.are.equal("f32", dm.ckpt.load(runs .. "/forms/ckpt-8").optim["block.engram.table.m"].dtype)
    cfg = helpers.tiny(common, {"optim.muon_lr=0.01"})
    cfg.steps = 10
    local ok, err = pcall(train.run, cfg, {runs = runs, resume = runs .. "/forms", quiet = true, silent = true,
                                          root = "."})
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("optim.muon_lr", 1, true), tostring(err))
    os.execute("rm -rf '" .. runs .. "'")
  end)

  it("rounds its 8-bit moments the same way every run (the codes' random bits are keyed, not drawn)", function()
    local function codes(seed)
      dm.manual_seed(8)
      local a = Toy()
      local opt = optim.new(a, {adamw_moments = "8bit"}, {warmup = 2}, 20, {quiet = true})
      dm.manual_seed(seed)                      -- the global generator elsewhere: the codes must not follow it
      for step = 1, 3 do grads_for(a, step); opt:step(step) end
      return opt:state()
    end
    local x, y = codes(1), codes(2)
    for key, t in pairs(x) do assert.is_true(dm.allclose(t, y[key], {rtol = 0, atol = 0}), key) end
  end)

  it("refuses a state with a missing, misshapen or unknown key, or no step", function()
    dm.manual_seed(7)
    local opt = optim.new(Toy(), {}, {}, 10, {quiet = true})
    local function state() return opt:state() end
    local s = state(); s["l1.weight.momentum"] = nil
    expect_error(function() opt:load_state(s) end, "optim state: missing 'l1.weight.momentum'")
    s = state(); s["norm.gain.v"] = dm.zeros({3})
    expect_error(function() opt:load_state(s) end, "optim state 'norm.gain.v': shape [3] but the parameter's is [32]")
    s = state(); s["l9.weight.m"] = dm.zeros({3}); s["zzz"] = dm.zeros({1})
    expect_error(function() opt:load_state(s) end, "unexpected key 'l9.weight.m' and 1 more")
    s = state(); s.step = nil
    expect_error(function() opt:load_state(s) end, "optim state: missing 'step'")
    expect_error(function() opt:load_state(3) end, "expected a table of tensors, got a number")
    s = state(); s.step = dm.tensor({2.5})
    expect_error(function() opt:load_state(s) end, "'step' must hold an integer >= 0, got 2.5")
  end)
end)

describe("optim settings and the core functions", function()
  it("refuses unknown keys, bad coefficients and non-f32 parameters", function()
    dm.manual_seed(8)
    local m = Reg("proj")
    expect_error(function() optim.new(m, {muon_lrr = 1}, {}, 10, {quiet = true}) end, "optim: unknown key 'muon_lrr'", "muon_lr")
    -- the schema's types check a plain table as they check the config (the same messages)
    expect_error(function() optim.new(m, {ns_coeffs = "cubic"}, {}, 10, {quiet = true}) end,
                 'optim: ns_coeffs: "cubic" is not allowed; allowed: "quintic", "polar_express"')
    expect_error(function() optim.new(m, {momentum_dtype = "f16"}, {}, 10, {quiet = true}) end,
                 'optim: momentum_dtype: "f16" is not allowed; allowed: "f32", "bf16", "bf16_stochastic"')
    expect_error(function() optim.new(m, {ns_dtype = "f64"}, {}, 10, {quiet = true}) end,
                 'optim: ns_dtype: "f64" is not allowed')
    expect_error(function() optim.new(m, {momentum = 1}, {}, 10, {quiet = true}) end, "optim: momentum: ")
    assert.is_truthy(optim.new(m, {ns_dtype = false}, {}, 10, {quiet = true}))   -- false: by device
    local half = {{name = "w", tensor = dm.zeros({2, 2}, {dtype = "bf16"})}}
    expect_error(function() optim.new(half, {}, {}, 10, {quiet = true}) end, "parameter 'w' is bf16; the optimisers update f32 masters")
    expect_error(function() optim.new({}, {}, {}, 10, {quiet = true}) end, "the model has no parameters")
    expect_error(function() optim.new(3, {}, {}, 10) end, "expected a module or a list of {name, tensor} entries, got a number")
    expect_error(function() optim.new(m, "fast", {}, 10) end, "optim: the config must be a table, got a string")
    expect_error(function() optim.new(m, {}, 5, 10) end, "schedule: the config must be a table, got a number")
    expect_error(function() optim.new(m, {}, {}, 10, {quiet = true}):step() end, "step must be an integer >= 1, got nil")
  end)

  it("core.newton_schulz orthogonalises and checks its arguments", function()
    local x = core.newton_schulz(dm.randn({6, 10}, {seed = 1}), 5, "quintic", "f32")
    local gram = dm.matmul(x, x:t()):totable()
    for i = 1, 6 do assert.is_true(gram[i][i] > 0.45 and gram[i][i] < 1.45, tostring(gram[i][i])) end
    expect_error(function() core.newton_schulz(dm.randn({6, 10}), 5, "cubic") end,
                 "coefficients must be \"quintic\" or \"polar_express\", got cubic")
    expect_error(function() core.newton_schulz(dm.randn({6, 10}), 5, "quintic", "f64") end,
                 "dtype must be \"f32\" or \"bf16\", got f64")
    expect_error(function() core.newton_schulz(dm.randn({6}), 5) end, "newton_schulz: takes a matrix")
  end)

  it("core.newton_schulz's Gram form iterates in f32 whatever dtype it gives (a rank-deficient bank too)", function()
    -- bf16 rounding of the matrix itself would be pushed towards 1 in the directions its rank leaves out
    local low = dm.matmul(dm.randn({3, 8, 3}, {seed = 4}), dm.randn({3, 3, 40}, {seed = 5}))   -- rank 3 of 8
    for _, x in ipairs {dm.randn({3, 8, 40}, {seed = 4}), low} do
      local r16 = core.newton_schulz(x, 5, "polar_express", "bf16")
      local r32 = core.newton_schulz(x, 5, "polar_express", "f32")
      assert.equal("bf16", r16.dtype)
      local err = (r16:to("f32") - r32):square():sum():sqrt():item() / r32:square():sum():sqrt():item()
      assert.is_true(err > 0 and err < 5e-3, tostring(err))      -- the result's own rounding
    end
  end)

  it("Muon+ normalises the orthogonalised update by column, row or both before its scale", function()
    -- one step from zero momentum: the update is NS(g (1 + mu)) normalised, times lr 0.2 sqrt(max(m, n))
    local function l2(x, dim)
      local sq = x * x
      local shape = x:shape()
      shape[dim] = 1
      return x / (sq:sum_to(shape):sqrt() + 1e-7)
    end
    for _, case in ipairs {{shape = {6, 10}}, {shape = {2, 16, 4}}} do     -- a matrix, and a bank (Gram form)
      for _, how in ipairs {"col", "row", "colrow"} do
        local g = dm.randn(case.shape, {seed = 7})
        local p = dm.zeros(case.shape)
        p.grad = g
        local mu, lr = 0.9, 0.1
        core.muon_step({p}, {dm.zeros(case.shape)}, {lr = lr, momentum = mu, weight_decay = 0, ns_steps = 5,
                                                      coeffs = "quintic", ns_dtype = "f32", normalize = how})
        local n = #case.shape
        local o = core.newton_schulz(g * (1 + mu), 5, "quintic", "f32")
        if how ~= "row" then o = l2(o, n - 1) end
        if how ~= "col" then o = l2(o, n) end
        local m_, n_ = case.shape[n - 1], case.shape[n]
        local want = o * (-lr * 0.2 * math.sqrt(math.max(m_, n_)))
        local err = (p - want):abs():max():item() / want:abs():max():item()
        assert.is_true(err < 1e-5, string.format("%s %s: %.3g", table.concat(case.shape, "x"), how, err))
      end
    end
    expect_error(function()
      core.muon_step({dm.zeros({2, 3})}, {dm.zeros({2, 3})}, {lr = 1, momentum = 0.9, weight_decay = 0, ns_steps = 5,
                                                             normalize = "both"})
    end, 'normalize must be "none", "col", "row" or "colrow", got both')
    assert.equal("none", require("dormouse.config").load("experiments/tiny.lua").optim.muon_plus)
  end)

  it("scales each matrix of a bank's update by its entry (update_by_load), not its decay", function()
    local shape = {3, 4, 6}
    local function step(scales)
      local p = dm.randn(shape, {seed = 31})
      p.grad = dm.randn(shape, {seed = 32})
      core.muon_step({p}, {dm.zeros(shape)}, {lr = 0.1, momentum = 0.9, weight_decay = 0.5, ns_steps = 5,
                                              coeffs = "quintic", ns_dtype = "f32", scales = scales})
      return p
    end
    local p0, plain = dm.randn(shape, {seed = 31}), step(nil)
    local scaled = step({dm.tensor({1, 0, 0.5})})
    local decayed = p0 * (1 - 0.1 * 0.5)
    for e, s in ipairs {1, 0, 0.5} do
      local want = decayed:narrow(1, e, 1) + (plain:narrow(1, e, 1) - decayed:narrow(1, e, 1)) * s
      local err = (scaled:narrow(1, e, 1) - want):abs():max():item()
      assert.is_true(err < 1e-6, string.format("matrix %d: %.3g", e, err))
    end
    assert.equal(0, (step({false}) - plain):abs():max():item())           -- false: no scales
    expect_error(function() step({dm.tensor({1, 0})}) end,
                 "muon: the update scales of parameter 1 of 1 are f32 [2] on cpu; a bank [3, 4, 6] on cpu takes f32 [E] on its device")
  end)

  it("muon_step on Gram-form banks equals Newton-Schulz's result applied, member by member", function()
    -- banks tall and wide, a bank and a matrix in one group, scales on one bank: every member's
    -- matrices found in the group's stack and its update where newton_schulz puts them
    local mu, lr, wd = 0.9, 0.05, 0.2
    local list = {{3, 40, 6}, {2, 5, 33}, {5, 33}, {4, 9, 20}}
    local scales = {dm.tensor({1, 0.25, 0}), false, false, false}
    local p, b = {}, {}
    for i, shape in ipairs(list) do
      p[i] = dm.randn(shape, {seed = 40 + i})
      p[i].grad = dm.randn(shape, {seed = 50 + i})
      b[i] = dm.zeros(shape)
    end
    local p0, g = {}, {}
    for i in ipairs(list) do p0[i], g[i] = p[i]:clone(), p[i].grad:clone() end
    core.muon_step(p, b, {lr = lr, momentum = mu, nesterov = true, weight_decay = wd, ns_steps = 5,
                          coeffs = "polar_express", ns_dtype = "f32", scales = scales})
    for i, shape in ipairs(list) do
      local n = #shape
      local o = core.newton_schulz(g[i] * (1 + mu), 5, "polar_express", "f32")   -- nesterov from zero momentum
      local step = -lr * 0.2 * math.sqrt(math.max(shape[n - 1], shape[n]))
      local want = p0[i] * (1 - lr * wd) + o * step
      if scales[i] then
        for e, s in ipairs(scales[i]:totable()) do
          local pe = p0[i]:narrow(1, e, 1) * (1 - lr * wd) + o:narrow(1, e, 1) * (step * s)
          local err = (p[i]:narrow(1, e, 1) - pe):abs():max():item()
          assert.is_true(err < 1e-5, string.format("member %d matrix %d: %.3g", i, e, err))
        end
      else
        local err = (p[i] - want):abs():max():item()
        assert.is_true(err < 1e-5, string.format("member %d %s: %.3g", i, table.concat(shape, "x"), err))
      end
    end
  end)

  it("model.moe.update_by_load gives Muon the experts' scales from the step's rows", function()
    local config = require "dormouse.config"
    local train = require "dormouse.train"
    for _, how in ipairs {"active", "share"} do
      local cfg = config.load("experiments/tiny.lua", {"model.moe.update_by_load=" .. how})
      dm.manual_seed(1)
      local m = nn.build({device = "cpu"}, train.build_model, cfg, ".")
      local opt = optim.new(m, cfg.optim, cfg.schedule, 10, {quiet = true})
      local muon = opt.groups[1]
      local named = {}
      for i, e in ipairs(muon.entries) do named[e.name] = muon.scales[i] end
      assert.is_truthy(named["block.moe.D"])
      assert.equal(false, named["block.kda.wq.weight"])
      local counts = dm.tensor({0, 3, 9, 0, 1, 2, 3, 6}, {dtype = "i64"})
      local moe = m.block.moe
      assert.equal(8, moe.experts)
      moe:set_update_scale(counts)
      local want = how == "active" and {0, 1, 1, 0, 1, 1, 1, 1} or {0, 1, 1, 0, 1 / 3, 2 / 3, 1, 1}
      local got = moe.update_scale:totable()
      for e = 1, 8 do assert.is_true(math.abs(got[e] - want[e]) < 1e-6, how .. " " .. e .. ": " .. got[e]) end
    end
    local cfg = config.load("experiments/tiny.lua", {})
    local m = nn.build({device = "cpu"}, train.build_model, cfg, ".")
    assert.is_nil(optim.new(m, cfg.optim, cfg.schedule, 10, {quiet = true}).groups[1].scales)   -- off: none
    -- LittleBit's residual latents are banks of the experts too
    cfg = config.load("experiments/tiny.lua", {"model.moe.update_by_load=share", "model.moe.littlebit=residual"})
    m = nn.build({device = "cpu"}, train.build_model, cfg, ".")
    local muon = optim.new(m, cfg.optim, cfg.schedule, 10, {quiet = true}).groups[1]
    local got = {}
    for i, e in ipairs(muon.entries) do got[e.name] = muon.scales[i] end
    assert.is_truthy(got["block.moe.D_res"])
    assert.is_truthy(got["block.moe.Ug"])
  end)

  it("core steps name a missing hyper-parameter, a bad list and a mismatched state", function()
    local p = dm.zeros({2, 3})
    p.grad = dm.ones({2, 3})
    local m, v = dm.zeros({2, 3}), dm.zeros({2, 3})
    expect_error(function() core.adamw_step({p}, {m}, {v}, {lr = 1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, step = 1}) end,
                 "adamw_step: hp.weight_decay must be a number, got nil")
    expect_error(function() core.adamw_step({p}, {m}, {}, {}) end, "adamw_step: 1 parameters but 0 second moments")
    expect_error(function() core.adamw_step({p, 3}, {m}, {v}, {}) end, "adamw_step: params[2] is a number, not a tensor")
    local hp = {lr = 1, momentum = 0.9, weight_decay = 0, ns_steps = 5}
    expect_error(function() core.muon_step({p}, {dm.zeros({3, 2})}, hp) end,
                 "muon: parameter 1 has shape [2, 3] but its momentum buffer has shape [3, 2]")
    expect_error(function() core.muon_step({p}, {dm.zeros({2, 3})}, {lr = 1, momentum = 0.9, weight_decay = 0,
                                                                  ns_steps = 5, clip = 1}) end,
                 "muon: clip 1 needs the gradients' sum of squares (sumsq_at)")
    expect_error(function() core.clip_scale({p}, 1, dm.zeros({1})) end, "clip_scale: the sum of squares")
    hp.ns_dtype = "f16"
    expect_error(function() core.muon_step({p}, {dm.zeros({2, 3})}, hp) end, "dtype must be \"f32\" or \"bf16\", got f16")
    expect_error(function() core.clip_grad_norm({p}, -1) end, "max_norm must be >= 0")
    expect_error(function() core.clip_grad_norm(p) end, "clip_grad_norm: params must be a list of tensors, got userdata")
    expect_error(function() core.muon_step({p}, {m}, 0.1) end, "muon_step: hyper-parameters must be a table, got number")
    local gone = dm.zeros({2, 3})
    gone:free()
    expect_error(function() core.adamw_step({gone}, {m}, {v}, {}) end, "adamw_step: params[1] was freed")
  end)
end)

describe("optim on the device scalars (step_async)", function()
  local Pair = nn.class("Pair")
  function Pair:init()
    self:child("l1", nn.Linear(8, 16, {bias = true}))
    self:param("bank", nn.init.normal({3, 16, 4}, 0.2))
    self:child("head", nn.Linear(16, 8))
  end

  local function twins()
    dm.manual_seed(11)
    local a = Pair()
    dm.manual_seed(11)
    local b = Pair()
    local cfg = {clip = 0.5, muon_lr = 0.02, adamw_lr = 0.01}
    return a, b, optim.new(a, cfg, {warmup = 2}, 10, {quiet = true}), optim.new(b, cfg, {warmup = 2}, 10, {quiet = true})
  end

  local function same_grads(a, b, seed, bad)
    local pa, pb = a:named_parameters(), b:named_parameters()
    for i, e in ipairs(pa) do
      local g = dm.randn(e.tensor:shape(), {seed = seed + i})
      if bad and i == 2 then g = g * (0 / 0) end
      e.tensor.grad = g
      pb[i].tensor.grad = g:clone()
    end
  end

  -- The update from the host's values: every group's kernels with lr, step and the clip as numbers,
  -- the firewall decided on the host (the reference the device scalars must match bit for bit).
  -- Returns whether the step was skipped.
  local function host_step(o, step)
    local mult = o.lr_mult(step)
    local all, apart = o:grads_split()
    local sumsq = dm.zeros({1}, {dtype = "f64"})
    core.clip_grads_async(all, 0, sumsq)
    local n = math.sqrt(sumsq:item())
    if not (n == n and n < math.huge) then return true end
    core.clip_scale(apart, o.clip, sumsq)
    o.t = o.t + 1
    for _, g in ipairs(o.groups) do
      g:update(mult, o.t, g.clips_inside and {sumsq_at = sumsq, clip = o.clip} or nil)
    end
    return false
  end

  it("updates from the device scalars as from the host's values, bit for bit, a skipped step included", function()
    local a, b, oa, ob = twins()
    for step = 1, 5 do
      same_grads(a, b, 100 * step, step == 3)
      local r = oa:step(step)                       -- prepare + step_async, read back
      assert.are.equal(step == 3, r.skipped)
      assert.are.equal(step == 3, host_step(ob, step))
      oa:zero_grad(); ob:zero_grad()
      local pa, pb = a:named_parameters(), b:named_parameters()
      for i, e in ipairs(pa) do
        assert.is_true(dm.allclose(e.tensor, pb[i].tensor, {rtol = 0, atol = 0}), e.name .. " at step " .. step)
      end
    end
    assert.are.equal(4, oa.t)
    assert.are.equal(4, oa:sync().t)
    assert.are.equal(4, oa:state().step:item())
  end)

  it("skips a step whose loss is not finite though its gradients are", function()
    local a, _, oa = twins()
    same_grads(a, a, 7)
    local before = a:named_parameters()[1].tensor:clone()
    oa:prepare(1)
    oa:step_async(dm.tensor({math.huge}, {dtype = "f64"}))
    assert.are.equal(0, oa:sync().t)
    assert.is_true(dm.allclose(before, a:named_parameters()[1].tensor, {rtol = 0, atol = 0}))
    oa:zero_grad()
    same_grads(a, a, 8)
    oa:prepare(2)
    oa:step_async(dm.tensor({2.5}, {dtype = "f64"}))        -- a finite loss: applied
    assert.are.equal(1, oa:sync().t)
  end)

  it("refuses scalars of the wrong dtype or size", function()
    local a, _, oa = twins()
    same_grads(a, a, 1)
    expect_error(function()
      core.adamw_step(oa.groups[2].params, oa.groups[2].state.m, oa.groups[2].state.v,
        {lr = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0, step = 1, lr_at = dm.zeros({2})})
    end, "hp.lr_at must be one f64 element")
    expect_error(function() core.clip_grads_async(oa:grads(), 1.0, dm.zeros({1})) end,
                 "the sum of squares must be one contiguous f64 element")
  end)

  it("names a group that cannot take device scalars, before anything is clipped or counted", function()
    local a, _, oa = twins()
    same_grads(a, a, 1)
    local g1 = a:named_parameters()[1].tensor.grad:clone()
    oa.groups[2].device_scalars = false
    oa:prepare(1)
    expect_error(function() oa:step_async() end, "group 'adamw'", "without host reads")
    assert.are.equal(0, oa:sync().t)
    assert.is_true(dm.allclose(a:named_parameters()[1].tensor.grad, g1, {rtol = 0, atol = 0}))
  end)

  it("keeps one count of updates when eager steps and step_async take turns", function()
    local a, _, oa = twins()
    oa:scalars()
    for step = 1, 3 do
      same_grads(a, a, 10 * step)
      if step == 2 then oa:prepare(step); oa:step_async() else oa:step(step) end
      oa:zero_grad()
    end
    assert.are.equal(3, oa:state().step:item())
    assert.are.equal(3, oa.t)
  end)
end)
