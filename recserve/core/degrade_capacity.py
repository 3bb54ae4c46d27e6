"""The capacity a ``[degrade]`` door learned, carried over to the server's next run.

The first step's door learns its capacity from a backlog
(:mod:`recserve.backends.steps.degrade_control`). Until one has shown it, a spike after a start is
met by the queue-wait loop alone, and its first quarter second goes in at full cost
(docs/design/degrade.md, "A capacity known in advance"). :class:`CapacityFile` keeps the learned
capacity in a small JSON file beside the step's versions: written atomically while it moves (at
most every :data:`KEEP_EVERY_S`) and when the step stops, and read when the step starts where the
spec sets none (``[degrade] capacity = 0``), and by the access layer's door
(:mod:`recserve.access.value_door`, every second while the proxy runs: its Lua reads the same
``capacity_per_s`` within :data:`LIMITS` from at most :data:`MAX_BYTES`). What it read is only a
start: the counters go on correcting it, as they correct a capacity set in the spec.

Plain Python, without Triton; the clock is passed in, so tests run on a synthetic one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from recserve.core.files import write_text_atomically

LOGGER = logging.getLogger(__name__)

#: the file's name, in the step's model folder (beside its version folders)
FILE_NAME = "degrade-capacity.json"
#: a capacity that moves is written again at most this often
KEEP_EVERY_S = 5.0
#: ... and only once it moved by more than this share of the one written
MOVED = 0.05
#: full-cost requests per second outside these are never written nor read (a damaged or foreign file)
LIMITS = (1e-3, 1e7)
#: a larger file is not read
MAX_BYTES = 4096


class CapacityFile:
    """One step's carried capacity at ``path``.

    Args:
        path: the JSON file (``{"capacity_per_s": ...}``).
        clock: seconds, monotonic.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.clock = clock
        self._kept: float | None = None  # what the file holds
        self._at = -math.inf  # when it was written

    def load(self) -> float | None:
        """The capacity the last run kept; None when there is none, or it cannot be trusted (logged)."""
        try:
            if self.path.stat().st_size > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES} bytes")
            value = json.loads(self.path.read_text()).get("capacity_per_s")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as exc:
            LOGGER.warning("[degrade]: the kept capacity %s is not read: %s", self.path, exc)
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not _within(value):
            LOGGER.warning("[degrade]: the kept capacity %s is not read: %.80r", self.path, value)
            return None
        self._kept = float(value)
        return self._kept

    def keep(self, capacity: float, force: bool = False) -> bool:
        """Write ``capacity`` when it is known and moved enough, not too soon (``force``: whenever it moved).

        Returns whether it was written. A failed write is logged; the step goes on.
        """
        if not _within(capacity) or capacity == self._kept:
            return False
        now = self.clock()
        if not force and (
            now - self._at < KEEP_EVERY_S
            or (self._kept is not None and abs(capacity - self._kept) <= MOVED * self._kept)
        ):
            return False
        try:
            write_text_atomically(self.path, json.dumps({"capacity_per_s": capacity}))
        except OSError as exc:
            LOGGER.warning("[degrade]: the capacity could not be kept in %s: %s", self.path, exc)
            return False
        self._kept, self._at = capacity, now
        return True


def _within(capacity: float) -> bool:
    return math.isfinite(capacity) and LIMITS[0] <= capacity <= LIMITS[1]
