"""A protobuf walk of a unary gRPC call's message (Lua), keeping only what the front door checks.

One uncompressed message per call; varints, lengths and wire types checked against the message's
end. ``ModelInfer``: the model, each input's name and shape and each output's name, checked as the
JSON ones are; a singular field given twice is refused. ``ModelReady``, ``ModelMetadata``,
``ModelConfig``, ``ModelStatistics``: the model named must be public (the statistics of all models,
no name given, stay readable: counters only, which perf_analyzer reads of an ensemble's steps).
``renamed``: a ``ModelInfer`` message naming another model (the value door's caller's-order level).
"""

GRPC_MESSAGE = r"""local function varint(s, i, limit)
  local result, scale = 0, 1
  for j = i, math.min(i + 9, limit) do
    local b = s:byte(j)
    result = result + (b % 128) * scale
    if b < 128 then return result, j + 1 end
    scale = scale * 128
  end
  refuse("a protobuf varint runs past its message")
end

-- Calls field(number, wire, a, b, k) for each field of the message s[i..limit]: for wire type 2,
-- a..b are its bytes; for wire type 0, a is its value; k is where its key starts.
local function fields(s, i, limit, field)
  while i <= limit do
    local key
    local k = i
    key, i = varint(s, i, limit)
    local number, wire = math.floor(key / 8), key % 8
    if wire == 0 then
      local v
      v, i = varint(s, i, limit)
      field(number, 0, v)
    elseif wire == 2 then
      local n
      n, i = varint(s, i, limit)
      if n > limit - i + 1 then refuse("a protobuf field runs past its message") end
      field(number, 2, i, i + n - 1, k)
      i = i + n
    elseif wire == 1 or wire == 5 then
      i = i + (wire == 1 and 8 or 4)
    else
      refuse("protobuf wire type " .. wire .. " is not used by the inference API")
    end
  end
  if i ~= limit + 1 then refuse("a protobuf field runs past its message") end
end

local function once(old, what, new)
  if old ~= nil then refuse("field '" .. what .. "' given twice") end
  return new
end

local function grpc_input(s, a, b, index, model)
  local where, name, dims, product = "inputs[" .. index .. "]", nil, {}, 1
  local function dim(v)
    if v >= 2 ^ 63 then refuse(where .. ": a dimension must be a non-negative integer") end
    product = check_dim(where, dims, product, string.format("%.0f", v), v)
  end
  fields(s, a, b, function(number, wire, x, y)
    if number == 1 and wire == 2 then
      name = once(name, "name", s:sub(x, y))
      where = "input '" .. shorten(name) .. "'"
    elseif number == 2 and wire == 2 then
      local datatype = s:sub(x, y)
      if not DATATYPES[datatype] then
        refuse(where .. ": datatype '" .. shorten(datatype) .. "' is not a KServe v2 datatype")
      end
    elseif number == 3 and wire == 0 then
      dim(x)
    elseif number == 3 and wire == 2 then
      local j = x
      while j <= y do
        local v
        v, j = varint(s, j, y)
        dim(v)
      end
    elseif number == 4 and wire == 2 then
      fields(s, x, y, function(n, w, p, q)
        if n == 1 and w == 2 then bounded(where .. ": parameter", s:sub(p, q)) end
      end)
    end
  end)
  if name == nil then refuse(where .. " has no name") end
  check_input(model, where, name, dims, product, nil)
  return name
end

-- The call's message s (one gRPC frame) with its model_name field (bytes from..to: key, length and
-- name) naming model instead: the frame's length and the field's follow.
local function renamed(s, from, to, model)
  local length, n = {}, #model
  repeat
    local b = n % 128
    n = math.floor(n / 128)
    length[#length + 1] = string.char(n > 0 and b + 128 or b)
  until n == 0
  local message = s:sub(6, from - 1) .. "\10" .. table.concat(length) .. model .. s:sub(to + 1)
  local size = #message
  return string.char(0, math.floor(size / 16777216) % 256, math.floor(size / 65536) % 256,
    math.floor(size / 256) % 256, size % 256) .. message
end

-- Checks a call's message; for ModelInfer returns the model it names and that field's bytes.
local function scan_grpc(s, method)
  if #s < 5 or s:byte(1) ~= 0 then refuse("the proxy takes one uncompressed gRPC message per call") end
  local size = ((s:byte(2) * 256 + s:byte(3)) * 256 + s:byte(4)) * 256 + s:byte(5)
  if size ~= #s - 5 then refuse("the proxy takes one uncompressed gRPC message per call") end
  if method == "ModelInfer" then
    local model, inputs, outputs, names, from, to = nil, {}, {}, {}, nil, nil
    fields(s, 6, #s, function(number, wire, a, b, k)
      if wire ~= 2 then return end
      if number == 1 then
        model, from, to = once(model, "model_name", s:sub(a, b)), k, b
      elseif number == 2 then
        bounded("model version", s:sub(a, b))
      elseif number == 4 then
        fields(s, a, b, function(n, w, p, q)
          if n == 1 and w == 2 then bounded("the request's parameter", s:sub(p, q)) end
        end)
      elseif number == 5 then
        inputs[#inputs + 1] = {a, b}
      elseif number == 6 then
        outputs[#outputs + 1] = {a, b}
      end
    end)
    model = model or ""
    served(model)
    for index, span in ipairs(inputs) do
      local name = grpc_input(s, span[1], span[2], index - 1, model)
      if names[name] then refuse("input '" .. shorten(name) .. "' given twice") end
      names[name] = true
    end
    for _, span in ipairs(outputs) do
      local name
      fields(s, span[1], span[2], function(n, w, p, q)
        if n == 1 and w == 2 then name = once(name, "name", s:sub(p, q)) end
      end)
      check_output(model, name or "")
    end
    return model, from, to
  elseif method == "ModelReady" or method == "ModelMetadata" or method == "ModelConfig"
      or method == "ModelStatistics" then
    local model
    fields(s, 6, #s, function(number, wire, a, b)
      if number == 1 and wire == 2 then model = once(model, "name", s:sub(a, b)) end
    end)
    -- the statistics of every model (no name): read-only counters, what perf_analyzer reads of an
    -- ensemble's steps
    if not (method == "ModelStatistics" and (model or "") == "") then served(model or "") end
  end
end

"""
