"""The two forms of a request: categorical values as 64-bit ids (INT64) or as text (BYTES).

Both forms carry the numeric values, the targets and the sequences alike; they differ in how the
categorical, time and multi-hot values travel (``ctr`` shown; ``B`` rows, names from the spec)::

    ids form (the SDK's default)                     bytes form (curl, generic clients)
    categorical__ids      INT64 [B, S]  one id per   categorical  BYTES [B, C]  one string per
    categorical__missing  BOOL  [B, S]  single col.                              wire column
    <multi-hot>__ids      INT64 [B, W]  ragged       <multi-hot>  BYTES [B, W]  (``wire = "list"``;
    <multi-hot>__length   INT32 [B, 1]  0..W                                     else a joined field)

An id is what the value codec (:mod:`recserve.core.values`) makes of the text: a hex or decimal
value as its 64-bit value (a uint64 above 2^63 as its int64 view), a string as its FNV-1a 64, a time
as unix seconds; an empty value is ``missing`` (its id is ignored). A multi-hot row's values are its
first ``length`` positions (at most ``max_length`` are kept, as in the bytes form). The served step
reads the id form with whole-array numpy only (:mod:`recserve.backends.features.id_inputs`); the
bytes form is decoded and parsed there element by element.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from recserve.core.names import (
    BYTES_WIRE,
    CANDIDATE_PREFIX,
    IDS_SUFFIX,
    IDS_WIRE,
    LENGTH_SUFFIX,
    MISSING_SUFFIX,
    WIRE_FORMS,
)
from recserve.core.spec.types import PROFILE_PREFIX, CategoricalGroup, ProfilePart, WireTensor
from recserve.core.values import categorical_values, join_list, multi_hot_values
from recserve.errors import InvalidInput

if TYPE_CHECKING:
    from recserve.core.spec.model import ModelSpec


@dataclass(frozen=True)
class IdList:
    """One multi-hot column in the id form: its values ``[B, W]`` and each row's count ``[B, 1]``."""

    column: int  # the raw column's index in the categorical group
    values: str
    length: str


@dataclass(frozen=True)
class WireForm:
    """One form of the wire: its tensors, split for candidate lists as the spec splits the bytes form.

    Attributes:
        name: ``ids`` or ``bytes``.
        inputs: the row layout's tensors.
        user_inputs: those a candidate list carries once per user (profile parts as ``profile__<name>``).
        candidate_inputs: those a candidate list carries per candidate.
        profile_parts: the column-wise tensors split into a user's profile columns and the others.
        profile_lists: the multi-hot tensors among the profile columns (once per user).
        marker: the tensor only a request of this form carries (``categorical__ids`` or ``categorical``).
        single: id form: the raw columns of ``categorical__ids``, in order (those without a separator).
        lists: id form: each multi-hot column's tensors.
    """

    name: str
    inputs: tuple[WireTensor, ...]
    user_inputs: tuple[WireTensor, ...]
    candidate_inputs: tuple[WireTensor, ...]
    profile_parts: tuple[ProfilePart, ...]
    profile_lists: tuple[str, ...]
    marker: str
    single: tuple[int, ...] = ()
    lists: tuple[IdList, ...] = ()

    @property
    def missing(self) -> str:
        """Id form: the empty-value mask of ``categorical__ids``."""
        return self.marker.removesuffix(IDS_SUFFIX) + MISSING_SUFFIX


def ids_name(group: CategoricalGroup) -> str:
    """The id form's tensor of the single-valued columns (``categorical__ids``)."""
    return group.name + IDS_SUFFIX


def split_user_inputs(
    tensors: Sequence[WireTensor], per_user: Collection[str], parts: Sequence[ProfilePart]
) -> tuple[tuple[WireTensor, ...], tuple[WireTensor, ...]]:
    """The tensors a candidate list carries once per user and those it carries per candidate.

    ``per_user`` names the whole tensors sent once per user; each of ``parts`` sends its profile
    columns once per user (as ``profile__<name>``) and its other columns per candidate.
    """
    users = [t for t in tensors if t.name in per_user]
    candidates = [t for t in tensors if t.name not in per_user]
    for part in parts:
        at = next(i for i, t in enumerate(candidates) if t.name == part.name)
        users.append(WireTensor(part.profile_name, candidates[at].dtype, (len(part.profile),)))
        if part.other:
            candidates[at] = replace(candidates[at], dims=(len(part.other),))
        else:
            del candidates[at]
    return tuple(users), tuple(candidates)


def bytes_form(spec: ModelSpec) -> WireForm:
    """The bytes form, as the spec describes its wire (``ModelSpec.wire_inputs``)."""
    return WireForm(
        BYTES_WIRE,
        spec.wire_inputs(),
        spec.user_inputs(),
        spec.candidate_inputs(),
        spec.profile_parts,
        spec.profile_lists,
        spec.categorical.name,
    )


