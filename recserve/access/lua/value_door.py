"""The value door's Lua: under a spike, the lowest values refused before any tritonserver queues them.

Filled in by :func:`recserve.access.front_door.lua_source` from :class:`recserve.access.value_door.ValueDoor`
(``@DOOR@``: its table, or ``nil`` without a door). Its budget is ``headroom`` x the servers'
capacity / workers x the window; where the servers keep the capacity they learn, each worker reads
their files again every ``reread_ms`` (Envoy's Lua has ``io``; a file is written by a rename, so it is
never read half-written) and spends their sum once every one holds a capacity within ``limits``;
until then it lets every request through. Per Envoy worker, the door keeps the arrivals of
the last ``window_ms`` (a ring: a time and a value each). At every inference call it reads the
request's value (the ``recserve-value`` header: a tier or a number; none: the default) and sets
lambda as the first step's door does (``DegradeController.arrived``): the smallest lambda of the
grid at which the window's arrivals, each at the level lambda gives it, cost the steps at most
``budget`` (a refusal here costs them nothing). A request whose level is the refusal is answered at
once (HTTP 503, gRPC ``UNAVAILABLE``); one let through carries that lambda in ``recserve-lambda``,
so the first step serves it at the level the door counted it at, and the door's refusals since
the last request it let through, by tier (``recserve-door-refused``), which the first step counts
with its own. A request whose level is answered in the caller's order (``caller_order``) goes to that
model instead of the ensemble (the caller of :func:`door` rewrites the model name), and is reported
the same way (``recserve-door-ordered``). Each of these headers sent by a caller is removed from
every request: only the door sets them.
"""

