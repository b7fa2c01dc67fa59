-- One owner per fact: what a layer built without an option takes is the schema's default, and the
-- planner's numbers for the card come from the C that uses them.
local dm = require "dormouse"
local nn = require "dormouse.nn"
local schema = require "dormouse.schema"
local core = require "dormouse.core"

describe("one owner per fact", function()
  it("layers built without an option take the schema's default", function()
    local moe = nn.MoE(8, {experts = 4, top_k = 1, rank = 2, shared_rank = 2, ffn = 4})
    assert.are.equal(schema.default("model.moe.lfb_gamma"), moe.gamma)
    assert.are.equal(schema.default("model.moe.balance"), moe.balance)
    assert.are.equal(schema.default("model.moe.router"), moe.router_form)
    assert.are.equal(schema.default("model.moe.aux_balance"), moe.aux_weight)
    local kda = nn.KDA(8, 2, 4)
    assert.are.equal(schema.default("model.kda.gate"), kda.gate)
    assert.are.equal(schema.default("model.kda.gate_lb"), kda.gate_lb)
    local engram = nn.Engram(8, {orders = {2}, rows = 64, width = 4})
    assert.are.equal(schema.default("model.engram.output"), engram.output)
    local t = engram.table:to("f64")
    local rms = ((t * t):mean():item()) ^ 0.5                  -- the rows' std (their mean is 0)
    assert.is_true(math.abs(rms / schema.default("model.init.engram_std") - 1) < 0.2, "rows' std " .. rms)
    assert.has_error(function() schema.default("model.moe.nope") end, "schema.default: no key 'model.moe.nope'")
  end)

  it("the plan counts cuBLASLt's workspace as kernels/gemm.c takes it; Newton-Schulz's dtype by device", function()
    local plan = require "dormouse.plan"
    assert.are.equal(core.gemm_workspace(), plan.OUTSIDE[1].bytes)
    assert.are.equal(32 * 2 ^ 20, core.gemm_workspace())
    assert.are.equal("f32", require("dormouse.optim").ns_dtype_for("cpu"))
    assert.are.equal("bf16", require("dormouse.optim").ns_dtype_for("cuda"))
  end)

  it("the floating-point dtypes come from the C table (core.float_dtypes), written nowhere in Lua", function()
    assert.same({f32 = true, f64 = true, bf16 = true, f16 = true}, core.float_dtypes())
    local p = assert(io.popen("grep -rlE 'f16 = true|bf16 = true' lua/dormouse models"))
    local found = p:read("a")
    p:close()
    assert.are.equal("", found)
  end)
end)
