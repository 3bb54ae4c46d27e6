"""The rate of ``recserve import`` on one large table, and the memory it holds meanwhile.

``python -m recserve.perf.lab.import_bench --rows 10000000 --dim 64`` writes an item table of that size
in each import format (random vectors, written a block at a time), imports it with the small tables
of the tiny spec and an untrained built-in network, and prints per format the seconds, rows per
second and the peak anonymous memory of the process (sampled; file pages of the memory-mapped
tables are not counted: they are the page cache's, not copies). A table of ``rows * dim * 4`` bytes
imported with a peak far below that size was never held whole in memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tomllib
from safetensors.numpy import save_file

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.hashing import keys_for, table_salt
from recserve.build.export import export_onnx
from recserve.build.importer import import_repository
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec, spec_path

BLOCK_ROWS = 1 << 18
FORMATS = ("hugectr", "keyed", "vocabulary")


def bench_spec(rows: int, dim: int) -> ModelSpec:
    """The tiny spec with every table ``dim`` wide and an item table of ``rows`` rows."""
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["embedding_dim"] = dim
    doc["dense_net"]["bottom_mlp"] = [16, dim]
    doc["tables"]["item"]["cardinality"] = rows
    return parse_spec(doc)


def anonymous_kib() -> int:
    """The process's resident anonymous memory (KiB), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class PeakMemory:
    """Samples :func:`anonymous_kib` every few milliseconds while the block runs; ``peak`` in KiB."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_kib())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_item_table(spec: ModelSpec, folder: Path, fmt: str, seed: int = 0) -> None:
    """The item table in format ``fmt``: ids 0..rows-1 (keyed as serving keys them), random vectors."""
    rows, dim = spec.tables["item"].cardinality, spec.tables["item"].dim
    rng = np.random.default_rng(seed)
    ids = np.arange(rows, dtype=np.uint64)
    if fmt == "vocabulary":
        out = np.lib.format.open_memmap(folder / "item.npy", "w+", np.float32, (rows, dim))
        (folder / "item.vocab.json").write_text(json.dumps({"tokens": ids.tolist()}))
    elif fmt == "keyed":
        _write_safetensors(folder / "item.safetensors", keys_for(ids, _salt(spec, "item")), rows, dim, rng)
        return
    else:
        (folder / "item").mkdir()
        keys_for(ids, _salt(spec, "item")).astype("<i8").tofile(folder / "item" / "key")
        out = np.memmap(folder / "item" / "emb_vector", np.float32, "w+", shape=(rows, dim))
    for start in range(0, rows, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, rows)
        out[start:stop] = rng.normal(0, 0.1, (stop - start, dim)).astype(np.float32)
    out.flush()


def _salt(spec: ModelSpec, table: str) -> np.uint64:
    return table_salt(spec.hashing.namespace, table)


def _write_safetensors(path: Path, keys: np.ndarray, rows: int, dim: int, rng: np.random.Generator) -> None:
    """A safetensors file with ``keys`` and ``vectors`` [rows, dim], the vectors written in blocks."""
    header = {
        "keys": {"dtype": "I64", "shape": [rows], "data_offsets": [0, rows * 8]},
        "vectors": {
            "dtype": "F32",
            "shape": [rows, dim],
            "data_offsets": [rows * 8, rows * 8 + rows * dim * 4],
        },
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        fh.write(keys.astype("<i8").tobytes())
        for start in range(0, rows, BLOCK_ROWS):
            fh.write(rng.normal(0, 0.1, (min(BLOCK_ROWS, rows - start), dim)).astype("<f4").tobytes())


def write_small_tables(spec: ModelSpec, folder: Path) -> None:
    """Every other table of the spec: a few keyed rows each."""
    for name in spec.table_names:
        if name != "item":
            keys = keys_for(np.arange(8, dtype=np.uint64), _salt(spec, name))
            vectors = np.zeros((8, spec.tables[name].dim), np.float32)
            save_file({"keys": keys, "vectors": vectors}, str(folder / f"{name}.safetensors"))


def run(rows: int, dim: int, formats: tuple[str, ...], scratch: Path) -> list[dict]:
    """Import the table in each format; one result per format."""
    spec = bench_spec(rows, dim)
    dense = scratch / "dense.onnx"
    export_onnx(spec, CTRNet(spec), dense)
    results = []
    for fmt in formats:
        tables = scratch / f"tables-{fmt}"
        tables.mkdir()
        write_item_table(spec, tables, fmt)
        write_small_tables(spec, tables)
        before = anonymous_kib()
        with PeakMemory() as memory:
            report = import_repository(
                spec, tables, dense, scratch / f"repository-{fmt}", progress=lambda _: None
            )
        results.append(
            {
                "format": fmt,
                "rows": rows,
                "dim": dim,
                "table_mib": rows * dim * 4 / 2**20,
                "seconds": report.seconds,
                "rows_per_s": report.rows_per_second,
                "peak_anon_mib_over_start": (memory.peak - before) / 1024,
            }
        )
        shutil.rmtree(tables)
        shutil.rmtree(scratch / f"repository-{fmt}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per format."""
    parser = argparse.ArgumentParser(prog="python -m recserve.perf.lab.import_bench", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}"
    )
    parser.add_argument(
        "--scratch", type=Path, default=None, help="folder for the files (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for result in run(args.rows, args.dim, tuple(args.formats.split(",")), Path(scratch)):
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
