"""Models trained "elsewhere" for the import tests: a built model's tables written in the three import
formats, and a dense ONNX written by hand with ``onnx.helper`` plus its own numpy reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from recserve.backends.features.hashing import fnv1a64, splitmix64
from recserve.backends.store.tiered import TieredStore
from recserve.build.repository import version_dir
from recserve.core.names import (
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    HISTORY_EMBEDDINGS,
    HISTORY_MASK,
    LOGIT,
    SPARSE_EMBEDDINGS,
    TARGET_EMBEDDING,
)
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec

#: A user's DeepFM spec: 16- and 8-wide field tables, a 1-wide first-order table per field.
DEEPFM_SPEC = """
[model]
name = "deepfm"
max_batch_size = 64
output = "logit"

[[features]]
name = "site_id"
kind = "categorical"
value_type = "string"
tables = ["site_id", "site_id_linear"]

[[features]]
name = "app_id"
kind = "categorical"
value_type = "string"
tables = ["app_id", "app_id_linear"]

[[features]]
name = "device_type"
kind = "categorical"
value_type = "int64"
tables = ["device_type", "device_type_linear"]

[[features]]
name = "C15"
kind = "categorical"
value_type = "int64"
tables = ["C15", "C15_linear"]

[[features]]
name = "C15_number"
kind = "numeric"
column = "C15"
clip = [0, 2000]
log1p = true

