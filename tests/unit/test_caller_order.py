"""The caller's-order level: a level the access layer's door answers beside the ensemble, nothing scored.

The spec's rules for it, the steps never choosing it, the answer (every row ``fallback_score``), the
model's config and adapter beside each ensemble, and the door's Lua sending a request there (the gRPC
message renamed, the HTTP path) and reporting it to the first step.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from recserve.access.front_door import FrontDoor
from recserve.access.value_door import ValueDoor
from recserve.backends.steps.caller_order import CallerOrder
from recserve.backends.steps.degrade_control import DegradeController
from recserve.build.configs import all_configs, render, write_configs
from recserve.core.names import DENSE_VERSION, PROBABILITY
from recserve.core.sections.base import SpecError
from recserve.core.sections.degrade import DEGRADE_LEVEL, LAMBDA_HEADER, ORDERED_HEADER, VALUE_HEADER
from recserve.core.spec.parse import parse_spec
from recserve.errors import InvalidInput
from tests.unit.helpers import ctr_spec_document
from tests.unit.lua_door import door_script

LEVELS = [
    {"name": "minimal", "cost": 0.5, "quality": 0.97, "max_candidates": 8, "history_length": 8},
    {"name": "order", "cost": 0.125, "quality": 0.95, "caller_order": True},
]
DEGRADE = {
    "enabled": True,
    "tiers": {"low": 0.25, "standard": 1.0},
    "levels": LEVELS,
    "fallback_score": -1.0,
    "full_value": 3.5,
    "max_lambda": 4.0,
    "capacity": 400.0,
}


def spec(**changes):
    return parse_spec({**ctr_spec_document(), "degrade": {**DEGRADE, **changes}})


def test_the_level_is_the_last_and_scores_nothing():
    served = spec()
    assert served.degrade.order_level == 2
    assert served.caller_order_models == {
        "ctr": "ctr__caller_order",
        "ctr_candidates": "ctr_candidates__caller_order",
    }
    assert spec(levels=LEVELS[:1]).caller_order_models == {}
    for levels in ([LEVELS[1], {**LEVELS[0], "cost": 0.1}], [LEVELS[0], {**LEVELS[1], "max_candidates": 4}]):
        with pytest.raises(SpecError, match="caller_order is the last level"):
            spec(levels=levels)


def test_the_steps_never_choose_it_and_the_door_does():
    section = spec().degrade
    low = [0.3, 0.3]
    assert DegradeController(section).levels(low, [4.0, 4.0]) == [3, 3]  # refused, never the order's
    door = DegradeController(section, at_steps=False)
    assert door.levels(low, [0.5, 4.0]) == [2, 3]  # the caller's order where it pays, then refused
    assert DegradeController(section).levels([1.0], [0.5]) == [1]  # past the order's: the next level


def test_every_row_is_answered_with_the_fallback_score():
    served = spec()
    lists = CallerOrder(served, lists=True).answer(
        {"history_items": (2, 16), "target_item": (2, 5, 1), "categorical__ids": (2, 5, 26)}
    )
    assert lists[PROBABILITY].shape == (10, 1) and (lists[PROBABILITY] == -1.0).all()
    assert lists[DEGRADE_LEVEL].tolist() == [[2], [2]] and lists[DENSE_VERSION].tolist() == [[0]]
    rows = CallerOrder(served, lists=False).answer({"dense": (3, 13), "target_item": (3, 1)})
    assert rows[PROBABILITY].shape == (3, 1) and rows[DEGRADE_LEVEL].shape == (3, 1)
    for shapes, named in (
        ({"target_item": (2, 5, 1), "categorical__ids": (2, 4, 26)}, "categorical__ids"),
        ({"target_item": (2, 5, 1), "history_items": (3, 16)}, "history_items"),
        ({"history_items": (2, 16)}, "history_items"),
        ({}, "inputs"),
    ):
        with pytest.raises(InvalidInput, match=named):
            CallerOrder(served, lists=True).answer(shapes)


def test_each_ensemble_gets_the_model_beside_it(tmp_path):
    served = spec()
    configs = all_configs(served)
    for ensemble, model in served.caller_order_models.items():
        order, beside = configs[model], configs[ensemble]
        assert order.backend == "python" and order.max_batch_size > 0 and order.HasField("dynamic_batching")
        assert [i.name for i in order.input] == [i.name for i in beside.input]
        assert [o.name for o in order.output] == [o.name for o in beside.output]
        cut = 0 if beside.max_batch_size else 1  # a list's users are the batch dimension here
        assert [list(i.dims) for i in order.input] == [list(i.dims)[cut:] for i in beside.input]
        assert all(i.allow_ragged_batch for i in order.input)
    write_configs(served, tmp_path)
    for model in served.caller_order_models.values():
        assert (tmp_path / model / "config.pbtxt").read_text() == render(configs[model])
        assert "TritonPythonModel" in (tmp_path / model / str(served.version) / "model.py").read_text()
    assert not set(all_configs(spec(levels=LEVELS[:1]))) & set(served.caller_order_models.values())


def infer_message(model: str) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id="r1")
    request.inputs.add(name="target_item", datatype="INT64", shape=[1, 3, 1])
    request.raw_input_contents.append(np.arange(3, dtype=np.int64).tobytes())
    message = request.SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message


def test_the_door_sends_the_lowest_values_to_the_callers_order_and_reports_them():
    luajit = pytest.importorskip("lupa.luajit21")
    served = spec()
    run = door_script(luajit, FrontDoor(value_door=ValueDoor.in_front_of(served, [object()], 1)))
    grpc = {"content-type": "application/grpc"}
    path = "/inference.GRPCInferenceService/ModelInfer"
    status, _, logged, after = run(infer_message("ctr_candidates"), path, {**grpc, VALUE_HEADER: "100"}, 0.0)
    assert status is None and logged is None and run.sent is None  # over full_value: as it came
    # a budget of 400 full lists a second, 18 a window of 50 ms: low values arriving every 0.5 ms
    # go to the caller's order (0.125 each: for them it beats the 8-candidate level at every lambda)
    sent = []
    for t in range(60):
        status, _, logged, after = run(
            infer_message("ctr_candidates"), path, {**grpc, VALUE_HEADER: "low"}, t / 2
        )
        assert status is None and logged is None  # none refused: the caller's order fits
        sent.append(run.sent)
    ordered = [body for body in sent if body is not None]
    assert sent[:17] == [None] * 17 and len(ordered) > 30 and float(after[LAMBDA_HEADER]) > 0
    run.sent = sent[-1]
    framed = bytes(run.sent if isinstance(run.sent, bytes) else run.sent.encode("latin-1"))
    assert framed[0] == 0 and struct.unpack(">I", framed[1:5])[0] == len(framed) - 5
    renamed = service_pb2.ModelInferRequest.FromString(framed[5:])
    original = service_pb2.ModelInferRequest.FromString(infer_message("ctr_candidates")[5:])
    assert renamed.model_name == "ctr_candidates__caller_order"
    renamed.model_name = original.model_name
    assert renamed == original  # nothing else changed
    assert ORDERED_HEADER not in after
    http = {VALUE_HEADER: "low"}
    body = json.dumps({"inputs": []}).encode()
    status, _, _, after = run(body, "/v2/models/ctr/versions/1/infer", http, 30.0)
    assert status is None and after[":path"] == "/v2/models/ctr__caller_order/versions/1/infer"
    status, _, _, after = run(infer_message("ctr"), path, {**grpc, VALUE_HEADER: "100"}, 30.5)
    reported = served.degrade.door_counts(after[ORDERED_HEADER], ORDERED_HEADER)
    assert status is None and reported == {"low": len(ordered) + 1}
    _, _, _, after = run(
        infer_message("ctr"), path, {**grpc, ORDERED_HEADER: "low:9", VALUE_HEADER: "100"}, 31.0
    )
    assert ORDERED_HEADER not in after  # a caller's report is removed; none is pending
