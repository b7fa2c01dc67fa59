--[[
What people read: the counts and sizes that lines and tables print, and a model's bytes made
safe for a terminal.

  human.count(39.4e6)  --> "39.40M"       (parameters, rows: 1.23B, 45.60M, 812.0K, 100)
  human.bytes(3.2e9)   --> "3.20 GB"      (decimal units: 3.20 GB, 45.1 MB, 812.0 kB, 100 bytes)
  local put, finish = human.byte_printer(io.write)
]]
local human = {}

function human.count(n)
  if n >= 1e9 then return string.format("%.2fB", n / 1e9) end
  if n >= 1e6 then return string.format("%.2fM", n / 1e6) end
  if n >= 1e3 then return string.format("%.1fK", n / 1e3) end
  return tostring(n)
end

function human.bytes(n)
  if n >= 1e9 then return string.format("%.2f GB", n / 1e9) end
  if n >= 1e6 then return string.format("%.1f MB", n / 1e6) end
  if n >= 1e3 then return string.format("%.1f kB", n / 1e3) end
  return string.format("%d bytes", math.floor(n))
end

--[[ human.byte_printer(write) -> put(byte), finish(): a model's bytes for a
terminal, one at a time. Printable ASCII, newlines and tabs go as they are,
and so do whole valid UTF-8 sequences (held until complete); any other byte
(a control byte, a stray or cut continuation, an overlong or surrogate form)
is written as \xNN, so that what a model samples can neither break the
text nor drive the terminal. finish() writes a cut sequence's bytes so. ]]
function human.byte_printer(write)
  local held = {}          -- the bytes of a sequence not yet complete
  local want = 0           -- its length
  local function escape(b) write(string.format("\\x%02X", b)) end
  local function flush_held()
    for _, b in ipairs(held) do escape(b) end
    held, want = {}, 0
  end
  local function put(c)
    local b = c:byte()
    if want > 0 then
      if b >= 0x80 and b <= 0xBF then
        held[#held + 1] = b
        if #held == want then
          local seq = string.char(table.unpack(held))
          if utf8.len(seq) == 1 then write(seq); held, want = {}, 0 else flush_held() end
        end
        return
      end
      flush_held()
    end
    if b == 0x0A or b == 0x09 or (b >= 0x20 and b <= 0x7E) then write(c)
    elseif b >= 0xC2 and b <= 0xF4 then held, want = {b}, b >= 0xF0 and 4 or b >= 0xE0 and 3 or 2
    else escape(b) end
  end
  return put, flush_held
end

return human
