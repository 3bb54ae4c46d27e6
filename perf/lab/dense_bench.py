"""``recserve lab dense-bench``: the dense step's bucketed runner against the bare graphs, side by side.

Four tables, each measured in one run so that only ratios are compared (the CI machine is shared):

1. per bucket of the grid: rows/s of today's single dynamic-shape graph, of the bare compiled graph
   at that bucket (no runner), and of the runner (policy, padding, counters); the runner's overhead
   is runner vs bare compiled, and, steadier on a busy machine, the runner's own bookkeeping (the
   runner around graphs that do nothing) as a share of its time; its speed-up is runner vs dynamic;
2. off-bucket shapes: the runner (padding to its buckets, compiling tight ones) vs the dynamic
   graph at the exact shape;
3. generated requests (the spec's history-length distribution, through the feature and lookup
   code) per client batch size: the runner vs the dynamic graph on the same batches;
4. an unseen shape: first-request latency (the generic graph) vs the bucketed steady state, and the
   time from the first miss until the compiled bucket takes over.

Variants are interleaved round by round (neighbouring rounds share the machine's load) and the
best round of each is kept: on a shared machine it is the one least disturbed by other work.
"""

from __future__ import annotations

import csv
import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import numpy as np

from recserve.backends.dense.buckets import (
    Arrays,
    Bucket,
    BucketedRunner,
    BucketPolicy,
    pad_to_bucket,
    spec_buckets,
)
from recserve.build.export import example_inputs
from recserve.build.repository import version_dir
from recserve.core.contract import dense_net_inputs
from recserve.core.names import DENSE, HISTORY_MASK, PROBABILITY
from recserve.core.spec.model import ModelSpec
from recserve.perf.lab.dense_report import BucketRow, format_report

LOGGER = logging.getLogger(__name__)

OFF_BUCKET_SHAPES = ((5, 32), (41, 32), (60, 128), (100, 128), (200, 32))
UNSEEN_SHAPE = (41, 128)


@dataclass(frozen=True)
class Runners:
    """What one benchmark compares: the generic graph, one bare compiled graph per bucket, the runner."""

    name: str
    generic: Callable[[Arrays], object]
    bare: Callable[[Bucket], Callable[[Arrays], object]]
    make_runner: Callable[[], BucketedRunner]


def seconds_per_call(fn: Callable[[], object], budget_s: float, min_calls: int = 2) -> float:
    """Mean seconds per call of ``fn`` over about ``budget_s`` (at least ``min_calls`` calls)."""
    calls, started = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - started < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, budget_s: float
) -> dict[str, list[float]]:
    """Seconds per call of each variant in each round, measured round-robin (neighbours share the load)."""
    for fn in variants.values():
        fn()  # first-call costs stay out of the figures
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(seconds_per_call(fn, budget_s))
    return samples


def on(sample: Arrays, **variants: Callable[[Arrays], object]) -> dict[str, Callable[[], object]]:
    """Each variant bound to ``sample``."""
    return {name: functools.partial(fn, sample) for name, fn in variants.items()}


def best(samples: list[float]) -> float:
    """The fastest round: on a shared machine, the round least disturbed by other work."""
    return min(samples)


def runner_vs_dynamic(rows: int, times: dict[str, list[float]]) -> dict[str, float]:
    """Rows/s of the dynamic graph and of the runner (best rounds) and their ratio."""
    return {
        "dynamic_rows_per_s": rows / best(times["dynamic"]),
        "runner_rows_per_s": rows / best(times["runner"]),
        "speedup": best(times["dynamic"]) / best(times["runner"]),
    }


def bookkeeping_runner(spec: ModelSpec, policy: BucketPolicy) -> BucketedRunner:
    """The runner around graphs that do nothing: what the policy, counters and padding cost per call."""

    def compile_bucket(bucket: Bucket) -> Callable[[Arrays], np.ndarray]:
        buffers = {name: np.zeros(shape, np.float32) for name, shape in bucket.input_shapes(spec).items()}
        output = np.zeros((bucket.rows, 1), np.float32)

        def run(inputs: Arrays) -> np.ndarray:
            pad_to_bucket(inputs, bucket, buffers)
            return output

        return run

    return BucketedRunner(policy, compile_bucket, lambda inputs: np.zeros((1, 1)), spec_buckets(spec))


