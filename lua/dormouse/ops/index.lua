--[=[
Indexing one tensor through the values of another.

  x:gather(dim, idx)            dm.gather(x, dim, idx)      out[i][j] = x[idx[i][j]][j] for dim 1
  x:index_select(dim, idx)      the slices of x along dim named by the 1-D idx
  x:scatter_add(dim, idx, src)  dm.scatter_add(x, dim, idx, src)
                                a copy of x with src[i][j] added at [idx[i][j]][j] for dim 1
  dm.embedding(ids, table)      table[V, D] rows for ids of any shape: [..., D]

Index tensors hold i64, i32 or u8. Their values are positions, so they are
1-based like every position in Lua: gather's index 1 is the first slice.
Embedding ids are different: they are class ids (byte values 0..255, token
ids), so they count from 0 and id 0 is the table's first row. Repeated
indices add up (scatter_add, and every gradient). An index out of range is
an error naming it and the size. Gradients flow to x, src and the table,
never to an index.
]=]
return function(dm, T, core)

-- (gather, index_select and scatter_add come from their descriptors, which pass base 1:
-- lua/dormouse/ops/generated.lua)

local CLASS_BASE = 0     -- embedding ids are class ids

function dm.embedding(ids, table)
  return core.call("embedding", table, ids, {CLASS_BASE})
end

end
