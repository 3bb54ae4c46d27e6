"""``[model] lookups = "in_model"``: the in-model contract, and a network with its own tables imported.

The served side (the DIN of tests/integration/test_import_din.py exported as written) is in
tests/integration/test_import_in_model.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tomllib
from onnx import TensorProto, helper, numpy_helper

from recserve.build.importer import TableImportError, import_repository
from recserve.build.in_model_split import SplitError, split_at_lookups
from recserve.build.repository import reference_pipeline, version_dir
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.core.contract import dense_contract
from recserve.core.in_model import in_model_contract, in_model_problems
from recserve.core.names import (
    DENSE,
    DENSE_NORMALIZED,
    HISTORY_MASK,
    LOGIT,
    SPARSE_EMBEDDINGS,
    TARGET_EMBEDDING,
)
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import load_spec, parse_spec, spec_path

ROWS = 64
#: The tiny spec's features as the network takes them: the categorical ones, the target, the history.
FEATURES = ["C1", "C2", "C3", "C4", "target_item", "history_items"]


def quiet(message: str) -> None:
    """Progress lines are not asserted on."""


@pytest.fixture(scope="module")
def spec():
    """The tiny spec, its network looking up its own tables and returning a logit."""
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"] |= {"output": "logit", "lookups": "in_model"}
    return parse_spec(doc)


def test_the_in_model_contract_takes_each_features_rows_and_keeps_the_other_inputs(spec):
    inputs, outputs = in_model_contract(spec)
    assert [(t.name, t.dtype, t.shape) for t in inputs] == [
        (DENSE_NORMALIZED, "FP32", (-1, 4)),
        *((f"C{i}", "INT64", (-1,)) for i in range(1, 5)),
        ("target_item", "INT64", (-1,)),
        ("history_items", "INT64", (-1, -1)),
        (HISTORY_MASK, "FP32", (-1, -1)),
    ]
    assert "row in table 'C3'" in inputs[3].holds and outputs == dense_contract(spec)[1]


def test_contract_prints_the_in_model_contract_and_the_served_one_on_request(spec, tmp_path, capsys):
    path = tmp_path / "in_model.toml"
    path.write_text(
        spec_path("tiny").read_text().replace('name = "tiny"', 'name = "tiny"\nlookups = "in_model"')
    )
    assert main(["--spec", str(path), "contract", "--json"]) == 0
    contract = json.loads(capsys.readouterr().out)
    assert contract["lookups"] == "in_model"
    assert {t["name"]: t["dtype"] for t in contract["inputs"]}["history_items"] == "INT64"
    assert main(["--spec", str(path), "contract"]) == 0
    assert re.search(r"input  history_items +INT64 \[-1, -1\]", capsys.readouterr().out)
    assert main(["--spec", str(path), "contract", "--served", "--json"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert "lookups" not in served and [t["name"] for t in served["inputs"]][1] == "sparse_embeddings"


def test_what_an_in_model_network_cannot_take_is_named():
    taobao = in_model_problems(load_spec("taobao"))
    assert any("multi-hot feature 'tags'" in p for p in taobao)
    assert any("hist_item_ids + hist_cate_ids summed" in p for p in taobao)
    with pytest.raises(SpecError, match='lookups = "in_model" cannot take: multi-hot feature'):
        in_model_contract(load_spec("taobao"))
    avazu = load_spec("avazu")  # an embedding and a first-order weight per feature: one row input each
    assert in_model_problems(avazu) == []
    site = next(t for t in in_model_contract(avazu)[0] if t.name == "site_id")
    assert "tables 'site_id' and 'site_id_linear', the same in each" in site.holds
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["lookups"] = "inside"
    with pytest.raises(SpecError, match="model.lookups must be one of store, in_model"):
        parse_spec(doc)


def _graph(spec, tables: dict[str, np.ndarray], misuse: str = "") -> onnx.ModelProto:
    """A small network over its own tables: the stacked profile, the target and the masked history sum.

    ``misuse``: ``"add"`` also adds a row input to a number; ``"copy"`` reads the target from a copy
    of the item table.
    """
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rows, f"{name}.weight") for name, rows in tables.items()]
    weights += [
        numpy_helper.from_array(rng.normal(0, 0.5, (8 * 6, 1)).astype(np.float32), "out"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([1], np.int64), "positions"),
    ]
    item = "item.copy" if misuse == "copy" else "item.weight"
    if misuse == "copy":
        weights.append(numpy_helper.from_array(tables["item"], item))
    nodes = [helper.make_node("Gather", [f"C{i}.weight", f"C{i}"], [f"e{i}"]) for i in range(1, 5)]
    nodes += [helper.make_node("Unsqueeze", [f"e{i}", "positions"], [f"s{i}"]) for i in range(1, 5)]
    nodes += [  # the profile stacked and flattened to the batch (measured on a row input), as exporters do
        helper.make_node("Concat", ["s1", "s2", "s3", "s4"], ["profile"], axis=1),
        helper.make_node("Shape", ["target_item"], ["batch"]),
        helper.make_node("Concat", ["batch", "last"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["profile", "flat_shape"], ["flat"]),
        helper.make_node("Gather", [item, "target_item"], ["target"]),
        helper.make_node("Identity", ["item.weight"], ["items"]),  # exporters alias shared weights so
        helper.make_node("Gather", ["items", "history_items"], ["history"]),
        helper.make_node("Unsqueeze", [HISTORY_MASK, "last"], ["mask3"]),
        helper.make_node("Mul", ["history", "mask3"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "positions"], ["pooled"], keepdims=0),
        helper.make_node("Concat", ["flat", "target", "pooled"], ["x"], axis=1),
        helper.make_node("MatMul", ["x", "out"], [LOGIT]),
    ]
    if misuse == "add":
        nodes.append(helper.make_node("Add", ["C1", "C2"], ["sum"]))
    rows = [helper.make_tensor_value_info(f, TensorProto.INT64, ["batch"]) for f in FEATURES[:5]]
    inputs = [
        helper.make_tensor_value_info(DENSE_NORMALIZED, TensorProto.FLOAT, ["batch", 4]),
        *rows,
        helper.make_tensor_value_info("history_items", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info(HISTORY_MASK, TensorProto.FLOAT, ["batch", "sequence"]),
    ]
    output = helper.make_tensor_value_info(LOGIT, TensorProto.FLOAT, ["batch", 1])
    graph = helper.make_graph(nodes, "in_model", inputs, [output], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _vocabularies(spec, rows, folder) -> dict[str, dict[str, int]]:
    """Per table, the rows' values but every fifth as ``<table>.vocab.json`` (row 0: oov); value -> row."""
    folder.mkdir()
    values = {f"C{i}": [v.decode() for v in rows.categorical[:, i - 1]] for i in range(1, 5)}
    values["item"] = [str(v) for v in (*rows.target, *rows.history.reshape(-1))]
    index = {}
    for table, seen in values.items():
        tokens = [t for k, t in enumerate(sorted(set(seen))) if k % 5]
        (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))
        index[table] = {t: r + 1 for r, t in enumerate(tokens)}
    return index


