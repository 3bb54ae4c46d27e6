"""Property-based tests of the parsers of untrusted input: it parses or is refused with the module's error.

Hypothesis draws specs, update manifests and heads, stream entries, ``.npy`` headers and JSON
files, valid ones changed at one place and arbitrary ones; each parser must return a value or raise
its documented error (``SpecError``, ``UpdateRefused``, ``ArtifactError``), never another exception,
and what parses must come back the same when written and parsed again. Derandomized and few
examples per property, so the suite stays fast and the same on every run.
"""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from recserve.backends.base.bounded_files import npy_header, parse_json
from recserve.backends.store.updates.schema import (
    DELTA_FORMAT,
    UpdateRefused,
    check_table,
    parse_head,
    parse_manifest,
)
from recserve.backends.store.updates.stream import UpdateStream
from recserve.backends.store.updates.versions import UpdateLog
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import key_line, load_spec, parse_spec, spec_from_json
from recserve.errors import ArtifactError
from tests.unit.helpers import fast

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
TINY = load_spec("tiny").source


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value of a document (keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def edited_specs(draw: st.DrawFn) -> dict[str, Any]:
    """The tiny spec's document with one value replaced, one key removed or one key added."""
    doc = copy.deepcopy(TINY)
    path = draw(st.sampled_from(_paths(doc)))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(("replace", "remove", "add")))
    if action == "replace":
        parent[path[-1]] = draw(JSON)
    elif action == "remove" and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(JSON)
    return doc


@fast(25)
@given(edited_specs())
def test_an_edited_spec_parses_or_is_refused_with_a_spec_error_and_round_trips(doc):
    try:
        spec = parse_spec(doc)
    except SpecError:
        return
    again = spec_from_json(spec.to_json())
    assert again.to_json() == spec.to_json()
    assert again == spec


@fast(60)
@given(st.dictionaries(st.sampled_from([*TINY, "access", "inputs", "x"]), JSON, max_size=6))
def test_any_document_parses_or_is_refused_with_a_spec_error(doc):
    with pytest.raises(SpecError):  # no document of arbitrary values builds a whole spec
        parse_spec(doc)


@fast(60)
@given(st.text(max_size=200), st.text(max_size=20), st.text(max_size=10))
def test_key_line_never_raises(text, where, key):
    line = key_line(text, where, key)
    assert line is None or 1 <= line <= len(text.splitlines())


def manifest(version: int = 2, parent: int = 1, kind: str = "delta") -> dict[str, Any]:
    files = {
        name: {"path": f"{name}.npy", "sha256": "0" * 64, "bytes": 128, "shape": [2, 8], "dtype": dtype}
        for name, dtype in (("keys", "int64"), ("vectors", "float32"))
    }
    return {
        "format": DELTA_FORMAT,
        "table": "t0",
        "version": version,
        "parent": parent,
        "created": 1.5,
        "kind": kind,
        "files": files if kind == "delta" else {},
    }


@st.composite
def edited_manifests(draw: st.DrawFn) -> Any:
    doc = manifest(kind=draw(st.sampled_from(("delta", "revert"))))
    path = draw(st.sampled_from(_paths(doc)))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if draw(st.booleans()):
        parent[path[-1]] = draw(JSON)
    else:
        del parent[path[-1]]
    return doc


@fast(50)
@given(edited_manifests() | JSON)
@example(manifest())
@example({**manifest(), "version": 10**400})
@example({**manifest(), "created": float("nan")})
def test_a_manifest_parses_or_is_refused_and_round_trips(doc):
    try:
        checked = parse_manifest(doc, "t0", base=1)
    except UpdateRefused:
        return
    assert parse_manifest(json.loads(json.dumps(checked.as_json())), "t0", base=1) == checked


@fast(60)
@given(JSON, st.integers(min_value=0, max_value=5))
def test_a_head_parses_or_is_refused(doc, base):
    try:
        version = parse_head(doc, "t0", base)
    except UpdateRefused:
        return
    assert version >= base and parse_head({"version": version}, "t0", base) == version


