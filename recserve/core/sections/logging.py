"""``[logging]``: what the steps log of the requests they serve, for the joiner and the learner.

Off by default: without the section (or with ``enabled = false``) the steps log nothing and pay
nothing. ``recserve serve --log-dir DIR`` turns it on for one server without editing the spec (the
environment variables below, read by each step at load). See docs/design/loop.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from recserve.core.sections.base import SpecError
from recserve.errors import shorten

#: Where records go: Parquet segment files in a folder (the one sink built so far).
LOG_SINKS = ("parquet",)
#: ``recserve serve --log-dir``: the folder of the segments; set, it turns logging on.
LOG_DIR_ENV = "RECSERVE_LOG_DIR"
#: ``recserve serve --log-sample-rate``: the share of requests logged (with ``--log-dir``).
LOG_SAMPLE_RATE_ENV = "RECSERVE_LOG_SAMPLE_RATE"


@dataclass(frozen=True)
class LoggingSection:
    """``[logging]``: the sample rate, the sink and its folder, what is logged, the queue's bound."""

    enabled: bool = False
    # the share of requests logged, decided from the request id alone, so every step of the
    # ensemble logs the same requests (1.0: all)
    sample_rate: float = 1.0
    sink: str = "parquet"
    directory: str = "request_log"  # the segments' folder (relative: to the server's working folder)
    history: bool = True  # log the history keys (once per request or list), not only the row features
    queue_records: int = 4096  # requests waiting for the writer at most; past it, records are dropped
    segment_mib: float = 32.0  # a segment is closed once its records hold this much
    segment_seconds: float = 30.0  # ... or once its oldest record is this old

    def check(self) -> None:
        """Raise :class:`SpecError` on a value out of range."""
        if not 0.0 <= self.sample_rate <= 1.0 or math.isnan(self.sample_rate):
            raise SpecError(f"[logging] sample_rate lies in 0..1, got {self.sample_rate}")
        if self.sink not in LOG_SINKS:
            raise SpecError(f"[logging] sink must be one of {', '.join(LOG_SINKS)}, got {self.sink!r}")
        if not self.directory:
            raise SpecError("[logging] directory must not be empty")
        if not 1 <= self.queue_records <= 1_000_000:
            raise SpecError(f"[logging] queue_records lies in 1..1000000, got {self.queue_records}")
        if not 0.0 < self.segment_mib <= 4096.0:
            raise SpecError(f"[logging] segment_mib lies in (0, 4096], got {self.segment_mib}")
        if not 0.0 < self.segment_seconds <= 86400.0:
            raise SpecError(f"[logging] segment_seconds lies in (0, 86400], got {self.segment_seconds}")

    def from_environment(self, environ: Mapping[str, str] | None = None) -> LoggingSection:
        """This section with ``recserve serve --log-dir`` / ``--log-sample-rate`` applied.

        Raises:
            SpecError: the sample rate in the environment is not a number in 0..1.
        """
        env = os.environ if environ is None else environ
        directory = env.get(LOG_DIR_ENV, "")
        if not directory:
            return self
        section = replace(self, enabled=True, directory=directory)
        rate = env.get(LOG_SAMPLE_RATE_ENV, "")
        if rate:
            try:
                section = replace(section, sample_rate=float(rate))
            except ValueError:
                message = f"{LOG_SAMPLE_RATE_ENV} must be a number in 0..1, got {shorten(rate)}"
                raise SpecError(message) from None
        section.check()
        return section
