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

from recserve.backends import batching
from recserve.build.repository import reference_pipeline
from recserve.spec import NUMPY_DTYPES, ModelSpec, load_spec

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


class CTRHandler:
    """Scores a TorchServe batch of requests in one call of the in-process pipeline."""

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
                arrays.append(decode(self.spec, item.get("body") if item.get("body") is not None else item.get("data")))
                valid.append(i)
            except (KeyError, TypeError, ValueError) as exc:
                results[i] = {"error": f"bad request: {exc}"}
        if valid:
            merged, sizes = batching.merge(arrays)
            probabilities = self.pipeline.predict(merged)
            for i, part in zip(valid, batching.split({"p": probabilities}, sizes)):
                results[i] = part["p"].tolist()
        return results


_SERVICE = CTRHandler()


def handle(data: list[Mapping[str, Any]] | None, context: Any) -> list[Any] | None:
    """TorchServe's entry point: initialise once, then score each batch."""
    if _SERVICE.pipeline is None:
        _SERVICE.initialize(context)
    if data is None:
        return None
    return _SERVICE.handle(data, context)