def test_a_network_with_its_own_tables_imports_and_serves_its_own_scores(spec, tmp_path):
    rows = generate(spec, ROWS, seed=4)
    index = _vocabularies(spec, rows, tmp_path / "tables")
    rng = np.random.default_rng(5)
    tables = {t: rng.normal(0, 0.5, (len(index[t]) + 1, 8)).astype(np.float32) for t in index}
    onnx.save(_graph(spec, tables), tmp_path / "model.onnx")
    import_repository(spec, tmp_path / "tables", tmp_path / "model.onnx", tmp_path / "repo", quiet)

    served = reference_pipeline(spec, tmp_path / "repo", "onnx").predict(rows.to_wire(spec))
    feeds = {
        f"C{i}": [index[f"C{i}"].get(v.decode(), 0) for v in rows.categorical[:, i - 1]] for i in range(1, 5)
    }
    feeds["target_item"] = [index["item"].get(str(v), 0) for v in rows.target]
    feeds["history_items"] = [[index["item"].get(str(v), 0) for v in row] for row in rows.history]
    width = rows.history.shape[1]
    mask = (np.arange(width)[None, :] < rows.lengths[:, None]).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(
        None,
        {
            **{name: np.array(ids, np.int64) for name, ids in feeds.items()},
            DENSE_NORMALIZED: np.zeros((ROWS, 4), np.float32),
            HISTORY_MASK: mask,
        },
    )[0]
    np.testing.assert_allclose(served, 1 / (1 + np.exp(-logits[:, 0])), atol=1e-6)
    assert (
        0 < np.mean(np.array(feeds["C3"]) == 0) < 0.5
    )  # unknown values reach the oov row, known ones theirs

    graph = onnx.load(str(version_dir(tmp_path / "repo", DENSE, spec) / "model.onnx")).graph
    assert not {w.name for w in graph.initializer} & {f"{t}.weight" for t in tables}  # the tables left
    read = {node.output[0]: (node.op_type, list(node.input)) for node in graph.node}
    assert read["profile"] == ("Identity", [SPARSE_EMBEDDINGS])  # the stack is the packed input itself
    assert read["batch"] == ("Shape", [TARGET_EMBEDDING])
    assert {i.name for i in graph.input} == {t.name for t in dense_contract(spec)[0]}


