"""Before/after figures for the cuts made in the Python-backend adapter, measured in one run.

``python -m recserve.perf.lab.microbench`` times, on the same data:

* BYTES decoding of one request's ``categorical`` tensor: the stub's own decoder (the same
  algorithm as ``tritonclient.utils.deserialize_bytes_tensor``) against
  :func:`recserve.backends.triton.bytes_codec.decode_bytes_tensor`;
* the feature transform of a dynamic batch of batch-1 requests: one call per request against
  one call on the merged batch (what ``execute_merged_or_alone`` does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from recserve.backends.base import batching
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.triton.bytes_codec import decode_bytes_tensor
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.perf.harness.loadgen import sample_batches

LOGGER = logging.getLogger(__name__)


def per_call_us(call: Callable[[], object], repeat: int) -> float:
    """Median of five rounds of ``repeat`` calls, in microseconds per call."""
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        rounds.append((time.perf_counter() - started) / repeat * 1e6)
    return float(np.median(rounds))


def adapter_gains(
    spec: ModelSpec, requests_per_batch: int = 8, rows: int = 64
) -> list[tuple[str, float, float]]:
    """``(what, before µs, after µs)`` for each cut."""
    wide = sample_batches(spec, rows, count=1)[0][spec.categorical.name]
    encoded = np.frombuffer(serialize_byte_tensor(wide).item(), np.uint8)
    transform = FeatureTransform(spec)
    singles = sample_batches(spec, 1, count=requests_per_batch)

    def merged() -> None:
        transform.transform(batching.merge(singles)[0])

    return [
        (f"decode BYTES of a {rows}-row request ({wide.size} strings)",
         per_call_us(lambda: deserialize_bytes_tensor(encoded), 50),
         per_call_us(lambda: decode_bytes_tensor(encoded), 50)),
        (f"feature transform of {requests_per_batch} batch-1 requests",
         per_call_us(lambda: [transform.transform(r) for r in singles], 50), per_call_us(merged, 50)),
    ]  # fmt: skip


def main() -> None:
    """Print the table."""
    print(f"{'what':<50} {'before µs':>10} {'after µs':>10} {'gain':>6}")
    for what, before, after in adapter_gains(load_spec()):
        print(f"{what:<50} {before:>10.0f} {after:>10.0f} {before / after:>5.1f}x")


if __name__ == "__main__":
    main()
