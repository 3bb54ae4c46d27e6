"""perf_analyzer ``--input-data`` JSON generated from the spec.

Rows come from the same synthetic generator as training (Zipf-skewed categorical values, the
spec's sequence-length distribution), so the measured load has realistic key skew and sequence
lengths. perf_analyzer fills a batch of ``-b N`` from ``N`` consecutive entries, which must share
their shapes: every entry's history is padded to the longest history in the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recserve.build.synthetic import generate
from recserve.spec import ModelSpec

DEFAULT_ROWS = 1024


def input_data(spec: ModelSpec, rows: int = DEFAULT_ROWS, seed: int = 7) -> dict:
    """The ``{"data": [...]}`` document: one entry per row, without the batch dimension."""
    wire = generate(spec, rows, seed).to_wire(spec)
    entries = []
    for r in range(rows):
        entry = {}
        for tensor in spec.wire_inputs():
            value = wire[tensor.name][r]
            if tensor.dtype == "BYTES":
                content: list = [v.decode() for v in value]
            elif tensor.dtype == "BOOL":
                content = [bool(v) for v in value]
            else:
                content = value.tolist()
            entry[tensor.name] = {"content": content, "shape": list(value.shape)}
        entries.append(entry)
    return {"data": entries}


def write_input_data(spec: ModelSpec, path: Path, rows: int = DEFAULT_ROWS, seed: int = 7) -> Path:
    """Write the input-data JSON and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(input_data(spec, rows, seed)))
    return path


def mean_history_length(document: dict, spec: ModelSpec) -> float:
    """Mean real history length in a document (for reports)."""
    return float(np.mean([e[spec.sequence_length_input]["content"][0] for e in document["data"]]))