[tables]
site_id = { dim = 16 }
app_id = { dim = 16 }
device_type = { dim = 8 }
C15 = { dim = 8 }
site_id_linear = { dim = 1 }
app_id_linear = { dim = 1 }
device_type_linear = { dim = 1 }
C15_linear = { dim = 1 }
"""


def table_tokens(spec: ModelSpec, table: str) -> list[str | int]:
    """Every raw value the synthetic rows can hold for ``table`` (hex strings, or item ids)."""
    cardinality = spec.tables[table].cardinality
    if table in spec.categorical.columns:
        ranks = np.arange(cardinality, dtype=np.uint64)
        values = splitmix64(ranks ^ np.uint64(fnv1a64(table))) & np.uint64(0xFFFFFFFF)
        return ["", *(f"{int(v):08x}" for v in values)]
    return [-1, *range(cardinality)]


def export_tables(spec: ModelSpec, repository: Path, folder: Path, formats: dict[str, str]) -> None:
    """Write each table of a built repository in the format named (``vocabulary``, ``keyed``, ``hugectr``)."""
    from recserve.backends.features.vocabulary import vocabulary_keys

    store = TieredStore.load(version_dir(repository, EMBEDDING_LOOKUP, spec), spec)
    folder.mkdir(parents=True, exist_ok=True)
    for name in spec.table_names:
        table = store.table_arrays(name)
        keys, vectors = table.keys, np.asarray(table.vectors, np.float32)
        if formats[name] == "vocabulary":
            tokens = table_tokens(spec, name)
            by_key = dict(zip(vocabulary_keys(spec, name, tokens).tolist(), tokens, strict=True))
            known = np.array([int(k) in by_key for k in keys])  # not the padding key: masked, never served
            np.save(folder / f"{name}.npy", np.concatenate([vectors[known], table.default[None, :]]))
            vocab = {"tokens": [by_key[int(k)] for k in keys[known]] + [None], "oov": int(known.sum())}
            (folder / f"{name}.vocab.json").write_text(json.dumps(vocab))
        elif formats[name] == "keyed":
            save_file(
                {"keys": keys, "vectors": vectors, "default": table.default},
                str(folder / f"{name}.safetensors"),
            )
        else:
            (folder / name).mkdir()
            keys.astype("<i8").tofile(folder / name / "key")
            vectors.astype("<f4").tofile(folder / name / "emb_vector")
            table.default.astype("<f4").tofile(folder / name / "default")


class HandWrittenModel:
    """A linear CTR model over the dense contract, written with ``onnx.helper`` and scored in numpy.

    ``logit = dense @ w + sum(sparse * u) + target @ v + mean(history over the mask) @ z + b``;
    with ``newest``, also ``+ (history at the last position, times its mask) @ y``: the newest item
    when the spec pads its sequence on the left, so the layout of the positions matters.
    """

    def __init__(self, spec: ModelSpec, seed: int = 3, newest: bool = False) -> None:
        self.newest = newest
        rng = np.random.default_rng(seed)
        dim, features = spec.model.embedding_dim, spec.num_sparse
        self.w = rng.normal(0, 0.3, (len(spec.dense.columns), 1)).astype(np.float32)
        self.u = rng.normal(0, 0.3, (features, dim)).astype(np.float32)
        self.v = rng.normal(0, 0.3, (dim, 1)).astype(np.float32)
        self.z = rng.normal(0, 0.3, (dim, 1)).astype(np.float32)
        self.b = np.array([-0.5], np.float32)
        self.y = rng.normal(0, 0.5, (dim, 1)).astype(np.float32)

    def write(self, path: Path, output: str = LOGIT) -> None:
        """The ONNX file, its output ``logit`` (or ``probability``: the sigmoid inside the graph)."""
        f = TensorProto.FLOAT
        inputs = [
            helper.make_tensor_value_info(DENSE_NORMALIZED, f, ["n", self.w.shape[0]]),
            helper.make_tensor_value_info(SPARSE_EMBEDDINGS, f, ["n", *self.u.shape]),
            helper.make_tensor_value_info(TARGET_EMBEDDING, f, ["n", self.v.shape[0]]),
            helper.make_tensor_value_info(HISTORY_EMBEDDINGS, f, ["n", "len", self.z.shape[0]]),
            helper.make_tensor_value_info(HISTORY_MASK, f, ["n", "len"]),
        ]
        weights = [
            numpy_helper.from_array(array, name)
            for name, array in (
                ("w", self.w),
                ("u", self.u),
                ("v", self.v),
                ("z", self.z),
                ("b", self.b),
                ("one", np.array([1.0], np.float32)),
                ("axes_features", np.array([1, 2], np.int64)),
                ("axis_1", np.array([1], np.int64)),
                ("axis_2", np.array([2], np.int64)),
                *((("y", self.y), ("last", np.array(-1, np.int64))) if self.newest else ()),
            )
        ]
        n = helper.make_node
        nodes = [
            n("MatMul", [DENSE_NORMALIZED, "w"], ["a"]),
            n("Mul", [SPARSE_EMBEDDINGS, "u"], ["su"]),
            n("ReduceSum", ["su", "axes_features"], ["s"], keepdims=0),
            n("Unsqueeze", ["s", "axis_1"], ["s1"]),
            n("MatMul", [TARGET_EMBEDDING, "v"], ["t"]),
            n("Unsqueeze", [HISTORY_MASK, "axis_2"], ["m3"]),
            n("Mul", [HISTORY_EMBEDDINGS, "m3"], ["hm"]),
            n("ReduceSum", ["hm", "axis_1"], ["hs"], keepdims=0),
            n("ReduceSum", [HISTORY_MASK, "axis_1"], ["count"], keepdims=1),
            n("Add", ["count", "one"], ["count1"]),
            n("Div", ["hs", "count1"], ["hmean"]),
            n("MatMul", ["hmean", "z"], ["h"]),
            n("Add", ["a", "s1"], ["x1"]),
            n("Add", ["x1", "t"], ["x2"]),
            n("Add", ["x2", "h"], ["x3"]),
        ]
        if self.newest:
            nodes += [
                n("Gather", [HISTORY_EMBEDDINGS, "last"], ["last_vector"], axis=1),
                n("Gather", [HISTORY_MASK, "last"], ["last_mask"], axis=1),
                n("Unsqueeze", ["last_mask", "axis_1"], ["last_mask1"]),
                n("Mul", ["last_vector", "last_mask1"], ["newest_vector"]),
                n("MatMul", ["newest_vector", "y"], ["newest_term"]),
                n("Add", ["x3", "newest_term"], ["x3_newest"]),
            ]
        nodes.append(n("Add", [nodes[-1].output[0], "b"], [LOGIT if output == LOGIT else "logit_inside"]))
        if output != LOGIT:
            nodes.append(n("Sigmoid", ["logit_inside"], [output]))
        graph = helper.make_graph(
            nodes, "hand_written_ctr", inputs, [helper.make_tensor_value_info(output, f, ["n", 1])], weights
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        onnx.save(model, str(path))

    def random_tables(self, spec: ModelSpec, folder: Path, seed: int = 5) -> dict[str, dict]:
        """Random vocabulary-format tables (every other value known, row 0 the OOV row); returns them."""
        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        tables = {}
        for name in spec.table_names:
            tokens = table_tokens(spec, name)[::2]
            vectors = rng.normal(0, 0.5, (len(tokens) + 1, spec.tables[name].dim)).astype(np.float32)
            np.save(folder / f"{name}.npy", vectors)
            (folder / f"{name}.vocab.json").write_text(json.dumps({"tokens": ["<unk>", *tokens], "oov": 0}))
            tables[name] = {"rows": {str(t): i + 1 for i, t in enumerate(tokens)}, "vectors": vectors}
        return tables

    def reference(self, spec: ModelSpec, tables: dict[str, dict], rows: Rows) -> np.ndarray:
        """Probabilities of ``rows`` computed from raw values, tokens and this model's weights in numpy."""

        def vector(table: str, token: str) -> np.ndarray:
            entry = tables[table]
            return entry["vectors"][entry["rows"].get(token, 0)]

        dense = np.log1p(np.clip(np.where(rows.dense_missing, 0.0, rows.dense), 0, 1e9)).astype(np.float32)
        out = np.empty(len(rows), np.float64)
        for r in range(len(rows)):
            sparse = np.stack(
                [vector(c, rows.categorical[r, i].decode()) for i, c in enumerate(spec.categorical.columns)]
            )
            items = spec.target.table
            target = vector(items, str(int(rows.target[r])))
            history = [vector(items, str(int(i))) for i in rows.history[r, : rows.lengths[r]]]
            mean = (
                np.sum(history, axis=0) / (len(history) + 1)
                if history
                else np.zeros(spec.model.embedding_dim)
            )
            logit = dense[r] @ self.w + np.sum(sparse * self.u) + target @ self.v + mean @ self.z + self.b
            if self.newest and history:
                logit = logit + history[-1] @ self.y
            out[r] = 1.0 / (1.0 + np.exp(-logit[0]))
        return out
