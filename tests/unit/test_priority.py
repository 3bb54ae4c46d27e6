import os
import subprocess
import sys

import pytest

from recserve.backends.priority import lower_process_priority

# Run in a child: a process cannot raise its own priority back without privilege.
_CHILD = """
import os, threading
from recserve.backends.priority import lower_process_priority
started, stop = threading.Event(), threading.Event()
def idle():
    started.set()
    stop.wait()
thread = threading.Thread(target=idle)
thread.start()
started.wait()
changed = lower_process_priority(7)
late = []
worker = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, 0)))
worker.start()
worker.join()
nices = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
stop.set()
thread.join()
print(changed, sorted(nices), late[0])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_every_thread_of_the_process_is_lowered_and_new_threads_inherit():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    changed, nices, inherited = int(out[0]), out[1], int(out[2])
    assert changed >= 2 and nices == "[7]" and inherited == 7


def test_nice_outside_the_unprivileged_range_is_refused():
    with pytest.raises(ValueError, match="0..19"):
        lower_process_priority(20)
