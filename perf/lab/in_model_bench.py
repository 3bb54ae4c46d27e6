"""What ``[model] lookups = "in_model"`` costs against the split form, for one DIN served both ways.

``python -m recserve.perf.lab.in_model_bench`` writes a DIN in plain PyTorch (the shape of
tests/integration/test_import_din.py: a profile of three features, items of width 8 next to their
categories of width 4, histories of up to 16, DIN's attention unit and MLP), exports it twice and
imports each: **split**, the network after its lookups exported through a wrapper and the tables as
``<table>.npy`` + ``<table>.vocab.json``; **in_model**, its ``forward(ids, mask)`` exported as written
with its tables inside and the vocabularies only. Then, ``--rounds`` times and alternating the order,
each repository is served by tritonserver and timed through the gRPC client: the p50 latency of
one-row requests, one at a time, and the rows per second of 64-row requests, one at a time. Prints
one JSON document: the import seconds, every round, the medians and the load average around each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recserve.backends.dense.runner import open_session
from recserve.build.export import example_inputs
from recserve.build.importer import import_repository
from recserve.build.repository import ONNX_FILE, version_dir
from recserve.clients import CTRClient
from recserve.core.names import BATCH_AXIS, DENSE, SEQUENCE_AXIS
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.server import Ports, TritonServer

SPEC = """
[model]
name = "din"
max_batch_size = 64
output = "logit"
lookups = "{lookups}"

[serving]
batch_buckets = [1, 8, 64]
sequence_buckets = [4, 16]
max_queue_delay_microseconds = 100
instances = {{ embedding_lookup = 1, dense = 1 }}

[[features]]
name = "user"
kind = "categorical"
value_type = "int64"

[[features]]
name = "gender"
kind = "categorical"
value_type = "string"

[[features]]
name = "age_level"
kind = "categorical"
value_type = "int64"

[[features]]
name = "hist_item_ids"
kind = "sequence"
table = "item"
max_length = 16
combine = "concat"

[[features]]
name = "hist_cate_ids"
kind = "sequence"
table = "cate"
positions = "hist_item_ids"

[[features]]
name = "item_id"
kind = "categorical"
value_type = "int64"
table = "item"
attends = "hist_item_ids"

[[features]]
name = "cate_id"
kind = "categorical"
value_type = "int64"
table = "cate"
attends = "hist_cate_ids"

[tables]
user = {{ dim = 8 }}
gender = {{ dim = 8 }}
age_level = {{ dim = 8 }}
item = {{ dim = 8 }}
cate = {{ dim = 4 }}
"""
VOCABULARIES: dict[str, list] = {
    "user": list(range(100, 1100)),
    "gender": ["M", "F"],
    "age_level": list(range(7)),
    "item": list(range(1, 5001)),
    "cate": list(range(50)),
}
WIDTHS = {"user": 8, "gender": 8, "age_level": 8, "item": 8, "cate": 4}
PROFILE = ("user", "gender", "age_level")
#: The in-model network's inputs: its ``ids`` dict in order, then the mask.
NAMES = [*PROFILE, "item_id", "cate_id", "hist_item_ids", "hist_cate_ids", "history_mask"]


class DIN(nn.Module):
    """DIN as a model zoo writes it: row ids in, a logit out."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {table: nn.Embedding(len(VOCABULARIES[table]) + 1, width) for table, width in WIDTHS.items()}
        )
        self.unit = nn.Sequential(nn.Linear(48, 16), nn.PReLU(), nn.Linear(16, 1))
        self.mlp = nn.Sequential(nn.Linear(24 + 24, 32), nn.PReLU(), nn.Linear(32, 1))

    def forward(self, ids: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1]`` from row ids and the history mask."""
        profile = torch.stack([self.embeddings[f](ids[f]) for f in PROFILE], dim=1)
        target = torch.cat(
            [self.embeddings["item"](ids["item_id"]), self.embeddings["cate"](ids["cate_id"])], -1
        )
        history = torch.cat(
            [self.embeddings["item"](ids["hist_item_ids"]), self.embeddings["cate"](ids["hist_cate_ids"])], -1
        )
        return self.head(profile, target, history, mask)

    def head(
        self, profile: torch.Tensor, target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The network after the lookups: attention unit, weighted sum, MLP."""
        query = target[:, None, :].expand_as(history)
        scores = (
            self.unit(torch.cat([history, query, history - query, history * query], -1)).squeeze(-1) * mask
        )
        pooled = (scores[:, :, None] * history).sum(dim=1)
        return self.mlp(torch.cat([profile.flatten(1), pooled, target], dim=1))


class Head(nn.Module):
    """The split form's wrapper: the dense contract's inputs into ``head``."""

    def __init__(self, model: DIN) -> None:
        super().__init__()
        self.model = model

    def forward(self, profile, target, history, mask):  # noqa: D102
        return self.model.head(profile, target, history, mask)


