--[==[
dormouse baseline [CORPUS] --order N[-M] [--eval-bytes N] [--fit-bytes N] [--seq T [--windows N]]

Fits an interpolated Kneser-Ney byte n-gram model on a corpus's train split
and prints its held-out bits per byte: the number a trained model must beat
on the same split. Without CORPUS, the default corpus (the King James Bible)
is used; CORPUS may be an experiment file (its data.path or data.sources,
data.weights, data.eval, data.eval_bytes and eval windows). --eval-bytes N: the held-out split (default: the config's
data.eval_bytes). --order 1-6 prints one row per order. --seq T scores the targets of
the held-out windows of T+1 bytes the model is evaluated on (--windows N of
them; all by default) instead of the whole held-out split. --fit-bytes N: fit on
N bytes of the train split, in pieces spread evenly over it (default: the
config's eval.baseline_bytes, 8 MiB; 0: all of it).
example: dormouse baseline experiments/small.lua --order 1-6
]==]
local data = require "dormouse.data"

local usage = "usage: dormouse baseline [CORPUS] --order N[-M] [--eval-bytes N] [--fit-bytes N] [--seq T [--windows N]]"

local function commas(n)
  local s = tostring(n)
  repeat
    local k
    s, k = s:gsub("^(%d+)(%d%d%d)", "%1,%2")
  until k == 0
  return s
end

local function count(text, flag)
  local n = math.tointeger(tonumber(text))
  if not n or n < 1 then error(flag .. " takes a positive integer, got '" .. tostring(text) .. "'", 0) end
  return n
end

local function parse(argv)
  local args = {}
  local i = 2
  while i <= #argv do
    local a = argv[i]
    local value = argv[i + 1]
    if a == "--order" then
      local lo, hi = tostring(value):match("^(%d+)%-(%d+)$")
      args.orders = lo and {count(lo, a), count(hi, a)} or {count(value, a), count(value, a)}
      i = i + 2
    elseif a == "--eval-bytes" then args.eval_bytes = count(value, a); i = i + 2
    elseif a == "--fit-bytes" then
      args.fit_bytes = math.tointeger(tonumber(value))
      if not args.fit_bytes or args.fit_bytes < 0 then
        error("--fit-bytes takes an integer >= 0, got '" .. tostring(value) .. "'", 0)
      end
      i = i + 2
    elseif a == "--seq" then args.seq = count(value, a); i = i + 2
    elseif a == "--windows" then args.windows = count(value, a); i = i + 2
    elseif a == "--help" or a == "-h" then args.help = true; i = i + 1
    elseif a:sub(1, 2) == "--" then error("unknown option '" .. a .. "'", 0)
    elseif args.target then error("one corpus at a time; got '" .. args.target .. "' and '" .. a .. "'", 0)
    else args.target = a; i = i + 1 end
  end
  if not args.help and not args.orders then error("which order? give --order N (or a range, --order 1-6)", 0) end
  if args.windows and not args.seq then error("--windows needs --seq", 0) end
  return args
end

--[[ What to measure: the corpus (paths and data.open's options), its label, and the scored
windows. An experiment config (experiments/*.lua) gives its data keys (data.path or
data.sources, data.weights, data.eval, data.eval_bytes) and the eval windows the trainer scores
(seq = data.ctx or seq, n = eval.windows), each overridden by the flags. ]]
local function resolve(args)
  if args.target and args.target:match("%.lua$") then
    local cfg = require("dormouse.config").load(args.target)
    local spec = require("dormouse.train").corpus_spec(cfg.data)
    spec.opts.eval_bytes = args.eval_bytes or spec.opts.eval_bytes
    local seq = args.seq or cfg.data.ctx or cfg.seq
    spec.windows = {seq = seq, n = args.windows or (not args.seq and cfg.eval.windows or nil)}
    spec.fit_bytes = args.fit_bytes or cfg.eval.baseline_bytes
    return spec
  end
  local defaults = require("dormouse.config").resolve({}, "defaults")
  local path = args.target or data.default_corpus()
  return {
    paths = {path}, label = path,
    opts = {eval_bytes = args.eval_bytes or defaults.data.eval_bytes},
    eval_default = args.eval_bytes == nil,
    fit_bytes = args.fit_bytes or defaults.eval.baseline_bytes,
    windows = args.seq and {seq = args.seq, n = args.windows} or nil,
  }
end

local function report(src, orders)
  local corpus <close> = data.open(src.paths, src.opts)
  local files = #corpus:files()
  print(string.format("corpus    %s (%s bytes in %d file%s)", src.label, commas(corpus:size()), files,
                      files == 1 and "" or "s"))
  local sampled = src.fit_bytes > 0 and src.fit_bytes < corpus:train_size()
  print(string.format("train     %s bytes%s", commas(corpus:train_size()),
                      sampled and string.format(", fitted on %s of them in %d pieces (--fit-bytes)",
                                                commas(src.fit_bytes), data.NGRAM_PIECES) or ""))
  local where = src.opts.eval and "the last of " .. src.opts.eval
                or #corpus:sources() > 1 and "each source's tail, shared by weight" or "the last of the corpus"
  print(string.format("held out  %s bytes, %s%s", commas(corpus:eval_size()), where,
                      src.eval_default and " (the config default data.eval_bytes; --eval-bytes N to change)" or ""))
  if src.windows then
    local n = src.windows.n or corpus:eval_count(src.windows.seq)
    print(string.format("scored    the targets of %d held-out windows of %d bytes", n, src.windows.seq + 1))
  end
  print("order  bpb      bytes scored  discounts D_1..D_n (plain KN)             fit s  score s")
  for order = orders[1], orders[2] do
    local t0 = os.clock()
    local m <close> = corpus:ngram(order, {sample = src.fit_bytes})
    local t1 = os.clock()
    local bpb, scored = m:bpb(src.windows)
    local t2 = os.clock()
    local d = {}
    for i, v in ipairs(m:info().discounts) do d[i] = string.format("%.3f", v) end
    print(string.format("%-6d %-8.4f %-13s %-40s %6.2f %8.2f", order, bpb, commas(scored),
                        table.concat(d, " "), t1 - t0, t2 - t1))
  end
end

local function run(argv, cli)
  return cli.framed("baseline", usage, parse, function(args)
    local t0 = os.clock()
    report(resolve(args), args.orders)
    print(string.format("took %.2f s of CPU time", os.clock() - t0))
  end)(argv)
end

return {
  summary = "held-out bits per byte of an order-N Kneser-Ney byte n-gram model",
  args = "[CORPUS] --order N",
  run = run,
}
