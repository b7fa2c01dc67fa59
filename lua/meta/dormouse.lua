---@meta dormouse
-- LuaLS definitions for `require "dormouse"` and its tensors, so editors
-- complete the methods of a userdata they cannot see into. Nothing here
-- runs: the implementation is vm/lua/*.c and lua/dormouse/.
-- Positions are 1-based (dims, narrow starts, gather/index_select/scatter_add
-- indices, the indices max and argmax return); negative dims count from the end.
-- tests/lua/tensor_spec.lua checks that every method and function is listed here or,
-- for the ops whose descriptors give their function, in build/meta/ops.lua (`dormouse meta`).

---@alias dormouse.DType "f32"|"f64"|"bf16"|"f16"|"i32"|"i64"|"u8"
---@alias dormouse.Device "cpu"|"cuda"|"meta"
---@alias dormouse.Shape integer[]

---@class dormouse.CreateOptions
---@field dtype? dormouse.DType element type (default "f32")
---@field device? dormouse.Device where the memory lives (default "cpu")
---@field requires_grad? boolean a leaf whose gradient backward accumulates in .grad

---@class dormouse.DrawOptions: dormouse.CreateOptions
---@field seed? integer draw at (seed, offset), reproducible by itself; without it, the global generator
---@field offset? integer the Philox counter to start at (default 0)

---@class dormouse.AllcloseOptions
---@field rtol? number relative tolerance (default 1e-5)
---@field atol? number absolute tolerance (default 1e-8)

---@class dormouse.Memory
---@field current integer bytes allocated now
---@field allocated integer the same as current
---@field peak integer the most bytes allocated at once since the start or dm.reset_peak()
---@field count integer live blocks
---@field reserved integer bytes held by the allocator, allocated or cached
---@field device_allocs integer allocations that reached the system (or the CUDA driver)
---@field tape_nodes integer ops recorded on the autograd tape

---@class dormouse.OpInfo
---@field name string the op's name in the op table
---@field doc string one line
---@field attrs string its numeric attributes
---@field n_in integer tensor inputs (-1: a list)
---@field n_out integer tensor outputs
---@field differentiable boolean whether it has a backward
---@field lua? "function"|"method" the Lua function its descriptor gives it (lua/dormouse/ops/generated.lua)
---@field args? string its inputs by name, each with its shape
---@field optional boolean[] optional[i]: input i may be nil

---A view over refcounted storage: dtype, shape, strides, device. Arithmetic
---operators broadcast as in NumPy and take a number on either side.
---@class dormouse.Tensor
---@field dtype dormouse.DType the element type
---@field device dormouse.Device where the values live
---@field ndim integer the number of dims
---@field is_leaf boolean true unless the tensor is the output of a recorded op
---@field grad dormouse.Tensor|nil the gradient backward accumulated (leaves only); assign nil to reset it
---@operator add(dormouse.Tensor|number): dormouse.Tensor
---@operator sub(dormouse.Tensor|number): dormouse.Tensor
---@operator mul(dormouse.Tensor|number): dormouse.Tensor
---@operator div(dormouse.Tensor|number): dormouse.Tensor
---@operator pow(number): dormouse.Tensor
---@operator unm: dormouse.Tensor
---@operator len: integer
local Tensor = {}

-- ---- sizes and values --------------------------------------------------------

---The sizes of the dims, as a new table.
---@return dormouse.Shape
function Tensor:shape() end

---The sizes of the dims, or the size of one dim (1-based, negative from the end).
---@param dim? integer
---@return integer|dormouse.Shape
function Tensor:size(dim) end

---The strides, in elements.
---@return integer[]
function Tensor:stride() end

---The offset of the first element in the storage, in elements.
---@return integer
function Tensor:storage_offset() end

---The number of dims.
---@return integer
function Tensor:dim() end

---The number of elements.
---@return integer
function Tensor:numel() end

---Whether the elements lie in row-major order without gaps.
---@return boolean
function Tensor:is_contiguous() end

---The value of a one-element tensor: a float, or an integer for integer dtypes.
---@return number
function Tensor:item() end

---The values as nested tables (a number for a 0-dim tensor).
---@return number|table
function Tensor:totable() end

-- ---- devices, dtypes and copies ---------------------------------------------------

---A copy on a device or in a dtype; x:to{device = "cuda", dtype = "bf16"} for both.
---@param target dormouse.DType|dormouse.Device|{device?: dormouse.Device, dtype?: dormouse.DType}
---@return dormouse.Tensor
function Tensor:to(target) end

---A copy on the GPU (the tensor itself if it is there).
---@return dormouse.Tensor
function Tensor:cuda() end

---A copy in host memory (the tensor itself if it is there).
---@return dormouse.Tensor
function Tensor:cpu() end

---A copy as f32.
---@return dormouse.Tensor
function Tensor:float() end

---A copy as f64.
---@return dormouse.Tensor
function Tensor:double() end

---A copy as bf16 (round to nearest even).
---@return dormouse.Tensor
function Tensor:bf16() end

---A copy as f16 (round to nearest even).
---@return dormouse.Tensor
function Tensor:half() end

---A copy as i64 (floats truncate toward zero); ends the graph.
---@return dormouse.Tensor
function Tensor:long() end

---A copy as i32 (floats truncate toward zero); ends the graph.
---@return dormouse.Tensor
function Tensor:int() end

-- ---- views ------------------------------------------------------------------------

---The same as reshape.
---@param shape dormouse.Shape|integer
---@param ... integer
---@return dormouse.Tensor
function Tensor:view(shape, ...) end

---The transpose of a 2-D tensor (a view).
---@return dormouse.Tensor
function Tensor:t() end

-- ---- elementwise ------------------------------------------------------------------

---x + y, broadcasting; y may be a number.
---@param y dormouse.Tensor|number
---@return dormouse.Tensor
function Tensor:add(y) end

---x - y, broadcasting; y may be a number.
---@param y dormouse.Tensor|number
---@return dormouse.Tensor
function Tensor:sub(y) end

---x * y, broadcasting; y may be a number.
---@param y dormouse.Tensor|number
---@return dormouse.Tensor
function Tensor:mul(y) end

---x / y, broadcasting; y may be a number.
---@param y dormouse.Tensor|number
---@return dormouse.Tensor
function Tensor:div(y) end

-- ---- in place (no autograd: optimisers, under dm.no_grad for tensors that require grad) --

---x += alpha * y in place (alpha defaults to 1); returns x.
---@param y dormouse.Tensor|number
---@param alpha? number
---@return dormouse.Tensor
function Tensor:add_(y, alpha) end

---x *= y in place; returns x.
---@param y dormouse.Tensor|number
---@return dormouse.Tensor
function Tensor:mul_(y) end

---Copies src into x in place (broadcasting, casting, across devices); returns x.
---@param src dormouse.Tensor
---@return dormouse.Tensor
function Tensor:copy_(src) end

---Sets every element to v in place; returns x.
---@param v number
---@return dormouse.Tensor
function Tensor:fill_(v) end

---Sets every element to 0 in place; returns x.
---@return dormouse.Tensor
function Tensor:zero_() end

-- ---- reductions ---------------------------------------------------------------------

---The largest value (no dim), or the values and 1-based i64 indices along dim.
---@param dim? integer
---@param keepdim? boolean
---@return dormouse.Tensor values
---@return dormouse.Tensor? indices
function Tensor:max(dim, keepdim) end

---The smallest value (no dim), or the values and 1-based i64 indices along dim.
---@param dim? integer
---@param keepdim? boolean
---@return dormouse.Tensor values
---@return dormouse.Tensor? indices
function Tensor:min(dim, keepdim) end

-- ---- products and indexing ---------------------------------------------------------

-- ---- model blocks (fused ops with their own backward) ----------------------------------

---quantize's values forward, the gradient passed straight through (quantisation-aware training).
---@param format "fp8_e4m3"|"nvfp4"|"ternary"|"binary"
---@param block? integer
---@return dormouse.Tensor
function Tensor:fake_quantize(format, block) end

-- ---- autograd -------------------------------------------------------------------------

---Runs the tape back from this tensor, accumulates the leaves' .grad, then frees the tape.
---A tensor of more than one element needs its gradient.
---@param grad? dormouse.Tensor
function Tensor:backward(grad) end

---A view of the same values outside the graph: a constant for what follows.
---@return dormouse.Tensor
function Tensor:detach() end

---Whether the tensor requires grad; with an argument, marks (or unmarks) a leaf and returns it.
---@param on? boolean
---@return boolean|dormouse.Tensor
function Tensor:requires_grad(on) end

-- ---- memory -----------------------------------------------------------------------------

---Drops this tensor's storage now, whoever holds the tensor; any later use is an error.
function Tensor:free() end

---Whether the tensor was freed (by :free(), a <close> variable or the end of its dm.scope).
---@return boolean
function Tensor:is_freed() end


---@class dormouse
---@field version string the runtime's version
---@field core table the C binding module `dormouse.core`
---@field cuda table the CUDA backend: is_available, info, synchronize, memory, empty_cache, tf32, graph, ...
---@field profile table the op profiler: profile.start(), profile.stop() → rows {name, family, phase, ms, calls}, profile.region, profile.table
---@field optim table optimisers (loaded on first use): optim.new(model, cfg.optim, cfg.schedule, steps)
---@field nn table modules and layers (loaded on first use): nn.class, nn.Linear, nn.KDA, nn.Block, ...
local dm = {}

dm.data = require("dormouse.data")
dm.ckpt = require("dormouse.ckpt")
dm.config = require("dormouse.config")

---A fused elementwise op from an expression: dm.fuse("silu(a) * b")(a, b). Parsed with LPeg,
---differentiated symbolically, compiled once with NVRTC on the GPU, evaluated directly on the CPU.
---@param expr string
---@param opts? {inputs?: string[]}
---@return fun(...): dormouse.Tensor
function dm.fuse(expr, opts) end

---The autograd tape.
dm.autograd = {}

---The number of ops on the tape.
---@return integer
function dm.autograd.size() end

---Drops the tape (a step that will not call backward).
function dm.autograd.clear() end

-- ---- creation ------------------------------------------------------------------------------

---A tensor from a number or nested tables of numbers.
---@param data number|table
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.tensor(data, opts) end

---A tensor of zeros.
---@param shape dormouse.Shape|integer
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.zeros(shape, opts) end

---A tensor of ones.
---@param shape dormouse.Shape|integer
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.ones(shape, opts) end

---A tensor filled with value.
---@param shape dormouse.Shape|integer
---@param value number
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.full(shape, value, opts) end

---A tensor whose values are not set.
---@param shape dormouse.Shape|integer
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.empty(shape, opts) end

---start, start + step, ... below stop; dm.arange(n) is 0..n-1. The options may follow any number.
---@param start number
---@param stop? number|dormouse.CreateOptions
---@param step? number|dormouse.CreateOptions
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.arange(start, stop, step, opts) end

---Uniform draws in [0, 1) from Philox-4x32-10.
---@param shape dormouse.Shape|integer
---@param opts? dormouse.DrawOptions
---@return dormouse.Tensor
function dm.rand(shape, opts) end

---Standard normal draws from Philox-4x32-10 (Box-Muller).
---@param shape dormouse.Shape|integer
---@param opts? dormouse.DrawOptions
---@return dormouse.Tensor
function dm.randn(shape, opts) end

---Zeros of x's shape, dtype and device (the options override).
---@param x dormouse.Tensor
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.zeros_like(x, opts) end

---Ones of x's shape, dtype and device.
---@param x dormouse.Tensor
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.ones_like(x, opts) end

---An unset tensor of x's shape, dtype and device.
---@param x dormouse.Tensor
---@param opts? dormouse.CreateOptions
---@return dormouse.Tensor
function dm.empty_like(x, opts) end

---Uniform draws of x's shape, dtype and device.
---@param x dormouse.Tensor
---@param opts? dormouse.DrawOptions
---@return dormouse.Tensor
function dm.rand_like(x, opts) end

---Normal draws of x's shape, dtype and device.
---@param x dormouse.Tensor
---@param opts? dormouse.DrawOptions
---@return dormouse.Tensor
function dm.randn_like(x, opts) end

---Whether v is a tensor.
---@param v any
---@return boolean
function dm.is_tensor(v) end

-- ---- ops as functions -------------------------------------------------------------------

---x @ w^T + b, with w of shape [out, in] and b (optional) of shape [out].
---@param x dormouse.Tensor
---@param w dormouse.Tensor
---@param b? dormouse.Tensor
---@return dormouse.Tensor
function dm.linear(x, w, b) end

---The rows of table [V, D] for class ids (counted from 0) of any shape: [..., D].
---@param ids dormouse.Tensor
---@param table dormouse.Tensor
---@return dormouse.Tensor
function dm.embedding(ids, table) end

---Joins tensors along an existing dim (default 1).
---@param list dormouse.Tensor[]
---@param dim? integer
---@return dormouse.Tensor
function dm.cat(list, dim) end

---Joins tensors of one shape along a new dim (default 1; -1 puts it last).
---@param list dormouse.Tensor[]
---@param dim? integer
---@return dormouse.Tensor
function dm.stack(list, dim) end

---|a - b| <= atol + rtol * |b| everywhere, with equal shapes (NaN never passes).
---@param a dormouse.Tensor
---@param b dormouse.Tensor
---@param opts? dormouse.AllcloseOptions
---@return boolean
function dm.allclose(a, b, opts) end

---Every registered op with its doc line.
---@return dormouse.OpInfo[]
function dm.ops() end

-- ---- grad mode ---------------------------------------------------------------------------

---Recompute (activation checkpointing): fn(...) (one tensor) without keeping its activations; the backward
---runs fn again on a nested tape. fn must compute the same thing both times.
---@param fn fun(...): dormouse.Tensor
---@param ... dormouse.Tensor
---@return dormouse.Tensor
function dm.recompute(fn, ...) end

---The name dm.recompute had: an error that gives the new one.
---@deprecated
function dm.checkpoint(...) end

---True while a recomputed function runs the second time, in a backward.
---@return boolean
function dm.recomputing() end

---Calls fn(...) with grad mode off (nothing is recorded) and returns its results; restored after an error.
---@generic R
---@param fn fun(...): R
---@param ... any
---@return R
function dm.no_grad(fn, ...) end

---Calls fn(...) with grad mode on and returns its results.
---@generic R
---@param fn fun(...): R
---@param ... any
---@return R
function dm.enable_grad(fn, ...) end

---Whether ops are being recorded.
---@return boolean
function dm.grad_enabled() end

-- ---- the generator -------------------------------------------------------------------------

---Resets the global generator to (seed, offset 0).
---@param seed integer
function dm.manual_seed(seed) end

---The global generator's seed and counter offset.
---@return integer seed
---@return integer offset
function dm.rng_state() end

---Sets the global generator's seed and counter offset.
---@param seed integer
---@param offset integer
function dm.set_rng_state(seed, offset) end

-- ---- memory -------------------------------------------------------------------------------

---Runs fn(...) as a step: tensors handed to Lua inside it are freed when it ends,
---except those it returns (also inside a returned table) and those given to dm.keep.
---@generic R
---@param fn fun(...): R
---@param ... any
---@return R
function dm.scope(fn, ...) end

---Takes t out of the current dm.scope, so it outlives it; returns t.
---@param t dormouse.Tensor
---@return dormouse.Tensor
function dm.keep(t) end

---Memory statistics of a device (default "cpu").
---@param device? dormouse.Device
---@return dormouse.Memory
function dm.memory(device) end

---Starts the peak of dm.memory() again from the current use.
---@param device? dormouse.Device
function dm.reset_peak(device) end

-- ---- model ops (lua/dormouse/ops/conv.lua, kda.lua, engram.lua, moe.lua) -------------------

---@class dormouse.Conv1dOptions
---@field dilation? integer the spacing of the taps (default 1)
---@field cache? dormouse.Tensor [B, (K-1) * dilation, C]: the inputs before x (default zeros)
---@field return_cache? boolean also return the cache of the next segment
---@field silu? boolean silu of the convolution, which the backward recomputes (keeps only x)

---@class dormouse.KdaOptions
---@field initial_state? dormouse.Tensor S0 [B, H, dk, dv]
---@field output_final_state? boolean also return the final state
---@field chunk? integer the backward's checkpoint interval (default 64)
---@field algo? "auto"|"recurrent"|"chunked" the kernel: chunked (WY/UT) on CUDA for T >= 32 by default, else recurrent

---@class dormouse.EngramLayout
---@field orders integer[] the n-gram orders
---@field heads integer hashed heads per order
---@field rows integer rows per hashed sub-table at most
---@field total_rows integer rows of the one physical table
---@field max_order integer the largest order
---@field n_sub integer sub-tables: #orders * heads
---@field sub table[] {order, head, direct, offset, size} per sub-table

---@class dormouse.AdamOptions
---@field lr number the learning rate
---@field betas? number[] {b1, b2} (default {0.9, 0.95})
---@field eps? number (default 1e-8)
---@field step integer the step, from 1
---@field n? integer how many of rows to update (default all)

---@class dormouse.HostTable
---@field weight dormouse.Tensor the table, in host memory
---@field m dormouse.Tensor Adam's first moment
---@field v dormouse.Tensor Adam's second moment
local HostTable = {}

---Starts gathering the rows of the next batch.
---@param idx dormouse.Tensor
function HostTable:prefetch(idx) end

---The prefetched rows [U, de] (on device), the lookups' ids into them, the rows' numbers [U].
---@return dormouse.Tensor rows
---@return dormouse.Tensor local_ids
---@return dormouse.Tensor unique
function HostTable:take() end

---prefetch and take in one call.
---@param idx dormouse.Tensor
---@return dormouse.Tensor rows
---@return dormouse.Tensor local_ids
---@return dormouse.Tensor unique
function HostTable:gather(idx) end

---Adam on the rows of the last take, with their gradients [U, de] (on any device: copied back once,
---through pinned memory on CUDA); the rows of a prefetch in flight that it changes are refreshed.
---@param grads dormouse.Tensor
---@param opts dormouse.AdamOptions
function HostTable:apply(grads, opts) end

---Counts: steps, lookups, unique, unique_fraction, gather_ms, ...
---@return table
function HostTable:counters() end

---The Adam thread count; sets it when n is given.
---@param n? integer
---@return integer
function HostTable:threads(n) end

---Stops the table's threads.
function HostTable:close() end

---A loader of training batches (data.lua: corpus:loader{...}).
---@class dormouse.Loader
local Loader = {}

---The next batch x [B, T+1], prefix [B, ctx] and its number k.
---@return dormouse.Tensor x
---@return dormouse.Tensor prefix
---@return integer k
function Loader:next() end

---The batch the next next() returns (the very same tensors), without taking it; position() is unchanged.
---@return dormouse.Tensor x
---@return dormouse.Tensor prefix
---@return integer k
function Loader:peek() end

---The k the next next() returns: the data state a checkpoint keeps.
---@return integer
function Loader:position() end

---Stops the loader's thread.
function Loader:close() end

---quantize's values forward, the gradient passed straight through to x.
---@param x dormouse.Tensor
---@param format "fp8_e4m3"|"nvfp4"|"ternary"|"binary"
---@param block? integer
---@return dormouse.Tensor
function dm.fake_quantize(x, format, block) end


---Depthwise causal convolution of x [B, T, C] with w [C, K], no bias.
---@param x dormouse.Tensor
---@param w dormouse.Tensor
---@param opts? dormouse.Conv1dOptions
---@return dormouse.Tensor y
---@return dormouse.Tensor? cache
function dm.causal_conv1d(x, w, opts) end

---Kimi Delta Attention: q, k, g [B, T, H, dk], v [B, T, H, dv], beta [B, T, H] → o (and the final state).
---@param q dormouse.Tensor
---@param k dormouse.Tensor
---@param v dormouse.Tensor
---@param g dormouse.Tensor
---@param beta dormouse.Tensor
---@param opts? dormouse.KdaOptions
---@return dormouse.Tensor o
---@return dormouse.Tensor? state
function dm.kda(q, k, v, g, beta, opts) end

---The layout of Engram's hashed n-gram table.
---@param opts {orders: integer[], heads?: integer, rows: integer}
---@return dormouse.EngramLayout
function dm.engram_layout(opts) end

---The table rows [B, T, n_sub] (i64, from 0) of every n-gram ending at each byte of x [B, T].
---@param x dormouse.Tensor
---@param prefix? dormouse.Tensor
---@param layout dormouse.EngramLayout
---@return dormouse.Tensor
function dm.engram_index(x, prefix, layout) end

---The distinct rows (increasing), each lookup's id among them, the lookups per row and their
---number (a one-element i64 tensor on idx's device). opts: a bound, or {bound =, padded = true}:
---the padded form keeps numel(idx) rows and counts (the tail row 0, count 0) and never waits.
---@param idx dormouse.Tensor
---@param opts? integer|{bound?: integer, padded?: boolean}
---@return dormouse.Tensor rows
---@return dormouse.Tensor inverse
---@return dormouse.Tensor counts
---@return dormouse.Tensor n
function dm.engram_unique(idx, opts) end

---g [M, de] summed per unique row in lookup order: [n, de], the same bits on every backend.
---@param g dormouse.Tensor
---@param inverse dormouse.Tensor
---@param n integer
---@return dormouse.Tensor
function dm.engram_sparse_grad(g, inverse, n) end

---The memory gate sigmoid(sum_i w_i rmsnorm(u)_i rmsnorm(kx)_i / sqrt(d)).
---@param u dormouse.Tensor
---@param kx dormouse.Tensor
---@param opts? {eps?: number, gain?: dormouse.Tensor}
---@return dormouse.Tensor
function dm.engram_alpha(u, kx, opts) end

---Adam in place on the named rows of a table and its moments only.
---@param table dormouse.Tensor
---@param m dormouse.Tensor
---@param v dormouse.Tensor
---@param rows dormouse.Tensor
---@param grads dormouse.Tensor
---@param opts dormouse.AdamOptions
function dm.engram_adam(table, m, v, rows, grads, opts) end

---A table and its Adam moments in host memory, gathered and updated by threads (threads = 0: the
---online cores, at most 8). On CUDA its staging memory is pinned and take's copies are queued, not waited for.
---@param opts {weight?: dormouse.Tensor, m?: dormouse.Tensor, v?: dormouse.Tensor, rows?: integer, width?: integer, std?: number, threads?: integer, device?: dormouse.Device}
---@return dormouse.HostTable
function dm.HostTable(opts) end

---Each assignment's low-rank gated expert applied to its token, rows in sorted order [N*k, F].
---@param u dormouse.Tensor
---@param perm dormouse.Tensor
---@param offsets dormouse.Tensor
---@param ug dormouse.Tensor
---@param uu dormouse.Tensor
---@param cg dormouse.Tensor
---@param cu dormouse.Tensor
---@param d dormouse.Tensor
---@param k integer
---@param fp8? table {Ug = {codes, scales}, Uu = ..., D = ...} (dm.bank_fp8's): the kernels read these; ug, uu, d then give shapes only (dm.stand_in)
---@return dormouse.Tensor
function dm.moe_experts(u, perm, offsets, ug, uu, cg, cu, d, k, fp8) end

---Gates with the tokens past each expert's capacity set to 0, and the drops per expert.
---@param w dormouse.Tensor
---@param idx dormouse.Tensor
---@param inv dormouse.Tensor
---@param offsets dormouse.Tensor
---@param factor number
---@return dormouse.Tensor w
---@return dormouse.Tensor drops
function dm.moe_capacity(w, idx, inv, offsets, factor) end

---Load statistics: busiest_share, entropy (nats), entropy_max, dead.
---@param counts dormouse.Tensor
---@return {busiest_share: number, entropy: number, entropy_max: number, dead: integer}
function dm.moe_counters(counts) end

-- ---- files ------------------------------------------------------------------------------------

---Writes tensors to a safetensors file (a temporary name, then renamed; refused input writes nothing).
---@param path string
---@param tensors table<string, dormouse.Tensor>
---@param metadata? table<string, string>
function dm.save(path, tensors, metadata) end

---Reads a safetensors file: the tensors by name (contiguous, on the CPU) and the metadata.
---@param path string
---@return table<string, dormouse.Tensor> tensors
---@return table<string, string> metadata
function dm.load(path) end

-- ---- experiments ------------------------------------------------------------------------------

---Trains every (arm, seed) of an experiment and prints a verdict table.
---@param spec {base: string, arms: table<string, table>, seeds: integer[], set?: table, control?: string}
---@return table
function dm.sweep(spec) end

return dm
