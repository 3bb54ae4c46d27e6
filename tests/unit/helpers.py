"""Helpers shared by unit-test modules (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from hypothesis import HealthCheck, settings

from recserve.backends.store.table_data import RowBlock
from recserve.backends.store.tiered import TieredStore
from recserve.build.synthetic import generate, zipf_ranks
from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec, spec_path
from tests.conftest import ROOT
from tests.store_tables import DIM


def ctr_spec_document() -> dict:
    """The bundled ``ctr`` spec as its parsed TOML document, for a test to edit and parse."""
    with open(spec_path("ctr"), "rb") as fh:
        return tomllib.load(fh)


def tagged_ctr_spec(pooling: str = "mean") -> ModelSpec:
    """The bundled ``ctr`` spec with a multi-hot feature ``tags`` of 4 values (table ``tags``)."""
    doc = ctr_spec_document()
    doc["features"].append(
        {"name": "tags", "kind": "multi_hot", "value_type": "int64", "separator": "|", "max_length": 4}
        | {"pooling": pooling}
    )
    doc["tables"]["tags"] = {"cardinality": 1000}
    return parse_spec(doc)


def two_sequence_ctr_spec(combine: str = "sum") -> ModelSpec:
    """The bundled ``ctr`` spec with a second sequence in its attention group: each history item's
    category (``history_cates``, table ``cate``, 4 wide), and the candidate's (``target_cate``)."""
    doc = ctr_spec_document()
    doc["features"] += [
        {"name": "history_cates", "kind": "sequence", "table": "cate", "positions": "history_items"},
        {"name": "target_cate", "kind": "categorical", "value_type": "int64", "table": "cate"}
        | {"attends": "history_cates"},
    ]
    doc["tables"]["cate"] = {"cardinality": 100} | ({"dim": 4} if combine == "concat" else {})
    if combine == "concat":
        next(f for f in doc["features"] if f["name"] == "history_items")["combine"] = "concat"
    return parse_spec(doc)


def two_behaviour_ctr_spec() -> ModelSpec:
    """The bundled ``ctr`` spec with a second behaviour of positions of its own (``cart``, a second group)."""
    doc = ctr_spec_document()
    doc["features"] += [
        {"name": "cart", "kind": "sequence", "table": "item", "max_length": 16},
        {"name": "cart_target", "kind": "categorical", "value_type": "int64", "table": "item"}
        | {"attends": "cart"},
    ]
    return parse_spec(doc)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
        ),
    ),
]
SLOT_BYTES = DIM * 4 + 16  # what one L1 slot costs in the byte budget


def zipf_batch(tables, rng, size, unknown=0.05):
    """Keys of both tables drawn Zipf(1.05) by row rank, plus a share of unknown keys, and their table ids."""
    names = sorted(tables)
    table = rng.integers(0, len(names), size)
    keys = np.empty(size, np.int64)
    for number, name in enumerate(names):
        chosen = table == number
        keys[chosen] = tables[name].keys[zipf_ranks(rng, len(tables[name].keys), 1.05, (int(chosen.sum()),))]
    strangers = rng.random(size) < unknown
    keys[strangers] = rng.integers(1, 1 << 40, int(strangers.sum()))
    return keys, table.astype(np.int16)


def warm(store, tables, rng, batches=20):
    for _ in range(batches):
        store.lookup(*zipf_batch(tables, rng, 512))
    store.refresh_cache()


class SwapsMidBatch(TieredStore):
    """A store whose next lookups each publish a new delta first, as the upkeep thread might."""

    swaps = 0
    rows: tuple = ()

    def lookup(self, keys, table_ids, record=True):
        if self.swaps:
            self.swaps -= 1
            version = self.version_of("t0") + 1
            self.install(
                {"t0": version}, RowBlock.of(self.rows, np.full((len(self.rows), DIM), version, np.float32))
            )
        return super().lookup(keys, table_ids, record)


def python_files() -> list[Path]:
    """The repository's Python files, sorted: tracked or not ignored (no build outputs, results, venvs)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z", "*.py"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted(p for p in (ROOT / name for name in listed.split("\0") if name) if p.is_file())


#: The real-time tail of the user-state specs below.
USER_TAIL = 16


def user_state_spec(padding: str = "right", **section: object) -> ModelSpec:
    """The ctr spec with ``[user_state]`` on (96 tokens, a tail of :data:`USER_TAIL`), padded so."""
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True, "tokens": 96, "exact_tokens": 64, "tail": USER_TAIL, **section}
    for feature in doc["features"]:
        if feature.get("kind") == "sequence":
            feature["padding"] = padding
    return parse_spec(doc)


def user_rows(spec: ModelSpec, rows: int, seed: int, users, newest, tail_items) -> dict[str, np.ndarray]:
    """Wire rows of ``spec`` whose history is ``tail_items[r]`` (the tail); with users and newest seqs.

    ``users`` None: rows without a user.
    """
    wire = generate(spec, rows, seed).to_wire(spec)
    width = max(len(t) for t in tail_items) or 1
    items = np.zeros((rows, width), np.int64)
    for r, tail in enumerate(tail_items):
        items[r, : len(tail)] = tail
    wire[spec.sequences[0].name] = items
    wire[spec.attention_groups[0].length_input] = np.array([[len(t)] for t in tail_items], np.int32)
    if users is not None:
        wire[USER_ID] = np.asarray(users, np.int64).reshape(-1, 1)
        wire[USER_SEQ] = np.asarray(newest, np.int64).reshape(-1, 1)
    return wire


def fast(examples: int) -> settings:
    """Hypothesis settings for the unit suite: few, reproducible examples, no database, no deadline."""
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
