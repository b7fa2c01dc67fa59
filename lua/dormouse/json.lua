--[[
A JSON encoder for metrics.jsonl and the report: numbers (non-finite ones
as null), strings, booleans, arrays (tables with 1..n) and objects (sorted keys);
json.decode_string, which reads one of its strings back, and json.decode.
]]
local json = {}

local escapes = {['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f',
                 ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t'}

-- s with every byte that is not part of a valid UTF-8 sequence written as \u00XX (the byte's value:
-- decode_string reads it back as that byte), so that the output is valid JSON
local function valid_utf8(s)
  if utf8.len(s) then return s end
  local out, i = {}, 1
  while i <= #s do
    local b = s:byte(i)
    local n = b < 0x80 and 1 or b >= 0xF0 and 4 or b >= 0xE0 and 3 or b >= 0xC2 and 2 or 0
    if n > 0 and i + n - 1 <= #s and utf8.len(s, i, i + n - 1) == 1 then
      out[#out + 1] = s:sub(i, i + n - 1)
      i = i + n
    else
      out[#out + 1] = string.format("\\u%04x", b)
      i = i + 1
    end
  end
  return table.concat(out)
end

-- a list: keys exactly 1..n (an empty table too); any other table is an object
local function is_array(v)
  local n = 0
  for _ in pairs(v) do n = n + 1 end
  return n == #v
end

local function encode(v, out)
  local t = type(v)
  if t == "nil" then out[#out + 1] = "null"
  elseif t == "boolean" then out[#out + 1] = tostring(v)
  elseif t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then out[#out + 1] = "null"
    elseif math.type(v) == "integer" then out[#out + 1] = tostring(v)
    else out[#out + 1] = string.format("%.8g", v) end
  elseif t == "string" then
    local escaped = v:gsub('[%c"\\]', function(c) return escapes[c] or string.format("\\u%04x", c:byte()) end)
    out[#out + 1] = '"' .. valid_utf8(escaped) .. '"'
  elseif t == "table" then
    if is_array(v) then
      out[#out + 1] = "["
      for i = 1, #v do
        if i > 1 then out[#out + 1] = "," end
        encode(v[i], out)
      end
      out[#out + 1] = "]"
    else
      local keys = {}
      for k in pairs(v) do keys[#keys + 1] = tostring(k) end
      table.sort(keys)
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = "," end
        encode(k, out)
        out[#out + 1] = ":"
        local val = v[k]
        if val == nil then val = v[tonumber(k)] end
        encode(val, out)
      end
      out[#out + 1] = "}"
    end
  else
    error("json: cannot encode a " .. t)
  end
end

local unescapes = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}

-- The JSON string that starts at s[i] (its opening quote): its value and the position after its
-- closing quote; nil when there is none. \uXXXX is read back as the byte it stands for below 256
-- (what encode writes for control bytes), as UTF-8 above.
function json.decode_string(s, i)
  if s:sub(i, i) ~= '"' then return nil end
  local out, j = {}, i + 1
  while j <= #s do
    local c = s:sub(j, j)
    if c == '"' then return table.concat(out), j + 1 end
    if c == "\\" then
      local e = s:sub(j + 1, j + 1)
      if e == "u" then
        local code = tonumber(s:sub(j + 2, j + 5), 16)
        if not code then return nil end
        out[#out + 1] = code < 256 and string.char(code) or utf8.char(code)
        j = j + 6
      elseif unescapes[e] then
        out[#out + 1] = unescapes[e]
        j = j + 2
      else
        return nil
      end
    else
      out[#out + 1] = c
      j = j + 1
    end
  end
  return nil
end

local function skip(s, i) return s:find("[^ \t\r\n]", i) or #s + 1 end

local decode_value

local function decode_list(s, i, close, keyed)   -- s[i] opens it; returns the table and the next position
  local out, n = {}, 0
  i = skip(s, i + 1)
  if s:sub(i, i) == close then return out, i + 1 end
  while true do
    local key
    if keyed then
      key, i = json.decode_string(s, skip(s, i))
      if not key then error("json: a key (a string) expected at " .. i, 0) end
      i = skip(s, i)
      if s:sub(i, i) ~= ":" then error("json: ':' expected at " .. i, 0) end
      i = i + 1
    end
    local v
    v, i = decode_value(s, i)
    n = n + 1
    if keyed then out[key] = v else out[n] = v end  -- null leaves a hole (as a non-finite number was written)
    i = skip(s, i)
    local c = s:sub(i, i)
    if c == close then return out, i + 1 end
    if c ~= "," then error("json: ',' or '" .. close .. "' expected at " .. i, 0) end
    i = i + 1
  end
end

function decode_value(s, i)
  i = skip(s, i)
  local c = s:sub(i, i)
  if c == "{" then return decode_list(s, i, "}", true) end
  if c == "[" then return decode_list(s, i, "]", false) end
  if c == '"' then
    local v, j = json.decode_string(s, i)
    if not v then error("json: a broken string at " .. i, 0) end
    return v, j
  end
  if s:sub(i, i + 3) == "null" then return nil, i + 4 end
  if s:sub(i, i + 3) == "true" then return true, i + 4 end
  if s:sub(i, i + 4) == "false" then return false, i + 5 end
  local num = s:match("^%-?%d+%.?%d*[eE]?[%+%-]?%d*", i)
  if not num or not tonumber(num) then error("json: a value expected at " .. i, 0) end
  return tonumber(num), i + #num
end

-- The value of the JSON text s (objects and arrays as tables, null as nil); an error names the
-- position of what is wrong. It reads what encode writes, and plain JSON besides.
function json.decode(s)
  local v, i = decode_value(s, 1)
  i = skip(s, i)
  if i <= #s then error("json: text after the value at " .. i, 0) end
  return v
end

function json.encode(v)
  local out = {}
  encode(v, out)
  return table.concat(out)
end

return json
