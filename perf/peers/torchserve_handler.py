"""TorchServe handler serving the same ``ctr`` model: a peer server for the benchmark.

Written as a TorchServe user would: JSON in, TorchServe's own batching (each call gets a list of
requests), the trained PyTorch network in eager mode, and the same feature transform and embedding
tables as the Triton steps. ``recserve bench`` archives this file with a ``recserve.json`` naming the
spec and the built repository.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.base import batching
from recserve.build.repository import reference_pipeline
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec
from recserve.core.spec.types import NUMPY_DTYPES

LOGGER = logging.getLogger(__name__)

SETTINGS_FILE = "recserve.json"


def decode(spec: ModelSpec, body: Any) -> dict[str, np.ndarray]:
    """One request's JSON (bytes or already parsed) as the wire arrays of the spec."""
    document = json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
    arrays = {}
    for wire in spec.wire_inputs():
        values = document[wire.name]
        if wire.dtype == "BYTES":
            arrays[wire.name] = np.array([[v.encode() for v in row] for row in values], dtype=object)
        else:
            arrays[wire.name] = np.asarray(values, dtype=NUMPY_DTYPES[wire.dtype])
    return arrays


def row_groups(rows: list[int], limit: int) -> list[list[int]]:
    """Consecutive request indices grouped so that no group holds more than ``limit`` rows."""
    groups: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(rows):
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


class CTRHandler:
    """Scores a TorchServe batch of requests.

    In as few calls of the in-process pipeline as ``max_batch_size`` allows.
    """

    def __init__(self) -> None:
        self.spec: ModelSpec | None = None
        self.pipeline: Any = None

    def initialize(self, context: Any) -> None:
        """Load the spec, the tables and the PyTorch network named by ``recserve.json``."""
        settings = json.loads((Path(context.system_properties["model_dir"]) / SETTINGS_FILE).read_text())
        self.spec = load_spec(settings["spec"])
        self.pipeline = reference_pipeline(self.spec, Path(settings["repository"]), runtime="torch")

    def handle(self, data: list[Mapping[str, Any]], context: Any) -> list[Any]:
        """One list of probabilities per request; a request that does not decode gets an error object."""
        assert self.spec is not None
        results: list[Any] = [None] * len(data)
        valid, arrays = [], []
        for i, item in enumerate(data):
            try:
                arrays.append(
                    decode(self.spec, item.get("body") if item.get("body") is not None else item.get("data"))
                )
                valid.append(i)
            except (KeyError, TypeError, ValueError) as exc:
                results[i] = {"error": f"bad request: {exc}"}
        rows = [len(a[self.spec.categorical.name]) for a in arrays]
        for group in row_groups(rows, self.spec.model.max_batch_size):
            merged, sizes = batching.merge([arrays[g] for g in group])
            probabilities = self.pipeline.predict(merged)
            for g, part in zip(group, batching.split({"p": probabilities}, sizes), strict=True):
                results[valid[g]] = part["p"].tolist()
        return results


_SERVICE = CTRHandler()


def handle(data: list[Mapping[str, Any]] | None, context: Any) -> list[Any] | None:
    """TorchServe's entry point: initialise once, then score each batch."""
    if _SERVICE.pipeline is None:
        _SERVICE.initialize(context)
    if data is None:
        return None
    return _SERVICE.handle(data, context)
