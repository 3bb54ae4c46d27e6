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

#: Where records go: Parquet segment files in a folder, or Redis Streams on the ``[store]`` Redis Cluster.
LOG_SINKS = ("parquet", "redis")
#: The Parquet segments' codecs. snappy by default: on the serving host the writer's CPU is what costs
#: (a 32-row request: snappy 86 µs, zstd 128 µs; zstd's segments are a quarter smaller), and every
#: Parquet reader reads it. zstd for a log kept long; none for the cheapest writer.
LOG_COMPRESSIONS = ("snappy", "lz4", "zstd", "none")
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
    compression: str = "snappy"  # the segments' codec, one of LOG_COMPRESSIONS
    # sink = "redis": the records go to ``<stream_prefix>:<kind>:{<shard>}`` on the [store] Redis Cluster,
    # a request's records to the shard of its id (recserve.core.streams), at most ``stream_max_len``
    # entries kept per stream (XADD MAXLEN ~), sent at most ``stream_flush_ms`` after they were served
    streams: int = 4
    stream_prefix: str = "rs:log"
    stream_max_len: int = 100_000
    stream_flush_ms: float = 100.0

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
        if self.compression not in LOG_COMPRESSIONS:
            codecs = ", ".join(LOG_COMPRESSIONS)
            raise SpecError(f"[logging] compression must be one of {codecs}, got {shorten(self.compression)}")
        if not 1 <= self.streams <= 1024:
            raise SpecError(f"[logging] streams lies in 1..1024, got {self.streams}")
        if not self.stream_prefix or any(c in self.stream_prefix for c in "{} "):
            raise SpecError(
                f"[logging] stream_prefix: non-empty, no braces or spaces, got {self.stream_prefix!r}"
            )
        if not 1 <= self.stream_max_len <= 1_000_000_000:
            raise SpecError(f"[logging] stream_max_len lies in 1..1e9, got {self.stream_max_len}")
        if not 0.0 < self.stream_flush_ms <= 60_000.0:
            raise SpecError(f"[logging] stream_flush_ms lies in (0, 60000], got {self.stream_flush_ms}")

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
