--[==[
dormouse corpus pack OUT.zst PATH... [--files-from LIST] [--frame-bytes N] [--level L] [--force] | corpus info PATH... [--read B,T]

pack writes the files the paths name (a file, a folder's files, a glob's
matches; .zst inputs decoded) into one zstd file of frames of N decoded
bytes (--frame-bytes, default 256 KiB, at most 16 MiB) with a seek table. A
run reads such a file in place, a frame at a time through a small cache, so
its memory does not grow with the corpus; any zstd tool decodes it whole.
--files-from LIST: the paths of a file, one a line, after those given (for
lists longer than a command line: `find ... > LIST`). --level: zstd's
compression level (default 9). OUT is written as OUT.tmp
and renamed when whole; an existing OUT is refused unless --force, and OUT
may not be one of the inputs.

info prints what a corpus of the paths holds: its files, its bytes, and
which .zst files a run would hold whole in memory instead of reading them in
place (one frame above 16 MiB, or frames without their sizes: `zstd` writes
such files; pack rewrites them). --read B,T: then times the loader thread
drawing 200 batches of B rows of T+1 bytes from it, as a run draws them, and
prints its rows/s and bytes/s.
example: dormouse corpus pack corpora/mine.zst texts/ && dormouse corpus info corpora/mine.zst --read 8,1024
]==]
local core = require "dormouse.core"
local data = require "dormouse.data"

local usage = "usage: dormouse corpus pack OUT.zst PATH... [--files-from LIST] [--frame-bytes N] [--level L] [--force] | " ..
              "corpus info PATH... [--read B,T]"

local human = require("dormouse.human").bytes

local function count(text, flag, min)
  local n = math.tointeger(tonumber(text))
  if not n or n < min then error(string.format("%s takes an integer >= %d, got '%s'", flag, min, tostring(text)), 0) end
  return n
end

local function parse(argv)
  local args = {paths = {}}
  local i = 2
  while i <= #argv do
    local a = argv[i]
    if a == "--help" or a == "-h" then args.help = true; i = i + 1
    elseif a == "--frame-bytes" then args.frame_bytes = count(argv[i + 1], a, 1); i = i + 2
    elseif a == "--level" then args.level = count(argv[i + 1], a, 1); i = i + 2
    elseif a == "--force" then args.force = true; i = i + 1
    elseif a == "--files-from" then
      if not argv[i + 1] then error("--files-from takes a file of paths, one a line", 0) end
      args.files_from = argv[i + 1]; i = i + 2
    elseif a == "--read" then
      local b, t = tostring(argv[i + 1]):match("^(%d+),(%d+)$")
      if not b then error("--read takes B,T (rows of a batch, bytes of a row but one), such as 8,1024", 0) end
      args.read = {batch = count(b, a, 1), seq = count(t, a, 1)}
      i = i + 2
    elseif a:sub(1, 2) == "--" then error("unknown option '" .. a .. "'", 0)
    elseif not args.action then args.action = a; i = i + 1
    else args.paths[#args.paths + 1] = a; i = i + 1 end
  end
  if args.help then return args end
  if args.action ~= "pack" and args.action ~= "info" then
    error(args.action and "unknown action '" .. args.action .. "' (pack, info)" or "which action? pack or info", 0)
  end
  if args.action == "pack" then
    args.out = table.remove(args.paths, 1)
    if not args.out then error("pack needs OUT.zst and the paths to pack", 0) end
    if not args.out:match("%.zst$") then error("pack writes a zstd file: OUT must end in .zst, got '" .. args.out .. "'", 0) end
  elseif args.frame_bytes or args.level or args.force or args.files_from then
    error("--files-from, --frame-bytes, --level and --force are pack's", 0)
  end
  if args.read and args.action ~= "info" then error("--read is info's", 0) end
  if #args.paths == 0 and not args.files_from then error(args.action .. " needs at least one path", 0) end
  return args
end

-- every file the paths name, in order; the output among them is refused
local function inputs(paths, out)
  local files = {}
  for _, p in ipairs(paths) do
    for _, f in ipairs(data.files(p)) do
      if core.same_file(f, out) then
        error("'" .. f .. "' is the output: pack into another file", 0)
      end
      files[#files + 1] = f
    end
  end
  return files
end

local function pack(args)
  if core.file_kind(args.out) ~= "missing" and not args.force then
    error("'" .. args.out .. "' exists; --force replaces it (once the new file is whole)", 0)
  end
  if args.files_from then
    local f, err = io.open(args.files_from, "r")
    if not f then error("--files-from: cannot read " .. err, 0) end
    for line in f:lines() do if line ~= "" then args.paths[#args.paths + 1] = line end end
    f:close()
    if #args.paths == 0 then error("--files-from: " .. args.files_from .. " names no path", 0) end
  end
  local files = inputs(args.paths, args.out)
  local t0, last = core.now(), core.now()
  local bytes_in, bytes_out = data.pack(args.out, files, {frame_bytes = args.frame_bytes, level = args.level,
    progress = function(i, file, sofar)
      if core.now() - last >= 5 or i == #files then
        last = core.now()
        io.stderr:write(string.format("pack: %d of %d files, %s read, %.0f s\n", i, #files, human(sofar), last - t0))
      end
    end})
  print(string.format("pack: %s: %s in %d file%s -> %s (%.2fx) in frames of %s, %.1f s", args.out, human(bytes_in),
                      #files, #files == 1 and "" or "s", human(bytes_out), bytes_in / math.max(bytes_out, 1),
                      human(args.frame_bytes or data.FRAME_BYTES), core.now() - t0))
end

local function info(args)
  local corpus <close> = data.open(args.paths)
  local files = corpus:files()
  print(string.format("corpus    %s in %d file%s", human(corpus:size()), #files, #files == 1 and "" or "s"))
  local whole, held = corpus:decoded_whole(), 0
  for _, w in ipairs(whole) do
    held = held + w.bytes
    print(string.format("whole     %s: %s held in memory (`dormouse corpus pack` writes it in frames)", w.path,
                        human(w.bytes)))
  end
  print(string.format("memory    %s of decoded .zst held whole; the other files mapped or read in place",
                      human(held)))
  if args.read then
    local batches = 200
    local loader <close> = corpus:loader {batch = args.read.batch, seq = args.read.seq, seed = 1}
    local t0 = core.now()
    for _ = 1, batches do loader:next() end
    local dt, rows = core.now() - t0, batches * args.read.batch
    print(string.format("read      %d batches of %d rows of %d bytes through the loader: %.2f s, %.0f rows/s, %s/s",
                        batches, args.read.batch, args.read.seq + 1, dt, rows / dt,
                        human(rows * (args.read.seq + 1) / dt)))
  end
end

local function run(argv, cli)
  return cli.framed("corpus", usage, parse, function(args)
    if args.action == "pack" then pack(args) else info(args) end
  end)(argv)
end

return {
  summary = "write a corpus as zstd frames read in place (pack), or say what a corpus holds (info)",
  args = "pack|info ...",
  run = run,
}
