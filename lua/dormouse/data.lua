--[[
dormouse.data — byte corpora: splits, training batches, a loader thread,
held-out windows, and the n-gram baseline.

  local data = require "dormouse.data"
  local corpus <close> = data.open(data.default_corpus(), {eval_bytes = 400000})
  local x, prefix = corpus:batch(k, {batch = 8, seq = 256, seed = 1, ctx = 4})
  local loader <close> = corpus:loader {batch = 8, seq = 256, seed = 1, start = k}
  local x, prefix, k = loader:next()        -- loader:peek(): the same, without taking it
  local ex, eprefix = corpus:eval_windows {seq = 256, n = 16}
  print(corpus:ngram_bpb(5, {seq = 256, n = 16}))

A corpus is one byte stream: a file, a list of files, a directory (its
regular files, recursively, each level in sorted name order, hidden names
skipped) or a glob; `.zst` files are decompressed at open. The held-out
split is the last eval_bytes of the stream; training windows never touch it.
A mixture (opts.weights) holds each source's train bytes in turn, then the
held-out bytes: each source's tail, or the end of a separate eval source.

Batch k (k = 0, 1, ...: the number of batches drawn before it) is x [B, T+1]
(inputs x[:, 1..T], targets x[:, 2..T+1]) and prefix [B, ctx], the ctx
bytes before each row (pad byte 0 before the corpus start). Row r's start is
drawn from (seed, k, r) alone, so the next k is the whole data state a
checkpoint keeps, and a loader started at k continues a run exactly.
Held-out window i starts at train_size + i*T; consecutive windows share one
byte, so their targets cover the held-out bytes once. Byte offsets
(corpus:bytes) count from 0, as in a file.
]]
local core = require "dormouse.core"

local data = {}

-- An error located at the first caller outside the dormouse library.
local function fail(fmt, ...)
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if not info then level = 1; break end
    if info.what ~= "C" and not info.source:find("/dormouse/", 1, true) then break end
    level = level + 1
  end
  error(string.format(fmt, ...), level)
end

