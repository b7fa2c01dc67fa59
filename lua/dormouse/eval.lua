--[[
Evaluation: the held-out loss of a model, and sampling text from it.
]]
local dm = require "dormouse"

local eval = {}

--[[ Held-out windows x [n, T+1] with their prefixes, in batches. Returns
{bytes, fin, periter = {CE_i}, depths = {[D] = fin_D}} in nats per byte. ]]
function eval.held_out(model, x, prefix, opts)
  local n, T = x:size(1), x:size(2) - 1
  local batch = opts.batch or 8
  local fin, periter, depths = 0, {}, {}
  local was_training = model.training
  model:eval()
  dm.no_grad(function()
    for start = 1, n, batch do
      local len = math.min(batch, n - start + 1)
      dm.scope(function()
        local xb, pb = x:narrow(1, start, len), prefix:narrow(1, start, len)
        if opts.device and opts.device ~= "cpu" then xb, pb = xb:to(opts.device), pb:to(opts.device) end
        local out = model:forward(xb, pb, {depths = opts.depths})
        local w = len / n
        fin = fin + out.fin:item() * w
        for i, ce in ipairs(out.periter or {}) do periter[i] = (periter[i] or 0) + ce:item() * w end
        for _, D in ipairs(opts.depths or {}) do        -- (periter and fin_D are optional: docs/models.md)
          if out.fin_D and out.fin_D[D] then depths[D] = (depths[D] or 0) + out.fin_D[D]:item() * w end
        end
      end)
    end
  end)
  model:train(was_training)
  return {bytes = n * T, fin = fin, periter = periter, depths = depths}
end

-- Pick a byte from logits [256] (a CPU f32 tensor) with temperature and top-p.
local function pick(logits, temperature, top_p, u)
  local probs = (logits * (1 / temperature)):softmax(-1):totable()
  local order = {}
  for b = 1, #probs do order[b] = b end
  table.sort(order, function(a, b) return probs[a] > probs[b] end)
  local mass, keep = 0, {}
  for _, b in ipairs(order) do
    keep[#keep + 1] = b
    mass = mass + probs[b]
    if mass >= top_p then break end
  end
  local r, acc = u * mass, 0
  for _, b in ipairs(keep) do
    acc = acc + probs[b]
    if r <= acc then return b - 1 end
  end
  return keep[#keep] - 1
end

--[[ Sample n bytes after a prompt. opts: temperature (1), top_p (0.95),
seed (0), context (the bytes of context kept, 256), device, on_byte (called
with each byte as a one-character string, for streaming). ]]
function eval.sample(model, prompt, n, opts)
  opts = opts or {}
  local temperature, top_p = opts.temperature or 1, opts.top_p or 0.95
  local context = opts.context or 256
  local bytes = {prompt:byte(1, -1)}
  if #bytes == 0 then bytes = {10} end
  local uniforms = dm.rand({n}, {seed = opts.seed or 0}):totable()
  local was_training = model.training
  model:eval()
  local out = {}
  dm.no_grad(function()
    for i = 1, n do
      dm.scope(function()
        local from = math.max(1, #bytes - context + 1)
        local row = {}
        for j = from, #bytes do row[#row + 1] = bytes[j] end
        row[#row + 1] = 0                                  -- a target slot the forward needs
        local x = dm.tensor({row}, {dtype = "u8"})
        local prefix = dm.zeros({1, 0}, {dtype = "u8"})
        if opts.device and opts.device ~= "cpu" then x, prefix = x:to(opts.device), prefix:to(opts.device) end
        local o = model:forward(x, prefix)
        local logits = o.fin_logits:narrow(2, #row - 1, 1):reshape({256}):to("cpu"):to("f32")
        local b = pick(logits, temperature, top_p, uniforms[i])
        bytes[#bytes + 1] = b
        out[#out + 1] = string.char(b)
        if opts.on_byte then opts.on_byte(out[#out]) end
      end)
    end
  end)
  model:train(was_training)
  return table.concat(out)
end

return eval