def _export(module: nn.Module, example: tuple, names: list[str], shapes: tuple, path: Path) -> None:
    """``module`` exported with torch.onnx.export's current exporter (torch.export)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, example, str(path), input_names=names, output_names=["logit"], dynamic_shapes=shapes
        )


def build(folder: Path) -> dict[str, tuple[ModelSpec, Path, float]]:
    """Both repositories of one DIN: ``{form: (spec, repository, import seconds)}``."""
    torch.manual_seed(3)
    model = DIN().eval()
    made = {}
    batch, sequence = torch.export.Dim(BATCH_AXIS), torch.export.Dim(SEQUENCE_AXIS)
    for form in ("split", "in_model"):
        root = folder / form
        (root / "tables").mkdir(parents=True)
        (root / "din.toml").write_text(SPEC.format(lookups="store" if form == "split" else "in_model"))
        spec = load_spec(root / "din.toml")
        for table, tokens in VOCABULARIES.items():
            (root / "tables" / f"{table}.vocab.json").write_text(
                json.dumps({"tokens": [None, *tokens], "oov": 0})
            )
            if form == "split":
                np.save(
                    root / "tables" / f"{table}.npy", model.state_dict()[f"embeddings.{table}.weight"].numpy()
                )
        if form == "split":
            names = ["sparse_embeddings", "target_embedding", "history_embeddings", "history_mask"]
            example = (torch.zeros(2, 3, 8), torch.zeros(2, 12), torch.zeros(2, 5, 12), torch.ones(2, 5))
            shapes = ({0: batch}, {0: batch}, {0: batch, 1: sequence}, {0: batch, 1: sequence})
            _export(Head(model), example, names, shapes, root / "din.onnx")
        else:
            ids = {name: torch.zeros(2, dtype=torch.long) for name in NAMES[:5]}
            ids |= {name: torch.zeros(2, 5, dtype=torch.long) for name in NAMES[5:7]}
            per_feature = {name: {0: batch} for name in NAMES[:5]}
            per_feature |= {name: {0: batch, 1: sequence} for name in NAMES[5:7]}
            _export(
                model,
                (ids, torch.ones(2, 5)),
                NAMES,
                (per_feature, {0: batch, 1: sequence}),
                root / "din.onnx",
            )
        started = time.perf_counter()
        import_repository(spec, root / "tables", root / "din.onnx", root / "repository", lambda _: None)
        made[form] = (spec, root / "repository", time.perf_counter() - started)
    return made


def rows(count: int, seed: int) -> Rows:
    """Raw rows with known values, histories of 0 to 16 items and their categories."""
    rng = np.random.default_rng(seed)
    columns = [
        rng.integers(100, 1100, count).astype(str),
        rng.choice(["M", "F"], count),
        rng.integers(0, 7, count).astype(str),
    ]
    categorical = np.array([[v.encode() for v in column] for column in columns], dtype=object).T
    items = rng.integers(1, 5001, size=(count, 16))
    lengths = rng.integers(0, 17, count).astype(np.int32)
    items[np.arange(16)[None, :] >= lengths[:, None]] = 0
    target = rng.integers(1, 5001, count)
    return Rows(
        dense=np.zeros((count, 0), np.float32),
        dense_missing=np.zeros((count, 0), bool),
        categorical=categorical,
        target=target,
        history=items,
        lengths=lengths,
        side={"hist_cate_ids": items % 50, "cate_id": target % 50},
    )


def served(spec: ModelSpec, repository: Path, log: Path, singles: int, batches: int) -> dict[str, float]:
    """p50 ms of one-row requests and rows/s of 64-row requests, each sent one at a time."""
    one = [rows(1, seed).to_wire(spec) for seed in range(50)]
    many = [rows(64, 100 + seed).to_wire(spec) for seed in range(10)]
    load = os.getloadavg()[0]
    with TritonServer(repository, Ports.free(), log_path=log) as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            for inputs in [*one, *many]:  # warm-up: every bucket
                client.predict_inputs(inputs)
            latencies = []
            for i in range(singles):
                started = time.perf_counter()
                client.predict_inputs(one[i % len(one)])
                latencies.append(time.perf_counter() - started)
            started = time.perf_counter()
            for i in range(batches):
                client.predict_inputs(many[i % len(many)])
            rate = batches * 64 / (time.perf_counter() - started)
    return {
        "p50_ms_batch_1": statistics.median(latencies) * 1e3,
        "rows_per_s_batch_64": rate,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def dense_step(spec: ModelSpec, repository: Path, repeats: int = 2000) -> dict[str, float]:
    """Median µs of the served dense graph alone (ONNX Runtime, one thread), 1 and 64 rows of 16 positions."""
    session = open_session(version_dir(repository, DENSE, spec) / ONNX_FILE, threads=1)
    times = {}
    for batch in (1, 64):
        feeds = example_inputs(spec, rows=batch, length=16, seed=batch)
        spent = []
        for _ in range(repeats):
            started = time.perf_counter()
            session.run(None, feeds)
            spent.append(time.perf_counter() - started)
        times[f"dense_us_batch_{batch}"] = statistics.median(spent) * 1e6
    return times


def main() -> None:
    """Build both repositories, serve and time each ``--rounds`` times, print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--singles", type=int, default=400, help="one-row requests per round")
    parser.add_argument("--batches", type=int, default=150, help="64-row requests per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        made = build(Path(scratch))
        dense = {form: dense_step(spec, repository) for form, (spec, repository, _) in made.items()}
        runs: dict[str, list[dict[str, float]]] = {form: [] for form in made}
        for round_ in range(args.rounds):
            for form in made if round_ % 2 == 0 else reversed(list(made)):
                spec, repository, _ = made[form]
                log = Path(scratch) / f"{form}-{round_}.log"
                runs[form].append(served(spec, repository, log, args.singles, args.batches))
    report = {
        form: {
            "import_s": made[form][2],
            "dense_step": dense[form],
            "rounds": runs[form],
            "median": {
                key: statistics.median(run[key] for run in runs[form])
                for key in ("p50_ms_batch_1", "rows_per_s_batch_64")
            },
        }
        for form in made
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
