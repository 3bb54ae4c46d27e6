"""What a categorical value costs the lookup step as text (BYTES) and as an id (INT64), in one run.

``python -m recserve.perf.lab.wire_bench [--spec NAME ...] [--rows N]`` times, on the same rows of
each spec (synthetic, a dynamic batch of ``N`` rows), what the ``embedding_lookup`` step does with
the categorical tensors of each wire form before any key is made:

* ``bytes``: decode the serialized BYTES tensor(s) as the stub hands them over
  (:func:`~recserve.backends.triton.bytes_codec.decode_bytes_tensor`), then parse and hash every
  value (:meth:`~recserve.backends.features.transform.FeatureTransform.raw_values`);
* ``ids``: view the INT64 buffer(s) and lay the ids out (the same call, on the id form);

and the whole feature transform of each form (keys, dense values, histories), and what the client
pays to turn the text into ids (:func:`recserve.core.wire_forms.ids_from_bytes`). Per element:
microseconds over the batch's categorical values (multi-hot elements counted). Not a test: the
figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tritonclient.utils import serialize_byte_tensor

from recserve.backends.features.transform import FeatureTransform
from recserve.backends.triton.bytes_codec import decode_bytes_tensor
from recserve.build.synthetic import generate
from recserve.core.names import BYTES_WIRE, IDS_WIRE
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.core.wire_forms import ids_from_bytes

LOGGER = logging.getLogger(__name__)


def per_call_us(call: Callable[[], object], seconds: float = 0.5) -> float:
    """Median over five rounds of about ``seconds / 5`` each, in microseconds per call."""
    call()  # warm-up
    rounds = []
    for _ in range(5):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / 5:
            call()
            calls += 1
        rounds.append(elapsed / calls * 1e6)
    return float(np.median(rounds))


def measure(spec: ModelSpec, rows: int = 256, seconds: float = 0.5) -> dict[str, Any]:
    """The timings of one spec at a batch of ``rows`` rows (see the module docstring)."""
    raw = generate(spec, rows, seed=5)
    text, ids = raw.to_wire(spec, BYTES_WIRE), raw.to_wire(spec, IDS_WIRE)
    bytes_tensors = [t.name for t in spec.wire_form(BYTES_WIRE).inputs if t.dtype == "BYTES"]
    encoded = {
        n: (np.frombuffer(serialize_byte_tensor(text[n]).item(), np.uint8), text[n].shape)
        for n in bytes_tensors
    }
    transform = FeatureTransform(spec)
    elements = int(ids[spec.wire_form(IDS_WIRE).marker].size) + sum(
        int(ids[item.length].sum()) for item in spec.wire_form(IDS_WIRE).lists
    )

    def decoded() -> dict[str, np.ndarray]:  # what the stub hands the step
        out = dict(text)
        out.update({n: decode_bytes_tensor(buffer).reshape(shape) for n, (buffer, shape) in encoded.items()})
        return out

    times = {
        "bytes_read_us": per_call_us(lambda: transform.raw_values(decoded()), seconds),
        "ids_read_us": per_call_us(lambda: transform.raw_values(ids), seconds),
        "bytes_transform_us": per_call_us(lambda: transform.transform(decoded()), seconds),
        "ids_transform_us": per_call_us(lambda: transform.transform(ids), seconds),
        "client_ids_from_bytes_us": per_call_us(lambda: ids_from_bytes(spec, text), seconds),
    }
    return {
        "spec": spec.name,
        "rows": rows,
        "categorical_elements": elements,
        **{k: round(v, 1) for k, v in times.items()},
        "bytes_us_per_element": round(times["bytes_read_us"] / elements, 3),
        "ids_us_per_element": round(times["ids_read_us"] / elements, 4),
        "transform_ids_vs_bytes": round(times["bytes_transform_us"] / times["ids_transform_us"], 2),
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    """The timings as a Markdown table."""
    lines = [
        "| spec | rows | elements | read: bytes µs | read: ids µs | µs / element: bytes | ids "
        "| transform: bytes µs | ids µs | bytes / ids | client text -> ids µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['spec']} | {r['rows']} | {r['categorical_elements']} | {r['bytes_read_us']:.0f} "
            f"| {r['ids_read_us']:.0f} | {r['bytes_us_per_element']:.3f} | {r['ids_us_per_element']:.4f} "
            f"| {r['bytes_transform_us']:.0f} | {r['ids_transform_us']:.0f} "
            f"| {r['transform_ids_vs_bytes']:.2f} | {r['client_ids_from_bytes_us']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the named specs and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--spec", action="append", help="a bundled spec or a file (default: all bundled)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=0.5, help="per timing")
    args = parser.parse_args(argv)
    names = args.spec or ["ctr", "avazu", "taobao"]
    print(table([measure(load_spec(name), args.rows, args.seconds) for name in names]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
