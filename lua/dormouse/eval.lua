--[[
Evaluation: the held-out loss of a model, and sampling text from it.
]]
local dm = require "dormouse"
local core = require "dormouse.core"

local segments = require "dormouse.segments"

local eval = {}

local numbers = segments.numbers                -- a forward's losses as numbers

--[[ Held-out windows x [n, T+1] with their prefixes, in batches; with
opts.segment shorter than T, each window by segments with the state
carried (dormouse.segments). Returns {bytes, ctx = T, segment, fin,
periter = {CE_i}, depths = {[D] = fin_D}} in nats per byte. ]]
function eval.held_out(model, x, prefix, opts)
  local n, T = x:size(1), x:size(2) - 1
  local batch = opts.batch or 8
  local segmented = opts.segment and opts.segment < T
  local fin, periter, depths, measures = 0, {}, {}, nil
  local was_training = model.training
  model:eval()
  dm.no_grad(function()
    for start = 1, n, batch do
      local len = math.min(batch, n - start + 1)
      dm.scope(function()
        local xb, pb = x:narrow(1, start, len), prefix:narrow(1, start, len)
        if opts.device and opts.device ~= "cpu" then xb, pb = xb:to(opts.device), pb:to(opts.device) end
        local r = segmented and segments.evaluate(model, xb, pb, opts.segment, {depths = opts.depths})
                  or numbers(model:forward(xb, pb, {depths = opts.depths}))
        local w = len / n
        fin = fin + r.fin * w
        for i, ce in ipairs(r.periter) do periter[i] = (periter[i] or 0) + ce * w end
        for _, D in ipairs(opts.depths or {}) do        -- (periter and fin_D are optional: docs/models.md)
          if r.fin_D[D] then depths[D] = (depths[D] or 0) + r.fin_D[D] * w end
        end
        for name, v in pairs(r.measures or {}) do         -- a model's own measures (an arm's), averaged alike
          measures = measures or {}
          measures[name] = (measures[name] or 0) + v * w
        end
      end)
    end
  end)
  model:train(was_training)
  return {bytes = n * T, ctx = T, segment = segmented and opts.segment or nil, fin = fin, periter = periter,
          depths = depths, measures = measures}
end

-- Pick a byte from logits [256] (a CPU f32 tensor) with temperature and top-p;
-- temperature 0 takes the most likely byte (the first of equals). The softmax of logits / T is
-- taken in double as exp((l - max) / T), every term in [0, 1]: a tiny T (1e-40, whose 1/T f32 cannot
-- hold) is as greedy as it should be, never a NaN.
local function pick(logits, temperature, top_p, u)
  local v = logits:totable()
  local best = 1
  for b = 2, #v do if v[b] > v[best] then best = b end end
  if temperature == 0 then return best - 1 end
  local probs, z = {}, 0
  for b = 1, #v do
    probs[b] = math.exp((v[b] - v[best]) / temperature)
    z = z + probs[b]
  end
  for b = 1, #v do probs[b] = probs[b] / z end
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

