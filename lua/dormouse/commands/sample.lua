--[==[
dormouse sample RUN [--prompt TEXT | --prompt-file FILE | --prompts FILE] [-n N] [--streams N]
                    [--stop TEXT] [--temperature T] [--top-p P] [--seed S] [--device cpu|cuda]
                    [--full] [--speculative] [--trust]

Loads a checkpoint (runs/NAME for its latest, or runs/NAME/ckpt-STEP) and
streams N bytes (default 200) after the prompt to stdout as they come: the
prompt is one pass that keeps the model's state, then each byte is one
recurrent step that carries it, so every byte costs the same whatever came
before. --full runs a full forward over the last 256 bytes for every byte
instead (the slow way, for comparison). Bytes that are not printable UTF-8
are written as \xNN. --temperature T (default 1; 0 takes the most likely
byte), --top-p P (default 0.95; 1 with --speculative), --seed S (default 0), --device (default
cpu). Without --prompt or --prompt-file the prompt is empty. On stderr
at the end: the prompt's time (with the first byte) and the rate of
generation over bytes 2-100, 101-1000, 1001-10000, ... (bytes/s). A run
whose config names its model file by a path (not models/NAME) is opened only
with --trust: that file is code, perhaps shipped with the checkpoint.
--speculative drafts each next byte with the model's draft head
(model.aux.draft) and verifies it in the same pass, keeping it when the
model would have drawn it: the model's own distribution, more bytes a pass
when the draft is good (the share kept on stderr at the end); it samples
the whole distribution (--top-p 1, its default there).

Many streams at once: --prompts FILE (one prompt a line; a .jsonl file holds
one {"prompt": ...} a line) and --streams N (how many run in one batched
step; default: one a prompt; with one prompt, that prompt sampled N times). Stream j samples with
seed S + j - 1, so its text is what a single-stream sample with that seed
gives; a stream ends after N bytes or once its text ends with --stop (default:
none), and its slot takes the next prompt. Each stream is written as it ends, one JSON
line {"stream": j, "prompt": ..., "text": ...} (bytes that are not UTF-8 as
U+FFFD); on stderr the total rate.
example: dormouse sample runs/demo --prompt "In the beginning" -n 200
]==]
local dm = require "dormouse"
local probe = require "dormouse.probe"
local eval = require "dormouse.eval"

local usage = "usage: dormouse sample RUN [--prompt TEXT | --prompt-file FILE | --prompts FILE] [-n N] " ..
              "[--streams N] [--stop TEXT] [--temperature T] [--top-p P] [--seed S] [--device cpu|cuda] " ..
              "[--full] [--speculative] [--trust]"

local function number(text, flag, ok, what)
  local v = tonumber(text)
  if not v or not ok(v) then error(string.format("%s takes %s, got '%s'", flag, what, tostring(text)), 0) end
  return v
end

local function parse(argv)
  local args = {n = 200, temperature = 1, seed = 0, device = "cpu"}       -- top_p: eval's default (0.95; 1 speculative)
  local i = 2
  while i <= #argv do
    local a, value = argv[i], argv[i + 1]
    local function need() if value == nil then error(a .. " needs a value", 0) end return value end
    if a == "--prompt" then args.prompt = need(); i = i + 2
    elseif a == "--prompt-file" then args.prompt_file = need(); i = i + 2
    elseif a == "--prompts" then args.prompts = need(); i = i + 2
    elseif a == "--stop" then
      args.stop = need()
      if #args.stop == 0 then error("--stop takes a non-empty text", 0) end
      i = i + 2
    elseif a == "--streams" then
      args.streams = math.tointeger(number(need(), a, function(v) return math.tointeger(v) and v >= 1 end,
                                           "a positive integer")); i = i + 2
    elseif a == "-n" or a == "--bytes" then
      args.n = math.tointeger(number(need(), a, function(v) return math.tointeger(v) and v >= 1 end,
                                     "a positive integer")); i = i + 2
    elseif a == "--temperature" then
      args.temperature = number(need(), a, function(v) return v >= 0 and v < math.huge end, "a finite number >= 0")
      i = i + 2
    elseif a == "--top-p" then
      args.top_p = number(need(), a, function(v) return v > 0 and v <= 1 end, "a number in (0, 1]"); i = i + 2
    elseif a == "--seed" then
      args.seed = math.tointeger(number(need(), a, function(v) return math.tointeger(v) and v >= 0 end,
                                        "an integer >= 0")); i = i + 2
    elseif a == "--device" then
      args.device = need()
      if args.device ~= "cpu" and args.device ~= "cuda" then
        error("--device takes cpu or cuda, got '" .. args.device .. "'", 0)
      end
      i = i + 2
    elseif a == "--full" then args.full = true; i = i + 1
    elseif a == "--speculative" then args.speculative = true; i = i + 1
    elseif a == "--trust" then args.trust = true; i = i + 1
    elseif a == "--help" or a == "-h" then args.help = true; i = i + 1
    elseif a:sub(1, 1) == "-" then error("unknown option '" .. a .. "'", 0)
    elseif args.run then error("one run at a time; got '" .. args.run .. "' and '" .. a .. "'", 0)
    else args.run = a; i = i + 1 end
  end
  if args.help then return args end
  if not args.run then error("which run? give runs/NAME or runs/NAME/ckpt-STEP", 0) end
  if args.prompt and args.prompt_file then error("--prompt or --prompt-file, not both", 0) end
  if args.prompts and (args.prompt or args.prompt_file) then
    error("--prompts FILE holds the prompts: not with --prompt or --prompt-file", 0)
  end
  if args.full and (args.prompts or args.streams) then
    error("--full runs one stream a full forward a byte: not with --prompts or --streams", 0)
  end
  if args.speculative and args.full then error("--speculative drafts on the streamed step: not with --full", 0) end
  return args
