"""The fuzzer's bodies and oracle: spellings keep the meaning, the oracle calls cases as Triton reads them."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recserve.build.synthetic import generate
from recserve.core.spec.parse import load_spec
from recserve.perf.lab.fuzz.bodies import ANY, HEADER_LENGTH, INVALID, VALID, Limits, Writer, classify, parse
from recserve.perf.lab.fuzz.cases import CaseMaker, request

LIMITS = Limits("m", {"dense": 32, "ids": 48}, {"dense": "FP32", "ids": "INT64"}, 70_000)
BASE = '{"id":"1","inputs":[{"name":"dense","shape":[1,4],"datatype":"FP32","data":[1.5,0.0,2.0,3.25]}]}'


def _call(body: str | bytes, headers: dict[str, str] | None = None, base: str = BASE) -> str:
    data = body.encode() if isinstance(body, str) else body
    return classify(data, headers or {}, LIMITS, (parse(base), None))


def test_the_oracle_calls_each_body_as_the_front_door_must():
    assert _call(BASE) == VALID
    assert _call(BASE.replace('"inputs"', '"in\\u0070uts"').replace("1.5", "15e-1")) == VALID
    assert _call(json.dumps(json.loads(BASE), indent=2)) == VALID
    bomb = '{"in\\u0070uts":[{"name":"dense","shape":[1099511627776,13],"datatype":"FP32","data":[0]}]}'
    assert _call(bomb) == INVALID  # the escaped bomb
    shadow = BASE.replace('"shape":[1,4]', '"sh\\u0061pe":[1099511627776,4],"shape":[1,4]')
    assert _call(shadow) == INVALID  # a key given twice once decoded
    for broken in ("01", "1.", "NaN", "-", "1e"):
        assert _call(BASE.replace("2.0", broken)) == INVALID, broken
    assert _call(BASE[:-1]) == INVALID
    assert _call(BASE.replace('"id":"1"', '"id":"1","extra":1')) == INVALID
    assert _call(BASE.replace('"data":[1.5,0.0,2.0,3.25]', '"data":' + "[" * 40 + "]" * 40)) == INVALID
    assert _call(BASE.replace("[1,4]", "[1,4.0]")) == INVALID
    assert _call(BASE.replace('"dense"', '"nope"')) == INVALID
    assert _call(BASE.replace("2.0", "1" * 5000)) == ANY  # JSON; Triton's to refuse
    assert _call(BASE.replace("[1,4]", "[-0,4]")) == ANY
    assert _call(BASE.replace('"1"', '"2"')) == ANY  # another valid request
    assert _call(BASE.replace('"FP32"', '"FP64"')) == ANY
    assert _call(BASE.encode().replace(b'"1"', b'"\xff"')) == ANY  # not UTF-8
    assert _call(BASE + " " * 70_000) == INVALID  # over the body limit


def test_the_oracle_reads_the_binary_form():
    header = (
        '{"inputs":[{"name":"dense","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]}'
    )
    raw = np.arange(4, dtype=np.float32).tobytes()
    body = header.encode() + raw
    base = (parse(header), raw)
    length = {HEADER_LENGTH: str(len(header))}
    assert classify(body, length, LIMITS, base) == VALID
    assert classify(body + b"\0", length, LIMITS, base) == INVALID  # sizes do not add up
    assert classify(body, {HEADER_LENGTH: "99999"}, LIMITS, base) == INVALID
    assert classify(body, {HEADER_LENGTH: "1e3"}, LIMITS, base) == INVALID


TREES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(width=32, allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))
    return type(a) is type(b) and a == b


@settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(TREES, st.randoms(use_true_random=False), st.floats(0, 1), st.floats(0, 1))
def test_every_spelling_of_a_tree_reads_back_as_the_tree(tree, rng, escapes, spaces):
    text = Writer(rng, escapes=escapes, spaces=spaces, shuffle=0.5).write(tree)
    assert _equal(json.loads(text), tree), text


def test_the_case_maker_is_seeded_and_its_mutations_mean_what_they_say():
    spec = load_spec("tiny")
    pool = [generate(spec, rows, seed=rows).to_wire(spec) for rows in (1, 3)]
    pool.append(generate(spec, 16, seed=0).to_wire(spec))
    limits = Limits(
        spec.name,
        {t.name: 256 * 128 for t in spec.wire_inputs()},
        {"dense": "FP32", "dense__missing": "BOOL", "categorical": "BYTES", "target_item": "INT64",
         "history_items": "INT64", "history_items__length": "INT32"},
        1 << 20,
    )  # fmt: skip
    first, again = CaseMaker(pool, limits, seed=3), CaseMaker(pool, limits, seed=3)
    cases = [first.next() for _ in range(250)]
    assert [c.body for c in cases] == [again.next().body for _ in range(250)]
    other = CaseMaker(pool, limits, seed=4)
    assert [c.body for c in cases[:20]] != [other.next().body for _ in range(20)]
    kinds = Counter(c.mutation for c in cases)
    assert len(kinds) >= 13, kinds
    by_kind: dict[str, set[str]] = {}
    for case in cases:
        by_kind.setdefault(case.mutation, set()).add(case.expect)
    assert by_kind["valid"] == {VALID}  # another spelling never changes the meaning
    for kind in ("escaped_bomb", "duplicate_key", "unknown_key", "truncate", "over_limit"):
        assert by_kind[kind] == {INVALID}, kind
    assert VALID in by_kind["binary"] and INVALID in by_kind["binary"]


def test_a_request_tree_holds_every_input_with_its_shape():
    spec = load_spec("tiny")
    inputs = generate(spec, 2, seed=1).to_wire(spec)
    tree = request(inputs, random.Random(0), nested=True, binary=False)
    items = {item.get("name"): item for item in tree.get("inputs")}
    assert set(items) == set(inputs)
    for name, array in inputs.items():
        assert items[name].get("shape") == list(array.shape)
        assert np.asarray(items[name].get("data")).shape == array.shape