-- bytes[from..to] as a [1, n] u8 tensor on device, with zeros before byte 1 where from < 1
local function byte_row(bytes, from, to, device)
  local row = {}
  for j = from, to do row[#row + 1] = j >= 1 and bytes[j] or 0 end
  local t = #row > 0 and dm.tensor({row}, {dtype = "u8"}) or dm.zeros({1, 0}, {dtype = "u8"})
  if device and device ~= "cpu" then t = t:to(device) end
  return t
end

-- the last position's fin logits of a forward, as a CPU f32 [256]
local function last_logits(out)
  local logits = out.fin_logits
  return logits:narrow(2, logits:size(2), 1):reshape({256}):to("cpu"):to("f32")
end

local free_state = segments.free

local warned_full = false

--[[ The generator of eval.sample: next() gives the logits of the byte after
`bytes` (a list the caller appends each chosen byte to), then push(b) adds b.
Streaming: the prompt is one pass that keeps the model's state, each new
byte one pass of T = 1 that carries it, so every byte costs the same.
A model whose forward returns no state (out.state) runs a full forward over
the last `context` bytes for every byte instead, said once on stderr. ]]
local function generator(model, bytes, opts)
  local device, context = opts.device, opts.context or 256
  local ctx = model.context and model:context() or 0
  local state, logits
  local streaming = opts.stream ~= false
  local function full()
    return dm.scope(function()
      local from = math.max(1, #bytes - context + 1)
      local x = byte_row(bytes, from, #bytes + 1, device)      -- a target slot the forward needs
      return last_logits(model:forward(x, byte_row(bytes, 1, 0, device)))
    end)
  end
  -- the prompt in chunks of opts.prompt_chunk bytes (8,192), each carrying the state: memory stays flat
  local function first()
    local n, chunk, l, s = #bytes, opts.prompt_chunk or 8192, nil, {}
    for a = 1, n, chunk do
      local b = math.min(n, a + chunk - 1)
      local prev = s
      l, s = dm.scope(function()
        local out = model:forward(byte_row(bytes, a, b + 1, device), byte_row(bytes, math.max(1, a - ctx), a - 1, device),
                                  {state = prev})
        return b == n and last_logits(out) or nil, out.state
      end)
      if a > 1 then free_state(prev) end
      -- the chunk's freed host blocks lie scattered through a heap that is never trimmed (vm/core/alloc.c):
      -- their pages go back, so that host memory stays flat over a long prompt
      core.empty_cache("cpu")
      if not s then break end                 -- no state: the model streams nothing (below)
    end
    if not s then
      streaming = false
      if not warned_full then
        warned_full = true
        io.stderr:write("sample: this model's forward carries no state (out.state): each byte runs a full " ..
                        "forward over the last " .. context .. " bytes\n")
      end
    end
    return l, s
  end
  local gen = {}
  function gen.next()
    if logits then return logits end
    if not streaming then logits = full()
    elseif not state then logits, state = first()
    else
      local n = #bytes
      local l, s = dm.scope(function()
        local x = byte_row(bytes, n, n + 1, device)               -- the newest byte and a target slot
        local out = model:forward(x, byte_row(bytes, n - ctx, n - 1, device), {state = state})
        return last_logits(out), out.state
      end)
      free_state(state)
      logits, state = l, s
    end
    return logits
  end
  function gen.push(b)                       -- the state covers the bytes before b: next() steps b in
    bytes[#bytes + 1] = b
    if logits then logits:free() end
    logits = nil
  end
  function gen.close() free_state(state); state = nil end
  return gen
end

--[[ The rate of generation from the wall times at which the bytes came (stamps[i]: byte i; the
first one's holds the prompt's pass): {{from, to, rate}, ...} over bytes 2-100, 101-1000,
1001-10000, ..., in bytes/s (dormouse sample, dormouse long). ]]
function eval.rates(stamps)
  local out, from, to = {}, 2, 100
  while from <= #stamps do
    local last = math.min(to, #stamps)
    local dt = stamps[last] - stamps[from - 1]
    out[#out + 1] = {from = from, to = last, rate = dt > 0 and (last - from + 1) / dt or 0 / 0}
    from, to = last + 1, to * 10
  end
  return out
end

--[[ Sample n bytes after a prompt. opts: temperature (1; 0 takes the most
likely byte), top_p (0.95), seed (0), device, on_byte (called with each
byte as a one-character string, for streaming), stream (true: the model's
state carried from byte to byte, the same cost for every byte, the prompt
in chunks of prompt_chunk bytes, 8,192; false: a full forward over the
last `context` bytes, 256, for each). ]]
-- a prompt's bytes as a list (an empty prompt: one newline)
local function prompt_bytes(prompt)
  local bytes = {}
  for i = 1, #prompt, 4096 do                    -- a long prompt: a slice at a time (string.byte's limit)
    table.move({prompt:byte(i, math.min(#prompt, i + 4095))}, 1, math.min(4096, #prompt - i + 1), #bytes + 1, bytes)
  end
  if #bytes == 0 then bytes = {10} end
  return bytes
end

-- fn(gen) with the model in eval mode, no autograd, and the generator closed after, whatever happens
local function generating(model, prompt, opts, fn)
  local was_training = model.training
  model:eval()
  local ok, err = pcall(dm.no_grad, function()
    local gen = generator(model, prompt_bytes(prompt), opts)
    local done, e = pcall(fn, gen)
    gen.close()
    if not done then error(e, 0) end
  end)
  model:train(was_training)
  if not ok then error(err, 0) end
end

function eval.sample(model, prompt, n, opts)
  opts = opts or {}
  local temperature, top_p = opts.temperature or 1, opts.top_p or 0.95
  if type(temperature) ~= "number" or not (temperature >= 0 and temperature < math.huge) then
    error("sample: temperature must be a finite number >= 0, got " .. tostring(temperature), 2)
  end
  if type(top_p) ~= "number" or top_p <= 0 or top_p > 1 then
    error("sample: top_p must be a number in (0, 1], got " .. tostring(top_p), 2)
  end
  local uniforms = dm.rand({math.max(n, 1)}, {seed = opts.seed or 0}):totable()
  local out = {}
  generating(model, prompt, opts, function(gen)
    for i = 1, n do
      local b = pick(gen.next(), temperature, top_p, uniforms[i])
      gen.push(b)
      out[#out + 1] = string.char(b)
      if opts.on_byte then opts.on_byte(out[#out]) end
    end
  end)
  return table.concat(out)
end

--[[ The greedy continuation of a prompt, a byte at a time, until judge(text) decides: true
(solved), false (it cannot be any more) or nil (go on); at most n bytes. Returns the text and
the verdict (nil: the budget ran out first). The bytes stream as eval.sample's (opts.device,
opts.stream). ]]
function eval.greedy_until(model, prompt, n, judge, opts)
  opts = opts or {}
  local out, verdict = {}, nil
  generating(model, prompt, opts, function(gen)
    for _ = 1, n do
      local b = pick(gen.next(), 0, 1, 0)
      gen.push(b)
      out[#out + 1] = string.char(b)
      verdict = judge(table.concat(out))
      if verdict ~= nil then return end
    end
  end)
  return table.concat(out), verdict
end

return eval
