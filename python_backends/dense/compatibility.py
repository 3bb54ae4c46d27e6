"""Does a dense network fit the embeddings and features it will be fed?

A new ``dense`` version is refused at load when the shapes its graph declares disagree with the
spec the ``embedding_lookup`` step serves (another embedding dim, another number of categorical
features, another dense width), so a mismatched pair never goes live: the old pair keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from recserve import wire
from recserve.backends.artifacts import read_manifest, verified_path
from recserve.errors import ArtifactError
from recserve.spec import ModelSpec

LOGGER = logging.getLogger(__name__)

Dim = int | str | None


def dense_input_dims(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Per-row dims of each dense-network input under ``spec`` (-1: variable length)."""
    dim = spec.embedding_dim
    return {
        wire.DENSE_NORMALIZED: (len(spec.dense.columns),),
        wire.SPARSE_EMBEDDINGS: (spec.num_sparse, dim),
        wire.TARGET_EMBEDDING: (dim,),
        wire.HISTORY_EMBEDDINGS: (-1, dim),
        wire.HISTORY_MASK: (-1,),
    }


def _render(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if not isinstance(d, int) or d < 0 else str(d) for d in dims) + "]"


def check_dense_fits(spec: ModelSpec, graph_inputs: Mapping[str, Sequence[Dim]]) -> None:
    """Refuse a dense graph whose inputs do not fit the spec's embeddings and features.

    Args:
        spec: the spec the embedding tables and feature step are served with.
        graph_inputs: input name -> declared shape including the batch dim (ints for fixed dims,
            names or None for symbolic ones), as ONNX Runtime reports them.

    Raises:
        ArtifactError: an input is missing or a fixed dim differs; the message names both shapes.
    """
    problems = []
    for name, expected in dense_input_dims(spec).items():
        if name not in graph_inputs:
            problems.append(f"it has no input '{name}'")
            continue
        declared = tuple(graph_inputs[name])[1:]
        fits = len(declared) == len(expected) and all(
            want < 0 or got == want for got, want in zip(declared, expected, strict=True)
        )
        if not fits:
            problems.append(
                f"'{name}' is {_render(declared)} per row, the embeddings give {_render(expected)}"
            )
    if problems:
        raise ArtifactError(
            f"dense model does not fit spec '{spec.name}' (embedding_dim {spec.embedding_dim}, "
            f"{spec.num_sparse} categorical features): " + "; ".join(problems)
        )


def onnx_input_dims(version_dir: Path) -> dict[str, list[Dim]]:
    """Declared input shapes of a ``dense`` version's checked ONNX graph (symbolic dims as names)."""
    import onnx

    path = verified_path(version_dir, read_manifest(version_dir)["files"]["model"])
    graph = onnx.load(str(path), load_external_data=False).graph
    return {
        i.name: [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in i.type.tensor_type.shape.dim
        ]
        for i in graph.input
    }
