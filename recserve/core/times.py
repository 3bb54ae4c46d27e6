"""Time values: unix seconds of one raw time value, and the parts (hour, weekday, ...) read from them."""

from __future__ import annotations

import datetime
import functools
import zoneinfo

import numpy as np

#: The last unix second a time part can be read of (9999-12-31 23:59:59 UTC).
LAST_SECOND = 253402300799


@functools.lru_cache(maxsize=65536)
def unix_seconds(text: str, time_format: str, time_unit: str, timezone: str) -> int:
    """Unix seconds of one time value (cached: a batch holds few distinct times).

    Raises:
        ValueError: not a time in ``time_format`` (or not a number of unix ``time_unit``), before
            1970, or after 9999-12-31.
    """
    if time_format:
        parsed = datetime.datetime.strptime(text, time_format)
        stamp = parsed.replace(tzinfo=parsed.tzinfo or zoneinfo.ZoneInfo(timezone)).timestamp()
    else:
        if not (text.isascii() and text.isdigit()):
            raise ValueError("not a number of non-negative digits")
        stamp = int(text) / (1000 if time_unit == "ms" else 1)
    if stamp < 0:
        raise ValueError("before 1970")
    if stamp > LAST_SECOND:
        raise ValueError("after 9999-12-31")
    return int(stamp)


def time_part(seconds: np.ndarray, part: str, timezone: str) -> np.ndarray:
    """A part of unix times as seen in ``timezone``.

    hour_of_day 0..23, weekday 0..6 (Monday 0), is_weekend 0/1, day_of_month 0..30, month 0..11.
    """
    zone = zoneinfo.ZoneInfo(timezone)
    unique, inverse = np.unique(seconds, return_inverse=True)
    local = [datetime.datetime.fromtimestamp(int(s), zone) for s in unique]
    parts = {
        "hour_of_day": [t.hour for t in local],
        "weekday": [t.weekday() for t in local],
        "is_weekend": [int(t.weekday() >= 5) for t in local],
        "day_of_month": [t.day - 1 for t in local],
        "month": [t.month - 1 for t in local],
    }[part]
    return np.asarray(parts, dtype=np.uint64)[inverse].reshape(seconds.shape)
