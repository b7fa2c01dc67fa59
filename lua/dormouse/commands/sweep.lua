--[[
dormouse sweep FILE.lua [--set KEY=VALUE ...] [--arms A,B] [--seeds S,S] [--steps N] [--base FILE] [--jobs N] [--quiet]

Runs a seed sweep: FILE returns the table dm.sweep takes ({base =, arms =,
seeds =, set =, ...}; experiments/sweep_seeds.lua). Every --set applies to
every arm, over the file's `set` (an arm's own keys still win); a run shorter
than the base's warm-up gets a shorter one, and a line says so. Prints the
verdict table and writes it to runs/sweep-NAME/. --jobs N (default 1) trains N runs at
once, each a process of its own (several small runs share a GPU well; their
output goes to runs/sweep-NAME/ARM-sSEED.log). --run ARM:SEED trains that
one run of the sweep alone (what each of those processes does). --arms A,B
runs those arms only, besides the control (default: every arm). --seeds 1,2 replaces the file's
seeds; --steps N gives every run N steps (a short sweep: the warm-up follows);
--base FILE replaces the experiment every arm starts from (experiments/tiny.lua:
the sweep's smoke run, its arms' keys checked against another model).
Run again, a sweep reads the runs
that finished and resumes the ones that stopped; --overwrite trains every run
afresh (a run folder holding another config's run is refused without it).
--quiet prints the verdict table alone, not the runs' lines.
example: dormouse sweep experiments/sweep_demo.lua --seeds 1,2 --steps 50   (a few minutes on a CPU)
]]
local config = require "dormouse.config"

local sweep_cmd = {args = "FILE.lua [--set KEY=VALUE ...]", summary = "a seed sweep: arms x seeds, a verdict table"}

local usage = "usage: dormouse sweep FILE.lua [--set KEY=VALUE ...] [--arms A,B] [--seeds S,S] [--steps N] " ..
              "[--base FILE] [--jobs N] [--run ARM:SEED] [--overwrite] [--quiet]"

local function fail(msg, code)
  io.stderr:write(msg, "\n")
  return code
end

function sweep_cmd.run(argv, cli)
  local ok, args = pcall(config.parse_args, argv, 2, {quiet = true, help = true, jobs = "N", run = "ARM:SEED", arms = "A,B",
                                                               overwrite = true, seeds = "S,S", steps = "N", base = "FILE"})
  if not ok then return fail("dormouse sweep: " .. args .. "\n" .. usage, 2) end
  if args.flags.help then io.write(require("dormouse.cli").help_text("sweep", usage), "\n"); return 0 end
  if not args.file then return fail("dormouse sweep: which file?\n" .. usage, 2) end
  local chunk, err = config.loadfile(args.file, "t")
  if not chunk then return fail("dormouse sweep: " .. err, 1) end
  local ran, spec = pcall(chunk)
  if not ran then return fail(tostring(spec), 1) end
  if type(spec) ~= "table" or not (spec.base and spec.arms and spec.seeds) then
    return fail(string.format("dormouse sweep: %s must return a sweep {base = FILE, arms = {name = {overrides}}, " ..
                              "seeds = {...}}, got %s", args.file, type(spec)), 1)
  end
  spec.cli_set = args.overrides
  if args.flags.base then spec.base, spec.base_flag = args.flags.base, args.flags.base end   -- a smoke run on tiny
  if args.flags.steps then                         -- a short sweep: every run's steps (the warm-up follows)
    for _, s in ipairs(spec.cli_set) do
      if config.split_set(s) == "steps" then
        return fail("dormouse sweep: --steps and --set steps=... both give the steps: give one", 2)
      end
    end
    local n = math.tointeger(tonumber(args.flags.steps))
    if not n or n < 1 then return fail("dormouse sweep: --steps takes a whole number of at least 1, got " ..
                                       args.flags.steps, 2) end
    spec.cli_set[#spec.cli_set + 1] = "steps=" .. n
  end
  if args.flags.seeds then                         -- the file's seeds replaced
    local seeds = {}
    for s in args.flags.seeds:gmatch("[^,]+") do
      local n = math.tointeger(tonumber(s))
      if not n or n < 0 then return fail("dormouse sweep: --seeds takes integers >= 0 with commas, got " ..
                                         args.flags.seeds, 2) end
      seeds[#seeds + 1] = n
    end
    if #seeds == 0 then return fail("dormouse sweep: --seeds takes one seed or more (1,2,3)", 2) end
    spec.seeds, spec.seeds_flag = seeds, args.flags.seeds
  end
  spec.quiet = spec.quiet or args.flags.quiet
  spec.root = spec.root or cli.root
  spec.file = args.file
  spec.only = args.flags.run
  spec.select = args.flags.arms
  spec.overwrite = spec.overwrite or args.flags.overwrite
  if args.flags.jobs then
    spec.jobs = math.tointeger(tonumber(args.flags.jobs))
    if not spec.jobs or spec.jobs < 1 then
      return fail("dormouse sweep: --jobs takes a whole number of at least 1, got " .. args.flags.jobs, 2)
    end
  end
  local done, e, dir = pcall(require("dormouse.sweep").run, spec)
  if not done then return fail(tostring(e), 1) end
  if args.flags.quiet and dir then                 -- --quiet drops the runs' lines, never the verdict
    local f = io.open(dir .. "/verdict.txt", "r")
    if f then io.write(f:read("a")); f:close() end
  end
  return 0
end

return sweep_cmd