VALUE_DOOR = r"""-- The value door ([degrade]): levels chosen as the first step chooses them, refusals here.
local DOOR = @DOOR@
local LAMBDA_HEADER = "@LAMBDA_HEADER@"
local VALUE_HEADER = "@VALUE_HEADER@"
local REFUSED_HEADER = "@REFUSED_HEADER@"
local ORDERED_HEADER = "@ORDERED_HEADER@"
local RING = 4096
local seen_at, seen_value, seen_first, seen_next = {}, {}, 0, 0
local refused_by_tier = {}  -- since the last request let through, reported with the next one
local ordered_by_tier = {}  -- sent to a caller's-order model since then, reported the same way
local REPORTS = {{REFUSED_HEADER, refused_by_tier}, {ORDERED_HEADER, ordered_by_tier}}
local door_budget, door_read_at = 0, -math.huge  -- what a window may cost (0: capacity not known)

local function door_spends(capacity)
  door_budget = DOOR.headroom * capacity / DOOR.workers * DOOR.window_s
end
if DOOR ~= nil then door_spends(DOOR.capacity) end

-- One kept capacity file's figure, or nil (absent, too large, unreadable, out of range).
local function door_kept(path)
  local ok, file = pcall(io.open, path, "r")
  if not ok or file == nil then return nil end
  local text = file:read(DOOR.max_bytes + 1)
  file:close()
  if text == nil or #text > DOOR.max_bytes then return nil end
  local capacity = tonumber(text:match('"capacity_per_s"%s*:%s*([-+%d.eE]+)'))
  if capacity == nil or capacity < DOOR.limits[1] or capacity > DOOR.limits[2] then return nil end
  return capacity
end

-- Every reread_ms: the servers' kept capacities again; their sum once each has one (else as it was).
local function door_follow(now)
  if #DOOR.kept == 0 or now - door_read_at < DOOR.reread_ms then return end
  door_read_at = now
  local total = 0
  for _, path in ipairs(DOOR.kept) do
    local capacity = door_kept(path)
    if capacity == nil then return end
    total = total + capacity
  end
  door_spends(total)
end

local function door_value(raw)
  if raw == nil or raw == "" then return DOOR.default end
  local tier = DOOR.tiers[raw]
  if tier ~= nil then return tier end
  local number = tonumber(raw)
  if number == nil or number ~= number or number < 0 or number == math.huge then return nil end
  return number
end

-- The best value x quality - lambda x cost (ties: the fuller level); full_value and above: full.
local function door_level(value, lam)
  if DOOR.full_value > 0 and value >= DOOR.full_value then return 1 end
  local best, level = value * DOOR.qualities[1] - lam * DOOR.costs[1], 1
  for l = 2, #DOOR.costs do
    local gain = value * DOOR.qualities[l] - lam * DOOR.costs[l]
    if gain > best then best, level = gain, l end
  end
  return level
end

local function door_spent(lam)
  local spent = 0
  for k = seen_first, seen_next - 1 do spent = spent + DOOR.spend[door_level(seen_value[k % RING], lam)] end
  return spent
end

-- The window's arrivals with this one; the smallest lambda at which they fit the budget (0: in full).
local function door_lambda(now, value)
  seen_at[seen_next % RING], seen_value[seen_next % RING] = now, value
  seen_next = seen_next + 1
  if seen_next - seen_first > RING then seen_first = seen_next - RING end
  while seen_at[seen_first % RING] < now - DOOR.window_ms do seen_first = seen_first + 1 end
  if seen_next - seen_first <= door_budget then return 0 end
  local grid = DOOR.grid
  local low, high = 1, #grid
  if door_spent(grid[high]) > door_budget then return grid[high] end
  while low < high do  -- what the arrivals cost falls as lambda rises: the first grid point that fits
    local middle = math.floor((low + high) / 2)
    if door_spent(grid[middle]) <= door_budget then high = middle else low = middle + 1 end
  end
  return grid[low]
end

-- The tier column a request is counted in: its tier, a number's, or no value's.
local function door_tier(raw)
  if raw == nil or raw == "" then return DOOR.default_tier end
  return DOOR.tiers[raw] ~= nil and raw or DOOR.number_tier
end

-- What the door answered itself, by tier, as the report header's text (at most max_reported a tier;
-- the rest stay for the next request let through); nil: nothing to report.
local function door_report(counts)
  if next(counts) == nil then return nil end
  local reported = {}
  for tier, count in pairs(counts) do
    local sent = math.min(count, DOOR.max_reported)
    reported[#reported + 1] = tier .. ":" .. string.format("%d", sent)
    counts[tier] = count > sent and count - sent or nil
  end
  return table.concat(reported, ",")
end

-- A request the door sent to a caller's-order model (a level with caller_order), counted.
local function door_ordered(tier)
  ordered_by_tier[tier] = (ordered_by_tier[tier] or 0) + 1
end

-- An inference call at the door: the refusal's message, or nil (lambda set on the request for the
-- steps); second, the request's tier column where its level is answered in the caller's order (the
-- caller rewrites the model it names, and counts it with door_ordered).
local function door(handle, headers)
  if DOOR == nil then return nil end
  local raw = headers:get(VALUE_HEADER)
  local value = door_value(raw)
  if value == nil then return nil end  -- the first step answers what is wrong with it
  local now = handle:timestamp()
  door_follow(now)
  if door_budget <= 0 then return nil end  -- the capacity is not known yet: the first step decides
  local lam = door_lambda(now, value)
  local level = door_level(value, lam)
  if DOOR.refuses and level == #DOOR.costs then
    local tier = door_tier(raw)
    refused_by_tier[tier] = (refused_by_tier[tier] or 0) + 1
    return string.format("refused under load at the access layer (lambda %.3g, value %.3g); retry later",
      lam, value)
  end
  if lam > 0 then headers:replace(LAMBDA_HEADER, string.format("%.17g", lam)) end
  if level == DOOR.order then return nil, door_tier(raw) end
  for _, kind in ipairs(REPORTS) do
    local report = door_report(kind[2])
    if report ~= nil then headers:replace(kind[1], report) end
  end
  return nil
end

"""
