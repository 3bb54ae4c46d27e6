"""Names written as one range, ``C{1..26}``, expanded into the names they stand for."""

from __future__ import annotations

import re

from recserve.core.sections.base import SpecError


def expand_names(pattern: str) -> tuple[str, ...]:
    """Names of a pattern with one range, ``C{1..26}`` -> ``C1 .. C26``; other names stay as they are.

    Raises:
        SpecError: an empty or reversed range.
    """
    match = _RANGE.search(pattern)
    if match is None:
        return (pattern,)
    low, high = int(match[1]), int(match[2])
    if high < low:
        raise SpecError(f"{pattern!r}: the range {match[0]} is empty")
    return tuple(f"{pattern[: match.start()]}{i}{pattern[match.end() :]}" for i in range(low, high + 1))


_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
