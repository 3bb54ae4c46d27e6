"""The ``recserve`` console script's entry point (``python -m recserve.cli`` works too).

The commands live in :mod:`recserve.commands`; this module keeps the entry point's import path.
"""

from __future__ import annotations

import sys

from recserve.commands.main import main, parser

__all__ = ["main", "parser"]

if __name__ == "__main__":
    sys.exit(main())
