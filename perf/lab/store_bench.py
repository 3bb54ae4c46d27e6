"""``recserve lab store-bench``: the parameter store against the speed and size of the memory it reads.

One run, on one machine, side by side:

* **lookups/s** of batches of 64 rows x 26 features (1,664 keys) with Zipf(1.05) keys over a table of
  10M keys x 64 dims through L1 + L2 (``TieredStore.lookup``: hash probe, cache, gather), against
  the **floor**: numpy ``take`` of the same number of rows at known row indices from the contiguous
  vector array. The store runs both its compiled loops and its numpy path (same snapshot, same
  batches). Batches rotate between the three so that machine noise hits them alike.
* **hit rates** per tier and **bytes per key** (fp32, and fp16 storage).
* **resident memory** of 2 processes serving the same shard files (PSS summed, so shared pages
  count once) against the raw size of keys + vectors.
* **warm-up**: p99 of the first batches after a restart with L1 preloaded from the recorded hot keys,
  and without, against the steady state.
* **L1 rebuild**: the median time of a rebuild from the key counts, as the upkeep thread runs one.
* with ``--device cuda`` (or ``cpu``): the **device L1**
  (:class:`~recserve.backends.store.device.cache.DeviceL1`, result left on the device) against the
  host path, the same batches interleaved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import numpy as np

from recserve.backends.base.artifacts import write_manifest
from recserve.backends.features.hashing import splitmix64
from recserve.backends.store.shards import MANIFEST_FORMAT, write_shards
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TIERS, TieredStore
from recserve.build.synthetic import zipf_ranks
from recserve.core.sections.serving import StoreSection

TABLE = "bench"


@dataclass(frozen=True)
class StoreBenchReport:
    """Figures of one run."""

    keys: int
    dim: int
    batch_keys: int
    compiled: bool  # whether the store's compiled loops were measured (else only its numpy path)
    store_keys_per_s: float
    floor_keys_per_s: float
    ratio_to_floor: float
    store_p99_us: float
    floor_p99_us: float
    numpy_keys_per_s: float  # the store's numpy path
    numpy_ratio_to_floor: float
    numpy_p99_us: float
    hit_rates: dict[str, float]
    bytes_per_key: float
    bytes_per_key_fp16: float
    raw_bytes: int
    resident_bytes_two_processes: int
    resident_ratio: float
    steady_p99_us: float
    restart_warm_p99_us: float
    restart_cold_p99_us: float
    l1_rebuild_ms: float  # median of 8 rebuilds from the key counts, each after an eighth of the batches
    device: DeviceFigures | None = None


@dataclass(frozen=True)
class DeviceFigures:
    """The device L1 against the host path, same batches, interleaved (``--device``)."""

    device: str
    device_keys_per_s: float
    host_keys_per_s: float
    device_p99_us: float
    host_p99_us: float
    device_median_us: float
    host_median_us: float
    l1_hit_rate: float


def make_table(keys: int, dim: int, seed: int = 0) -> TableArrays:
    """A synthetic table: hashed keys (as the feature step makes them), random vectors."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((keys, dim), dtype=np.float32)
    return TableArrays(
        TABLE, splitmix64(np.arange(keys, dtype=np.uint64)).view(np.int64), vectors, np.zeros(dim, np.float32)
    )


