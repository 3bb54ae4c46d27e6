"""Triton model ``dense``: the exported network on ONNX Runtime (see recserve.backends.dense_runner)."""

from recserve.backends import tensors
from recserve.backends.artifacts import read_manifest, verified_path
from recserve.backends.dense_runner import OnnxDenseRunner, session_threads
from recserve.backends.triton_adapter import ModelContext, execute_merged


class TritonPythonModel:
    """Runs one ONNX Runtime call per dynamic batch."""

    def initialize(self, args: dict) -> None:
        """Verify the ONNX file against its manifest and open a session."""
        context = ModelContext.from_args(args)
        manifest = read_manifest(context.version_dir)
        model_path = verified_path(context.version_dir, manifest["files"]["model"])
        self.runner = OnnxDenseRunner(context.spec, model_path, session_threads(context.instance_count))

    def execute(self, requests: list) -> list:
        """Probabilities for every valid request."""
        return execute_merged(
            requests, tensors.DENSE_NET_INPUTS, self.runner.check, lambda merged: {tensors.PROBABILITY: self.runner.predict(merged)}
        )
