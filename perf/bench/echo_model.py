"""Triton model for the hop-floor benchmark: a step's inputs in, zero outputs of its shapes out.

Installed as ``model.py`` of the echo steps that :mod:`recserve.perf.bench.hops` generates: it reads every
input and answers every request with outputs of the shapes and dtypes its config declares (rows
from the request; a variable axis as wide as the config parameter ``width_from`` names), computing
nothing. An ensemble of such steps costs what the hops cost and nothing else.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Zero outputs of the declared shapes for every request."""

    def initialize(self, args: dict) -> None:
        """Read the declared inputs and outputs."""
        config = json.loads(args["model_config"])
        self.inputs = [tensor["name"] for tensor in config["input"]]
        self.outputs = [
            (
                tensor["name"],
                pb_utils.triton_string_to_numpy(tensor["data_type"]),
                [int(d) for d in tensor["dims"]],
            )
            for tensor in config["output"]
        ]
        parameters = config["parameters"]
        self.width_from = parameters["width_from"]["string_value"]
        self.buckets = [int(b) for b in parameters["width_buckets"]["string_value"].split(",") if b]
        # a [-1] output packing several tensors: fixed values plus per_position values per position
        self.fixed, self.per_position = (int(n) for n in parameters["packed"]["string_value"].split(","))

    def execute(self, requests: list) -> list:
        """One response of zeros per request."""
        responses = []
        for request in requests:
            present = {tensor.name(): tensor for tensor in request.inputs()}  # optional ones may be absent
            arrays = {name: present[name].as_numpy() for name in self.inputs if name in present}
            rows = len(next(iter(arrays.values())))
            width = arrays[self.width_from].shape[1] if self.width_from in arrays else 1
            width = next((b for b in self.buckets if b >= width), width)  # as the real step pads
            packed = self.fixed + self.per_position * width  # a [-1] output (the width itself unless packed)
            tensors = [
                pb_utils.Tensor(
                    name,
                    np.zeros(
                        [rows, *((packed if len(dims) == 1 else width) if d < 0 else d for d in dims)], dtype
                    ),
                )
                for name, dtype, dims in self.outputs
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