def write_table(folder: Path, table: TableArrays, dtype: str) -> Path:
    """Shard files and manifest of one table under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(
        folder,
        {"format": MANIFEST_FORMAT, "version": 1, **write_shards(folder, {TABLE: table}, {TABLE: dtype})},
    )
    return folder


def query_rows(keys: int, batches: int, batch_keys: int, exponent: float, seed: int = 1) -> np.ndarray:
    """Row numbers of Zipf-distributed keys, ``[batches, batch_keys]``; hot rows scattered over the table."""
    rng = np.random.default_rng(seed)
    ranks = zipf_ranks(rng, keys, exponent, (batches, batch_keys))
    return rng.permutation(keys)[ranks]


def _p99_us(seconds: list[float]) -> float:
    return float(np.percentile(np.asarray(seconds) * 1e6, 99))


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (shared pages divided among the processes sharing them)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss for process {pid}")


def serve_child(folder: Path, dim: int) -> None:
    """Child process: map the shards, touch every row through lookups, report, wait for the parent."""
    import os

    baseline = pss_bytes(os.getpid())
    store = TieredStore.map(folder, {TABLE: dim}, StoreSection(cache_mib=64))
    keys = np.asarray(store.shards[0].keys)
    ids = np.zeros(1 << 16, np.int16)
    for start in range(0, len(keys), 1 << 16):
        chunk = keys[start : start + (1 << 16)]
        store.lookup(chunk, ids[: len(chunk)])
    store.refresh_cache()
    print(json.dumps({"baseline": baseline}), flush=True)
    sys.stdin.readline()


def _pipe(stream: IO[str] | None) -> IO[str]:
    """A stream of a child started with ``subprocess.PIPE``: never None."""
    if stream is None:
        raise RuntimeError("the child process was started without a pipe")
    return stream


def resident_two_processes(folder: Path, dim: int) -> int:
    """PSS summed over two serving processes, less their interpreter baseline."""
    module = "recserve.perf.lab.store_bench"
    command = [sys.executable, "-m", module, "--child", str(folder), "--dim", str(dim)]
    children = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        baselines = [json.loads(_pipe(child.stdout).readline())["baseline"] for child in children]
        total = sum(pss_bytes(child.pid) for child in children) - sum(baselines)
    finally:
        for child in children:
            _pipe(child.stdin).write("\n")
            _pipe(child.stdin).flush()
            child.wait(timeout=60)
    return total


def timed_lookups(store: TieredStore, keys: np.ndarray) -> list[float]:
    """Seconds of each batch lookup."""
    ids = np.zeros(keys.shape[1], np.int16)
    seconds = []
    for batch in keys:
        started = time.perf_counter()
        store.lookup(batch, ids)
        seconds.append(time.perf_counter() - started)
    return seconds


def compare_device(store: TieredStore, queries: np.ndarray, device: str) -> DeviceFigures:
    """:class:`DeviceL1` lookups against the host path.

    The device lookups are synchronised: the result is complete on the device.
    """
    import torch

    from recserve.backends.store.device.cache import DeviceL1

    device_l1 = DeviceL1(store, device)
    if device_l1.device.type == "cpu":
        # as the host path: one thread (two spinning threads lose on a shared machine)
        torch.set_num_threads(1)
    synchronize = torch.cuda.synchronize if device_l1.device.type == "cuda" else lambda: None
    ids = np.zeros(queries.shape[1], np.int16)
    on_device, on_host, l1 = [], [], 0
    for batch in queries:
        started = time.perf_counter()
        result = device_l1.lookup(batch, ids)
        synchronize()
        middle = time.perf_counter()
        store.lookup(batch, ids)
        on_host.append(time.perf_counter() - middle)
        on_device.append(middle - started)
        l1 += int((result.tiers == 0).sum())
    return DeviceFigures(
        device=str(device_l1.device),
        device_keys_per_s=queries.size / sum(on_device),
        host_keys_per_s=queries.size / sum(on_host),
        device_p99_us=_p99_us(on_device),
        host_p99_us=_p99_us(on_host),
        device_median_us=float(np.median(on_device) * 1e6),
        host_median_us=float(np.median(on_host) * 1e6),
        l1_hit_rate=l1 / queries.size,
    )


def run(
    keys: int = 10_000_000,
    dim: int = 64,
    batch_keys: int = 64 * 26,
    batches: int = 3000,
    exponent: float = 1.05,
    cache_mib: float = 64.0,
    folder: Path | None = None,
    device: str | None = None,
) -> StoreBenchReport:
    """Measure everything in the module docstring.

    ``folder`` receives the shard files (temporary by default).
    """
    with tempfile.TemporaryDirectory(prefix="recserve-store-bench-") as scratch:
        root = folder or Path(scratch)
        table = make_table(keys, dim)
        fp32 = write_table(root / "fp32", table, "float32")
        fp16 = write_table(root / "fp16", table, "float16")
        del table
        options = StoreSection(cache_mib=cache_mib)
        store = TieredStore.map(fp32, {TABLE: dim}, options)
        rows = query_rows(keys, batches * 2, batch_keys, exponent)
        all_keys = np.asarray(store.shards[0].keys)
        queries = all_keys[rows]
        vectors = store.shards[0].vectors

        # warm the page cache and the frequency counts, then build L1 as a running server does
        timed_lookups(store, queries[:batches])
        store.refresh_cache()
        store.stats.by_table_tier[:] = 0

        numpy_store = TieredStore(list(store.tables.values()), store.shards, 1, options, compiled=False)
        numpy_store.snapshot = store.snapshot  # the same L1
        store_s, floor_s, numpy_s = [], [], []
        ids = np.zeros(batch_keys, np.int16)
        for batch_rows, batch in zip(rows[batches:], queries[batches:], strict=True):
            started = time.perf_counter()
            np.take(vectors, batch_rows, axis=0)
            middle = time.perf_counter()
            store.lookup(batch, ids)
            after_store = time.perf_counter()
            numpy_store.lookup(batch, ids, record=False)
            numpy_s.append(time.perf_counter() - after_store)
            store_s.append(after_store - middle)
            floor_s.append(middle - started)
        counts = store.stats.by_table_tier.sum(axis=0)
        figures = compare_device(store, queries[batches:], device) if device else None
        hit_rates = {tier: float(counts[i] / counts.sum()) for i, tier in enumerate(TIERS)}
        steady = _p99_us(store_s[-500:])
        rebuilds = []
        for part in np.array_split(queries[batches:], 8):
            timed_lookups(store, part)
            started = time.perf_counter()
            store.refresh_cache()
            rebuilds.append(time.perf_counter() - started)

        # restart: a new store over the same (page-cached) files, with and without the recorded hot keys
        hot = store.hot_keys()
        probe = queries[batches : batches + 200]
        cold_store = TieredStore(list(store.tables.values()), store.shards, 1, options)
        cold = _p99_us(timed_lookups(cold_store, probe))
        warm_store = TieredStore(list(store.tables.values()), store.shards, 1, options)
        warm_store.refresh_cache(seed=hot)
        warm = _p99_us(timed_lookups(warm_store, probe))

        bytes16 = TieredStore.map(fp16, {TABLE: dim}).bytes_per_key
        raw = keys * (8 + dim * 4)
        resident = resident_two_processes(fp32, dim)
        store_rate = batch_keys * len(store_s) / sum(store_s)
        floor_rate = batch_keys * len(floor_s) / sum(floor_s)
        numpy_rate = batch_keys * len(numpy_s) / sum(numpy_s)
        return StoreBenchReport(
            keys=keys,
            dim=dim,
            batch_keys=batch_keys,
            compiled=store.compiled,
            store_keys_per_s=store_rate,
            floor_keys_per_s=floor_rate,
            ratio_to_floor=store_rate / floor_rate,
            store_p99_us=_p99_us(store_s),
            floor_p99_us=_p99_us(floor_s),
            numpy_keys_per_s=numpy_rate,
            numpy_ratio_to_floor=numpy_rate / floor_rate,
            numpy_p99_us=_p99_us(numpy_s),
            hit_rates=hit_rates,
            bytes_per_key=store.bytes_per_key,
            bytes_per_key_fp16=bytes16,
            raw_bytes=raw,
            resident_bytes_two_processes=resident,
            resident_ratio=resident / raw,
            steady_p99_us=steady,
            restart_warm_p99_us=warm,
            restart_cold_p99_us=cold,
            l1_rebuild_ms=1e3 * float(np.median(rebuilds)),
            device=figures,
        )


def format_report(report: StoreBenchReport) -> str:
    """A short human-readable table."""
    hits = ", ".join(f"{tier} {rate:.1%}" for tier, rate in report.hit_rates.items() if rate)
    return "\n".join(
        [
            f"table: {report.keys:,} keys x {report.dim} dims; "
            f"batches of {report.batch_keys} keys (64 rows x 26 features), Zipf keys",
            f"store L1+L2   {report.store_keys_per_s:>12,.0f} keys/s   p99 {report.store_p99_us:7.1f} us   "
            f"({'compiled loops' if report.compiled else 'numpy path: the compiled loops are not built'})",
            f"  numpy path  {report.numpy_keys_per_s:>12,.0f} keys/s   p99 {report.numpy_p99_us:7.1f} us",
            f"floor (take)  {report.floor_keys_per_s:>12,.0f} keys/s   p99 {report.floor_p99_us:7.1f} us",
            f"ratio to floor: {report.ratio_to_floor:.2f} (numpy path {report.numpy_ratio_to_floor:.2f})",
            f"hit rates: {hits}",
            f"bytes per key: {report.bytes_per_key:.1f} (fp32), {report.bytes_per_key_fp16:.1f} (fp16)",
            f"resident, 2 processes: {report.resident_bytes_two_processes / 2**20:,.0f} MiB = "
            f"{report.resident_ratio:.2f} x raw ({report.raw_bytes / 2**20:,.0f} MiB)",
            f"p99 after restart: {report.restart_warm_p99_us:.1f} us with warm-up, "
            f"{report.restart_cold_p99_us:.1f} us cold; steady {report.steady_p99_us:.1f} us",
            f"L1 rebuild from the key counts: {report.l1_rebuild_ms:.1f} ms (median of 8)",
            *([] if report.device is None else [format_device(report.device)]),
        ]
    )


def format_device(figures: DeviceFigures) -> str:
    """The ``--device`` lines."""
    return "\n".join(
        [
            f"device L1 ({figures.device}) {figures.device_keys_per_s:>12,.0f} keys/s   "
            f"p99 {figures.device_p99_us:7.1f} us   median {figures.device_median_us:6.1f} us",
            f"host path, same batches {figures.host_keys_per_s:>12,.0f} keys/s   "
            f"p99 {figures.host_p99_us:7.1f} us   median {figures.host_median_us:6.1f} us",
            f"device / host: {figures.device_keys_per_s / figures.host_keys_per_s:.2f}; "
            f"L1 hits {figures.l1_hit_rate:.1%}",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``recserve lab store-bench`` and ``python -m``)."""
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--cache-mib", type=float, default=8.0, help="L1 budget")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--device", default=None, help="also measure the device L1 on this torch device (cuda, cuda:N, cpu)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the table."""
    report = run(
        keys=args.keys, dim=args.dim, batches=args.batches, cache_mib=args.cache_mib, device=args.device
    )
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line of the benchmark (also run as a child process for the memory figure)."""
    parser = argparse.ArgumentParser(
        prog="python -m recserve.perf.lab.store_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        serve_child(args.child, args.dim)
        return 0
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
