"""The fuzzer's cases: valid inference requests of the served spec, and mutations of them, from one seed.

:class:`CaseMaker` holds a pool of valid requests (the spec's synthetic rows, as
:func:`recserve.build.synthetic.generate` makes them; one at the largest batch) and draws each case
from a seeded :class:`random.Random`: a valid request written in another spelling
(:class:`~recserve.perf.lab.fuzz.bodies.Writer`), or one mutation of it (escaped keys over a shape
bomb, duplicate and unknown keys, number forms, nesting, truncation, stray bytes, unicode, shapes
and bodies near and over each limit, the binary form with ``Inference-Header-Content-Length``).
Each case carries what :func:`~recserve.perf.lab.fuzz.bodies.classify` expects of it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from recserve.perf.lab.fuzz.bodies import HEADER_LENGTH, Limits, Members, Raw, Writer, classify, parse

#: Ids of valid requests (echoed back by Triton): plain, escaped, quoted, beyond ASCII and the BMP.
IDS = ("1", "fuzz", "", 'a "quoted" \\ id', "ünïcødé ☃", "😀 emoji", "/v2/models", "\t")
#: A dimension that makes tritonserver 2.51 allocate far more than it has.
BOMB = 1 << 40
#: Spellings of a shape's dimension that are not a plain non-negative integer (or are too large).
DIM_FORMS = (
    "1e3", "1.0", "-1", "01", "+1", "-0", "1E0", "0x10", "99999999999999999999", "1099511627776",
    "null", '"2"', "true", "[]", "{}", "9223372036854775807", "1" * 400,
)  # fmt: skip
#: Spellings of a number in ``data``: not JSON, then JSON but odd.
NUMBER_FORMS = (
    "01", "NaN", "Infinity", "-Infinity", "1.", "-.5", ".5", "1e", "1e+", "--1", "+1", "0x1F", "1_0",
    "\u0661", "1e3", "-0", "-0.0", "1E-7", "1e400", "-1e400", "123456789012345678901234567890", "1" * 5000,
)  # fmt: skip
#: Bytes dropped into a body at random.
STRAY = (b"\x00", b"\xff", b"\\", b'"', b",", b"}", b"]", b"[", b"{", b"\xc3\x28", b"\xed\xa0\x80", b":")
#: Unicode put where a name or an id goes.
UNICODE = ("d\u0065nse", "dense\u0000", "dénse", "\ud800", "\udfff\ud800", "\U0001f600" * 50, "x" * 70000)


@dataclass(frozen=True)
class Case:
    """One request body to send, and what the oracle expects of it (``valid``, ``invalid``, ``any``)."""

    mutation: str
    body: bytes
    expect: str
    headers: Mapping[str, str] = field(default_factory=dict)


def json_value(array: np.ndarray, nested: bool) -> list[Any]:
    """``data`` of a request for ``array``: flat or nested as its shape, bytes as text."""
    values = array if nested else array.reshape(-1)
    if array.dtype == object:
        values = np.vectorize(lambda b: b.decode(), otypes=[object])(values)
    result: list[Any] = values.tolist()
    return result


def request(inputs: Mapping[str, np.ndarray], rng: random.Random, nested: bool, binary: bool) -> Members:
    """A valid request tree for ``inputs`` (JSON ``data``, or the binary form's header)."""
    items = []
    for name, array in inputs.items():
        item = Members([("name", name), ("shape", list(array.shape)), ("datatype", _datatype(array))])
        if binary:
            item.append(("parameters", Members([("binary_data_size", len(_tensor_bytes(array)))])))
        else:
            item.append(("data", json_value(array, nested)))
            if rng.random() < 0.1:
                item.append(("parameters", Members()))
        items.append(item)
    doc = Members([("id", rng.choice(IDS)), ("inputs", items)])
    if rng.random() < 0.3:
        doc.append(("outputs", [Members([("name", "probability")])]))
    if rng.random() < 0.1:
        doc.append(("parameters", Members()))
    return doc


def _datatype(array: np.ndarray) -> str:
    return str(np_to_triton_dtype(array.dtype))


def _tensor_bytes(array: np.ndarray) -> bytes:
    if array.dtype == object:
        return bytes(serialize_byte_tensor(array).item())  # a 0-d array holding the bytes
    return np.ascontiguousarray(array).tobytes()


def _objects(tree: Any) -> list[Members]:
    """Every object of a tree, the top first."""
    found, stack = [], [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, Members):
            found.append(item)
            stack.extend(v for _, v in item)
        elif isinstance(item, list):
            stack.extend(item)
    return found


class CaseMaker:
    """Draws cases from a seed: the same seed, pool and limits give the same cases.

    Args:
        pool: valid requests' inputs (name -> array, as the spec's wire form); one at the largest
            batch makes the near-limit cases.
        limits: what the served model takes.
        seed: the seed of every choice.
    """

    def __init__(self, pool: Sequence[Mapping[str, np.ndarray]], limits: Limits, seed: int) -> None:
        self.pool = pool
        self.limits = limits
        self.rng = random.Random(seed)
        self.mutations: dict[str, tuple[float, Callable[[Members], tuple[Any, dict[str, str]]]]] = {
            "valid": (30, self._valid),
            "binary": (6, self._binary),
            "escaped_bomb": (5, self._escaped_bomb),
            "duplicate_key": (6, self._duplicate_key),
            "unknown_key": (4, self._unknown_key),
            "dim_form": (6, self._dim_form),
            "number_form": (6, self._number_form),
            "nesting": (4, self._nesting),
            "truncate": (6, self._truncate),
            "stray_bytes": (6, self._stray_bytes),
            "unicode": (5, self._unicode),
            "datatype": (3, self._datatype),
            "over_limit": (4, self._over_limit),
            "largest_batch": (1, self._largest_batch),
            "body_size": (0.5, self._body_size),
        }

    def next(self) -> Case:
        """The next case."""
        names = list(self.mutations)
        name = self.rng.choices(names, weights=[self.mutations[n][0] for n in names])[0]
        inputs = self.rng.choice(self.pool[:-1] or self.pool)
        binary = name == "binary"
        tree = request(inputs, self.rng, nested=self.rng.random() < 0.3, binary=binary)
        raw = b"".join(_tensor_bytes(a) for a in inputs.values()) if binary else None
        base = (parse(Writer(self.rng).write(tree)), raw)
        if name == "largest_batch":
            inputs = self.pool[-1]
            tree = request(inputs, self.rng, nested=False, binary=False)
            base = (parse(Writer(self.rng).write(tree)), None)
        made, headers = self.mutations[name][1](tree)
        if isinstance(made, Raw):
            body = made.text.encode("utf-8", "surrogateescape")
        elif isinstance(made, bytes):
            body = made
        else:
            body = self._spelling().write(made).encode("utf-8", "surrogatepass")
        if binary and raw is not None and HEADER_LENGTH not in headers:
            headers = {HEADER_LENGTH: str(len(body)), **headers}
            body += raw
        return Case(name, body, classify(body, headers, self.limits, base), headers)

    def _spelling(self) -> Writer:
        r = self.rng.random
        return Writer(self.rng, escapes=r() * r() * 0.5, spaces=r() * 0.3, shuffle=r(), floats=r() < 0.8)

    def _valid(self, tree: Members) -> tuple[Any, dict[str, str]]:
        return tree, {}

    def _binary(self, tree: Members) -> tuple[Any, dict[str, str]]:
        roll = self.rng.random()
        if roll < 0.6:
            return tree, {}
        if roll < 0.75:
            self._input(tree)[1]["shape"] = [BOMB, 13]
            return tree, {}
        if roll < 0.9:
            return tree, {HEADER_LENGTH: self.rng.choice(("abc", "-1", "1e3", "99999999", "", "0x10"))}
        parameters = self._input(tree)[1]["parameters"]
        parameters[0] = ("binary_data_size", parameters.get("binary_data_size") + self.rng.choice((-1, 1)))
        return tree, {}

    def _input(self, tree: Members) -> tuple[int, _View]:
        """A random input of ``tree`` and a dict view that writes through to its members."""
        items = tree.get("inputs")
        index = self.rng.randrange(len(items))
        return index, _View(items[index])

    def _escaped_bomb(self, tree: Members) -> tuple[Any, dict[str, str]]:
        _, item = self._input(tree)
        shape = item["shape"]
        bomb = [BOMB, *shape[1:]] if self.rng.random() < 0.5 else [BOMB * 4096, 13]
        key = Raw('"sh\\u0061pe"')
        if self.rng.random() < 0.5:  # the escaped key shadows a literal one (Triton reads the first)
            members = item.members
            members.insert(members.keys().index("shape"), (key, bomb))
        else:
            item["shape"] = bomb
            tree[tree.keys().index("inputs")] = (Raw('"in\\u0070uts"'), tree.get("inputs"))
        return tree, {}

    def _duplicate_key(self, tree: Members) -> tuple[Any, dict[str, str]]:
        target = self.rng.choice(_objects(tree) or [tree])
        if not target:
            target = tree
        key, value = self.rng.choice(list(target))
        other = self.rng.choice((value, [BOMB, 13], "other", 0, Members()))
        target.insert(self.rng.randrange(len(target) + 1), (key, other))
        return tree, {}

    def _unknown_key(self, tree: Members) -> tuple[Any, dict[str, str]]:
        target = self.rng.choice([tree, *tree.get("inputs"), *tree.get("outputs", [])])
        key = self.rng.choice(("extra", "Inputs", "input", "shapes", "Name", "data ", "\u0000", "x" * 9000))
        target.insert(self.rng.randrange(len(target) + 1), (key, self.rng.choice((1, "x", [BOMB, 13]))))
        return tree, {}

    def _dim_form(self, tree: Members) -> tuple[Any, dict[str, str]]:
        _, item = self._input(tree)
        shape = list(item["shape"])
        shape[self.rng.randrange(len(shape))] = Raw(self.rng.choice(DIM_FORMS))
        item["shape"] = shape
        return tree, {}

    def _number_form(self, tree: Members) -> tuple[Any, dict[str, str]]:
        _, item = self._input(tree)
        data = item.get("data")
        while isinstance(data, list) and data and isinstance(data[0], list):
            data = self.rng.choice(data)
        if isinstance(data, list) and data:
            data[self.rng.randrange(len(data))] = Raw(self.rng.choice(NUMBER_FORMS))
        return tree, {}

    def _nesting(self, tree: Members) -> tuple[Any, dict[str, str]]:
        levels = self.rng.choice((14, 15, 16, 17, 18, 64, 1000, 100_000))
        where = self.rng.randrange(3)
        if where == 0:
            _, item = self._input(tree)
            item["data"] = Raw("[" * levels + "0" + "]" * levels)
        elif where == 1:
            tree.append(("parameters", Raw('{"a":' * levels + "1" + "}" * levels)))
        else:
            return Raw("[" * levels + "]" * levels), {}
        return tree, {}

    def _truncate(self, tree: Members) -> tuple[Any, dict[str, str]]:
        text = self._spelling().write(tree).encode()
        return Raw(text[: self.rng.randrange(len(text))].decode("utf-8", "surrogateescape")), {}

    def _stray_bytes(self, tree: Members) -> tuple[Any, dict[str, str]]:
        text = self._spelling().write(tree).encode()
        for _ in range(self.rng.randint(1, 3)):
            at = self.rng.randrange(len(text) + 1)
            text = text[:at] + self.rng.choice(STRAY) + text[at:]
        return text, {}

    def _unicode(self, tree: Members) -> tuple[Any, dict[str, str]]:
        text = self.rng.choice(UNICODE)
        if self.rng.random() < 0.5:
            tree[0] = ("id", text)
        else:
            self._input(tree)[1]["name"] = text
        if self.rng.random() < 0.3:  # bytes that are not UTF-8 where a string goes
            body = self._spelling().write(tree).encode("utf-8", "surrogatepass")
            return body.replace(b'"id":', b'"id":"\xff\xfe",' + b'"x":', 1), {}
        return tree, {}

    def _datatype(self, tree: Members) -> tuple[Any, dict[str, str]]:
        _, item = self._input(tree)
        item["datatype"] = self.rng.choice(("FP64", "INT8", "fp32", "BYTES", "FP32 ", "", "BF16"))
        return tree, {}

    def _over_limit(self, tree: Members) -> tuple[Any, dict[str, str]]:
        _, item = self._input(tree)
        most = self.limits.elements.get(item["name"], 1)
        rows = most // max(1, int(np.prod(item["shape"][1:]))) + self.rng.choice((1, 2, 1000, 1 << 30))
        item["shape"] = [rows, *item["shape"][1:]]
        item["data"] = [0]
        return tree, {}

    def _largest_batch(self, tree: Members) -> tuple[Any, dict[str, str]]:
        return tree, {}

    def _body_size(self, tree: Members) -> tuple[Any, dict[str, str]]:
        text = Writer(self.rng).write(tree).encode()
        room = self.limits.max_body_bytes - len(text)
        pad = room - self.rng.randint(1, 64) if self.rng.random() < 0.5 else room + self.rng.randint(1, 64)
        return text + b" " * max(pad, 0), {}


@dataclass
class _View:
    """A dict-like view of an input's members: ``view[key] = value`` replaces or appends the member."""

    members: Members

    def __getitem__(self, key: str) -> Any:
        return self.members.get(key)

    def __setitem__(self, key: str, value: Any) -> None:
        for index, (name, _) in enumerate(self.members):
            if name == key:
                self.members[index] = (key, value)
                return
        self.members.append((key, value))

    def get(self, key: str) -> Any:
        """The first value under ``key``, or None."""
        return self.members.get(key)
