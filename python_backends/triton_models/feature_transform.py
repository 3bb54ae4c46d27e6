"""Triton model ``feature_transform``: raw features to keys (see recserve.backends.features)."""

from recserve.backends.features import FeatureTransform
from recserve.backends.triton_adapter import ModelContext, execute_each


class TritonPythonModel:
    """Validates raw inputs per request and computes keys, normalised dense values and masks."""

    def initialize(self, args: dict) -> None:
        """Build the transform from the spec in the model config."""
        context = ModelContext.from_args(args)
        self.transform = FeatureTransform(context.spec)
        self.input_names = [t.name for t in context.spec.wire_inputs()]

    def execute(self, requests: list) -> list:
        """One response per request; a bad request fails alone with INVALID_ARG."""
        return execute_each(requests, self.input_names, self.transform.transform)
