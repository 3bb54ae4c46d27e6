"""perf_analyzer ``--input-data`` JSON generated from the spec.

Rows come from the same synthetic generator as training (Zipf-skewed categorical values, the
spec's sequence-length distribution), so the measured load has realistic key skew and sequence
lengths. perf_analyzer fills a batch of ``-b N`` from ``N`` consecutive entries, which must share
their shapes: every entry's history is padded to the longest history in the file. The requests are
of the id form by default (categorical values as 64-bit ids, :mod:`recserve.core.wire_forms`), as
the SDK sends them; ``form="bytes"`` writes the text form.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recserve.build.synthetic import generate
from recserve.core.candidate_lists import candidate_list_inputs
from recserve.core.names import IDS_WIRE
from recserve.core.spec.model import ModelSpec

DEFAULT_ROWS = 1024


def input_data(spec: ModelSpec, rows: int = DEFAULT_ROWS, seed: int = 7, form: str = IDS_WIRE) -> dict:
    """The ``{"data": [...]}`` document: one entry per row, without the batch dimension."""
    wire = generate(spec, rows, seed).to_wire(spec, form)  # lists as wide as the longest row's
    tensors = spec.wire_form(form).inputs
    entries = []
    for r in range(rows):
        entries.append({tensor.name: _entry(tensor.dtype, wire[tensor.name][r]) for tensor in tensors})
    return {"data": entries}


def candidate_input_data(
    spec: ModelSpec, candidates: int, lists: int = 16, seed: int = 7, form: str = IDS_WIRE
) -> dict:
    """The document for the candidates ensemble: one entry per user, each one request.

    Each entry holds a user's sequences once (``[1, L]``, the user's own history length) and
    ``candidates`` rows of every per-candidate input (``[1, candidates, ...]``); perf_analyzer sends
    one entry per request (the ensemble batches nothing itself, ``max_batch_size: 0``).

    Raises:
        ValueError: the spec has no candidate-list layout.
    """
    if spec.candidates_model is None:
        raise ValueError(f"spec {spec.name!r} has no sequence: it has no candidate-list layout")
    raw = generate(spec, lists * candidates, seed)
    entries = []
    for user in range(lists):
        rows = raw.take(slice(user * candidates, (user + 1) * candidates))
        first = rows.take(slice(0, 1)).to_wire(spec, form)  # the user: the first row's sequences
        wire = rows.to_wire(spec, form)
        tensors = (*spec.wire_form(form).user_inputs, *spec.wire_form(form).candidate_inputs)
        arrays = {t.name: first[t.name] for t in tensors if t.name in first}  # the sequences
        arrays.update(candidate_list_inputs(spec, wire, form))
        entries.append({t.name: _entry(t.dtype, arrays[t.name]) for t in tensors})
    return {"data": entries}


def _entry(dtype: str, value: np.ndarray) -> dict:
    if dtype == "BYTES":
        content: list = [v.decode() for v in value.reshape(-1)]
    elif dtype == "BOOL":
        content = [bool(v) for v in value.reshape(-1)]
    else:
        content = value.reshape(-1).tolist()
    return {"content": content, "shape": list(value.shape)}


def write_input_data(
    spec: ModelSpec,
    path: Path,
    rows: int = DEFAULT_ROWS,
    seed: int = 7,
    candidates: int = 0,
    form: str = IDS_WIRE,
) -> Path:
    """Write the input-data JSON and return its path (``candidates``: the candidate-list layout's).

    ``form``: the wire form of the requests, ``ids`` (the default) or ``bytes``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    document = (
        candidate_input_data(spec, candidates, seed=seed, form=form)
        if candidates
        else input_data(spec, rows, seed, form)
    )
    path.write_text(json.dumps(document))
    return path


def mean_history_length(document: dict, spec: ModelSpec) -> float:
    """Mean real history length in a document (for reports)."""
    return float(np.mean([e[spec.sequence_length_input]["content"][0] for e in document["data"]]))
