"""Candidate lists: a user's list of items in the list layout of the wire and as rows, one per item."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from recserve.core.contract import dense_net_inputs, sequence_inputs
from recserve.core.names import BYTES_WIRE, CANDIDATE_PREFIX, WIRE_FORMS
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import WireTensor
from recserve.errors import InvalidInput


def candidate_step_inputs(spec: ModelSpec) -> tuple[WireTensor, ...]:
    """``embedding_lookup``'s inputs of the candidate-list layout, ``[users, candidates, ...]`` each.

    Those of both wire forms (each a request may leave out), each once: first those of both forms
    (every list carries them), then each form's own. None for a spec without a candidates ensemble.
    """
    if spec.candidates_model is None:
        return ()
    tensors: dict[str, WireTensor] = {}
    for form in WIRE_FORMS:
        wire = spec.wire_form(form)
        profile = {p.profile_name for p in wire.profile_parts}
        for t in wire.candidate_inputs:
            name = CANDIDATE_PREFIX + t.name
            tensors[name] = WireTensor(name, t.dtype, (-1, *t.dims), ragged=True, optional=True)
        for t in wire.user_inputs:
            if t.name in profile:
                tensors[t.name] = replace(t, ragged=True, optional=True)
    common = set.intersection(*({t.name for t in spec.wire_form(f).inputs} for f in WIRE_FORMS))
    shared = [t for t in tensors.values() if t.name.removeprefix(CANDIDATE_PREFIX) in common]
    return (*shared, *(t for t in tensors.values() if t not in shared))


def per_candidate_dense_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense contract's inputs that a candidate list carries per candidate (not the histories)."""
    histories = set(sequence_inputs(spec))
    return tuple(n for n in dense_net_inputs(spec) if n not in histories)


def candidate_rows(
    spec: ModelSpec, inputs: Mapping[str, np.ndarray], form: str = BYTES_WIRE
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One candidate list of a wire form (``ids`` or ``bytes``) as rows: the row inputs and each row's user.

    Each per-candidate input ``[U, N, ...]`` (named as :func:`candidate_step_inputs` says) becomes
    ``[U * N, ...]`` under its wire name, user by user; the user inputs (``[U, ...]``) are passed on
    as they are. The second value is each row's user, ``[U * N]``.

    Raises:
        InvalidInput: naming the wire input (as the client sent it) and what is wrong with it.
    """
    wire = spec.wire_form(form)
    rows: dict[str, np.ndarray] = {}
    shape: tuple[int, int] | None = None
    for tensor in wire.candidate_inputs:
        array = inputs.get(CANDIDATE_PREFIX + tensor.name)
        if array is None:
            raise InvalidInput(tensor.name, "is required but missing")
        if array.ndim != 2 + len(tensor.dims):
            raise InvalidInput(
                tensor.name,
                f"has shape {list(array.shape)}, expected [users, candidates, "
                f"{', '.join(map(str, tensor.dims))}]",
            )
        if shape is None:
            shape = (array.shape[0], array.shape[1])
            users, count = shape
            if not 1 <= users * count <= spec.model.max_batch_size:
                raise InvalidInput(
                    tensor.name,
                    f"holds {users} users x {count} candidates = {users * count} rows, "
                    f"outside 1..{spec.model.max_batch_size}",
                )
        elif array.shape[:2] != shape:
            raise InvalidInput(
                tensor.name,
                f"has {array.shape[0]} users x {array.shape[1]} candidates, other inputs have "
                f"{shape[0]} x {shape[1]}",
            )
        rows[tensor.name] = array.reshape(shape[0] * shape[1], *array.shape[2:])
    assert shape is not None  # a spec with sequences has per-candidate inputs (the targets)
    users, count = shape
    for part in wire.profile_parts:  # each candidate row gets its user's profile columns
        profile = _per_user(inputs, part.profile_name, users, len(part.profile))
        full = np.empty((users * count, len(part.profile) + len(part.other)), profile.dtype)
        full[:, list(part.profile)] = np.repeat(profile, count, axis=0)
        if part.other:
            other = rows[part.name]
            if other.shape[1] != len(part.other):
                raise InvalidInput(part.name, f"has {other.shape[1]} columns, expected {len(part.other)}")
            full[:, list(part.other)] = other
        rows[part.name] = full
    for name in wire.profile_lists:
        rows[name] = np.repeat(_per_user(inputs, name, users), count, axis=0)
    expanded = {*wire.profile_lists, *(p.profile_name for p in wire.profile_parts)}
    rows.update(
        {t.name: inputs[t.name] for t in wire.user_inputs if t.name in inputs and t.name not in expanded}
    )
    return rows, np.repeat(np.arange(users), count)


def _per_user(inputs: Mapping[str, np.ndarray], name: str, users: int, width: int = -1) -> np.ndarray:
    """The once-per-user input ``name``, ``[users, width]`` (-1: any width); else InvalidInput naming it."""
    array = inputs.get(name)
    if array is None:
        raise InvalidInput(name, "is required but missing")
    if array.ndim != 2 or array.shape[0] != users or width not in (-1, array.shape[1]):
        expected = f"[{users}, {'...' if width < 0 else width}]"
        raise InvalidInput(name, f"has shape {list(array.shape)}, expected {expected} (one row per user)")
    return array


def with_profiles_of(
    spec: ModelSpec, rows: Mapping[str, np.ndarray], first: np.ndarray, form: str = BYTES_WIRE
) -> dict[str, np.ndarray]:
    """Row-form ``rows`` (wire names, ``form``) whose row ``i`` has the profile columns of row ``first[i]``.

    Rows that share a ``first`` row then describe one user, as the rows of a candidate list do.
    """
    wire = spec.wire_form(form)
    out = dict(rows)
    for part in wire.profile_parts:
        columns = list(part.profile)
        array = out[part.name].copy()
        array[:, columns] = array[first][:, columns]
        out[part.name] = array
    out.update({name: out[name][first] for name in wire.profile_lists})
    return out


def candidate_list_inputs(
    spec: ModelSpec, rows: Mapping[str, np.ndarray], form: str = BYTES_WIRE
) -> dict[str, np.ndarray]:
    """One user's candidate list from the row layout of its candidates (``[N, ...]`` each, by wire name).

    Each per-candidate input as ``[1, N, ...]`` and the profile columns once, from the first row,
    as ``[1, ...]``. The sequences and their lengths are left to the caller, who has the user's.
    ``form``: the wire form of ``rows`` (and of the list).
    """
    wire = spec.wire_form(form)
    parts = {p.name: p for p in wire.profile_parts}
    out = {}
    for tensor in wire.candidate_inputs:
        array = rows[tensor.name]
        part = parts.get(tensor.name)
        out[tensor.name] = (array if part is None else array[:, list(part.other)])[None]
    for part in wire.profile_parts:
        out[part.profile_name] = rows[part.name][:1, list(part.profile)]
    out.update({name: rows[name][:1] for name in wire.profile_lists})
    return out
