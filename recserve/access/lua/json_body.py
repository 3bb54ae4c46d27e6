r"""A strict JSON parse of an HTTP inference body (Lua), keeping only what the front door checks.

JSON as RFC 8259 defines it, the grammar RapidJSON (Triton's parser) takes by default: strings with
their escapes decoded (``\uXXXX`` and surrogate pairs; a lone surrogate, a bad escape or a raw
control character is refused), numbers in JSON's own form (no ``01``, ``1.``, ``+1``, ``NaN``),
``true``/``false``/``null``, nesting at most ``MAX_DEPTH``, nothing after the body. Keys are compared
decoded, so ``"in\u0070uts"`` is ``inputs``. A key given twice in any object is refused (RapidJSON
reads the first, a scanner that kept the last would be fooled), and the request's objects take only
the keys of the KServe v2 schema. Linear in the body: anchored ``string.find`` patterns, no value
built but the few strings compared.
"""

JSON_BODY = r"""local function ws(s, i)
  local _, e = s:find("^[ \t\r\n]*", i)
  return e + 1
end

local function near(s, i)
  if i > #s then return "the end of the body" end
  return "'" .. shorten(s:sub(i, i + 15)) .. "' at byte " .. i
end

local function utf8(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return string.char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return string.char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
    0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

local function hex4(s, i, at)
  local h = s:match("^%x%x%x%x", i)
  if not h then refuse("a bad \\u escape in a JSON string at byte " .. at) end
  return tonumber(h, 16)
end

-- A string at s[i] == '"': its text with escapes decoded (only when decode), and the index after it.
local function str(s, i, decode)
  local parts = decode and {} or nil
  local j = i + 1
  while true do
    local k = s:find('[%z\1-\31"\\]', j)
    if not k then refuse("an unterminated JSON string at byte " .. i) end
    local c = s:byte(k)
    if parts then parts[#parts + 1] = s:sub(j, k - 1) end
    if c == 34 then return parts and table.concat(parts), k + 1 end
    if c ~= 92 then refuse("a raw control character (byte " .. c .. ") in a JSON string at byte " .. k) end
    local e = s:byte(k + 1)
    if e == 117 then
      local cp = hex4(s, k + 2, k)
      j = k + 6
      if cp >= 0xD800 and cp <= 0xDBFF then
        local low = s:sub(j, j + 1) == "\\u" and hex4(s, j + 2, j) or -1
        if low < 0xDC00 or low > 0xDFFF then
          refuse("a lone surrogate escape in a JSON string at byte " .. k)
        end
        cp = 0x10000 + (cp - 0xD800) * 1024 + (low - 0xDC00)
        j = j + 6
      elseif cp >= 0xDC00 and cp <= 0xDFFF then
        refuse("a lone surrogate escape in a JSON string at byte " .. k)
      end
      if parts then parts[#parts + 1] = utf8(cp) end
    elseif ESCAPES[e] then
      if parts then parts[#parts + 1] = ESCAPES[e] end
      j = k + 2
    else
      refuse("a bad escape in a JSON string at byte " .. k)
    end
  end
end

-- A number in JSON's grammar at s[i]: the index after it, or nil.
local function number(s, i)
  local j = i
  if s:byte(j) == 45 then j = j + 1 end
  local c = s:byte(j)
  if c == 48 then
    j = j + 1
  elseif c and c >= 49 and c <= 57 then
    local _, e = s:find("^%d*", j + 1)
    j = e + 1
  else
    return nil
  end
  if s:byte(j) == 46 then
    local _, e = s:find("^%d+", j + 1)
    if not e then return nil end
    j = e + 1
  end
  c = s:byte(j)
  if c == 101 or c == 69 then
    local _, e = s:find("^[-+]?%d+", j + 1)
    if not e then return nil end
    j = e + 1
  end
  -- RapidJSON refuses a number beyond double's range ("Number too big to be stored in double")
  if j - i > 300 or c == 101 or c == 69 then
    if math.abs(tonumber(s:sub(i, j - 1))) == math.huge then return nil end
  end
  return j
end

-- What Triton's JSON reader takes for a datatype's elements: RapidJSON's IsInt64, IsUint64,
-- IsNumber, IsBool, IsString. Anything else is Triton's 500 (INTERNAL), not a client's 400.
local ELEMENTS = {BOOL = "bool", BYTES = "string", FP16 = "number", FP32 = "number", FP64 = "number",
  BF16 = "number", INT8 = "int", INT16 = "int", INT32 = "int", INT64 = "int", UINT8 = "uint",
  UINT16 = "uint", UINT32 = "uint", UINT64 = "uint"}
local ELEMENT_NAMES = {bool = "true or false", string = "string", number = "number",
  int = "signed 64-bit integer", uint = "unsigned 64-bit integer"}

local function within(digits, most)
  return #digits < #most or (#digits == #most and digits <= most)
end

local function element(s, i, kind)
  local c = s:byte(i)
  if kind == "string" then
    if c ~= 34 then return nil end
    local _, e = str(s, i, false)
    return e
  elseif kind == "bool" then
    if s:sub(i, i + 3) == "true" then return i + 4 end
    if s:sub(i, i + 4) == "false" then return i + 5 end
    return nil
  end
  local e = number(s, i)
  if not e or kind == "number" then return e end
  local text = s:sub(i, e - 1)
  local negative = text:byte(1) == 45
  local digits = negative and text:sub(2) or text
  if not digits:find("^%d+$") or (negative and (kind == "uint" or digits == "0")) then return nil end
  local most = kind == "uint" and "18446744073709551615" or negative and "9223372036854775808"
    or "9223372036854775807"
  return within(digits, most) and e or nil
end

-- A check of each scalar of an input's data against its datatype's kind (for value's walk).
local function elements_of(kind, where)
  return function(s, i)
    if not element(s, i, kind) then
      refuse(where .. ": 'data' holds " .. near(s, i) .. ", not a " .. ELEMENT_NAMES[kind])
    end
  end
end

local value

-- An object at s[i] == '{'; member(key, s, i, depth) reads each value (nil: any value).
local function object(s, i, depth, member, where)
  if depth > MAX_DEPTH then refuse("JSON nested deeper than " .. MAX_DEPTH .. " levels") end
  i = ws(s, i + 1)
  if s:byte(i) == 125 then return i + 1 end
  local seen = {}
  while true do
    if s:byte(i) ~= 34 then refuse("expected a JSON key, found " .. near(s, i)) end
    local key
    key, i = str(s, i, true)
    if seen[key] then
      refuse((where and where .. ": " or "") .. "key '" .. shorten(key) .. "' given twice")
    end
    seen[key] = true
    i = ws(s, i)
    if s:byte(i) ~= 58 then
      refuse("expected ':' after key '" .. shorten(key) .. "', found " .. near(s, i))
    end
    i = ws(s, i + 1)
    if member then i = member(key, s, i, depth) else i = value(s, i, depth) end
    i = ws(s, i)
    local c = s:byte(i)
    if c == 44 then
      i = ws(s, i + 1)
    elseif c == 125 then
      return i + 1
    else
      refuse("expected ',' or '}', found " .. near(s, i))
    end
  end
end

local function array(s, i, depth, item, check)
  if depth > MAX_DEPTH then refuse("JSON nested deeper than " .. MAX_DEPTH .. " levels") end
  i = ws(s, i + 1)
  if s:byte(i) == 93 then return i + 1, 0 end
  local count = 0
  while true do
    local n
    if item then i, n = item(s, i, depth) else i, n = value(s, i, depth, check) end
    count = count + n
    i = ws(s, i)
    local c = s:byte(i)
    if c == 44 then
      i = ws(s, i + 1)
    elseif c == 93 then
      return i + 1, count
    else
      refuse("expected ',' or ']', found " .. near(s, i))
    end
  end
end

-- Returns the index after the value and how many scalars it holds (nested lists flattened);
-- ``check`` (optional) is called on every scalar and object found, once it is known to be JSON.
value = function(s, i, depth, check)
  local c = s:byte(i)
  if c == 123 then
    if check then check(s, i) end
    return object(s, i, depth + 1, nil), 1
  end
  if c == 91 then return array(s, i, depth + 1, nil, check) end
  if c == 34 then
    local _, j = str(s, i, false)
    if check then check(s, i) end
    return j, 1
  end
  local e = number(s, i)
  if not e then
    for _, word in ipairs({"true", "false", "null"}) do
      if s:sub(i, i + #word - 1) == word then e = i + #word end
    end
  end
  if not e then refuse("unexpected " .. near(s, i)) end
  if check then check(s, i) end
  return e, 1
end

local function text(s, i, where, key)
  if s:byte(i) ~= 34 then refuse(where .. ": '" .. key .. "' must be a string, found " .. near(s, i)) end
  return str(s, i, true)
end

local function parameters(s, i, depth, where)
  if s:byte(i) ~= 123 then refuse(where .. ": 'parameters' must be an object, found " .. near(s, i)) end
  return object(s, i, depth + 1, function(key, s, k, d)
    bounded(where .. ": parameter", key)
    return (value(s, k, d))
  end, where .. " parameters")
end

local function shape(s, i, where)
  if s:byte(i) ~= 91 then refuse(where .. ": 'shape' must be a list, found " .. near(s, i)) end
  local dims, product = {}, 1
  i = ws(s, i + 1)
  if s:byte(i) == 93 then return i + 1, dims, product end
  while true do
    local _, e = s:find("^[-+%w.]+", i)
    if not e then refuse(where .. ": 'shape' holds " .. near(s, i)) end
    local dim = s:sub(i, e)
    if not dim:find("^%d+$") or (#dim > 1 and dim:byte(1) == 48) then
      refuse(where .. ": a dimension must be a non-negative integer, got '" .. shorten(dim) .. "'")
    end
    product = check_dim(where, dims, product, dim, tonumber(dim))
    i = ws(s, e + 1)
    local c = s:byte(i)
    if c == 44 then
      i = ws(s, i + 1)
    elseif c == 93 then
      return i + 1, dims, product
    else
      refuse(where .. ": expected ',' or ']' in 'shape', found " .. near(s, i))
    end
  end
end

local INPUT_KEYS = "name, shape, datatype, parameters, data"

local function scan_json(s, model)
  local names = {}
  local index = -1
  local function input(s, i, depth)
    index = index + 1
    local where = "inputs[" .. index .. "]"
    if s:byte(i) ~= 123 then refuse(where .. " must be an object, found " .. near(s, i)) end
    local found = {}
    local j = object(s, i, depth + 1, function(key, s, k, d)
      if key == "name" then
        found.name, k = text(s, k, where, key)
        where = "input '" .. shorten(found.name) .. "'"
        return k
      elseif key == "datatype" then
        found.datatype, k = text(s, k, where, key)
        if not DATATYPES[found.datatype] then
          refuse(where .. ": datatype '" .. shorten(found.datatype) .. "' is not a KServe v2 datatype")
        end
        return k
      elseif key == "shape" then
        local n, dims, product = shape(s, k, where)
        found.shape, found.product = dims, product
        return n
      elseif key == "data" then  -- its elements checked in the same walk once the datatype is known
        local check = found.datatype and elements_of(ELEMENTS[found.datatype], where)
        local n, count = value(s, k, d, check)
        found.data, found.data_at, found.depth, found.checked = count, k, d, check ~= nil
        return n
      elseif key == "parameters" then
        return parameters(s, k, d, where)
      end
      refuse(where .. ": unknown key '" .. shorten(key) .. "' (an input takes " .. INPUT_KEYS .. ")")
    end, where)
    if found.name == nil then refuse(where .. " has no 'name'") end
    if found.shape == nil then refuse(where .. " has no 'shape'") end
    if names[found.name] then refuse(where .. " given twice") end
    names[found.name] = true
    check_input(model, where, found.name, found.shape, found.product, found.data)
    if found.data_at and found.datatype and not found.checked then  -- the datatype came after it
      value(s, found.data_at, found.depth, elements_of(ELEMENTS[found.datatype], where))
    end
    return j, 1
  end
  local function output(s, i, depth)
    if s:byte(i) ~= 123 then refuse("an output must be an object, found " .. near(s, i)) end
    return object(s, i, depth + 1, function(key, s, k, d)
      if key == "name" then
        local name
        name, k = text(s, k, "an output", key)
        check_output(model, name)
        return k
      elseif key == "parameters" then
        return parameters(s, k, d, "an output")
      end
      refuse("an output: unknown key '" .. shorten(key) .. "' (an output takes name, parameters)")
    end, "an output"), 1
  end
  local i = ws(s, 1)
  if s:byte(i) ~= 123 then refuse("an inference body is a JSON object, found " .. near(s, i)) end
  i = object(s, i, 1, function(key, s, k, d)
    if key == "inputs" or key == "outputs" then
      if s:byte(k) ~= 91 then refuse("'" .. key .. "' must be a list, found " .. near(s, k)) end
      return (array(s, k, d + 1, key == "inputs" and input or output))
    elseif key == "id" then
      local _, n = text(s, k, "the request", key)
      return n
    elseif key == "parameters" then
      return parameters(s, k, d, "the request")
    end
    refuse("unknown key '" .. shorten(key)
      .. "' in an inference request (KServe v2 takes id, parameters, inputs, outputs)")
  end)
  i = ws(s, i)
  if i <= #s then refuse("bytes after the JSON body: " .. near(s, i)) end
end

"""
