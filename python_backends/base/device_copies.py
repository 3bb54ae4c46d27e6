"""Bytes a device step moves between host memory and its torch device, counted for the metrics endpoint.

A step on a device (the ``cuda`` profile) should move little across the bus: ids in, probabilities
out. Each step counts what it copies as it copies it: a numpy array (host memory) made a tensor on
the step's device is ``h2d``, a device tensor read back into numpy is ``d2h``. On torch's CPU device
(how CI runs the device path) the same moves are counted, as the bytes that would cross on a GPU; a
tensor handed over through DLPack moves nothing and is not counted. ``executes`` counts the step's
executions, so a reader divides the bytes by them (or by the rows Triton's statistics report).
"""

from __future__ import annotations

import threading

from recserve.backends.base.metrics import MetricSample

COPY_METRIC = "recserve_device_copy_bytes_total"
COPY_HELP = "Bytes a device step copied between host memory and its device, by step and direction"
EXECUTES_METRIC = "recserve_device_executes_total"
EXECUTES_HELP = "Executions of a device step (the copies' denominator), by step"
#: The directions of :data:`COPY_METRIC`.
DIRECTIONS = ("h2d", "d2h")


class DeviceCopies:
    """Running totals of host-to-device and device-to-host bytes and of executions (thread-safe).

    Args:
        step: the step's name (the ``step`` label).
    """

    def __init__(self, step: str) -> None:
        self.step = step
        self.h2d = 0
        self.d2h = 0
        self.executes = 0
        self._lock = threading.Lock()

    def to_device(self, nbytes: int) -> None:
        """Count ``nbytes`` copied from host memory to the device."""
        with self._lock:
            self.h2d += int(nbytes)

    def to_host(self, nbytes: int) -> None:
        """Count ``nbytes`` copied from the device to host memory."""
        with self._lock:
            self.d2h += int(nbytes)

    def executed(self, count: int = 1) -> None:
        """Count executions of the step."""
        with self._lock:
            self.executes += count

    def totals(self) -> dict[str, int]:
        """``h2d``, ``d2h`` and ``executes`` so far."""
        with self._lock:
            return {"h2d": self.h2d, "d2h": self.d2h, "executes": self.executes}

    def samples(self) -> list[MetricSample]:
        """The totals as counters, every series declared (at 0 before any copy)."""
        totals = self.totals()
        step = (("step", self.step),)
        return [
            *(
                MetricSample(COPY_METRIC, "counter", COPY_HELP, (*step, ("direction", d)), totals[d])
                for d in DIRECTIONS
            ),
            MetricSample(EXECUTES_METRIC, "counter", EXECUTES_HELP, step, totals["executes"]),
        ]
