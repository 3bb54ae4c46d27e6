"""``recserve bench-loop``: the closed loop measured against a frozen copy of the same model, side by side.

A drifting synthetic stream (:mod:`.stream`) is served by two tritonservers on the same requests: one
logging at rate 1.0 whose rows ``recserve join`` and ``recserve learn`` (separate processes) turn into
published deltas that it serves, and a frozen copy without logging. :mod:`.bench` runs it,
:mod:`.figures` turns what it recorded into the summary and its plots.
"""
