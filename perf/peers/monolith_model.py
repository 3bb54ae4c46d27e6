"""Triton model for the bench's naive peer: feature transform, lookup and dense in one ``model.py``.

The monolith a user would write first: one Python-backend model that runs the whole ``ctr`` path
(the in-process pipeline: the same transform, tiered store and ONNX Runtime dense runner as the
served steps) on each dynamic batch. Installed by :mod:`recserve.perf.peers.monolith`; the built
repository it serves from is the config parameter ``repository``.
"""

from pathlib import Path

import numpy as np

from recserve.backends.triton.adapter import ModelContext, execute_merged_or_alone
from recserve.build.repository import reference_pipeline
from recserve.core.names import PROBABILITY, WIRE_FORMS


class TritonPythonModel:
    """The whole path per dynamic batch; a bad request fails alone with INVALID_ARG."""

    def initialize(self, args: dict) -> None:
        """Map the built repository's tables and open its dense model."""
        context = ModelContext.from_args(args)
        self.pipeline = reference_pipeline(context.spec, Path(context.parameters["repository"]), "onnx")
        forms = [context.spec.wire_form(form) for form in WIRE_FORMS]  # a request carries one
        self.inputs = list(dict.fromkeys(t.name for form in forms for t in form.inputs))

    def predict(self, inputs: dict) -> dict:
        """Probabilities ``[rows, 1]`` of one (merged) batch."""
        return {PROBABILITY: self.pipeline.predict(inputs).astype(np.float32).reshape(-1, 1)}

    def execute(self, requests: list) -> list:
        """One response per request."""
        return execute_merged_or_alone(requests, self.inputs, self.predict)
