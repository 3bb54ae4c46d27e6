"""The bench's spec: the default spec as served, trained on fewer rows, with lists as long as the bench's.

The bench builds its own repository in its one call, so it trains on ``BenchSizes.train_rows``
rows for one epoch (the served shapes, tables, widths and buckets are the spec's; only the trained
weights and how many keys the tables hold differ). Where the spec has ``[serving]
gpu_max_batch_size`` and it is below the bench's longest list, it is raised to that list, so the
GPU profiles take the lists the bench sends; the summary lists every change.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec, parse_spec

from ..common import BenchSizes


def bench_document(
    spec: ModelSpec, sizes: BenchSizes, lookup_instances: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The bench spec's document and what differs from ``spec``'s, in words.

    ``lookup_instances``: ``[serving.instances] embedding_lookup`` (None: the spec's).
    """
    doc = copy.deepcopy(spec.source)
    training = doc.setdefault("training", {})
    training.update(rows=sizes.train_rows, holdout_rows=sizes.holdout_rows, epochs=1)
    changes = [f"[training] rows {sizes.train_rows}, holdout_rows {sizes.holdout_rows}, epochs 1"]
    largest = max(sizes.lists)
    gpu_largest = getattr(spec.serving, "gpu_max_batch_size", None)  # a spec that knows GPU batches
    if gpu_largest is not None and max(gpu_largest, spec.model.max_batch_size) < largest:
        doc.setdefault("serving", {})["gpu_max_batch_size"] = largest
        changes.append(f"[serving] gpu_max_batch_size {largest} (was {gpu_largest})")
    if lookup_instances is not None:
        instances = doc.setdefault("serving", {}).setdefault("instances", dict(spec.serving.instances))
        was = instances.get(EMBEDDING_LOOKUP)
        instances[EMBEDDING_LOOKUP] = lookup_instances
        changes.append(f"[serving.instances] {EMBEDDING_LOOKUP} {lookup_instances} (was {was})")
    parse_spec(copy.deepcopy(doc))  # refuses a document the build would refuse
    return doc, changes


def write_bench_spec(
    base: str | Path, sizes: BenchSizes, target: Path, lookup_instances: int | None = None
) -> list[str]:
    """Write the bench spec of the spec ``base`` (a bundled name or a path) as JSON; return the changes."""
    doc, changes = bench_document(load_spec(base), sizes, lookup_instances)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1) + "\n")
    return changes
