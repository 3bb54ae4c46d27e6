"""The frame of the front door's Lua: its limits and refusals, and the entry point that answers.

Envoy bundles no JSON or protobuf parser for Lua, so the front door carries a small, strict one of
each (:mod:`recserve.access.lua.json_body`, :mod:`recserve.access.lua.grpc_message`) that decides on
what Triton will read. This part holds what both share: the limits (filled in for the served
models), the checks of one input or output, and the rule that **only public models are public**: a
path or call naming a model that is not served to clients (the steps of an ensemble) is answered
404 (gRPC ``NOT_FOUND``). The gRPC stream call is refused before its body. An inference call
passes the value door (:mod:`recserve.access.lua.value_door`) before its body is read, and is sent
to the caller's-order model where the door chose that level (the gRPC message renamed, or the HTTP
path); a ``recserve-lambda``, ``recserve-door-refused`` or ``recserve-door-ordered`` header a caller
sent is removed from every request.

The walk is linear in the body: anchored ``string.find`` patterns, no backtracking, no value built
but the few strings compared. A refusal is raised as a Lua table and answered as JSON
``{"error": ...}`` (HTTP) or a gRPC status; any other failure of the script refuses the request too
(fails closed). ``@NAME@`` placeholders are filled by :func:`recserve.access.front_door.lua_source`.
"""

PRELUDE = r"""-- recserve front door: refuse what Triton would be harmed or fooled by, on what Triton reads.
local PUBLIC = @PUBLIC@
local LIMITS = @LIMITS@
local OUTPUTS = @OUTPUTS@
local MAX_ELEMENTS = @MAX_ELEMENTS@
local MAX_DEPTH = @MAX_DEPTH@
local MAX_DIMS = @MAX_DIMS@
local MAX_NAME = @MAX_NAME@
local SHOWN = @SHOWN@
local GRPC_PREFIX = "/inference.GRPCInferenceService/"
local HUGE = 2 ^ 53
local DATATYPES = {BOOL = 1, UINT8 = 1, UINT16 = 1, UINT32 = 1, UINT64 = 1, INT8 = 1, INT16 = 1,
  INT32 = 1, INT64 = 1, FP16 = 1, FP32 = 1, FP64 = 1, BF16 = 1, BYTES = 1}
local ESCAPES = {[34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f", [110] = "\n",
  [114] = "\r", [116] = "\t"}

local function shorten(text)
  if #text <= SHOWN then return text end
  return text:sub(1, SHOWN) .. "... (" .. #text .. " characters)"
end

local function refuse(message, status) error({message, status or 400}, 0) end

local function is_public(model)
  return next(PUBLIC) == nil or PUBLIC[model] == true
end

local function served(model)
  if not is_public(model) then
    local names = {}
    for name in pairs(PUBLIC) do names[#names + 1] = name end
    table.sort(names)
    refuse("model '" .. shorten(model) .. "' is not served through this proxy (served: "
      .. table.concat(names, ", ") .. ")", 404)
  end
end

local function bounded(what, text)
  if #text > MAX_NAME then
    refuse(what .. " '" .. shorten(text) .. "' is longer than " .. MAX_NAME .. " bytes")
  end
  return text
end

-- One input as Triton will read it: a name of the model, a shape within its limit, data to match.
local function check_input(model, where, name, dims, product, data)
  local limits = LIMITS[model]
  local most = limits and limits[name]
  if most == nil then
    if limits ~= nil then refuse(where .. " is not an input of model '" .. shorten(model) .. "'") end
    bounded("input name", name)
    most = MAX_ELEMENTS
  end
  local text = "[" .. table.concat(dims, ",") .. "]"
  if product > most then
    refuse(where .. ": shape " .. shorten(text) .. " holds " .. string.format("%.0f", product)
      .. " elements, more than model '" .. shorten(model) .. "' takes (" .. most .. ")")
  end
  if data ~= nil and data ~= product then
    refuse(where .. ": shape " .. shorten(text) .. " holds " .. string.format("%.0f", product)
      .. " elements but 'data' holds " .. data)
  end
end

local function check_output(model, name)
  local known = OUTPUTS[model]
  if known ~= nil and known[name] == nil then
    refuse("output '" .. shorten(name) .. "' is not an output of model '" .. shorten(model) .. "'")
  end
  bounded("output name", name)
end

local function check_dim(where, dims, product, text, value)
  if #dims >= MAX_DIMS then refuse(where .. ": a shape has at most " .. MAX_DIMS .. " dimensions") end
  if #text > 15 then refuse(where .. ": dimension " .. shorten(text) .. " is too large") end
  dims[#dims + 1] = text
  return math.min(product * value, HUGE)
end

"""