@fast(60)
@given(SCALARS | st.text(alphabet="./\\abc\x00", max_size=8))
@example("../x")
@example("..")
def test_a_table_name_is_one_plain_folder_name_or_refused(table):
    try:
        name = check_table(table)
    except UpdateRefused:
        return
    assert "/" not in name and "\\" not in name and name not in (".", "..")


FIELD_VALUES = st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers(), st.none())


@fast(50)
@given(
    st.dictionaries(
        st.sampled_from(("table", "version", "manifest", "file:keys", "file:vectors", "x")),
        FIELD_VALUES | st.just(json.dumps(manifest()).encode()),
        max_size=6,
    )
)
@example({"table": b"t0", "version": b"9" * 5000, "manifest": json.dumps(manifest()).encode()})
@example({"table": b"\xff", "version": b"2", "manifest": b"[" * 100_000})
def test_a_stream_entry_is_imported_or_refused(tmp_path_factory, fields):
    log = UpdateLog(tmp_path_factory.mktemp("log"), base_version=1, tables=("t0",))
    try:
        UpdateStream(None, log)._import(fields)
    except UpdateRefused:
        pass


def npy_bytes(shape: tuple[int, ...], dtype: str) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype=dtype), allow_pickle=False)
    return buffer.getvalue()


@fast(50)
@given(
    st.lists(st.integers(min_value=0, max_value=3), max_size=3).map(tuple),
    st.sampled_from(("<f4", ">f4", "<i8", "|u1", "<f2", "|b1")),
)
def test_a_written_npy_header_reads_back(shape, dtype):
    assert npy_header(io.BytesIO(npy_bytes(shape, dtype)), "x.npy") == (shape, np.dtype(dtype))


@st.composite
def mangled_npy(draw: st.DrawFn) -> bytes:
    """A real ``.npy`` file with bytes of its header replaced, cut, or a header dict of one's own."""
    data = bytearray(npy_bytes((2, 3), "<f4"))
    roll = draw(st.integers(0, 2))
    if roll == 0:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, 127))] = draw(st.integers(0, 255))
        return bytes(data)
    if roll == 1:
        return bytes(data[: draw(st.integers(0, len(data)))])
    header = draw(
        st.sampled_from(
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 13), }",
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
                "{'descr': 'O', 'fortran_order': False, 'shape': (1,), }",
                "{'descr': [('a', '<f4')] * 3, 'fortran_order': False, 'shape': (1,), }",
                "{'descr': '<f4', 'fortran_order': False, 'shape': ((((1,),),),), }",
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)" + " " * 70000 + "}",
                "{'descr': 'xyz', 'fortran_order': 0, 'shape': 3}",
                "(" * 200 + ")" * 200,
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1e30,), }",
            )
        )
        | st.text(max_size=60)
    )
    text = header.encode("latin-1", "replace")[:65535]
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


@fast(50)
@given(mangled_npy() | st.binary(max_size=64))
def test_any_npy_header_is_read_or_refused_with_an_artifact_error(data):
    try:
        shape, dtype = npy_header(io.BytesIO(data), "x.npy")
    except ArtifactError:
        return
    assert all(isinstance(d, int) and d >= 0 for d in shape) and not dtype.hasobject


@fast(60)
@given(st.binary(max_size=80) | JSON.map(lambda v: json.dumps(v).encode()))
@example(b"[" * 100_000)
@example(b'{"a":' * 50_000)
def test_any_json_bytes_parse_or_are_refused_with_an_artifact_error(data):
    try:
        value = parse_json(data, 1 << 20, "file.json")
    except ArtifactError:
        return
    text = json.dumps(value)
    assert json.dumps(parse_json(text, 1 << 20, "file.json")) == text


@pytest.mark.parametrize("data", [b"1" * 5000, b'{"version": ' + b"9" * 5000 + b"}"])
def test_json_with_an_integer_python_cannot_convert_is_refused(data):
    with pytest.raises(ArtifactError):
        parse_json(data, 1 << 20, "manifest.json")
