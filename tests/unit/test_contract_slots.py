"""``recserve contract --json`` names every slot of a packed input; import checks a graph against them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recserve.backends.dense.compatibility import contract_problems
from recserve.backends.steps.pipeline import InProcessPipeline
from recserve.backends.store.tiered import TieredStore
from recserve.build.importer import import_repository
from recserve.build.repository import version_dir
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.core.contract import Slot, dense_contract
from recserve.core.names import EMBEDDING_LOOKUP, PROBABILITY, SPARSE_EMBEDDINGS
from recserve.core.spec.parse import load_spec
from tests.model_exports import HandWrittenModel


def contract_json(capsys, spec: str = "tiny") -> dict:
    assert main(["--spec", spec, "contract", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_packed_input_lists_its_slots_in_order_with_feature_and_table(capsys, tiny_spec):
    contract = contract_json(capsys)
    packed = [t for t in contract["inputs"] if "slots" in t]
    assert [t["name"] for t in packed] == [SPARSE_EMBEDDINGS]
    (sparse,) = packed
    assert sparse["slots"] == [{"feature": f"C{i}", "table": f"C{i}"} for i in range(1, 5)]
    assert len(sparse["slots"]) == sparse["shape"][1]
    others = [t for t in contract["inputs"] if t["name"] != SPARSE_EMBEDDINGS]
    assert all("slots" not in t for t in others)


def test_each_width_has_its_own_packed_input_and_slots(capsys):
    contract = contract_json(capsys, "avazu")
    packed = {t["name"]: t for t in contract["inputs"] if "slots" in t}
    assert len(packed) >= 2 and len({t["shape"][2] for t in packed.values()}) == len(packed)
    slots = [s for t in packed.values() for s in t["slots"]]
    spec = load_spec("avazu")
    for tensor in packed.values():
        assert len(tensor["slots"]) == tensor["shape"][1]
        assert {spec.tables[s["table"]].dim for s in tensor["slots"]} == {tensor["shape"][2]}
    assert sorted((s["feature"], s["table"]) for s in slots) == sorted(
        zip(spec.categorical.slot_names, spec.categorical.slot_tables, strict=True)
    )


def _signature(spec, sparse_shape):
    inputs, outputs = dense_contract(spec)
    declared = {t.name: (t.dtype, [None, *t.shape[1:]]) for t in inputs}
    declared[SPARSE_EMBEDDINGS] = ("FP32", [None, *sparse_shape])
    return declared, {outputs[0].name: ("FP32", [None, 1])}


@pytest.mark.parametrize(
    "shape, named",
    [
        ((3, 8), "no place for slot 3 (feature 'C4', table 'C4')"),
        ((2, 8), "no place for slot 2 (feature 'C3', table 'C3') and the 1 after it"),
        ((6, 8), "the contract's last slot is 3 (feature 'C4', table 'C4'): slots 4..5"),
        ((4, 16), "each slot is a row of 8 floats of its table (C1, C2, C3 and 1 more)"),
    ],
)
def test_a_graph_off_the_slots_is_refused_naming_the_slot(tiny_spec, shape, named):
    problems = contract_problems(tiny_spec, *_signature(tiny_spec, shape))
    assert len(problems) == 1 and named in problems[0], problems
    assert not contract_problems(tiny_spec, *_signature(tiny_spec, (4, 8)))


def test_the_slots_say_which_row_of_which_table_fills_each_position(capsys, tiny_spec, tmp_path):
    """A model written from the JSON alone gets, at slot i, the row of slot i's table for its feature."""
    model = HandWrittenModel(tiny_spec)
    model.write(tmp_path / "hand.onnx", output=PROBABILITY)
    tables = model.random_tables(tiny_spec, tmp_path / "tables")
    folder = tmp_path / "tables"
    import_repository(tiny_spec, folder, tmp_path / "hand.onnx", tmp_path / "repo", lambda line: None)
    slots = [Slot(**s) for t in contract_json(capsys)["inputs"] for s in t.get("slots", [])]
    fed: list[dict[str, np.ndarray]] = []
    store = TieredStore.load(version_dir(tmp_path / "repo", EMBEDDING_LOOKUP, tiny_spec), tiny_spec)
    pipeline = InProcessPipeline(tiny_spec, store, lambda inputs: fed.append(dict(inputs)) or np.zeros(1))
    rows = generate(tiny_spec, 40, seed=4)
    pipeline.predict(rows.to_wire(tiny_spec))
    columns = list(tiny_spec.categorical.columns)
    for i, slot in enumerate(slots):
        entry = tables[slot.table]
        for r in range(len(rows)):
            token = rows.categorical[r, columns.index(slot.feature)].decode()
            expected = entry["vectors"][entry["rows"].get(token, 0)]
            np.testing.assert_array_equal(fed[0][SPARSE_EMBEDDINGS][r, i], expected)
