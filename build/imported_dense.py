"""The dense half of ``recserve import``: the user's ONNX as recserve serves it, checked at every bucket."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recserve.backends.base.artifacts import file_entry, sha256_file, write_manifest
from recserve.backends.dense.runner import OnnxDenseRunner
from recserve.build.export import example_inputs
from recserve.build.repository import DENSE_FORMAT, ONNX_FILE, spec_digest
from recserve.core.contract import sequence_inputs
from recserve.core.names import BATCH_AXIS, LOGIT, PROBABILITY, SEQUENCE_AXIS
from recserve.core.spec.model import ModelSpec
from recserve.errors import ArtifactError


class DenseImportError(ArtifactError):
    """A dense model that cannot be imported; nothing was written."""


def served_onnx(spec: ModelSpec, source: Path) -> bytes:
    """The user's ONNX as recserve serves it: its dynamic axes named, a logit turned into a probability.

    The batch axis of every input and output is named :data:`~recserve.core.names.BATCH_AXIS` and the
    positions of the sequence inputs :data:`~recserve.core.names.SEQUENCE_AXIS` (the CPU path fixes them per
    bucket by these names); a ``logit`` output gets a ``Sigmoid`` to ``probability``.
    """
    import onnx
    from onnx import helper

    model = onnx.load(str(source))
    graph = model.graph
    sequences = set(sequence_inputs(spec))
    renames: dict[str, str] = {}
    for value in [*graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        axes = {0: BATCH_AXIS, **({1: SEQUENCE_AXIS} if value.name in sequences else {})}
        for axis, name in axes.items():
            if dims[axis].dim_param:
                renames[dims[axis].dim_param] = name
            dims[axis].dim_param = name
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    if spec.model.output == "logit":
        output = next(o for o in graph.output if o.name == LOGIT)
        graph.node.append(helper.make_node("Sigmoid", [output.name], [PROBABILITY], name="recserve_sigmoid"))
        served = helper.make_tensor_value_info(PROBABILITY, onnx.TensorProto.FLOAT, [BATCH_AXIS, 1])
        graph.output.remove(output)
        graph.output.append(served)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_imported_dense(spec: ModelSpec, source: Path, root: Path, original: Path | None = None) -> None:
    """The ``dense`` version folder of an imported ONNX; refuses one that does not run at every bucket.

    ``original``: the user's file when ``source`` was made from it (a network split at its lookups);
    errors and the manifest name it.
    """
    root.mkdir(parents=True, exist_ok=True)
    original = original or source
    path = root / ONNX_FILE
    path.write_bytes(served_onnx(spec, source))
    runner = OnnxDenseRunner(spec, path)
    for length in spec.serving.sequence_buckets:
        try:
            scores = runner.predict(example_inputs(spec, rows=3, length=length, seed=length))
        except Exception as exc:  # onnxruntime raises its own types for graphs that fail at run time
            raise DenseImportError(
                f"dense model {original.name} fails on a batch of 3 x {length}: {exc}"
            ) from None
        if scores.shape != (3, 1) or not np.all((scores >= 0) & (scores <= 1)):
            raise DenseImportError(
                f"dense model {original.name} returns {scores.reshape(-1)[:3]} (shape {list(scores.shape)}) "
                f'for 3 x {length} rows; expected probabilities in [0, 1] (set [model] output = "logit" '
                "for a model that returns logits)"
            )
    write_manifest(
        root,
        {
            "format": DENSE_FORMAT,
            "version": spec.version,
            "spec_sha256": spec_digest(spec),
            "holdout_auc": None,
            "imported": {
                "file": original.name,
                "sha256": sha256_file(original),
                "output": spec.model.output,
                "lookups": spec.model.lookups,
            },
            "files": {"model": file_entry(root, path)},
        },
    )
