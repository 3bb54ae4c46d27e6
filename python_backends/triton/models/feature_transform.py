"""Triton model ``feature_transform``: raw features to keys (see recserve.backends.features.transform)."""

import numpy as np

from recserve import wire
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.triton.adapter import ModelContext, execute_merged_or_alone


class TritonPythonModel:
    """Validates raw inputs; computes keys, normalised dense values and masks, a dynamic batch at a time."""

    def initialize(self, args: dict) -> None:
        """Build the transform from the spec in the model config."""
        context = ModelContext.from_args(args)
        self.spec = context.spec
        self.transform = FeatureTransform(context.spec)
        self.input_names = [t.name for t in context.spec.wire_inputs()]

    def history_width(self, inputs: dict) -> int:
        """The sequence bucket of one request's longest history: the width it gets back."""
        lengths = inputs[self.spec.sequence_length_input]
        return self.spec.sequence_bucket(max(int(np.max(lengths, initial=0)), 1))

    def execute(self, requests: list) -> list:
        """One response per request; a bad request fails alone with INVALID_ARG."""
        return execute_merged_or_alone(
            requests,
            self.input_names,
            self.transform.transform,
            ragged_outputs=(wire.HISTORY_KEYS, wire.HISTORY_MASK),
            ragged_width=self.history_width,
        )
