"""Lower the CPU priority of the calling process (every thread of it), for the admission step.

Linux keeps a nice value per thread, and threads inherit it from the thread that starts them, so
the whole process is reniced thread by thread; threads started afterwards inherit it from theirs.
Raising nice (lower priority) needs no privilege.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

LOGGER = logging.getLogger(__name__)

#: Model config parameter (string) naming the nice value a step's processes lower themselves to.
CPU_NICE_PARAMETER = "cpu_nice"


def lower_process_priority(nice: int, tasks: Path = Path("/proc/self/task")) -> int:
    """Set every thread of this process to at least ``nice`` (0..19); returns how many were changed.

    A thread already nicer than ``nice`` is left as it is; on a system without ``/proc`` only the
    calling thread is changed.
    """
    if not 0 <= nice <= 19:
        raise ValueError(f"nice must lie in 0..19, got {nice}")
    thread_ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    changed = 0
    for tid in thread_ids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    LOGGER.info("process %d lowered to nice %d (%d threads)", os.getpid(), nice, changed)
    return changed
