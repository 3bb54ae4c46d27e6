r"""JSON inference bodies for the front door's fuzzer: a randomised writer, and what Triton would read.

A body is built as a tree whose objects are :class:`Members` (key/value pairs in order, so a key may
appear twice) and written by :class:`Writer`, which picks at random, for the same tree, the order of
keys, the white space, ``\\uXXXX`` escapes in any string (keys, names, datatypes), the form of each
floating-point number (``0.5``, ``5.000000000e-01``, ``5E-1`` ...) and flat or nested ``data``.
:class:`Raw` puts text in verbatim (a number form such as ``01`` or ``NaN``, a key written by hand).

:func:`classify` is the oracle the front door is judged against. It parses a body with Python's
standard JSON parser (escapes decoded, duplicate keys kept) and says:

* :data:`VALID`: the body is standard JSON without duplicate keys and means exactly the valid
  request it was made from (the same values, read as Triton reads them): it must be served (200);
* :data:`INVALID`: the body breaks what the front door promises to refuse (not JSON, a duplicate
  or unknown key, nesting over the limit, a shape that is not a list of non-negative integers or
  holds more than the model takes, ``data`` whose count differs from the shape, an unknown input
  name, binary sizes that do not add up): it must be refused with a 4xx;
* :data:`ANY`: anything else (a different but possibly valid request, a wrong datatype, which
  Triton refuses itself, bytes that are not UTF-8): it may be served or refused, but must kill
  nothing.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VALID, INVALID, ANY = "valid", "invalid", "any"
#: Keys the KServe v2 inference request allows: the request, an input, an output.
TOP_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
INPUT_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
OUTPUT_KEYS = frozenset({"name", "parameters"})
#: The binary form's header: the JSON part's length in bytes.
HEADER_LENGTH = "Inference-Header-Content-Length"
_DIGITS = re.compile(r"[0-9]{1,15}")
#: Longer integers are read as infinities (Python converts at most 4,300 digits).
MAX_INT_DIGITS = 1000


class Members(list[Any]):
    """A JSON object as its ``(key, value)`` pairs in order (a key may appear twice)."""

    def get(self, key: str, default: Any = None) -> Any:
        """The first value under ``key`` (as Triton's parser reads it), or ``default``."""
        return next((value for name, value in self if name == key), default)

    def keys(self) -> list[str]:
        """The keys in order, duplicates included."""
        return [name for name, _ in self]


@dataclass(frozen=True)
class Raw:
    """Text written into a body as it is (a number form, a key spelt by hand)."""

    text: str


class MinusZero(int):
    """The JSON integer ``-0``: zero to Python, a float to some parsers, so never a sure dimension."""


@dataclass(frozen=True)
class Limits:
    """What the served model takes, as the front door derives it.

    Attributes:
        model: the model the body is sent to.
        elements: input -> the most elements one request may declare for it.
        datatypes: input -> its KServe datatype (``FP32``, ``INT64``, ``BYTES`` ...).
        max_body_bytes: the largest body the proxy takes.
        max_depth: the deepest nesting the proxy reads.
        max_dims: the most dimensions of one shape.
    """

    model: str
    elements: Mapping[str, int]
    datatypes: Mapping[str, str]
    max_body_bytes: int
    max_depth: int = 16
    max_dims: int = 8


@dataclass
class Writer:
    r"""Writes a tree as JSON text, choosing the spelling at random (the meaning stays the same).

    Args:
        rng: the source of every choice.
        escapes: chance that a character of a string is written as ``\\uXXXX``.
        spaces: chance of white space around each token.
        shuffle: chance that an object's keys are written in another order.
    """

    rng: random.Random
    escapes: float = 0.0
    spaces: float = 0.0
    shuffle: float = 0.0
    floats: bool = True
    _space: tuple[str, ...] = field(default=(" ", "\n", "\t", "\r\n  "), repr=False)

    def write(self, value: Any) -> str:
        """``value`` as JSON text."""
        return self._ws() + self._value(value) + self._ws()

    def _ws(self) -> str:
        return self.rng.choice(self._space) if self.spaces and self.rng.random() < self.spaces else ""

    def _value(self, value: Any) -> str:
        if isinstance(value, Raw):
            return value.text
        if isinstance(value, dict):
            value = Members(value.items())
        if isinstance(value, Members):
            pairs = list(value)
            if self.shuffle and self.rng.random() < self.shuffle:
                self.rng.shuffle(pairs)
            items = [f"{self._ws()}{self._key(k)}{self._ws()}:{self._ws()}{self._value(v)}" for k, v in pairs]
            return "{" + ",".join(item + self._ws() for item in items) + "}"
        if isinstance(value, list | tuple):
            return "[" + ",".join(self._ws() + self._value(v) + self._ws() for v in value) + "]"
        if isinstance(value, str):
            return self.string(value)
        if value is None or isinstance(value, bool):
            return json.dumps(value)
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            return self.number(value)
        raise TypeError(f"cannot write {type(value).__name__}")

    def _key(self, key: str | Raw) -> str:
        return key.text if isinstance(key, Raw) else self.string(key)

    def string(self, text: str) -> str:
        """A JSON string literal of ``text``, some characters escaped at random."""
        out = []
        for char in text:
            code = ord(char)
            if char in '"\\' or code < 0x20 or (self.escapes and self.rng.random() < self.escapes):
                if code > 0xFFFF:  # a surrogate pair
                    code -= 0x10000
                    out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
                else:
                    out.append(f"\\u{code:04{self.rng.choice('xX')}}")
            else:
                out.append(char)
        return '"' + "".join(out) + '"'

    def number(self, value: float) -> str:
        """A floating-point number in one of JSON's spellings (always with a fraction or an exponent)."""
        if not math.isfinite(value):
            raise ValueError(f"JSON has no spelling for {value}")
        if not self.floats:
            return repr(value)
        form = self.rng.randrange(5)
        if form == 0:
            return repr(value)
        if form == 1:
            return f"{value:.9e}"
        if form == 2:
            return f"{value:.9E}".replace("E-0", "E-").replace("E+0", "E+")
        if form == 3:
            return repr(value) + ("0" if "e" not in repr(value) else "")
        return "-0.0" if value == 0 else f"{value:.17g}" + ("" if "e" in f"{value:.17g}" else "e0")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_int(text: str) -> int | float:
    if len(text) > MAX_INT_DIGITS:  # Python refuses to convert it; no parser reads it as an integer
        return -math.inf if text.startswith("-") else math.inf
    return MinusZero(0) if text == "-0" else int(text)


def parse(text: str) -> Any:
    """``text`` as standard JSON (``NaN`` and ``Infinity`` refused), objects as :class:`Members`.

    Raises:
        ValueError: not JSON (:class:`json.JSONDecodeError`, a number of over 4,300 digits).
        RecursionError: nested deeper than Python's parser goes.
    """
    return json.loads(text, object_pairs_hook=Members, parse_constant=_refuse_constant, parse_int=_parse_int)


def depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar 0, ``[]`` 1, ``{"a": [1]}`` 2), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Members):
            stack.extend((v, level + 1) for _, v in item)
            deepest = max(deepest, level + 1)
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
            deepest = max(deepest, level + 1)
    return deepest


