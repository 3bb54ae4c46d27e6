"""Parsing a spec's TOML table into a typed section: unknown keys refused, defaults applied, values converted.

:func:`parse_section` builds a section from its raw TOML table: it refuses keys the section does not
have (naming the key and the section), requires the keys without a default, and converts values to
the field types (``int``, ``float``, ``str``, ``bool``, tuples, nested sections and tables of them).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

Section = TypeVar("Section")


#: A portable environment variable name (what ``redis_password_env`` may hold).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SpecError(ValueError):
    """The spec file is inconsistent."""


class UnknownKeyError(SpecError):
    """A spec table holds a key that recserve does not know (a typo, or a key of another section)."""

    def __init__(self, where: str, key: str, known: list[str]) -> None:
        label = "the spec" if where == "spec" else where if "[" in where else f"[{where}]"
        super().__init__(f"{label} has an unknown key {key!r}; known keys: {', '.join(known)}")
        self.where = where
        self.key = key


def parse_section(cls: type[Section], raw: Any, where: str) -> Section:
    """The section ``cls`` from its raw TOML table at ``where`` (e.g. ``store``, ``serving.queue``).

    Raises:
        SpecError: ``raw`` is not a table, a key is unknown or missing, or a value has the wrong type.
    """
    if not isinstance(raw, Mapping):
        raise SpecError(f"[{where}] must be a table, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in raw:
        if key not in fields:
            raise UnknownKeyError(where, str(key), sorted(fields))
    for name, spec_field in fields.items():
        required = (
            spec_field.default is dataclasses.MISSING and spec_field.default_factory is dataclasses.MISSING
        )
        if required and name not in raw:
            raise SpecError(f"[{where}] needs the key {name!r}")
    hints = typing.get_type_hints(cls)
    return cls(**{key: _convert(hints[key], value, f"{where}.{key}") for key, value in raw.items()})


def _convert(kind: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return None if value is None and len(options) < len(args) else _convert(options[0], value, where)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return parse_section(kind, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise SpecError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise SpecError(f"{where} must be a table, got {value!r}")
        return {str(k): _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if kind is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{where} must be true or false, got {value!r}")
        return value
    if kind in (int, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and value != int(value))
        ):
            raise SpecError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        return kind(value)
    if kind is str:
        if not isinstance(value, str):
            raise SpecError(f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(
        f"no conversion for {kind!r} at {where}"
    )  # a section declared a field type not handled here
