"""The front door's checks as Lua, run by Envoy's Lua HTTP filter on every public request.

:func:`recserve.access.front_door.lua_source` joins the parts in this order and fills their ``@NAME@``
placeholders: :data:`~recserve.access.lua.frame.PRELUDE` (limits, refusals, the checks of one input
or output), :data:`~recserve.access.lua.json_body.JSON_BODY`,
:data:`~recserve.access.lua.grpc_message.GRPC_MESSAGE`, :data:`~recserve.access.lua.value_door.VALUE_DOOR`
(``[degrade]``'s refusals by value), :data:`~recserve.access.lua.frame.ENTRY` (answers and
``envoy_on_request``).
"""
