--[[
Evaluation: the held-out loss of a model, and sampling text from it.
]]
local dm = require "dormouse"
local core = require "dormouse.core"

local segments = require "dormouse.segments"
local decode = require "dormouse.decode"

local eval = {}

local numbers = segments.numbers                -- a forward's losses as numbers

--[[ Held-out windows x [n, T+1] with their prefixes, in batches; with
opts.segment shorter than T, each window by segments with the state
carried (dormouse.segments). opts.mask [n, T] (on the CPU): only the targets
it keeps are scored (records), each batch weighted by the targets it keeps.
Returns {bytes (the bytes scored), ctx = T, segment, fin, periter = {CE_i},
depths = {[D] = fin_D}} in nats per byte. ]]
function eval.held_out(model, x, prefix, opts)
  local n, T = x:size(1), x:size(2) - 1
  local batch = opts.batch or 8
  local segmented = opts.segment and opts.segment < T
  local fin, periter, depths, measures = 0, {}, {}, nil
  local scored = opts.mask and opts.mask:to("f64"):sum():item() or n * T
  if scored == 0 then
    error(string.format("eval: the %d held-out windows of %d bytes score no target (every held-out prompt is " ..
                        "longer than a window?)", n, T + 1), 0)
  end
  local was_training = model.training
  model:eval()
  dm.no_grad(function()
    for start = 1, n, batch do
      local len = math.min(batch, n - start + 1)
      dm.scope(function()
        local xb, pb = x:narrow(1, start, len), prefix:narrow(1, start, len)
        local mb = opts.mask and opts.mask:narrow(1, start, len)
        local w = mb and mb:to("f64"):sum():item() / scored or len / n
        if opts.device and opts.device ~= "cpu" then
          xb, pb, mb = xb:to(opts.device), pb:to(opts.device), mb and mb:to(opts.device)
        end
        local r = segmented and segments.evaluate(model, xb, pb, opts.segment, {depths = opts.depths, mask = mb})
                  or numbers(model:forward(xb, pb, {depths = opts.depths, mask = mb}))
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
  return {bytes = scored, ctx = T, segment = segmented and opts.segment or nil, fin = fin, periter = periter,
          depths = depths, measures = measures}
end

-- Pick a byte from logits (256 numbers, a list) with temperature and top-p;
-- temperature 0 takes the most likely byte (the first of equals). The softmax of logits / T is
-- taken in double as exp((l - max) / T), every term in [0, 1]: a tiny T (1e-40, whose 1/T f32 cannot
-- hold) is as greedy as it should be, never a NaN. The nucleus takes bytes by probability, larger
-- first and equals by byte value, until their mass reaches top_p. core.sample_bytes (vm/ops/sample.h)
-- draws the same way on the logits' device.
local function pick(v, temperature, top_p, u)
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
  table.sort(order, function(a, b) return probs[a] > probs[b] or (probs[a] == probs[b] and a < b) end)
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

-- rows of bytes (each a list) from position `from` to `to` as a [#rows, len] u8 tensor on device,
-- with zeros before byte 1 where from < 1
local function byte_rows(rows, from, to, device)
  local out = {}
  for r, bytes in ipairs(rows) do
    local row = {}
    for j = from, to do row[#row + 1] = j >= 1 and bytes[j] or 0 end
    out[r] = row
  end
  local t = to >= from and dm.tensor(out, {dtype = "u8"}) or dm.zeros({#rows, 0}, {dtype = "u8"})
  if device and device ~= "cpu" then t = t:to(device) end
  return t
end

-- tokens a pass of prompts taken together holds at most (eval.sample_streams)
eval.PROMPT_TOKENS = 32768

--[[ The passes of prompts of one length together, as the generator's first() takes one: rows
(lists of bytes, all of one length) in chunks of opts.prompt_chunk bytes carrying the state.
Returns each row's logits of the byte after it (lists of 256; nil when a stateless model's prompt
is longer than a chunk) and the state (batch #rows; nil when the model's forward carries none). ]]
local function prompts_together(model, rows, opts)
  local device, ctx = opts.device, model.context and model:context() or 0
  local n, chunk, logits, s = #rows[1], opts.prompt_chunk or 8192, nil, {}
  for a = 1, n, chunk do
    local b = math.min(n, a + chunk - 1)
    local prev = s
    logits, s = dm.scope(function()
      local out = model:forward(byte_rows(rows, a, b + 1, device), byte_rows(rows, math.max(1, a - ctx), a - 1, device),
                                {state = prev})
      if b < n then return nil, out.state end
      local l = out.fin_logits
      return l:narrow(2, l:size(2), 1):reshape({#rows, l:size(3)}):to("cpu"):to("f32"):totable(), out.state
    end)
    if a > 1 then free_state(prev) end
    core.empty_cache("cpu")
    if not s then break end                   -- no state: the model streams nothing
  end
  return logits, s
end

--[[ The prompt's side of generation: next() gives the logits of the byte after
`bytes` (a list the caller appends each chosen byte to), then push(b) adds b.
Streaming: the prompt is one pass (in chunks) that keeps the model's state,
which take_state() hands over: the decoder (dormouse.decode) steps every
byte after it. A model whose forward returns no state (out.state), or
opts.stream = false, runs a full forward over the last `context` bytes for
every byte here instead, said once on stderr. ]]
local function generator(model, bytes, opts)
  local device, context = opts.device, opts.context or 256
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
    local rows, s = prompts_together(model, {bytes}, opts)
    if not s then
      streaming = false
      if not warned_full then
        warned_full = true
        io.stderr:write("sample: this model's forward carries no state (out.state): each byte runs a full " ..
                        "forward over the last " .. context .. " bytes\n")
      end
    end
    return rows and dm.tensor(rows[1], {dtype = "f32"}) or nil, s
  end
  local gen = {}
  function gen.next()
    if logits then return logits end
    if not streaming then logits = full()
    elseif not state then logits, state = first()
    else error("eval: the bytes after a streamed prompt are the decoder's (take_state, dormouse.decode)", 0) end
    return logits
  end
  function gen.push(b)                       -- the state covers the bytes before b: next() steps b in
    bytes[#bytes + 1] = b
    if logits then logits:free() end
    logits = nil
  end
  function gen.close() free_state(state); state = nil end
  function gen.take_state()                  -- the state after next(), now the caller's (nil: none)
    local s = streaming and state or nil
    if s then state = nil end
    return s
  end
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
last `context` bytes, 256, for each), block (bytes a decoder block), graph
(false: no CUDA graph), speculative (true: a draft head's byte verified a
pass, dormouse.decode; top_p then defaults to 1, the only value it takes). ]]
-- a prompt's bytes as a list (an empty prompt: one newline)
local function prompt_bytes(prompt)
  local bytes = {}
  for i = 1, #prompt, 4096 do                    -- a long prompt: a slice at a time (string.byte's limit)
    table.move({prompt:byte(i, math.min(#prompt, i + 4095))}, 1, math.min(4096, #prompt - i + 1), #bytes + 1, bytes)
  end
  if #bytes == 0 then bytes = {10} end
  return bytes
end

-- fn() with the model in eval mode and no autograd, its mode put back whatever happens
local function evaluating(model, fn)
  local was_training = model.training
  model:eval()
  local ok, err = pcall(dm.no_grad, fn)
  model:train(was_training)
  if not ok then error(err, 0) end
end

local function sampling(opts)
  local temperature, top_p = opts.temperature or 1, opts.top_p or 0.95
  if type(temperature) ~= "number" or not (temperature >= 0 and temperature < math.huge) then
    error("sample: temperature must be a finite number >= 0, got " .. tostring(temperature), 3)
  end
  if type(top_p) ~= "number" or top_p <= 0 or top_p > 1 then
    error("sample: top_p must be a number in (0, 1], got " .. tostring(top_p), 3)
  end
  return temperature, top_p
end

--[[ each(b) for the bytes that continue a prompt, at most n, until each returns true: the
prompt's pass and its first byte as the generator gives them, every later byte from the decoder's
blocks (dormouse.decode: the step on the device, a CUDA graph on a GPU). A model that carries no
state, or opts.stream = false, runs the generator a byte at a time instead. ]]
local function continuing(model, prompt, n, opts, temperature, top_p, each)
  if n < 1 then return end
  local seed = opts.seed or 0
  evaluating(model, function()
    local bytes = prompt_bytes(prompt)
    local gen = generator(model, bytes, opts)
    local d
    local ok, err = pcall(function()
      local b = pick(gen.next():totable(), temperature, top_p, dm.rand({1}, {seed = seed}):totable()[1])
      if each(b) or n == 1 then return end
      local state = gen.take_state()
      if not state then                        -- no state to carry: the generator's full forwards
        local uniforms = dm.rand({n}, {seed = seed}):totable()
        for i = 2, n do
          gen.push(b)
          b = pick(gen.next():totable(), temperature, top_p, uniforms[i])
          if each(b) then return end
        end
        return
      end
      bytes[#bytes + 1] = b
      local made, err = pcall(function()
        local make = opts.speculative and decode.speculative or decode.new
      d = make(model, 1, {device = opts.device, temperature = temperature, top_p = top_p, block = opts.block,
                          graph = opts.graph})
        d:put(1, state, bytes, seed, 1)
      end)
      free_state(state)                        -- the caller's since take_state, whatever happened
      if not made then error(err, 0) end
      local done = 1
      while done < n do
        for _, nb in ipairs(d:step()[1]) do
          done = done + 1
          if each(nb) or done == n then return end
        end
      end
    end)
    if d then d:free() end
    gen.close()
    if not ok then error(err, 0) end
  end)
end

function eval.sample(model, prompt, n, opts)
  opts = opts or {}
  local temperature, top_p = sampling(opts)
  if opts.speculative and opts.top_p == nil then top_p = 1 end       -- speculation samples the whole distribution
  local out = {}
  continuing(model, prompt, n, opts, temperature, top_p, function(b)
    out[#out + 1] = string.char(b)
    if opts.on_byte then opts.on_byte(out[#out]) end
  end)
  return table.concat(out)
end

--[[ Many streams at once: every prompt of `prompts` is continued by n bytes (or until its text
ends with opts.stop), opts.streams of them (all, by default) in one step of that batch a byte.
The first prompts run first, those of one length together (in chunks, as eval.sample's, up to
eval.PROMPT_TOKENS tokens a pass), each state then copied into a slot of the batch's; a stream that
ends gives its slot to the next prompt (continuous batching), whose pass runs alone.
Stream j samples as eval.sample does with seed opts.seed + j - 1, so each stream's text is the
one eval.sample gives alone, up to the rounding of a batched product. opts as eval.sample's, and
on_byte(j, byte) as they come, on_done(j, text) as each stream ends, stop (a string). Returns the
texts, in the prompts' order. ]]
function eval.sample_streams(model, prompts, n, opts)
  opts = opts or {}
  local temperature, top_p = sampling(opts)
  if opts.speculative and opts.top_p == nil then top_p = 1 end
  local width = math.min(opts.streams or #prompts, #prompts)
  local device, stop, seed = opts.device, opts.stop, opts.seed or 0
  local texts, slots, taken = {}, {}, 0
  -- the next prompt's pass alone: its stream with the first byte drawn, and its state (batch 1)
  local function start()
    taken = taken + 1
    local j = taken
    local bytes = prompt_bytes(prompts[j])
    local gen = generator(model, bytes, {device = device, prompt_chunk = opts.prompt_chunk})
    local logits = gen.next():totable()
    local s = gen.take_state()
    gen.close()
    if not s then error("sample: many streams need a model whose forward carries its state (out.state)", 0) end
    local first = pick(logits, temperature, top_p, dm.rand({1}, {seed = seed + j - 1}):totable()[1])
    return {j = j, bytes = bytes, out = {}, first = first}, s
  end
  -- stream s takes byte b; true when that ends it (n bytes, or its text ends with stop)
  local function take(s, b)
    s.bytes[#s.bytes + 1] = b
    s.out[#s.out + 1] = string.char(b)
    if opts.on_byte then opts.on_byte(s.j, s.out[#s.out]) end
    if #s.out >= n or (stop and #s.out >= #stop and table.concat(s.out, "", #s.out - #stop + 1) == stop) then
      s.done, texts[s.j] = true, table.concat(s.out)
      if opts.on_done then opts.on_done(s.j, texts[s.j]) end
      return true
    end
    return false
  end
  evaluating(model, function()
    local make = opts.speculative and decode.speculative or decode.new
    local d = make(model, width, {device = device, temperature = temperature, top_p = top_p, block = opts.block,
                                  graph = opts.graph})
    -- a free slot takes the next prompts until one of them outlives its first byte
    local function fill(slot)
      while taken < #prompts do
        local s, state = start()
        slots[slot] = s
        local ok, ended = pcall(function()    -- ended: the stream ended at its first byte
          if take(s, s.first) then return true end
          d:put(slot, state, s.bytes, seed + s.j - 1, 1)
          return false
        end)
        free_state(state)                      -- the caller's since take_state, whatever happened
        if not ok then error(ended, 0) end
        if not ended then return end
      end
    end
    -- the first `width` prompts: those of one length pass together, each then put in its slot
    local function first_fill()
      local by_length, lengths = {}, {}
      for j = 1, width do
        local bytes = prompt_bytes(prompts[j])
        local group = by_length[#bytes]
        if not group then group = {}; by_length[#bytes] = group; lengths[#lengths + 1] = #bytes end
        group[#group + 1] = {j = j, bytes = bytes}
      end
      taken = width
      local pending = {}                       -- slots whose stream ended at its first byte
      for _, len in ipairs(lengths) do
        local group = by_length[len]
        local per = math.max(1, eval.PROMPT_TOKENS // math.min(len, opts.prompt_chunk or 8192))
        for a = 1, #group, per do
          local part = table.move(group, a, math.min(a + per - 1, #group), 1, {})
          local rows = {}
          for r, e in ipairs(part) do rows[r] = e.bytes end
          local logits, state = prompts_together(model, rows, {device = device, prompt_chunk = opts.prompt_chunk})
          if not state then error("sample: many streams need a model whose forward carries its state (out.state)", 0) end
          local ok, err = pcall(function()
            for r, e in ipairs(part) do
              local first = pick(logits[r], temperature, top_p, dm.rand({1}, {seed = seed + e.j - 1}):totable()[1])
              local st = {j = e.j, bytes = e.bytes, out = {}, first = first}
              slots[e.j] = st
              if take(st, first) then
                pending[#pending + 1] = e.j
              else
                local row = {}
                segments.each(state, function(i, k, t)
                  row[i] = row[i] or {}
                  row[i][k] = t:narrow(1, r, 1)
                end)
                d:put(e.j, row, st.bytes, seed + e.j - 1, 1)
              end
            end
          end)
          free_state(state)
          if not ok then error(err, 0) end
        end
      end
      for _, slot in ipairs(pending) do fill(slot) end
    end
    local ok, err = pcall(function()
      first_fill()
      while true do
        local active = 0
        for _, s in ipairs(slots) do if not s.done then active = active + 1 end end
        if active == 0 then break end
        local rows = d:step()                 -- a finished stream's slot steps idle
        for slot, s in ipairs(slots) do
          if not s.done then
            for _, b in ipairs(rows[slot]) do if take(s, b) then break end end
            if s.done then fill(slot) end
          end
        end
      end
    end)
    d:free()
    if not ok then error(err, 0) end
  end)
  return texts
end

--[[ The greedy continuation of a prompt, a byte at a time, until judge(text) decides: true
(solved), false (it cannot be any more) or nil (go on); at most n bytes. Returns the text and
the verdict (nil: the budget ran out first). The bytes stream as eval.sample's (opts.device,
opts.stream). ]]
function eval.greedy_until(model, prompt, n, judge, opts)
  opts = opts or {}
  local out, verdict = {}, nil
  continuing(model, prompt, n, opts, 0, 1, function(b)
    out[#out + 1] = string.char(b)
    verdict = judge(table.concat(out))
    return verdict ~= nil
  end)
  return table.concat(out), verdict
end

eval.pick = pick          -- the host's draw (core.sample_bytes draws alike on the device)

return eval