local function options(opts, where, allowed)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail("%s: options must be a table, got a %s", where, type(opts)) end
  for key in pairs(opts) do
    if allowed[key] == nil then
      local names = {}
      for name in pairs(allowed) do names[#names + 1] = name end
      table.sort(names)
      fail("%s: unknown option '%s' (options: %s)", where, tostring(key), table.concat(names, ", "))
    end
  end
  return opts
end

-- opts[key] as an integer >= min; default when absent (nil default: required)
local function integer(opts, key, where, min, default)
  local v = opts[key]
  if v == nil then
    if default == nil then fail("%s: option '%s' is required", where, key) end
    return default
  end
  local i = type(v) == "number" and math.tointeger(v)
  if not i or i < min then
    fail("%s: option '%s' must be an integer >= %d, got %s", where, key, min, tostring(v))
  end
  return i
end

local function name(opts, key, where, choices, default)
  local v = opts[key]
  if v == nil then return default end
  for _, c in ipairs(choices) do if v == c then return v end end
  fail("%s: option '%s' must be one of %s, got %s", where, key, table.concat(choices, ", "), tostring(v))
end

local BATCH = {batch = true, seq = true, ctx = true, seed = true, dtype = true, device = true, first_row = true}
local LOADER = {batch = true, seq = true, ctx = true, seed = true, dtype = true, device = true,
                first_row = true, start = true, depth = true}
local WINDOWS = {seq = true, n = true, ctx = true, dtype = true, device = true}
local SCORED = {seq = true, n = true}
local DTYPES = {"u8", "i32", "i64"}

-- batch, seq, ctx, seed, dtype, device, first_row: the spec the core takes
local function batch_spec(o, where)
  local seed = o.seed == nil and 0 or type(o.seed) == "number" and math.tointeger(o.seed)
  if not seed then fail("%s: option 'seed' must be an integer, got %s", where, tostring(o.seed)) end
  return integer(o, "batch", where, 1), integer(o, "seq", where, 1), integer(o, "ctx", where, 0, 0),
         seed, name(o, "dtype", where, DTYPES, "u8"), o.device, integer(o, "first_row", where, 0, 0)
end

-- ---- the corpus ------------------------------------------------------------------------------

local Corpus = {}
local corpus_mt = core.data_metatable("corpus")
corpus_mt.__index = Corpus

local function path_list(paths, where, what)
  if type(paths) == "string" then paths = {paths} end
  if type(paths) ~= "table" or #paths == 0 then
    fail("%s: expects %s, got %s", where, what, type(paths) == "table" and "an empty list" or type(paths))
  end
  for i, p in ipairs(paths) do
    if type(p) ~= "string" then fail("%s: path %d is a %s, not a string", where, i, type(p)) end
  end
  return paths
end

--[[ data.open(path_or_list, {eval_bytes = N, weights = {w, ...}, eval = path_or_list}) → a corpus.
eval_bytes defaults to 0 (no held-out split). Without weights the paths are one source, joined in
order; with them each path (a file, a folder or a glob) is a source of its own, and each training
row reads one source, drawn by weight. eval: a held-out source whose last eval_bytes are the
held-out split (without it, each source's tail, eval_bytes shared by weight). ]]
function data.open(paths, opts)
  local o = options(opts, "data.open", {eval_bytes = true, weights = true, eval = true})
  paths = path_list(paths, "data.open", "a path or a list of paths")
  local weights = o.weights
  if weights ~= nil then
    if type(weights) ~= "table" or #weights ~= #paths then
      fail("data.open: option 'weights' must be a list of %d numbers, one a path, got %s", #paths,
           type(weights) == "table" and #weights .. " entries" or type(weights))
    end
    for i, w in ipairs(weights) do
      if type(w) ~= "number" or not (w > 0) or w == math.huge then
        fail("data.open: weight %d (of '%s') must be a number > 0, got %s", i, paths[i], tostring(w))
      end
    end
  end
  local eval = o.eval ~= nil and path_list(o.eval, "data.open: option 'eval'", "a path or a list of paths") or nil
  return core.corpus_open(paths, integer(o, "eval_bytes", "data.open", 0, 0), weights, eval)
end

corpus_mt.__tostring = function(self)
  local ok, size, train, held = pcall(core.corpus_sizes, self)
  if not ok then return "Corpus (closed)" end
  local files = core.corpus_files(self)
  local more = #files > 1 and string.format(" and %d more files", #files - 1) or ""
  local sources = core.corpus_sources(self)
  local mix = #sources > 1 and string.format(", %d sources", #sources) or ""
  return string.format("Corpus('%s'%s%s: %d bytes, train %d, held out %d)", files[1], more, mix, size, train, held)
end

function Corpus:size() return (core.corpus_sizes(self)) end
function Corpus:train_size() return (select(2, core.corpus_sizes(self))) end
function Corpus:eval_size() return select(3, core.corpus_sizes(self)) end
function Corpus:files() return core.corpus_files(self) end
--- corpus:decoded_whole() → {{path = p, bytes = n}, ...}: the .zst files held whole in memory (one frame
--- too large, or frames without their sizes, to read in place; `dormouse corpus pack` rewrites them)
function Corpus:decoded_whole() return core.corpus_whole(self) end
--- corpus:sources() → {{begin = b, ["end"] = e, share = w}, ...}: each source's train bytes [b, e) and its share of the rows
function Corpus:sources() return core.corpus_sources(self) end
function Corpus:close() core.corpus_close(self) end

--- corpus:bytes(offset, n) → n bytes from a 0-based offset, as a string
function Corpus:bytes(offset, n)
  return core.corpus_bytes(self, offset, n)
end

--- corpus:batch(k, {batch = B, seq = T, seed = s, ctx = c, dtype = "u8", device = "cpu", first_row = 0}) → x, prefix
--- (first_row: the rows first_row .. first_row + B - 1 of batch k, a data-parallel rank's share)
-- k as the batch number it must be (an integer >= 0)
local function batch_number(k, where)
  if type(k) ~= "number" or math.tointeger(k) == nil or k < 0 then
    fail("%s: k (the batch number, from 0) must be an integer >= 0, got %s", where, tostring(k))
  end
  return math.tointeger(k)
end

function Corpus:batch(k, opts)
  local where = "corpus:batch"
  return core.corpus_batch(self, batch_number(k, where), batch_spec(options(opts, where, BATCH), where))
end

--- corpus:starts(k, opts) → {offset, ...}: where batch k's rows start in the stream (opts as for corpus:batch)
function Corpus:starts(k, opts)
  local where = "corpus:starts"
  return core.corpus_starts(self, batch_number(k, where), batch_spec(options(opts, where, BATCH), where))
end

--- corpus:loader{batch, seq, seed, ctx, dtype, device, first_row, start = k, depth = 4} → a loader
function Corpus:loader(opts)
  local where = "corpus:loader"
  local o = options(opts, where, LOADER)
  local b, t, c, seed, dtype, device, first_row = batch_spec(o, where)
  local depth = o.depth ~= nil and integer(o, "depth", where, 1) or nil   -- nil: the core's default, 4
  return core.loader_new(self, b, t, c, seed, dtype, device, first_row, integer(o, "start", where, 0, 0), depth)
end

--- corpus:eval_count(seq) → how many held-out windows of seq+1 bytes there are
function Corpus:eval_count(seq)
  return core.corpus_eval_count(self, integer({seq = seq}, "seq", "corpus:eval_count", 1))
end

--- corpus:eval_windows{seq = T, n = N (default all), ctx, dtype, device} → x [N, T+1], prefix [N, ctx]
function Corpus:eval_windows(opts)
  local where = "corpus:eval_windows"
  local o = options(opts, where, WINDOWS)
  return core.corpus_eval_windows(self, integer(o, "n", where, 1, -1), integer(o, "seq", where, 1),
                                  integer(o, "ctx", where, 0, 0), name(o, "dtype", where, DTYPES, "u8"),
                                  o.device)
end

-- The bytes a baseline scores: the whole held-out split, or the targets of
-- the first n eval windows of seq+1 bytes, [train + 1, train + 1 + n*seq).
local function scored_range(corpus, opts, where)
  local o = options(opts, where, SCORED)
  local size, train, held = core.corpus_sizes(corpus)
  if held == 0 then fail("%s: the corpus has no held-out split (open it with {eval_bytes = N})", where) end
  if o.seq == nil then
    if o.n ~= nil then fail("%s: option 'n' needs 'seq'", where) end
    return train, size
  end
  local seq = integer(o, "seq", where, 1)
  local all = core.corpus_eval_count(corpus, seq)
  if all == 0 then
    fail("%s: the held-out split (%d bytes) is shorter than one window of seq + 1 = %d bytes",
         where, held, seq + 1)
  end
  local n = integer(o, "n", where, 1, all)
  if n > all then
    fail("%s: asked for %d windows of seq + 1 = %d bytes; the held-out split (%d bytes) holds %d",
         where, n, seq + 1, held, all)
  end
  return train + 1, train + 1 + n * seq
end

-- ---- writing corpora in frames ------------------------------------------------------------

-- dormouse corpus pack's defaults: frames of 256 KiB of text (a row decodes its frame: about
-- 4,000 rows/s on one CPU core, 40 times what b1's step at B 8 reads) at zstd level 9 (3.35x on
-- English text, 33 MB/s); docs/training.md, "Corpora"
data.FRAME_BYTES = 1 << 18
data.PACK_LEVEL = 9

--- data.files(path) → the files a path names: the file, a folder's files (recursively, sorted,
--- hidden names skipped) or a glob's matches, in the order a corpus joins them
function data.files(path)
  if type(path) ~= "string" then fail("data.files: expects a path, got %s", type(path)) end
  return core.corpus_list(path)
end

--[[ data.pack(out, files, {frame_bytes = N, level = L, progress = fn(i, file, bytes_in)}) →
bytes in, bytes out. Writes the files (raw, or .zst decoded) into one zstd file of frames of N
decoded bytes with a seek table, which a corpus reads in place a frame at a time; out is written as
out.tmp and renamed when whole, so it is never half-written. ]]
function data.pack(out, files, opts)
  local o = options(opts, "data.pack", {frame_bytes = true, level = true, progress = true})
  if type(out) ~= "string" or out == "" then fail("data.pack: expects the output path, got %s", tostring(out)) end
  files = path_list(files, "data.pack", "a list of files")
  local w <close> = core.zwriter_open(out, integer(o, "frame_bytes", "data.pack", 1, data.FRAME_BYTES),
                                      integer(o, "level", "data.pack", 1, data.PACK_LEVEL))
  for i, file in ipairs(files) do
    local bytes_in = core.zwriter_add_file(w, file)
    if o.progress then o.progress(i, file, bytes_in) end
  end
  return core.zwriter_close(w)
end

-- ---- the n-gram baseline ------------------------------------------------------------------

data.NGRAM_PIECES = core.ngram_pieces()    -- a sampled fit's pieces

-- A model is a table holding the fitted userdata (freed on close or collection) and its corpus.
local NGram = {}
NGram.__index = NGram

--- corpus:ngram(order, {sample = bytes}) → an interpolated Kneser-Ney byte model fitted on the
--- train split: the whole of it, or with sample, that many of its bytes in data.NGRAM_PIECES pieces
--- spread evenly over it (a corpus of gigabytes fits in seconds)
function Corpus:ngram(order, opts)
  local o = integer({order = order}, "order", "corpus:ngram", 1)    -- the core checks the top
  local sample = integer(options(opts, "corpus:ngram", {sample = true}), "sample", "corpus:ngram", 0, 0)
  return setmetatable({_m = core.ngram_fit(self, o, sample), _corpus = self}, NGram)
end

--- model:bpb(opts) → held-out bits per byte and the number of bytes scored; opts as for ngram_bpb
function NGram:bpb(opts)
  local from, to = scored_range(self._corpus, opts, "ngram:bpb")
  return core.ngram_bits(self._m, self._corpus, from, to) / (to - from), to - from
end

--- model:info() → {order = n, discounts = {D_1, ...}, entries = {distinct n-grams per order}}
function NGram:info()
  local order, d, entries = core.ngram_info(self._m)
  return {order = order, discounts = d, entries = entries}
end

function NGram:close() core.ngram_close(self._m) end
NGram.__close = NGram.close

--- corpus:ngram_bpb(order, {seq = T, n = N, sample = bytes}) → the order-n baseline's held-out bits
--- per byte on the targets of the same eval windows the model is scored on (no seq: the whole
--- held-out split), fitted as corpus:ngram(order, {sample = bytes}) fits
function Corpus:ngram_bpb(order, opts)
  local where = "corpus:ngram_bpb"
  local o = options(opts, where, {seq = true, n = true, sample = true})
  local scored = {seq = o.seq, n = o.n}
  scored_range(self, scored, where)                  -- check the options before the fit
  local m <close> = self:ngram(order, {sample = o.sample})
  return m:bpb(scored)
end

-- ---- the loader ----------------------------------------------------------------------------

local Loader = {}
local loader_mt = core.data_metatable("loader")
loader_mt.__index = Loader

-- A batch peek() took from the core ahead of its next(): {x, prefix, k} by loader (weak keys).
local peeked = setmetatable({}, {__mode = "k"})

--- loader:next() → x, prefix, k (batches start, start+1, ... in order)
function Loader:next()
  local p = peeked[self]
  if p then
    core.loader_position(self)           -- raises when the loader is closed
    peeked[self] = nil
    return p[1], p[2], p[3]
  end
  return core.loader_next(self)
end

--[[ loader:peek() → x, prefix, k: the batch the next next() returns (the very same tensors),
without taking it; position() is unchanged. The tensors outlive the dm.scope peek is called in
(the step before theirs), so they go back to the garbage collector, not to a scope. ]]
function Loader:peek()
  local p = peeked[self]
  if not p then
    local x, prefix, k = core.loader_next(self)
    p = {core.keep(x), core.keep(prefix), k}
    peeked[self] = p
  end
  return p[1], p[2], p[3]
end

--- loader:position() → the k the next call returns: the data state to checkpoint
function Loader:position()
  return peeked[self] and peeked[self][3] or core.loader_position(self)
end

function Loader:close()
  peeked[self] = nil
  core.loader_close(self)
end

-- ---- the default corpus -----------------------------------------------------------------------

local function cache_dir()
  local xdg, home = os.getenv("XDG_CACHE_HOME"), os.getenv("HOME")
  if xdg and xdg ~= "" then return xdg .. "/dormouse" end
  if home and home ~= "" then return home .. "/.cache/dormouse" end
  fail("data.default_corpus: neither XDG_CACHE_HOME nor HOME is set; pass {cache_dir = ...}")
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local BIBLE_RANGE = "-l0 gen1:1-rev22:21"

--[[ data.default_corpus() → the path of the King James Bible as one text file.

It is byte for byte what `bible -l0 gen1:1-rev22:21` prints (Debian package
bible-kjv): a blank line and "Genesis 1" heading each chapter, then one line
per verse, "  1 In the beginning God created ...", 4,298,239 bytes of
ASCII. Nothing is stripped: the headings and verse numbers are part of the
printed text and cost a model little. The file is cached under
$XDG_CACHE_HOME/dormouse (or ~/.cache/dormouse), written to a temporary name
and renamed. opts: cache_dir, program (the `bible` command; for tests).]]
function data.default_corpus(opts)
  local o = options(opts, "data.default_corpus", {cache_dir = true, program = true})
  local dir = o.cache_dir or cache_dir()
  local path = dir .. "/kjv.txt"
  if exists(path) then return path end
  local program = o.program or "bible"
  local core = require "dormouse.core"
  local argv = {program}
  for word in BIBLE_RANGE:gmatch("%S+") do argv[#argv + 1] = word end
  local text = core.run_program(argv)                      -- no shell: the words go to the program as they are
  if not text then
    fail("data.default_corpus: the program '%s' was not found; it comes with the Debian package " ..
         "bible-kjv: install it with `sudo apt-get install bible-kjv`", program)
  end
  if text:sub(1, 35) ~= "\nGenesis 1\n\n  1 In the beginning Go" or text:sub(-6) ~= "Amen.\n" then
    fail("data.default_corpus: `%s %s` printed %d bytes that are not the King James Bible " ..
         "(is the Debian package bible-kjv-text installed?)", program, BIBLE_RANGE, #text)
  end
  local made, why = pcall(core.mkdirs, dir)
  if not made then fail("data.default_corpus: cannot create the cache folder '%s': %s", dir, tostring(why)) end
  local written, werr = pcall(core.write_file, path, text)   -- a temporary name, then renamed
  if not written then fail("data.default_corpus: cannot write '%s': %s", path, tostring(werr)) end
  return path
end

return data