def bucket_table(spec: ModelSpec, runners: Runners, rounds: int, budget_s: float) -> list[BucketRow]:
    """Table 1 over every bucket of the grid."""
    runner = runners.make_runner()
    bookkeeping = bookkeeping_runner(spec, runner.policy)
    table = []
    try:
        for bucket in spec_buckets(spec):
            sample = example_inputs(spec, bucket.rows, bucket.length, seed=bucket.rows + bucket.length)
            bare = runners.bare(bucket)
            times = interleaved(
                on(
                    sample,
                    dynamic=runners.generic,
                    bare=bare,
                    runner=runner.predict,
                    bookkeeping=bookkeeping.predict,
                ),
                rounds,
                budget_s,
            )
            table.append(
                BucketRow(
                    bucket.rows,
                    bucket.length,
                    dynamic_rows_per_s=bucket.rows / best(times["dynamic"]),
                    bare_bucket_rows_per_s=bucket.rows / best(times["bare"]),
                    runner_rows_per_s=bucket.rows / best(times["runner"]),
                    overhead=best(times["runner"]) / best(times["bare"]) - 1.0,
                    speedup=best(times["dynamic"]) / best(times["runner"]),
                    bookkeeping_us=best(times["bookkeeping"]) * 1e6,
                    bookkeeping_share=best(times["bookkeeping"]) / best(times["runner"]),
                )
            )
            LOGGER.info("bucket %dx%d done", bucket.rows, bucket.length)
    finally:
        runner.close()
    return table


def off_bucket_table(
    spec: ModelSpec, runners: Runners, rounds: int, budget_s: float
) -> list[dict[str, float | str]]:
    """Table 2: off-bucket shapes, after the runner compiled what its policy asks for."""
    runner = runners.make_runner()
    table: list[dict[str, float | str]] = []
    try:
        for rows, length in OFF_BUCKET_SHAPES:
            sample = example_inputs(spec, rows, length, seed=rows * length)
            runner.predict(sample)
            runner.wait_compiled()
            times = interleaved(on(sample, dynamic=runners.generic, runner=runner.predict), rounds, budget_s)
            plan = runner.policy.plan(rows, length, runner.buckets)
            table.append(
                {
                    "rows": rows,
                    "length": length,
                    "bucket": f"{plan.bucket.rows}x{plan.bucket.length}" if plan.bucket else "generic",
                    **runner_vs_dynamic(rows, times),
                }
            )
    finally:
        runner.close()
    return table


REALISTIC_BATCH_SIZES = (1, 64, 256)
REALISTIC_BATCHES = 16


