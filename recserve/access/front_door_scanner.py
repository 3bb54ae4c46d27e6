"""The front door's scanner: Lua run by Envoy's Lua HTTP filter on every public HTTP inference request.

Envoy bundles no JSON parser for Lua, so this is a small one that builds no values: it walks the body
once with anchored ``string.find`` patterns (linear time, nesting at most ``MAX_DEPTH``) and reads
each input's ``name``, ``shape`` and the number of scalars in its ``data``. A refusal is raised as a
Lua table and answered as JSON ``{"error": ...}``; any other failure of the script refuses the
request too (fails closed). ``@NAME@`` placeholders are filled by
:func:`recserve.access.front_door.lua_source`.
"""

SCANNER = r"""-- recserve front door: refuse what could make tritonserver allocate unbounded memory.
local LIMITS = @LIMITS@
local MAX_ELEMENTS = @MAX_ELEMENTS@
local MAX_DEPTH = @MAX_DEPTH@
local MAX_DIMS = @MAX_DIMS@
local SHOWN = @SHOWN@
local HUGE = 2 ^ 53

local function shorten(text)
  if #text <= SHOWN then return text end
  return text:sub(1, SHOWN) .. "... (" .. #text .. " characters)"
end

local function refuse(message) error({message}, 0) end

local function ws(s, i)
  local _, e = s:find("^[ \t\r\n]*", i)
  return e + 1
end

local function near(s, i)
  if i > #s then return "the end of the body" end
  return "'" .. shorten(s:sub(i, i + 15)) .. "' at byte " .. i
end

local function str(s, i)
  local j = i + 1
  while true do
    local k = s:find('["\\]', j)
    if not k then refuse("an unterminated JSON string at byte " .. i) end
    if s:byte(k) == 34 then return s:sub(i + 1, k - 1), k + 1 end
    j = k + 2
  end
end

local value

local function object(s, i, depth, member)
  if depth > MAX_DEPTH then refuse("JSON nested deeper than " .. MAX_DEPTH .. " levels") end
  i = ws(s, i + 1)
  if s:byte(i) == 125 then return i + 1 end
  while true do
    if s:byte(i) ~= 34 then refuse("expected a JSON key, found " .. near(s, i)) end
    local key
    key, i = str(s, i)
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

local function array(s, i, depth, item)
  if depth > MAX_DEPTH then refuse("JSON nested deeper than " .. MAX_DEPTH .. " levels") end
  i = ws(s, i + 1)
  if s:byte(i) == 93 then return i + 1, 0 end
  local count = 0
  while true do
    local n
    if item then i, n = item(s, i, depth) else i, n = value(s, i, depth) end
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

-- Returns the index after the value and how many scalars it holds (nested lists flattened).
value = function(s, i, depth)
  local c = s:byte(i)
  if c == 123 then return object(s, i, depth + 1, nil), 1 end
  if c == 91 then return array(s, i, depth + 1, nil) end
  if c == 34 then
    local _, j = str(s, i)
    return j, 1
  end
  local _, e = s:find("^-?%d+%.?%d*[eE]?[-+]?%d*", i)
  if not e then _, e = s:find("^true", i) end
  if not e then _, e = s:find("^false", i) end
  if not e then _, e = s:find("^null", i) end
  if not e then refuse("unexpected " .. near(s, i)) end
  return e + 1, 1
end

local function shape(s, i, where)
  if s:byte(i) ~= 91 then refuse(where .. ": 'shape' must be a list, found " .. near(s, i)) end
  local dims, product = {}, 1
  i = ws(s, i + 1)
  if s:byte(i) == 93 then return i + 1, dims, product end
  while true do
    local _, e = s:find("^[-+%w.]+", i)
    if not e then refuse(where .. ": 'shape' holds " .. near(s, i)) end
    local text = s:sub(i, e)
    if not text:find("^%d+$") then
      refuse(where .. ": a dimension must be a non-negative integer, got '" .. shorten(text) .. "'")
    end
    if #text > 15 then refuse(where .. ": dimension " .. shorten(text) .. " is too large") end
    if #dims >= MAX_DIMS then refuse(where .. ": a shape has at most " .. MAX_DIMS .. " dimensions") end
    dims[#dims + 1] = text
    product = math.min(product * tonumber(text), HUGE)
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

local function scan(s, model)
  local limits = LIMITS[model] or {}
  local seen_inputs = false
  local index = -1
  local function input(s, i, depth)
    index = index + 1
    if s:byte(i) ~= 123 then refuse("inputs[" .. index .. "] must be an object, found " .. near(s, i)) end
    local found = {}
    local where = "inputs[" .. index .. "]"
    local j = object(s, i, depth + 1, function(key, s, k, d)
      if found[key] ~= nil and (key == "name" or key == "shape" or key == "data" or key == "datatype") then
        refuse(where .. ": key '" .. key .. "' given twice")
      end
      if key == "name" or key == "datatype" then
        if s:byte(k) ~= 34 then
          refuse(where .. ": '" .. key .. "' must be a string, found " .. near(s, k))
        end
        local text, n = str(s, k)
        found[key] = text
        if key == "name" then where = "input '" .. shorten(text) .. "'" end
        return n
      elseif key == "shape" then
        local n, dims, product = shape(s, k, where)
        found.shape, found.product = dims, product
        return n
      elseif key == "data" then
        local n, count = value(s, k, d)
        found.data = count
        return n
      end
      return (value(s, k, d))
    end)
    if found.name == nil then refuse(where .. " has no 'name'") end
    if found.shape == nil then refuse(where .. " has no 'shape'") end
    local most = limits[found.name]
    if most == nil then
      if LIMITS[model] ~= nil then
        refuse(where .. " is not an input of model '" .. shorten(model) .. "'")
      end
      most = MAX_ELEMENTS
    end
    local text = "[" .. table.concat(found.shape, ",") .. "]"
    if found.product > most then
      refuse(where .. ": shape " .. shorten(text) .. " holds " .. string.format("%.0f", found.product)
        .. " elements, more than model '" .. shorten(model) .. "' takes (" .. most .. ")")
    end
    if found.data ~= nil and found.data ~= found.product then
      refuse(where .. ": shape " .. shorten(text) .. " holds " .. string.format("%.0f", found.product)
        .. " elements but 'data' holds " .. found.data)
    end
    return j, 1
  end
  local i = ws(s, 1)
  if s:byte(i) ~= 123 then refuse("an inference body is a JSON object, found " .. near(s, i)) end
  i = object(s, i, 1, function(key, s, k, d)
    if key == "inputs" then
      if seen_inputs then refuse("key 'inputs' given twice") end
      seen_inputs = true
      if s:byte(k) ~= 91 then refuse("'inputs' must be a list, found " .. near(s, k)) end
      return (array(s, k, d + 1, input))
    end
    return (value(s, k, d))
  end)
  i = ws(s, i)
  if i <= #s then refuse("bytes after the JSON body: " .. near(s, i)) end
end

local function escape(text)
  return (text:gsub('[%c"\\\128-\255]', function(c) return string.format("\\u%04x", c:byte()) end))
end

local function answer(handle, status, message)
  handle:respond({[":status"] = tostring(status), ["content-type"] = "application/json"},
    '{"error":"' .. escape(message) .. '"}')
end

-- Headers are read before handle:body(), which yields (a header map is not usable across it).
local function check(handle)
  local headers = handle:headers()
  if headers:get(":method") ~= "POST" then return end
  local path = (headers:get(":path") or ""):gsub("%?.*$", "")
  local model = path:match("^/v2/models/([^/]+)/infer$")
    or path:match("^/v2/models/([^/]+)/versions/[^/]+/infer$")
  if model == nil then return end
  local encoding = headers:get("content-encoding")
  local header = headers:get("inference-header-content-length")
  if encoding ~= nil and encoding:lower() ~= "identity" then
    return answer(handle, 415, "the proxy takes uncompressed inference bodies, got content-encoding '"
      .. shorten(encoding) .. "'")
  end
  local body = handle:body()
  local length = body and body:length() or 0
  if length == 0 then return answer(handle, 400, "an inference request needs a JSON body") end
  local size = length
  if header ~= nil then
    if not header:find("^%d+$") or #header > 15 or tonumber(header) > length then
      return answer(handle, 400, "Inference-Header-Content-Length '" .. shorten(header)
        .. "' is not a byte count within the body's " .. length)
    end
    size = tonumber(header)
  end
  local ok, failure = pcall(scan, body:getBytes(0, size), model)
  if not ok then
    if type(failure) ~= "table" then handle:logErr("front door: " .. tostring(failure)) end
    local message = type(failure) == "table" and failure[1] or "the inference body could not be read"
    return answer(handle, 400, message)
  end
end

-- Fails closed: a request the script could not check is refused, never passed on.
function envoy_on_request(handle)
  local ok, failure = pcall(check, handle)
  if not ok then
    handle:logErr("front door: " .. tostring(failure))
    answer(handle, 400, "the inference request could not be checked")
  end
end
"""