def test_a_row_input_used_other_than_by_a_lookup_or_a_table_read_twice_is_refused(spec, tmp_path):
    tables = {t: np.zeros((3, 8), np.float32) for t in ("C1", "C2", "C3", "C4", "item")}
    onnx.save(_graph(spec, tables, misuse="add"), tmp_path / "add.onnx")
    with pytest.raises(
        SplitError, match="input 'C1' feeds node .* \\(Add\\); a row input may only be looked up"
    ):
        split_at_lookups(spec, tmp_path / "add.onnx")
    onnx.save(_graph(spec, tables, misuse="copy"), tmp_path / "copy.onnx")
    with pytest.raises(SplitError, match="table 'item' is read from two weights"):
        split_at_lookups(spec, tmp_path / "copy.onnx")


def test_an_in_model_import_takes_vocabularies_only(spec, tmp_path):
    tables = {t: np.zeros((3, 8), np.float32) for t in ("C1", "C2", "C3", "C4", "item")}
    onnx.save(_graph(spec, tables), tmp_path / "model.onnx")
    folder = tmp_path / "tables"
    folder.mkdir()
    for table in tables:
        (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, "1", "2"], "oov": 0}))
    np.save(folder / "item.npy", tables["item"])
    with pytest.raises(TableImportError, match="the tables are the model's own weights"):
        import_repository(spec, folder, tmp_path / "model.onnx", tmp_path / "repo", quiet)
    assert not (tmp_path / "repo").exists()


FM_SPEC = """
[model]
name = "fm"
output = "logit"
lookups = "in_model"

[[features]]
name = "site"
kind = "categorical"
value_type = "string"
tables = ["site", "site_linear"]

[[features]]
name = "app"
kind = "categorical"
value_type = "string"

[tables]
site = { dim = 8 }
site_linear = { dim = 1 }
app = { dim = 8 }
"""


def _fm_graph(tables: dict[str, np.ndarray]) -> onnx.ModelProto:
    """An FM of two fields, the site with its first-order weight: both read at the site's one row input."""
    weights = [numpy_helper.from_array(rows, f"{name}.weight") for name, rows in tables.items()]
    weights.append(numpy_helper.from_array(np.array([1], np.int64), "features"))
    nodes = [
        helper.make_node("Gather", ["site.weight", "site"], ["site_vector"]),
        helper.make_node("Gather", ["site_linear.weight", "site"], ["site_weight"]),
        helper.make_node("Gather", ["app.weight", "app"], ["app_vector"]),
        helper.make_node("Mul", ["site_vector", "app_vector"], ["product"]),
        helper.make_node("ReduceSum", ["product", "features"], ["interaction"], keepdims=1),
        helper.make_node("Add", ["interaction", "site_weight"], [LOGIT]),
    ]
    inputs = [helper.make_tensor_value_info(f, TensorProto.INT64, ["batch"]) for f in ("site", "app")]
    output = helper.make_tensor_value_info(LOGIT, TensorProto.FLOAT, ["batch", 1])
    graph = helper.make_graph(nodes, "fm", inputs, [output], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_feature_with_an_embedding_and_a_first_order_weight_is_one_row_input_read_twice(tmp_path):
    spec = parse_spec(tomllib.loads(FM_SPEC))
    assert [t.name for t in in_model_contract(spec)[0]] == ["site", "app"]
    rows = generate(spec, ROWS, seed=6)
    folder = tmp_path / "tables"
    folder.mkdir()
    index = {}
    for column, field in enumerate(("site", "app")):
        tokens = [t for k, t in enumerate(sorted({v.decode() for v in rows.categorical[:, column]})) if k % 4]
        index[field] = {t: r + 1 for r, t in enumerate(tokens)}
        for table in (field, f"{field}_linear") if field == "site" else (field,):
            (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))
    rng = np.random.default_rng(7)
    widths = {"site": 8, "site_linear": 1, "app": 8}
    tables = {
        t: rng.normal(0, 0.5, (len(index[t.split("_")[0]]) + 1, w)).astype(np.float32)
        for t, w in widths.items()
    }
    onnx.save(_fm_graph(tables), tmp_path / "fm.onnx")
    import_repository(spec, folder, tmp_path / "fm.onnx", tmp_path / "repo", quiet)

    served = reference_pipeline(spec, tmp_path / "repo", "onnx").predict(rows.to_wire(spec))
    feeds = {
        field: np.array([index[field].get(v.decode(), 0) for v in rows.categorical[:, column]], np.int64)
        for column, field in enumerate(("site", "app"))
    }
    session = ort.InferenceSession(str(tmp_path / "fm.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, feeds)[0]
    np.testing.assert_allclose(served, 1 / (1 + np.exp(-logits[:, 0])), atol=1e-6)

    (folder / "site_linear.vocab.json").write_text(
        json.dumps({"tokens": [None, *reversed(index["site"])], "oov": 0})
    )
    with pytest.raises(
        TableImportError, match="feature 'site' feeds tables .* their vocabularies must be the same"
    ):
        import_repository(spec, folder, tmp_path / "fm.onnx", tmp_path / "again", quiet)