def _scalars(value: Any) -> int | None:
    """Scalars in nested lists (None when an object is among them)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, Members):
            return None
        else:
            count += 1
    return count


def _duplicate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Members):
            if len(set(item.keys())) != len(item):
                return True
            stack.extend(v for _, v in item)
        elif isinstance(item, list):
            stack.extend(item)
    return False


def problem(doc: Any, limits: Limits, binary: bytes | None = None) -> str | None:
    """Why ``doc`` breaks what the front door refuses (None: it does not; ``"?"``: unsure)."""
    if not isinstance(doc, Members):
        return "not an object"
    if _duplicate(doc):
        return "a duplicate key"
    if not set(doc.keys()) <= TOP_KEYS:
        return f"unknown keys {sorted(set(doc.keys()) - TOP_KEYS)}"
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or not all(
        isinstance(o, Members) and set(o.keys()) <= OUTPUT_KEYS for o in outputs
    ):
        return "outputs"
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(i, Members) for i in inputs):
        return "inputs is not a list of objects"
    binary_bytes = 0
    for item in inputs:
        if not set(item.keys()) <= INPUT_KEYS:
            return f"unknown input keys {sorted(set(item.keys()) - INPUT_KEYS)}"
        name, shape = item.get("name"), item.get("shape")
        if not isinstance(name, str) or name not in limits.elements:
            return "an unknown input name"
        if not isinstance(shape, list) or len(shape) > limits.max_dims:
            return f"input {name!r}: shape"
        if any(isinstance(d, MinusZero) for d in shape):
            return "?"
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            return f"input {name!r}: a dimension that is not a non-negative integer"
        product = math.prod(shape)
        if product > limits.elements[name]:
            return f"input {name!r}: {product} elements"
        if item.get("datatype") != limits.datatypes.get(name):
            return "?"  # Triton's to refuse; 2.51 answers some of these with 500
        parameters = item.get("parameters", Members())
        size = parameters.get("binary_data_size") if isinstance(parameters, Members) else None
        if "data" in item.keys():
            if _scalars(item.get("data")) != product:
                return f"input {name!r}: data count"
        elif size is None or binary is None:
            return "?"  # no data: Triton's to refuse
        elif isinstance(size, int) and not isinstance(size, bool):
            binary_bytes += size
    if binary is not None and binary_bytes != len(binary):
        return "binary sizes"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Members) and isinstance(b, Members):
        da, db = dict(tuple(a)), dict(tuple(b))
        return da.keys() == db.keys() and all(_same(da[k], db[k]) for k in da)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))  # -0.0 is 0.0 to Triton's FP32 too
    if isinstance(a, MinusZero) or isinstance(b, MinusZero):
        return False
    return type(a) is type(b) and a == b


def split(body: bytes, headers: Mapping[str, str]) -> tuple[bytes, bytes | None] | None:
    """The JSON part and the binary part of a body (None when the header length cannot hold)."""
    length = headers.get(HEADER_LENGTH)
    if length is None:
        return body, None
    if not _DIGITS.fullmatch(length) or int(length) > len(body):
        return None
    return body[: int(length)], body[int(length) :]


def classify(body: bytes, headers: Mapping[str, str], limits: Limits, base: tuple[Any, bytes | None]) -> str:
    """:data:`VALID`, :data:`INVALID` or :data:`ANY` for ``body`` made from the valid request ``base``.

    Args:
        body: the request body sent.
        headers: its headers (the binary form's :data:`HEADER_LENGTH`).
        limits: what the served model takes.
        base: the valid request's parsed JSON part and its binary part (None for a JSON body).
    """
    if len(body) > limits.max_body_bytes:
        return INVALID
    parts = split(body, headers)
    if parts is None:
        return INVALID
    head, binary = parts
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return ANY
    try:
        doc = parse(text)
    except RecursionError:
        return INVALID
    except ValueError:
        return INVALID
    nesting = depth(doc)
    if nesting > limits.max_depth + 1:
        return INVALID
    reason = problem(doc, limits, binary)
    if reason == "?" or nesting >= limits.max_depth - 1:
        return ANY
    if reason is not None:
        return INVALID
    return VALID if _same(doc, base[0]) and binary == base[1] else ANY
