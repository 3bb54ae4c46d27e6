r"""Realistic traffic for ``ctr``: long-tailed request sizes through the client SDK, bounded in time.

Run (loopback server from ``make serve``)::

    .venv/bin/locust -f perf/bench/locustfile.py --headless -u 16 -r 4 --run-time 60s \
        --ctr-url 127.0.0.1:8000 --p99-ms 100 --max-failure-ratio 0.01

Each simulated user sends one request after another (no think time) whose batch size follows a
truncated power law (most requests carry a few rows, some carry hundreds), with the spec's
synthetic rows, so sequence lengths are long-tailed too (geometric, up to 256). The run stops by
itself after ``--ctr-max-seconds`` even without ``--run-time``, and the process exits non-zero
when the overall p99 or the failure ratio crosses its threshold.

The HTTP transport of the SDK is gevent based, which is what locust runs on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import gevent
import numpy as np
from locust import User, events, task

from recserve.build.synthetic import generate
from recserve.clients import CTRClient, RecserveClientError
from recserve.core.spec.parse import load_spec

LOGGER = logging.getLogger(__name__)

POOL_REQUESTS = 256
BATCH_TAIL_EXPONENT = 1.3


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--ctr-url", default="127.0.0.1:8000", help="host:port of Triton's HTTP endpoint")
    parser.add_argument("--ctr-spec", default="ctr", help="bundled spec name or path")
    parser.add_argument("--p99-ms", type=float, default=200.0, help="fail the run when the p99 exceeds this")
    parser.add_argument("--max-failure-ratio", type=float, default=0.01, help="fail the run above this ratio")
    parser.add_argument(
        "--ctr-max-seconds", type=float, default=300.0, help="hard stop, whatever --run-time says"
    )
    parser.add_argument("--ctr-seed", type=int, default=11)


def long_tailed_batch_sizes(
    rng: np.random.Generator, count: int, max_batch: int, exponent: float = BATCH_TAIL_EXPONENT
) -> np.ndarray:
    """``count`` batch sizes in ``1..max_batch`` with ``P(n) ∝ n ** -exponent``."""
    sizes = np.arange(1, max_batch + 1)
    weights = sizes.astype(np.float64) ** -exponent
    return rng.choice(sizes, size=count, p=weights / weights.sum())


def request_pool(spec_name: str, seed: int, count: int = POOL_REQUESTS) -> list[dict[str, np.ndarray]]:
    """Pre-built request tensors of long-tailed sizes (built once, cycled by the users)."""
    spec = load_spec(spec_name)
    rng = np.random.default_rng(seed)
    sizes = long_tailed_batch_sizes(rng, count, spec.model.max_batch_size)
    rows = generate(spec, int(sizes.sum()), seed)
    bounds = np.cumsum([0, *sizes])
    return [
        rows.take(slice(int(a), int(b))).to_wire(spec) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


_POOL: list[dict[str, np.ndarray]] = []


@events.test_start.add_listener
def _start(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    _POOL[:] = request_pool(options.ctr_spec, options.ctr_seed)
    runner = environment.runner
    if runner is not None:
        gevent.spawn_later(options.ctr_max_seconds, runner.quit)


@events.quitting.add_listener
def _verdict(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    total = environment.stats.total
    p99 = total.get_response_time_percentile(0.99) or 0.0
    print(
        f"ctr: {total.num_requests} requests, failure ratio {total.fail_ratio:.4f} "
        f"(max {options.max_failure_ratio}), "
        f"p99 {p99:.1f} ms (max {options.p99_ms})"
    )
    if total.num_requests == 0 or total.fail_ratio > options.max_failure_ratio or p99 > options.p99_ms:
        environment.process_exit_code = 1


class CTRUser(User):
    """One client connection sending requests back to back."""

    def on_start(self) -> None:
        """Open an SDK client (HTTP) for this user."""
        options = self.environment.parsed_options
        self.client = CTRClient(
            options.ctr_url, protocol="http", timeout_s=30.0, spec=load_spec(options.ctr_spec)
        )
        self.index = id(self) % POOL_REQUESTS

    def on_stop(self) -> None:
        """Close the connection."""
        self.client.close()

    @task
    def predict(self) -> None:
        """One request from the pool, reported under its batch-size class."""
        inputs = _POOL[self.index % len(_POOL)]
        self.index += 1
        rows = len(next(iter(inputs.values())))
        started = time.perf_counter()
        error: Exception | None = None
        try:
            self.client.predict_inputs(inputs)
        except RecserveClientError as exc:
            error = exc
        self.environment.events.request.fire(
            request_type="ctr",
            name=f"rows<={1 << max(rows - 1, 0).bit_length()}",
            response_time=(time.perf_counter() - started) * 1e3,
            response_length=rows,
            exception=error,
            context={},
        )
