"""How the build reports its steps: a sink of one line each (stderr by default).

Apart from the training code so that a command that only reports (an import refused at its first
check) does not load torch to do it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    """Default progress sink: one line per step on stderr."""
    print(message, file=sys.stderr, flush=True)