end

local function read_prompt(args)
  if not args.prompt_file then return args.prompt or "" end
  local text, why = require("dormouse.config").read_text(args.prompt_file)
  if not text then error("--prompt-file: " .. why, 0) end
  return text
end

-- --prompts FILE: one prompt a line, or a .jsonl file's {"prompt": ...} a line; errors name the line
local function read_prompts(path)
  local text, why = require("dormouse.config").read_text(path)
  if not text then error("--prompts: " .. why, 0) end
  local json, jsonl, out, n = require "dormouse.json", path:match("%.jsonl$") ~= nil, {}, 0
  for line in text:gmatch("([^\n]*)\n?") do
    n = n + 1
    if line ~= "" then
      if jsonl then
        local ok, rec = pcall(json.decode, line)
        if not ok or type(rec) ~= "table" or type(rec.prompt) ~= "string" then
          error(string.format("--prompts: %s line %d: expected {\"prompt\": \"...\"}%s", path, n,
                              ok and "" or ": " .. tostring(rec)), 0)
        end
        out[#out + 1] = rec.prompt
      else
        out[#out + 1] = line
      end
    end
  end
  if #out == 0 then error("--prompts: " .. path .. " holds no prompt", 0) end
  return out
end

-- "2-100: 1604.5, 101-1000: 1581.9, ..." (eval.rates)
local function rates(stamps)
  local parts = {}
  for _, r in ipairs(eval.rates(stamps)) do parts[#parts + 1] = string.format("%d-%d: %.1f", r.from, r.to, r.rate) end
  return table.concat(parts, ", ")
end

-- "; blocks: 31 replayed from a CUDA graph, 1 run eagerly" (the decoder's counters; on a GPU, where
-- the graph is meant to run), and the speculative drafts kept
local function blocks(device)
  local c = require("dormouse.decode").counters
  local kept = c.drafts > 0 and string.format("; drafts kept: %d of %d (%.1f%%)", c.drafts_kept, c.drafts,
                                                100 * c.drafts_kept / c.drafts) or ""
  if device ~= "cuda" or c.replayed + c.eager == 0 then return kept end
  return string.format("; blocks: %d replayed from a CUDA graph%s, %d run eagerly%s%s", c.replayed,
                       c.nodes_per_pass and string.format(" (%.0f nodes a pass)", c.nodes_per_pass) or "", c.eager,
                       c.failed_captures > 0 and " (the step could not be captured)" or "", kept)
end

-- many streams: one JSON line a stream as it ends, the total rate on stderr
local function many(args, model, prompts)
  local json, now = require "dormouse.json", require("dormouse.core").now
  local settle = args.device == "cuda" and dm.cuda.synchronize or function() end
  local width = math.min(args.streams or #prompts, #prompts)
  io.stderr:write(string.format("sample: %d stream%s, %d at once, up to %d bytes each\n", #prompts,
                                #prompts == 1 and "" or "s", width, args.n))
  local total, t0 = 0, now()
  eval.sample_streams(model, prompts, args.n, {
    temperature = args.temperature, top_p = args.top_p, seed = args.seed, device = args.device,
    streams = width, stop = args.stop, speculative = args.speculative,
    on_done = function(j, text)
      total = total + #text
      io.stdout:write(json.encode({stream = j, prompt = prompts[j], text = text}), "\n")
      io.stdout:flush()
    end})
  settle()
  local dt = now() - t0
  io.stderr:write(string.format("sample: %d bytes in %.3f s (prompts included): %.1f bytes/s in all%s\n", total, dt,
                                dt > 0 and total / dt or 0 / 0, blocks(args.device)))
end

local function run(argv, cli)
  return cli.framed("sample", usage, parse, function(args)
    if args.device == "cuda" and not dm.cuda.is_available() then
      error("--device cuda: no CUDA device here (or this build has no CUDA backend)", 0)
    end
    if args.prompts or (args.streams or 1) > 1 then
      local prompts = args.prompts and read_prompts(args.prompts) or {}
      if not args.prompts then for j = 1, args.streams do prompts[j] = read_prompt(args) end end
      local model = probe.load(args.run, cli.root, {device = args.device, trust = args.trust})
      return many(args, model, prompts)
    end
    local prompt = read_prompt(args)
    local model, _, dir, step = probe.load(args.run, cli.root, {device = args.device, trust = args.trust})
    io.stderr:write(string.format("sample: %s (step %d), %d prompt bytes, %s\n", dir, step, #prompt,
                                  args.full and "a full forward a byte" or "streaming"))
    local put, finish = require("dormouse.human").byte_printer(function(s) io.stdout:write(s) end)
    local settle = args.device == "cuda" and dm.cuda.synchronize or function() end
    local now = require("dormouse.core").now                  -- wall time
    local stamps, t_start = {}, now()
    eval.sample(model, prompt, args.n, {
      temperature = args.temperature, top_p = args.top_p, seed = args.seed, device = args.device,
      stream = not args.full, speculative = args.speculative,
      on_byte = function(b)
        put(b)
        io.stdout:flush()
        settle()
        stamps[#stamps + 1] = now()
      end})
    finish()
    io.stdout:write("\n")
    io.stdout:flush()                                          -- the text's end before stderr's line
    io.stderr:write(string.format("sample: the prompt and the first byte %.3f s; bytes/s over bytes %s%s\n",
                                  stamps[1] - t_start, #stamps > 1 and rates(stamps) or "(one byte)",
                                  blocks(args.device)))
  end)(argv)
end

return {
  summary = "stream bytes from a checkpoint after a prompt, at the same cost for every byte",
  args = "RUN --prompt TEXT",
  run = run,
}
