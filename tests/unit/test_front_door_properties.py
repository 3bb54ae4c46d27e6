"""Property-based tests of the front door's Lua, run in LuaJIT (the Lua of Envoy's filter) in process.

The script Envoy runs (:func:`recserve.access.front_door.lua_source`) is loaded into LuaJIT 2.1
through ``lupa`` and its ``envoy_on_request`` is called with a handle offering the calls the
script makes (``headers():get``, ``body():length/getBytes``, ``respond``, ``logErr``), so
thousands of bodies are checked in a second. Hypothesis draws bodies; the properties:

* any body is passed or refused with a JSON ``{"error": ...}``; the script itself never fails
  (a Lua error would be logged and refused as "could not be checked");
* what passes is safe for Triton as Python's standard JSON parser reads it (escapes decoded, the
  first of duplicate keys as RapidJSON takes it): standard JSON, no duplicate or unknown key, every
  shape of known inputs bounded and matching its ``data``;
* a valid request passes in any spelling (escapes, white space, key order, number forms), and what
  passes passes again once written by Python's ``json``.

The same script behind a real Envoy: ``tests/integration/test_front_door.py`` and the fuzzer
(``tests/integration/test_fuzz.py``).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc

from recserve.access.front_door import MAX_DEPTH, MAX_DIMS, FrontDoor
from recserve.perf.lab.fuzz.bodies import HEADER_LENGTH, Limits, Members, Raw, Writer, depth, parse, problem
from tests.unit.helpers import fast
from tests.unit.lua_door import door_script

luajit = pytest.importorskip("lupa.luajit21")


INPUTS = {
    "dense": ("FP32", mc.TYPE_FP32, [4]),
    "ids": ("INT64", mc.TYPE_INT64, [-1]),
    "cat": ("BYTES", mc.TYPE_STRING, [2]),
}
LONGEST = 6


def _door() -> FrontDoor:
    ensemble = mc.ModelConfig(name="m", platform="ensemble", max_batch_size=8)
    for name, (_, kind, dims) in INPUTS.items():
        ensemble.input.add(name=name, data_type=kind, dims=dims)
    ensemble.output.add(name="probability", data_type=mc.TYPE_FP32, dims=[1])
    step = mc.ModelConfig(name="step", backend="python", max_batch_size=8)
    step.input.add(name="dense", data_type=mc.TYPE_FP32, dims=[4])
    return FrontDoor.from_configs([ensemble, step], LONGEST)


DOOR = _door()
LIMITS = Limits(
    "m", DOOR.inputs["m"], {n: t for n, (t, _, _) in INPUTS.items()}, DOOR.max_body_bytes, MAX_DEPTH, MAX_DIMS
)


@pytest.fixture(scope="module")
def front_door():
    run = door_script(luajit, DOOR)

    def check(body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str] | None:
        """None when the body passes; else the status and the error message."""
        status, answer, logged, _ = run(body, "/v2/models/m/infer", headers)
        assert logged is None, f"the script failed: {logged}"
        if status is None:
            return None
        error = json.loads(answer)["error"]
        assert isinstance(error, str) and error
        return int(status), error

    return check


def _values(datatype: str, count: int, draw: st.DrawFn) -> list[Any]:
    if datatype == "FP32":
        return draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=count, max_size=count))
    if datatype == "INT64":
        return draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=count, max_size=count))
    return draw(st.lists(st.text(max_size=6), min_size=count, max_size=count))


@st.composite
def valid_requests(draw: st.DrawFn) -> Members:
    """A valid request of model ``m``: some inputs, 0 to 4 rows, ``data`` flat or nested."""
    rows = draw(st.integers(0, 4))
    items = []
    for name in draw(st.lists(st.sampled_from(sorted(INPUTS)), min_size=1, max_size=3, unique=True)):
        datatype, _, dims = INPUTS[name]
        width = dims[0] if dims[0] > 0 else draw(st.integers(1, LONGEST))
        data = _values(datatype, rows * width, draw)
        if rows and draw(st.booleans()):
            data = [data[r * width : (r + 1) * width] for r in range(rows)]
        items.append(
            Members([("name", name), ("shape", [rows, width]), ("datatype", datatype), ("data", data)])
        )
    doc = Members([("inputs", items)])
    if draw(st.booleans()):
        doc.append(("id", draw(st.text(max_size=8))))
    if draw(st.booleans()):
        doc.append(("outputs", [Members([("name", "probability")])]))
    return doc


def spelt(doc: Members, rng: random.Random) -> bytes:
    r = rng.random
    writer = Writer(rng, escapes=r() * 0.5, spaces=r() * 0.3, shuffle=r(), floats=r() < 0.8)
    return writer.write(doc).encode("utf-8", "surrogatepass")


@fast(30)
@given(valid_requests(), st.randoms(use_true_random=False))
def test_a_valid_request_passes_in_any_spelling(front_door, doc, rng):
    body = spelt(doc, rng)
    assert front_door(body) is None, body[:300]
    assert front_door(json.dumps(json.loads(body)).encode()) is None


KEYS = st.sampled_from(["inputs", "name", "shape", "data", "datatype", "id", "outputs", "parameters", "x"])
DIMS = st.sampled_from(
    ["1", "0", "8", "48", "49", "1099511627776", "-1", "1.0", "1e3", "01", "-0", '"2"', "null"]
)
NUMBERS = st.sampled_from(["0", "1.5", "-0", "1e3", "01", "1.", ".5", "NaN", "-", "1e400", "true", '"a"'])


@st.composite
def hostile_requests(draw: st.DrawFn) -> Members:
    """Request-like trees with keys that may repeat or be unknown, odd dimensions and numbers."""
    items = []
    for _ in range(draw(st.integers(0, 3))):
        members = Members()
        for _ in range(draw(st.integers(0, 5))):
            key = draw(KEYS)
            if key == "shape":
                value: Any = [Raw(d) for d in draw(st.lists(DIMS, max_size=3))]
            elif key == "data":
                value = [Raw(n) for n in draw(st.lists(NUMBERS, max_size=4))]
                value = draw(st.sampled_from([value, [value], [value, value]]))
            elif key in ("name", "datatype"):
                value = draw(st.sampled_from([*INPUTS, "FP32", "step", "x" * 300, 1]))
            else:
                value = draw(st.sampled_from([Members(), [], "x", 1]))
            members.append((key, value))
        items.append(members)
    doc = Members([("inputs", items)])
    for _ in range(draw(st.integers(0, 2))):
        doc.insert(
            draw(st.integers(0, len(doc))), (draw(KEYS), draw(st.sampled_from([items, "1", Members()])))
        )
    return doc


def _is_safe(body: bytes) -> str | None:
    """Why Triton could be hurt by a body that passed (None: it cannot)."""
    try:
        doc = parse(body.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError) as exc:
        return f"not standard JSON ({exc})"
    if depth(doc) > MAX_DEPTH + 1:
        return "nested too deeply"
    reason = problem(doc, LIMITS)
    return None if reason in (None, "?") else reason


ISSUE_BOMB = b'{"in\\u0070uts":[{"name":"dense","shape":[1099511627776,13],"datatype":"FP32","data":[0]}]}'
SHADOW = (
    b'{"inputs":[{"name":"dense","sh\\u0061pe":[1099511627776,4],'
    b'"shape":[1,4],"datatype":"FP32","data":[0]}]}'
)


@fast(80)
@given(hostile_requests(), st.randoms(use_true_random=False))
@example(Raw(ISSUE_BOMB.decode()), random.Random(0))
@example(Raw(SHADOW.decode()), random.Random(0))
def test_what_passes_is_safe_for_triton(front_door, doc, rng):
    body = doc.text.encode() if isinstance(doc, Raw) else spelt(doc, rng)
    if front_door(body) is None:
        assert _is_safe(body) is None, (_is_safe(body), body[:300])
        assert front_door(json.dumps(json.loads(body)).encode()) is None  # the plain spelling passes too


@fast(60)
@given(
    st.binary(max_size=200)
    | valid_requests()
    .map(lambda d: spelt(d, random.Random(1)))
    .flatmap(
        lambda b: st.integers(0, len(b)).map(lambda n: b[:n])  # cut anywhere
    )
)
@example(b"[" * 100_000)
@example(b'{"inputs":' + b"[" * 100_000)
@example(b'{"inputs":[{"name":"' + b"\\u" * 20_000)
def test_any_body_passes_or_is_refused_with_an_error(front_door, body):
    answer = front_door(body)
    if answer is None:
        assert _is_safe(body) is None
    else:
        assert answer[0] in (400, 413, 415) and len(answer[1]) < 600


@fast(15)
@given(valid_requests(), st.randoms(use_true_random=False))
def test_the_binary_form_has_its_json_header_checked(front_door, doc, rng):
    for item in doc.get("inputs"):
        data = item.get("data")
        del item[[k for k, _ in item].index("data")]
        item.append(("parameters", Members([("binary_data_size", 4 * len(json.dumps(data)))])))
    header = spelt(doc, rng)
    assert front_door(header + b"\0" * 64, {HEADER_LENGTH.lower(): str(len(header))}) is None
    first = doc.get("inputs")[0]
    first[[k for k, _ in first].index("shape")] = ("shape", [1 << 40, 4])
    lie = spelt(doc, rng)
    assert front_door(lie + b"\0" * 64, {HEADER_LENGTH.lower(): str(len(lie))})[0] == 400
