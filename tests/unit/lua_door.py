"""The front door's Lua run in LuaJIT in process (the Lua of Envoy's filter), with Envoy's request handle
as far as the script uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recserve.access.front_door import FrontDoor, lua_source

HANDLE = r"""
return function(body, path, extra, now)
  local headers = {[":method"] = "POST", [":path"] = path, ["content-type"] = "application/json"}
  for k, v in pairs(extra) do headers[k] = v end
  local result = {}
  local handle = {}
  local map = {get = function(_, k) return headers[k] end, remove = function(_, k) headers[k] = nil end,
    replace = function(_, k, v) headers[k] = v end}
  function handle:headers() return map end
  function handle:timestamp() return now end
  function handle:body()
    if #body == 0 then return nil end
    return {length = function() return #body end,
      getBytes = function(_, i, n) return body:sub(i + 1, i + n) end,
      setBytes = function(_, bytes) body = bytes; result.sent = bytes end}
  end
  function handle:respond(h, b) result.status = h[":status"]; result.body = b end
  function handle:logErr(m) result.logged = m end
  envoy_on_request(handle)
  return result.status, result.body, result.logged, headers, result.sent
end
"""
#: what the script did with one request: the status and body it answered (None: passed on), the
#: error it logged (None: none) and the request's headers after it
Answer = tuple[Any, Any, Any, dict[str, str]]


def door_script(luajit: Any, door: FrontDoor) -> Callable[..., Answer]:
    """``run(body, path, headers=None, now_ms=0.0)`` through the script of ``door`` (``luajit``: lupa's)."""
    runtime = luajit.LuaRuntime(unpack_returned_tuples=True)
    runtime.execute(lua_source(door))
    handle = runtime.execute(HANDLE)

    def run(body: bytes, path: str, headers: dict[str, str] | None = None, now_ms: float = 0.0) -> Answer:
        status, answer, logged, after, sent = handle(body, path, runtime.table_from(headers or {}), now_ms)
        run.sent = sent  # the body as the script set it (None: left as it came)
        return status, answer, logged, dict(after.items())

    return run