def id_form(spec: ModelSpec) -> WireForm:
    """The id form: the bytes form with its BYTES tensors replaced by INT64 ids, masks and lengths."""
    group = spec.categorical
    single = tuple(i for i, c in enumerate(group.raw_columns) if not c.separator)
    multi = tuple(i for i, c in enumerate(group.raw_columns) if c.separator)
    lists = tuple(
        IdList(i, group.raw_columns[i].name + IDS_SUFFIX, group.raw_columns[i].name + LENGTH_SUFFIX)
        for i in multi
    )
    ids = ids_name(group)
    replaced = [
        WireTensor(ids, "INT64", (len(single),)),
        WireTensor(group.name + MISSING_SUFFIX, "BOOL", (len(single),)),
    ]
    for item in lists:
        replaced += [
            WireTensor(item.values, "INT64", (-1,), ragged=True),
            WireTensor(item.length, "INT32", (1,)),
        ]
    bytes_names = {group.name, *(group.raw_columns[i].name for i in group.list_columns)}
    tensors: list[WireTensor] = []
    for tensor in spec.wire_inputs():
        if tensor.name == group.name:
            tensors += replaced
        elif tensor.name not in bytes_names:
            tensors.append(tensor)
    profile = set(spec.profile_columns)
    profile_lists = tuple(
        n for item in lists if group.columns[item.column] in profile for n in (item.values, item.length)
    )
    names = [group.raw_columns[i].name for i in single]
    inside = tuple(k for k, name in enumerate(names) if name in profile)
    parts = [p for p in spec.profile_parts if p.name != group.name]
    if inside:
        other = tuple(k for k in range(len(names)) if k not in inside)
        parts += [ProfilePart(ids, inside, other), ProfilePart(group.name + MISSING_SUFFIX, inside, other)]
    per_user = {s.name for s in spec.sequences} | {g.length_input for g in spec.attention_groups}
    users, candidates = split_user_inputs(tensors, per_user | set(profile_lists), parts)
    return WireForm(
        IDS_WIRE, tuple(tensors), users, candidates, tuple(parts), profile_lists, ids, single, lists
    )


def request_form(spec: ModelSpec, names: Collection[str]) -> str:
    """The form of a request carrying the tensors ``names`` (of the row layout or a candidate list).

    Raises:
        InvalidInput: the request carries both forms' categorical tensor, or neither (naming them).
    """
    ids, text = ids_name(spec.categorical), spec.categorical.name
    names = {n.removeprefix(CANDIDATE_PREFIX).removeprefix(PROFILE_PREFIX) for n in names}
    if (ids in names) == (text in names):
        how = "both" if ids in names else "neither"
        raise InvalidInput(
            ids if ids in names else text,
            f"a request carries either {ids} (INT64 ids, with {spec.categorical.name}{MISSING_SUFFIX}) "
            f"or {text} (BYTES); this one carries {how}",
        )
    return IDS_WIRE if ids in names else BYTES_WIRE


def check_form(form: str) -> str:
    """``form`` if it is one of :data:`~recserve.core.names.WIRE_FORMS`.

    Raises:
        ValueError: it is not.
    """
    if form not in WIRE_FORMS:
        raise ValueError(f"wire form must be one of {WIRE_FORMS}, got {form!r}")
    return form


def categorical_fields(spec: ModelSpec, wire: Mapping[str, np.ndarray]) -> np.ndarray:
    """Every raw categorical column's text fields ``[B, C]`` of a bytes-form request, lists joined.

    Raises:
        InvalidInput: a list tensor holds an element with the separator, or one that is not text.
    """
    group = spec.categorical
    fields = np.asarray(wire[group.name], dtype=object)
    if not group.list_columns:
        return fields
    out = np.empty((fields.shape[0], len(group.raw_columns)), dtype=object)
    out[:, group.wire_columns] = fields
    for i in group.list_columns:
        column = group.raw_columns[i]
        out[:, i] = join_list(np.asarray(wire[column.name], dtype=object), column, column.name)
    return out


def ids_from_bytes(spec: ModelSpec, wire: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A row-layout request of the bytes form in the id form: the text parsed and hashed by the codec.

    The tensors both forms share are passed on as they are; the result holds every tensor of the
    id form present in the request.

    Raises:
        InvalidInput: a value is not of its column's type (naming the input, column and row).
    """
    group = spec.categorical
    form = id_form(spec)
    fields = categorical_fields(spec, wire)
    values, empty = categorical_values(fields, group)
    converted = {
        form.marker: values[:, list(form.single)].view(np.int64),
        form.missing: empty[:, list(form.single)],
    }
    for item in form.lists:
        column = group.raw_columns[item.column]
        ids, mask = multi_hot_values(
            fields[:, item.column], column, column.name if column.as_list else group.name
        )
        lengths = mask.sum(axis=1).astype(np.int32)
        converted[item.values] = ids[:, : max(int(lengths.max(initial=0)), 1)].view(np.int64)
        converted[item.length] = lengths[:, None]
    converted.update({t.name: wire[t.name] for t in form.inputs if t.name in wire})  # shared ones
    return {t.name: converted[t.name] for t in form.inputs if t.name in converted}
