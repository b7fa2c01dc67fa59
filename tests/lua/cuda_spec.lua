-- dm.cuda on any machine. Without a GPU (CI) the device is unavailable and
-- says why; with one, tensors go there and back. The GPU's own checks are
-- tests/gpu/check.lua and `ops --device cuda` (tools/gpu.sh runs both).
local dm = require "dormouse"
local cuda = dm.cuda or require "dormouse.cuda"

local function error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

describe("dm.cuda", function()
  local available, reason = cuda.is_available()

  it("says whether a device is available, and why not", function()
    assert.is_boolean(available)
    if not available then
      assert.is_string(reason)
      assert.is_true(#reason > 0)
    end
  end)

  it("switches TF32 for f32 products and rejects a non-boolean", function()
    local before = cuda.tf32()
    assert.is_true(cuda.tf32(true))
    assert.is_false(cuda.tf32(false))
    cuda.tf32(before)
    assert.truthy(error_of(cuda.tf32, "yes"):find("dm.cuda.tf32: expected a boolean, got string", 1, true))
  end)

  it("checks the benchmark helpers' arguments before the device", function()
    assert.truthy(error_of(dm.core.cuda_bench_copy, 0):find("the size must be positive", 1, true))
    assert.truthy(error_of(dm.core.cuda_bench_gemm, "f8", 8, 8, 8):find("unknown dtype 'f8'", 1, true))
  end)

  it("reports memory statistics for the device", function()
    local m = cuda.memory()
    for _, k in ipairs {"allocated", "peak", "count", "reserved", "device_allocs"} do
      assert.is_number(m[k], k)
    end
    cuda.empty_cache()                      -- harmless with or without a device
  end)

  if not available then
    it("makes creating a CUDA tensor an error naming the reason", function()
      local err = error_of(dm.zeros, {2, 3}, {device = "cuda"})
      assert.truthy(err:find("cuda", 1, true), err)
      assert.truthy(err:find(reason, 1, true) or err:find("not available", 1, true), err)
      err = error_of(function() return dm.ones({4}):cuda() end)
      assert.truthy(err:find("cuda", 1, true), err)
    end)

    it("makes the device's functions errors naming the reason", function()
      local err = error_of(cuda.synchronize)
      assert.truthy(err:find("cuda: ", 1, true) and err:find(reason, 1, true), err)
      err = error_of(cuda.device_name)
      assert.truthy(err:find(reason, 1, true), err)
    end)
  else
    it("moves tensors to the device and back with the same values", function()
      local x = dm.randn({5, 7}, {seed = 3})
      local y = x:cuda()
      assert.are.equal("cuda", y.device)
      assert.is_true(dm.allclose(y:cpu(), x, {rtol = 0, atol = 0}))
      assert.is_string(cuda.device_name())
      cuda.synchronize()
    end)
  end
end)