def realistic_inputs(spec: ModelSpec, repository: Path, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Dense-step inputs of generated requests (spec's length distribution) through features and lookup."""
    from recserve.build.repository import reference_pipeline
    from recserve.build.synthetic import generate

    pipeline = reference_pipeline(spec, repository, runtime="torch")
    rows = generate(spec, batch_size * REALISTIC_BATCHES, seed=batch_size)
    batches = []
    for i in range(REALISTIC_BATCHES):
        raw = rows.take(slice(i * batch_size, (i + 1) * batch_size)).to_wire(spec)
        # the reference pipeline has no device L1: its lookup returns numpy arrays only
        merged = cast(dict[str, np.ndarray], pipeline.embeddings(raw))
        batches.append({name: merged[name] for name in dense_net_inputs(spec)})
    return batches


def call_each(fn: Callable[[Arrays], object], batches: list[dict[str, np.ndarray]]) -> list[object]:
    """``fn`` over every batch, in order."""
    return [fn(x) for x in batches]


def realistic_table(
    spec: ModelSpec, repository: Path, runners: Runners, rounds: int, budget_s: float
) -> list[dict[str, float]]:
    """Table 4: generated requests (history lengths as the spec says) per client batch size."""
    runner = runners.make_runner()
    table = []
    try:
        for batch_size in REALISTIC_BATCH_SIZES:
            batches = realistic_inputs(spec, repository, batch_size)
            for batch in batches:  # misses compile their buckets before the clock starts
                runner.predict(batch)
            runner.wait_compiled()
            times = interleaved(
                {
                    "dynamic": functools.partial(call_each, runners.generic, batches),
                    "runner": functools.partial(call_each, runner.predict, batches),
                },
                rounds,
                budget_s,
            )
            rows = batch_size * len(batches)
            table.append(
                {
                    "batch_size": batch_size,
                    "mean_positions": float(np.mean([b[HISTORY_MASK].shape[1] for b in batches])),
                    **runner_vs_dynamic(rows, times),
                }
            )
    finally:
        runner.close()
    return table


def unseen_shape(
    spec: ModelSpec, runners: Runners, steady_calls: int = 50, timeout_s: float = 60.0
) -> dict[str, float]:
    """Table 3: a shape no bucket holds, from the first request until its bucket serves it."""
    rows, length = UNSEEN_SHAPE
    sample = example_inputs(spec, rows, length, seed=4242)
    runner = runners.make_runner()
    try:
        started = time.perf_counter()
        runner.predict(sample)
        first_ms = (time.perf_counter() - started) * 1e3
        fallback_ms = []
        while runner.counters.snapshot()["compiles"] == 0:  # closed loop on the generic graph meanwhile
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(
                    f"the bucket for {rows}x{length} was not compiled within {timeout_s:.0f} s"
                )
            t0 = time.perf_counter()
            runner.predict(sample)
            fallback_ms.append((time.perf_counter() - t0) * 1e3)
        takeover_ms = (time.perf_counter() - started) * 1e3
        steady_ms = statistics.median(
            seconds_per_call(lambda: runner.predict(sample), 0.0, 1) * 1e3 for _ in range(steady_calls)
        )
        counts = runner.counters.snapshot()
    finally:
        runner.close()
    return {
        "rows": rows,
        "length": length,
        "first_request_ms": first_ms,
        "fallback_median_ms": statistics.median(fallback_ms) if fallback_ms else first_ms,
        "steady_state_ms": steady_ms,
        "takeover_ms": takeover_ms,
        "requests_before_takeover": counts["fallbacks"],
    }


def onnx_runners(spec: ModelSpec, repository: Path, threads: int) -> Runners:
    """ONNX Runtime on the CPU: the dynamic session, sessions fixed per bucket, the bucketed runner."""
    from recserve.backends.base.artifacts import read_manifest, verified_path
    from recserve.backends.dense.runner import OnnxBucket, OnnxDenseRunner, bucketed_onnx_runner

    root = version_dir(repository, DENSE, spec)
    model = verified_path(root, read_manifest(root)["files"]["model"])
    generic = OnnxDenseRunner(spec, model, threads)

    def bare(bucket: Bucket) -> Callable[[Arrays], object]:
        session = OnnxBucket(spec, model, bucket, threads).session
        return lambda inputs: session.run([PROBABILITY], dict(inputs))

    return Runners(
        f"onnxruntime-cpu ({threads} threads)",
        generic.predict,
        bare,
        lambda: bucketed_onnx_runner(spec, model, threads),
    )


def cuda_graph_runners(spec: ModelSpec, repository: Path) -> Runners:
    """PyTorch on CUDA: eager (dynamic), one CUDA graph per bucket, the bucketed runner."""
    from recserve.backends.dense.torch_runners import CudaGraphBucket, TorchEager, bucketed_torch_runner
    from recserve.build.repository import load_reference_net

    net = load_reference_net(spec, repository)
    eager = TorchEager(net, "cuda")
    return Runners(
        "pytorch-cuda-graphs",
        eager,
        lambda bucket: CudaGraphBucket(eager, spec, bucket),
        lambda: bucketed_torch_runner(spec, net, "cuda", prepare=spec_buckets(spec)),
    )


def run_dense_bench(
    spec: ModelSpec, repository: Path, device: str = "cpu", threads: int = 1, rounds: int = 30,
    budget_s: float = 0.01, output: Path | None = None,
) -> str:  # fmt: skip
    """Run all four tables; print-ready Markdown (and table 1 as CSV to ``output``)."""
    runners = (
        onnx_runners(spec, repository, threads) if device == "cpu" else cuda_graph_runners(spec, repository)
    )
    buckets = bucket_table(spec, runners, rounds, budget_s)
    off = off_bucket_table(spec, runners, rounds, budget_s)
    realistic = realistic_table(spec, repository, runners, rounds, budget_s)
    unseen = unseen_shape(spec, runners)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(asdict(buckets[0])))
            writer.writeheader()
            writer.writerows(asdict(row) for row in buckets)
    return format_report(runners.name, buckets, off, realistic, unseen)