ENTRY = r"""local function escape(text)
  return (text:gsub('[%c"\\\128-\255]', function(c) return string.format("\\u%04x", c:byte()) end))
end

local GRPC_CODES = {[400] = "3", [404] = "5", [415] = "3", [501] = "12", [503] = "14"}

local function answer(handle, status, message, grpc)
  if grpc then
    local encoded = message:gsub("[^ -$&-~]", function(c) return string.format("%%%02X", c:byte()) end)
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
      ["grpc-status"] = GRPC_CODES[status] or "2", ["grpc-message"] = encoded}, nil)
  else
    handle:respond({[":status"] = tostring(status), ["content-type"] = "application/json"},
      '{"error":"' .. escape(message) .. '"}')
  end
end

local function refused(handle, failure, grpc, what)
  if type(failure) ~= "table" then handle:logErr("front door: " .. tostring(failure)) end
  local message = type(failure) == "table" and failure[1] or what .. " could not be read"
  return answer(handle, type(failure) == "table" and failure[2] or 400, message, grpc)
end

local function check_grpc(handle, headers, path)
  local method = path:sub(#GRPC_PREFIX + 1)
  if path:sub(1, #GRPC_PREFIX) ~= GRPC_PREFIX then return end
  if method == "ModelStreamInfer" then
    return answer(handle, 501, "the proxy serves unary ModelInfer calls, not ModelStreamInfer", true)
  end
  local refusal, ordered
  if method == "ModelInfer" then refusal, ordered = door(handle, headers) end
  if refusal then return answer(handle, 503, refusal, true) end
  if ordered then headers:remove("content-length") end  -- the message may be renamed below
  local body = handle:body()
  local message = body and body:getBytes(0, body:length()) or ""
  local ok, model, from, to = pcall(scan_grpc, message, method)
  if not ok then return refused(handle, model, true, "the gRPC message") end
  local order = ordered and DOOR.ordered[model]
  if order then  -- answered in the caller's order, by the model beside the ensemble
    body:setBytes(renamed(message, from, to, order))
    door_ordered(ordered)
  end
end

-- Headers are read before handle:body(), which yields (a header map is not usable across it).
local function check(handle)
  local headers = handle:headers()
  headers:remove(LAMBDA_HEADER)  -- only the value door sets these
  headers:remove(REFUSED_HEADER)
  headers:remove(ORDERED_HEADER)
  local path = (headers:get(":path") or ""):gsub("%?.*$", "")
  if (headers:get("content-type") or ""):find("^application/grpc") then
    return check_grpc(handle, headers, path)
  end
  local model = path:match("^/v2/models/([^/]*)")
  if model == nil or path == "/v2/models/stats" then return end  -- every model's counters: readable
  local ok, failure = pcall(served, model)
  if not ok then return refused(handle, failure, false) end
  if headers:get(":method") ~= "POST" then return end
  if not (path:find("^/v2/models/[^/]+/infer$") or path:find("^/v2/models/[^/]+/versions/[^/]+/infer$")) then
    return
  end
  local encoding = headers:get("content-encoding")
  local header = headers:get("inference-header-content-length")
  if encoding ~= nil and encoding:lower() ~= "identity" then
    return answer(handle, 415, "the proxy takes uncompressed inference bodies, got content-encoding '"
      .. shorten(encoding) .. "'")
  end
  local refusal, ordered = door(handle, headers)
  if refusal then return answer(handle, 503, refusal) end
  local order = ordered and DOOR.ordered[model]
  if order then  -- answered in the caller's order, by the model beside the ensemble
    headers:replace(":path", "/v2/models/" .. order .. headers:get(":path"):sub(#"/v2/models/" + #model + 1))
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
  ok, failure = pcall(scan_json, body:getBytes(0, size), model)
  if not ok then return refused(handle, failure, false, "the inference body") end
  if order then door_ordered(ordered) end
end

-- Fails closed: a request the script could not check is refused, never passed on.
function envoy_on_request(handle)
  local grpc = (handle:headers():get("content-type") or ""):find("^application/grpc") ~= nil
  local ok, failure = pcall(check, handle)
  if not ok then
    handle:logErr("front door: " .. tostring(failure))
    answer(handle, 400, "the request could not be checked", grpc)
  end
end
"""
