"""What travels on the wire: tensor names between the ensemble steps, and raw rows as clients hold them.

The wire inputs of ``ctr`` are named after the spec's features (see :mod:`recserve.spec`); the
tensors below are the contract between ``embedding_lookup`` and ``dense`` (and, in process, between
the feature transform and the lookup inside ``embedding_lookup``). The ONNX export, the generated
configs, the backends and the clients all read them from here. This module is the bottom layer with
the spec: it imports nothing else of recserve but the spec, its sections and the errors.
"""

from __future__ import annotations

import datetime
import functools
import zoneinfo
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from recserve.errors import InvalidInput, cap_message, shorten

# re-exported: the steps beside the tensors between them
from recserve.sections import DENSE as DENSE
from recserve.sections import EMBEDDING_LOOKUP as EMBEDDING_LOOKUP
from recserve.sections import STEPS as STEPS
from recserve.spec import NUMERIC_INPUT, NUMPY_DTYPES, CategoricalGroup, ModelSpec, RawColumn, WireTensor

DENSE_NORMALIZED = "dense_normalized"
SPARSE_KEYS = "sparse_keys"
TARGET_KEY = "target_key"
HISTORY_KEYS = "history_keys"
HISTORY_MASK = "history_mask"
#: Keys and pooling weights of the multi-hot features, side by side (only for specs that have them).
MULTI_HOT_KEYS = "multi_hot_keys"
MULTI_HOT_WEIGHTS = "multi_hot_weights"

SPARSE_EMBEDDINGS = "sparse_embeddings"
TARGET_EMBEDDING = "target_embedding"
HISTORY_EMBEDDINGS = "history_embeddings"

PROBABILITY = "probability"
#: The output of a dense ONNX that returns logits (``[model] output = "logit"``); served as its sigmoid.
LOGIT = "logit"
#: Per row, the version of the ``dense`` model that scored it (hot swaps are visible to clients).
DENSE_VERSION = "dense_version"
#: Per row, the version of every embedding table in the store snapshot that served it, in the order of
#: :attr:`recserve.spec.ModelSpec.table_names` (one snapshot per batch: all rows of a request agree).
EMBEDDING_VERSION = "embedding_version"
#: Prefix of ``embedding_lookup``'s candidate-list inputs: the candidates ensemble
#: (:attr:`recserve.spec.ModelSpec.candidates_model`) hands it each per-candidate wire input ``x``,
#: ``[users, candidates, ...]``, as ``candidate_x``; the user's sequences keep their names.
CANDIDATE_PREFIX = "candidate_"

#: For a candidate list at ``dense``: each row's user, the row of ``history_embeddings`` and
#: ``history_mask`` (which then hold one row per user) that the row attends over.
HISTORY_USER = "history_user"

#: Request header (gRPC metadata key) naming the user: the access layer hashes it so that a user stays
#: on one model variant across calls.
USER_HEADER = "x-recserve-user"

#: Inputs of the dense network, in the order of its ``forward`` and of the ONNX graph.
DENSE_NET_INPUTS = (DENSE_NORMALIZED, SPARSE_EMBEDDINGS, TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)

#: The inputs of every further attention group are these names with ``__<sequence>`` appended.
GROUP_INPUTS = (TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)


def is_dense_net_input(name: str) -> bool:
    """True for a name the dense network may take (:data:`DENSE_NET_INPUTS`, a further group's or width's)."""
    return name in DENSE_NET_INPUTS or name.partition("__")[0] in (*GROUP_INPUTS, SPARSE_EMBEDDINGS)


def sparse_inputs(spec: ModelSpec) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """The categorical embeddings' tensors: ``(name, width, slots)`` each.

    ``sparse_embeddings`` (``embedding_dim``), then ``sparse_embeddings__<width>`` per other table
    width, ascending; ``slots`` are its features, as indices of
    :attr:`~recserve.spec.CategoricalGroup.slot_names`.
    """
    names = {spec.embedding_dim: SPARSE_EMBEDDINGS}
    return tuple(
        (names.get(width, f"{SPARSE_EMBEDDINGS}__{width}"), width, spec.sparse_slots(width))
        for width in (spec.embedding_dim, *spec.other_widths)
    )


def is_sequence_input(name: str) -> bool:
    """True for a dense input with a sequence axis (axis 1): a history or a mask, of any group."""
    return name.partition("__")[0] in (HISTORY_EMBEDDINGS, HISTORY_MASK)


#: Dynamic axes of the dense ONNX graph: rows of a batch and positions of a sequence.
BATCH_AXIS = "batch"
SEQUENCE_AXIS = "sequence"


@dataclass(frozen=True)
class ContractTensor:
    """One input or output of the dense network: name, Triton dtype, shape (-1: dynamic), contents."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    holds: str

    def to_json(self) -> dict[str, object]:
        """``{"name", "dtype", "shape", "holds"}``."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "holds": self.holds}


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def candidate_step_inputs(spec: ModelSpec) -> tuple[WireTensor, ...]:
    """``embedding_lookup``'s inputs of the candidate-list form, ``[users, candidates, ...]`` each.

    None for a spec without a candidates ensemble.
    """
    if spec.candidates_model is None:
        return ()
    profile = {p.profile_name for p in spec.profile_parts}
    return tuple(
        WireTensor(CANDIDATE_PREFIX + t.name, t.dtype, (-1, *t.dims), ragged=True, optional=True)
        for t in spec.candidate_inputs()
    ) + tuple(replace(t, ragged=True, optional=True) for t in spec.user_inputs() if t.name in profile)


@dataclass(frozen=True)
class AttentionInputs:
    """The dense network's inputs of one attention group: its query, its positions and their mask."""

    target: str
    history: str
    mask: str


def attention_inputs(spec: ModelSpec) -> tuple[AttentionInputs, ...]:
    """Per attention group (:attr:`~recserve.spec.ModelSpec.attention_groups`), its dense inputs.

    The first group's are ``target_embedding``, ``history_embeddings`` and ``history_mask``; each
    other group's carry its first sequence's name, ``history_embeddings__<sequence>`` and so on.
    """
    suffixes = ["" if i == 0 else f"__{g.primary.name}" for i, g in enumerate(spec.attention_groups)]
    return tuple(AttentionInputs(*(name + suffix for name in GROUP_INPUTS)) for suffix in suffixes)


def sequence_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense inputs with a sequence axis (axis 1): every group's history and mask."""
    return tuple(name for group in attention_inputs(spec) for name in (group.history, group.mask))


def left_padded_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The histories and masks of the groups padded on the left (``padding = "left"``)."""
    return tuple(
        name
        for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
        if group.primary.padding == "left"
        for name in (names.history, names.mask)
    )


def per_candidate_dense_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense contract's inputs that a candidate list carries per candidate (not the histories)."""
    histories = set(sequence_inputs(spec))
    return tuple(n for n in dense_net_inputs(spec) if n not in histories)


def candidate_rows(
    spec: ModelSpec, inputs: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One candidate list as rows: the row-form inputs and each row's user.

    Each per-candidate input ``[U, N, ...]`` (named as :func:`candidate_step_inputs` says) becomes
    ``[U * N, ...]`` under its wire name, user by user; the user inputs (``[U, ...]``) are passed on
    as they are. The second value is each row's user, ``[U * N]``.

    Raises:
        InvalidInput: naming the wire input (as the client sent it) and what is wrong with it.
    """
    rows: dict[str, np.ndarray] = {}
    shape: tuple[int, int] | None = None
    for tensor in spec.candidate_inputs():
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
            if not 1 <= users * count <= spec.max_batch_size:
                raise InvalidInput(
                    tensor.name,
                    f"holds {users} users x {count} candidates = {users * count} rows, "
                    f"outside 1..{spec.max_batch_size}",
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
    for part in spec.profile_parts:  # each candidate row gets its user's profile columns
        profile = _per_user(inputs, part.profile_name, users, len(part.profile))
        full = np.empty((users * count, len(part.profile) + len(part.other)), profile.dtype)
        full[:, list(part.profile)] = np.repeat(profile, count, axis=0)
        if part.other:
            other = rows[part.name]
            if other.shape[1] != len(part.other):
                raise InvalidInput(part.name, f"has {other.shape[1]} columns, expected {len(part.other)}")
            full[:, list(part.other)] = other
        rows[part.name] = full
    for name in spec.profile_lists:
        rows[name] = np.repeat(_per_user(inputs, name, users), count, axis=0)
    expanded = {*spec.profile_lists, *(p.profile_name for p in spec.profile_parts)}
    rows.update(
        {t.name: inputs[t.name] for t in spec.user_inputs() if t.name in inputs and t.name not in expanded}
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
    spec: ModelSpec, rows: Mapping[str, np.ndarray], first: np.ndarray
) -> dict[str, np.ndarray]:
    """Row-form ``rows`` (by wire name) whose row ``i`` has the profile columns of row ``first[i]``.

    Rows that share a ``first`` row then describe one user, as the rows of a candidate list do.
    """
    out = dict(rows)
    for part in spec.profile_parts:
        columns = list(part.profile)
        array = out[part.name].copy()
        array[:, columns] = array[first][:, columns]
        out[part.name] = array
    out.update({name: out[name][first] for name in spec.profile_lists})
    return out


def candidate_list_inputs(spec: ModelSpec, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One user's candidate list from the row form of its candidates (``[N, ...]`` each, by wire name).

    Each per-candidate input as ``[1, N, ...]`` and the profile columns once, from the first row,
    as ``[1, ...]``. The sequences and their lengths are left to the caller, who has the user's.
    """
    parts = {p.name: p for p in spec.profile_parts}
    out = {}
    for tensor in spec.candidate_inputs():
        array = rows[tensor.name]
        part = parts.get(tensor.name)
        out[tensor.name] = (array if part is None else array[:, list(part.other)])[None]
    for part in spec.profile_parts:
        out[part.profile_name] = rows[part.name][:1, list(part.profile)]
    out.update({name: rows[name][:1] for name in spec.profile_lists})
    return out


def dense_net_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The dense network's inputs under ``spec``, in the order of :data:`DENSE_NET_INPUTS`.

    ``dense_normalized`` only with numeric features that are not bucketized; the target, history
    and mask only with a sequence, then those of every further attention group.
    """
    first = (DENSE_NORMALIZED,) if spec.normalized_columns else ()
    sparse = tuple(name for name, _, _ in sparse_inputs(spec))
    groups = tuple(name for g in attention_inputs(spec) for name in (g.target, g.history, g.mask))
    return first + sparse + groups


def dense_contract(spec: ModelSpec) -> tuple[tuple[ContractTensor, ...], tuple[ContractTensor, ...]]:
    """What the dense network receives and returns under ``spec``: ``(inputs, outputs)``.

    Inputs in the order of :func:`dense_net_inputs`; every one FP32 with the batch first. With
    several attention groups, every history and mask has the same number of positions (the sequence
    bucket of the request's longest history of any group). The output
    is named after ``[model] output``: ``probability``, or ``logit`` (which recserve serves as its
    sigmoid). The built-in network and every imported ONNX follow this contract.
    """
    dim = spec.embedding_dim
    inputs = []
    if spec.dense is not None and spec.normalized_columns:
        numeric = [spec.dense.numeric[i] for i in spec.dense.normalized]
        ops = {c.describe() for c in numeric}
        how = ops.pop() if len(ops) == 1 else "each by its feature's ops"
        inputs.append(
            ContractTensor(
                DENSE_NORMALIZED, "FP32", (-1, len(numeric)), f"{_span([c.name for c in numeric])}: {how}"
            )
        )
    for name, width, slots in sparse_inputs(spec):
        features = [spec.categorical.slot_names[i] for i in slots]
        inputs.append(
            ContractTensor(
                name,
                "FP32",
                (-1, len(features), width),
                f"{_span(features)}: one embedding per feature, in this order",
            )
        )
    for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True):
        seq = group.primary
        target, history = (
            (
                f"{group.targets[0].name}: its row of table {group.targets[0].table!r}",
                f"{seq.name}: rows of table {seq.table!r}",
            )
            if len(group.sequences) == 1
            else (
                " + ".join(t.name for t in group.targets) + ": the sum of their rows",
                " + ".join(s.name for s in group.sequences) + ": the sum of their rows at each position",
            )
        )
        inputs += [
            ContractTensor(names.target, "FP32", (-1, dim), target),
            ContractTensor(
                names.history,
                "FP32",
                (-1, -1, dim),
                f"{history}, oldest first, padded to a sequence bucket on the {seq.padding}"
                + (" (the newest at the last position)" if seq.padding == "left" else ""),
            ),
            ContractTensor(
                names.mask,
                "FP32",
                (-1, -1),
                f"{seq.name}: 1 on real positions, 0 on padding (whose embeddings the network must ignore)",
            ),
        ]

    output = ContractTensor(
        spec.dense_output,
        "FP32",
        (-1, 1),
        "click probability" if spec.dense_output == PROBABILITY else "click logit (served as its sigmoid)",
    )
    return tuple(inputs), (output,)


#: Config parameter of ``embedding_lookup``: the torch device of its L1 and of the vectors it returns
#: (``cuda``: the instance's GPU, set by the ``cuda`` profile; ``cpu``: the same code on the host).
L1_DEVICE_PARAMETER = "l1_device"

_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i

#: Raw ``target_item`` value meaning "no target item".
ABSENT_ITEM = -1


#: A parser of hex strings with :func:`parse_hex`'s signature and results.
HexParser = Callable[[np.ndarray, int, str], tuple[np.ndarray, np.ndarray]]


def hex_bytes(values: np.ndarray, max_digits: int, input_name: str) -> np.ndarray:
    """``values`` as NUL-padded fixed-width bytes, ``max_digits + 1`` wide (a longer string shows).

    Raises:
        InvalidInput: a value is not ASCII.
    """
    try:
        return np.asarray(values, dtype=f"S{max_digits + 1}")
    except (UnicodeEncodeError, ValueError, TypeError):
        bad = next(v for v in values.ravel() if not _is_ascii(v))
        raise InvalidInput(input_name, f"value {shorten(bad)} is not an ASCII hex string") from None


def parse_hex(values: np.ndarray, max_digits: int, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse an array of hex byte strings into ``uint64`` values, vectorised.

    Args:
        values: object array of ``bytes`` (or ``str``), any shape.
        max_digits: longest accepted string (at most 16 digits fit 64 bits).
        input_name: named in errors.

    Returns:
        ``(values, missing)``: parsed values and a mask of empty strings, both of ``values.shape``.

    Raises:
        InvalidInput: a string is too long or holds a non-hex character.
    """
    fixed = hex_bytes(values, max_digits, input_name)
    width = fixed.dtype.itemsize
    flat = fixed.reshape(-1)
    raw_bytes = flat.view(np.uint8).reshape(-1, width)
    # a fixed-width bytes array pads with NUL and keeps no trailing NUL: the length is the non-NUL count
    # (an embedded NUL counts as a character, and LUT 255 refuses it)
    nonzero = raw_bytes != 0
    lengths = width - np.argmax(nonzero[:, ::-1], axis=1)
    lengths[~nonzero.any(axis=1)] = 0
    digits = _HEX_LUT[raw_bytes]
    positions = np.arange(width)[None, :] < lengths[:, None]
    bad_rows = (lengths > max_digits) | ((digits == 255) & positions).any(axis=1)
    if bad_rows.any():
        index = int(np.flatnonzero(bad_rows)[0])
        raw = values.reshape(-1)[index]
        raise InvalidInput(
            input_name,
            f"value {shorten(raw)} at flat index {index} is not a hex string of at most {max_digits} digits",
        )
    acc = np.zeros(flat.shape[0], dtype=np.uint64)
    for pos in range(max_digits):
        take = positions[:, pos]
        acc = np.where(take, (acc << np.uint64(4)) | digits[:, pos].astype(np.uint64), acc)
    return acc.reshape(values.shape), (lengths == 0).reshape(values.shape)


def _column_error(input_name: str, column: str, row: int, value: object, why: str) -> InvalidInput:
    return InvalidInput(input_name, f"{column} (row {row}) is {shorten(value)}: {why}")


def _as_text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def parse_decimal(
    values: np.ndarray, signed: bool, input_name: str, columns: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers (``int64`` when ``signed``, else ``uint64``) of string columns ``[B, len(columns)]``.

    Returns:
        ``(values, empty)``: the values as ``uint64`` (a negative int64 as its two's complement)
        and a mask of empty strings.

    Raises:
        InvalidInput: a value is not a decimal integer of that type (naming the row).
    """
    try:
        fixed = np.asarray(values, dtype="S21")
        empty = np.char.str_len(fixed) == 0
        body = np.char.replace(fixed, b"-", b"", count=1) if signed else fixed
        sign_ok = np.char.find(fixed, b"-") <= 0 if signed else True
        if (np.char.isdigit(body) & sign_ok | empty).all() and (np.char.str_len(fixed) < 21).all():
            parsed = np.where(empty, b"0", fixed).astype(np.int64 if signed else np.uint64)
            return parsed.view(np.uint64).reshape(values.shape), empty.reshape(values.shape)
    except (UnicodeEncodeError, ValueError, TypeError, OverflowError):
        pass
    low, high = (-(1 << 63), (1 << 63) - 1) if signed else (0, (1 << 64) - 1)
    for (row, col), value in np.ndenumerate(np.asarray(values, dtype=object)):  # slow path: name it
        text = _as_text(value)
        digits = text[1:] if signed and text.startswith("-") else text
        # 20 digits hold any 64-bit value; a longer string is refused before int() reads it
        if text and not (
            digits.isascii() and digits.isdigit() and len(digits) <= 20 and low <= int(text) <= high
        ):
            kind = "an int64" if signed else "a uint64"
            raise _column_error(input_name, columns[col], row, value, f"not {kind} in decimal digits")
    raise AssertionError("unreachable")  # pragma: no cover


@functools.lru_cache(maxsize=65536)
def _unix_seconds(text: str, time_format: str, time_unit: str, timezone: str) -> int:
    """Unix seconds of one time value (cached: a batch holds few distinct times)."""
    if time_format:
        parsed = datetime.datetime.strptime(text, time_format)
        stamp = parsed.replace(tzinfo=parsed.tzinfo or zoneinfo.ZoneInfo(timezone)).timestamp()
    else:
        if not (text.isascii() and text.isdigit()):
            raise ValueError("not a number of non-negative digits")
        stamp = int(text) / (1000 if time_unit == "ms" else 1)
    if stamp < 0:
        raise ValueError("before 1970")
    return int(stamp)


#: Strings up to this many bytes are hashed together, one numpy step per byte position; longer ones
#: one by one (a step costs the same for one string as for a batch, so one long value would make the
#: whole batch pay a step per byte of it).
VECTOR_HASH_BYTES = 64
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def _fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def hash_strings(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FNV-1a 64 of each string's UTF-8 bytes, vectorised; ``(values, empty)``.

    Work is linear in the bytes sent: strings over :data:`VECTOR_HASH_BYTES` are hashed one by one.
    """
    encoded = [
        v if isinstance(v, bytes) else str(v).encode() for v in np.asarray(values, dtype=object).ravel()
    ]
    long = [i for i, v in enumerate(encoded) if len(v) > VECTOR_HASH_BYTES]
    short = [b"" if len(v) > VECTOR_HASH_BYTES else v for v in encoded]
    width = max((len(v) for v in short), default=0) or 1
    fixed = np.array(short, dtype=f"S{width}")
    lengths = np.char.str_len(fixed)  # trailing NULs are not part of a value (as numpy reads it)
    data = fixed.view(np.uint8).reshape(-1, width).astype(np.uint64)
    acc = np.full(len(encoded), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for pos in range(width):
            step = (acc ^ data[:, pos]) * np.uint64(_FNV_PRIME)
            acc = np.where(pos < lengths, step, acc)
    for i in long:
        value = encoded[i].rstrip(b"\0")
        acc[i] = _fnv1a64(value)
        lengths[i] = len(value)
    return acc.reshape(values.shape), (lengths == 0).reshape(values.shape)


def parse_times(values: np.ndarray, column: RawColumn, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Unix seconds of a time column (``strptime`` format in its time zone, or unix s / ms).

    Raises:
        InvalidInput: a value does not match the format (naming the row).
    """
    unique, inverse = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    seconds = np.zeros(len(unique), dtype=np.uint64)
    for i, text in enumerate(unique):
        if text == "":
            continue
        try:
            seconds[i] = _unix_seconds(text, column.time_format, column.time_unit, column.timezone)
        except ValueError as exc:
            row = int(np.flatnonzero(inverse == i)[0])
            wanted = f"format {column.time_format!r}" if column.time_format else f"unix {column.time_unit}"
            raise _column_error(
                input_name,
                column.name,
                row,
                values.reshape(-1)[row],
                f"not a time in {wanted} ({cap_message(str(exc), 96)})",
            ) from None
    return seconds[inverse].reshape(values.shape), (unique[inverse] == "").reshape(values.shape)


def time_part(seconds: np.ndarray, part: str, timezone: str) -> np.ndarray:
    """A part of unix times as seen in ``timezone``.

    hour_of_day 0..23, weekday 0..6 (Monday 0), is_weekend 0/1, day_of_month 0..30, month 0..11.
    """
    zone = zoneinfo.ZoneInfo(timezone)
    unique, inverse = np.unique(seconds, return_inverse=True)
    local = [datetime.datetime.fromtimestamp(int(s), zone) for s in unique]
    parts = {
        "hour_of_day": [t.hour for t in local],
        "weekday": [t.weekday() for t in local],
        "is_weekend": [int(t.weekday() >= 5) for t in local],
        "day_of_month": [t.day - 1 for t in local],
        "month": [t.month - 1 for t in local],
    }[part]
    return np.asarray(parts, dtype=np.uint64)[inverse].reshape(seconds.shape)


def categorical_values(
    values: np.ndarray,
    group: CategoricalGroup,
    hex_parser: HexParser | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Parse the categorical tensor ``[B, C]`` column by column, by each column's value type.

    ``hex_parser`` stands in for :func:`parse_hex` (the serving steps pass the compiled one).

    Returns:
        ``(values, empty)``, both ``[B, C]``: ``uint64`` values (hex and decimal numbers as such,
        strings as their FNV-1a 64, times as unix seconds) and a mask of empty fields.

    Raises:
        InvalidInput: a value is not of its column's type (naming the input, column and row).
    """
    out = np.zeros(values.shape, dtype=np.uint64)
    empty = np.zeros(values.shape, dtype=bool)
    single = [not c.separator for c in group.raw_columns]  # multi-hot columns: multi_hot_values
    hex_columns = [i for i, c in enumerate(group.raw_columns) if c.value_type == "hex" and single[i]]
    if hex_columns:
        parse = hex_parser or parse_hex
        digits = max(group.raw_columns[i].max_hex_digits for i in hex_columns)
        if any(group.raw_columns[i].max_hex_digits != digits for i in hex_columns):
            for i in hex_columns:
                out[:, i], empty[:, i] = parse(values[:, i], group.raw_columns[i].max_hex_digits, group.name)
        else:
            out[:, hex_columns], empty[:, hex_columns] = parse(values[:, hex_columns], digits, group.name)
    string_columns = [i for i, c in enumerate(group.raw_columns) if c.value_type == "string" and single[i]]
    if string_columns:
        out[:, string_columns], empty[:, string_columns] = hash_strings(values[:, string_columns])
    for value_type in ("int64", "uint64"):
        index = [i for i, c in enumerate(group.raw_columns) if c.value_type == value_type and single[i]]
        if index:
            names = tuple(group.raw_columns[i].name for i in index)
            parsed = parse_decimal(values[:, index], value_type == "int64", group.name, names)
            out[:, index], empty[:, index] = parsed
    for i, column in enumerate(group.raw_columns):
        if column.value_type == "time":
            out[:, i], empty[:, i] = parse_times(values[:, i], column, group.name)
    return out, empty


def multi_hot_tokens(value: object, column: RawColumn) -> list[bytes]:
    """The elements of one multi-hot field kept for serving: the non-empty ones, the first ``max_length``."""
    text = value if isinstance(value, bytes) else str(value).encode()
    return [t for t in text.split(column.separator.encode()) if t][: column.max_length]


def multi_hot_values(values: np.ndarray, column: RawColumn, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """The values of a multi-hot column ``[B]`` (``a|b|c``): ``uint64 [B, max_length]`` and a mask.

    Empty elements are skipped; past ``max_length`` the rest of a row's values are dropped.

    Raises:
        InvalidInput: an element is not of the column's value type (naming the row).
    """
    rows = [multi_hot_tokens(v, column) for v in values]
    lengths = np.array([len(r) for r in rows], dtype=np.intp)
    mask = np.arange(column.max_length)[None, :] < lengths[:, None]
    out = np.zeros(mask.shape, dtype=np.uint64)
    flat = np.array([t for r in rows for t in r], dtype=object)
    if flat.size:
        element = CategoricalGroup(input_name, (replace(column, separator="", max_length=1),), ())
        try:
            out[mask] = categorical_values(flat[:, None], element)[0][:, 0]
        except InvalidInput:
            for row, tokens in enumerate(rows):  # slow path: name the row
                try:
                    categorical_values(np.array(tokens or [b""], dtype=object)[:, None], element)
                except InvalidInput:
                    raise _column_error(
                        input_name, column.name, row, values[row], f"not a list of {column.value_type} values"
                    ) from None
    return out, mask


def join_list(values: np.ndarray, column: RawColumn, input_name: str) -> np.ndarray:
    """The fields ``[B]`` of a multi-hot list tensor ``[B, W]`` (``wire = "list"``), joined by its separator.

    Empty elements are padding. Elements are bytes or str.

    Raises:
        InvalidInput: an element holds the separator or is not text (naming the row and position).
    """
    separator = column.separator.encode()
    fields = np.empty(values.shape[0], dtype=object)
    for row, elements in enumerate(values):
        parts = []
        for position, element in enumerate(elements):
            if isinstance(element, str):
                element = element.encode()
            if not isinstance(element, bytes) or separator in element:
                raise InvalidInput(
                    input_name,
                    f"row {row} position {position} is {shorten(element)}: one value per element, "
                    f"without {column.separator!r}",
                )
            if element:
                parts.append(element)
        fields[row] = separator.join(parts)
    return fields


def split_list(fields: np.ndarray, column: RawColumn) -> np.ndarray:
    """A multi-hot column's fields ``[B]`` as its list tensor ``[B, W]`` (empty elements pad the rows)."""
    separator = column.separator.encode()
    lists = [
        [t for t in (f if isinstance(f, bytes) else str(f).encode()).split(separator) if t] for f in fields
    ]
    out = np.full((len(lists), max([len(v) for v in lists] + [1])), b"", dtype=object)
    for row, values in enumerate(lists):
        out[row, : len(values)] = values
    return out


def _is_ascii(value: object) -> bool:
    if isinstance(value, bytes):
        return value.isascii()
    return isinstance(value, str) and value.isascii()


class SideSequences:
    """Rows with attention groups: the first group's arrays as attributes, the others in ``side``.

    ``target``, ``history`` and ``lengths`` are the first group's; the other sequences and targets
    are in ``side`` by name, and so are the lengths of every further group, by its length input.
    """

    target: np.ndarray
    history: np.ndarray
    lengths: np.ndarray
    side: dict[str, np.ndarray]

    def sequence(self, name: str) -> np.ndarray:
        """Ids ``[N, W]`` of one sequence (the first is ``history``)."""
        return self.side.get(name, self.history)

    def lengths_of(self, length_input: str) -> np.ndarray:
        """Lengths ``[N]`` of the attention group whose length input is named so (the first: ``lengths``)."""
        return self.side.get(length_input, self.lengths)

    def target_ids(self, name: str) -> np.ndarray:
        """int64 ids ``[N]`` of one attention target (the first is ``target``; -1: absent)."""
        return self.side.get(name, self.target).astype(np.int64)


@dataclass
class Rows(SideSequences):
    """Raw feature values of ``N`` rows, column-wise as numpy arrays: what a client reads and sends.

    One container for every source of rows (files read by :func:`recserve.clients.read_rows`, the
    synthetic generator, the training split). Parts the spec lacks are empty: ``dense`` ``[N, 0]``
    without numeric features; without a sequence every target is absent and every history empty.

    Attributes:
        dense: float32 ``[N, D]`` raw numeric values, 0 where missing (``D = 0`` without numeric features).
        dense_missing: bool ``[N, D]``, True where a numeric value is absent.
        categorical: object ``[N, C]`` of ``bytes`` as sent (checked by type), ``b""`` when empty.
        target: int64 ``[N]`` target item id, -1 when absent.
        history: int64 ``[N, W]`` history item ids, newest last, valid below ``lengths``; ``W >= 1``.
        lengths: int32 ``[N]`` number of valid history positions per row.
        labels: float32 ``[N]`` click labels, or None when the input had no label column.
        side: the other sequences (``[N, W]``) and their targets (``[N]``) by name, and the lengths
            (``[N]``) of every further attention group by the name of its length input.
    """

    dense: np.ndarray
    dense_missing: np.ndarray
    categorical: np.ndarray
    target: np.ndarray
    history: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray | None = None
    side: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, index: slice | np.ndarray) -> Rows:
        """Rows selected by a slice or an index array (the history keeps its padded width)."""
        parts: dict[str, Any] = {
            name: None if getattr(self, name) is None else getattr(self, name)[index]
            for name in self.__dataclass_fields__
            if name != "side"
        }
        return Rows(**parts, side={name: values[index] for name, values in self.side.items()})

    def batches(self, size: int) -> Iterator[Rows]:
        """Consecutive slices of at most ``size`` rows, in order.

        Args:
            size: rows per batch, at least 1.

        Raises:
            ValueError: ``size`` is not positive.
        """
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        for start in range(0, len(self), size):
            yield self.take(slice(start, start + size))

    def label_values(self) -> np.ndarray:
        """The labels ``[N]`` of rows that have them (generated, or read with a label column).

        Raises:
            ValueError: the rows carry no label.
        """
        if self.labels is None:
            raise ValueError("these rows carry no label")
        return self.labels

    def with_labels(self, labels: np.ndarray) -> Rows:
        """These rows in their canonical dtypes (0 where a numeric value is missing), with ``labels``."""
        return Rows(
            dense=np.where(self.dense_missing, 0.0, self.dense).astype(np.float32),
            dense_missing=self.dense_missing.astype(bool),
            categorical=self.categorical,
            target=self.target.astype(np.int64),
            history=self.history.astype(np.int64),
            lengths=self.lengths.astype(np.int32),
            labels=labels,
            side=self.side,
        )

    def to_raw(self, spec: ModelSpec) -> Rows:
        """The rows to train on: canonical dtypes and float32 labels.

        Raises:
            ValueError: the rows carry no label.
        """
        if self.labels is None:
            raise ValueError(
                f"rows to train on need a label column (label first in TSV, {spec.inputs.label!r} in CSV)"
            )
        return self.with_labels(self.labels.astype(np.float32))

    def to_inputs(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """Request tensors of the spec's ensemble for these rows.

        The history is trimmed or zero padded to ``W = max(1, longest history of these rows)``.

        Args:
            spec: the model spec naming the wire inputs and their dtypes.

        Returns:
            One array per wire input, keyed by input name, dtypes as in ``spec.wire_inputs()``.
        """
        wire_rows = self.with_labels(np.zeros(len(self), np.float32)).to_wire(spec)
        return {
            wire.name: np.ascontiguousarray(wire_rows[wire.name], dtype=NUMPY_DTYPES[wire.dtype])
            for wire in spec.wire_inputs()
        }

    def user_runs(self, spec: ModelSpec) -> list[slice]:
        """Consecutive rows of one user (``[inputs] user``) that share every sequence and profile column.

        Such rows are one candidate list: the same user at the same moment. A row whose user,
        sequences or profile (``[inputs] profile``) differ from the row before starts a new run;
        without ``[inputs] user`` every row is its own run.
        """
        rows = len(self)
        if not spec.inputs.user or rows == 0:
            return [slice(i, i + 1) for i in range(rows)]
        changed = np.zeros(rows, dtype=bool)
        raw, numeric = spec.categorical.columns, spec.numeric_columns
        for name in spec.profile_columns:  # the user column among them
            if name in raw:
                columns = [self.categorical[:, raw.index(name)]]
            else:
                j = numeric.index(name)
                columns = [self.dense[:, j], self.dense_missing[:, j]]
            for values in columns:
                changed[1:] |= values[1:] != values[:-1]
        changed[0] = True
        for group in spec.attention_groups:
            lengths = self.lengths_of(group.length_input)
            changed[1:] |= lengths[1:] != lengths[:-1]
        for sequence in spec.sequences:
            ids = self.sequence(sequence.name)
            changed[1:] |= (ids[1:] != ids[:-1]).any(axis=1)
        starts = [*np.flatnonzero(changed).tolist(), rows]
        return [slice(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]

    def user_of(self, spec: ModelSpec, row: int) -> dict[str, np.ndarray]:
        """The sequences of one row by name: the user context of a candidate list."""
        context = {}
        for group in spec.attention_groups:
            length = int(self.lengths_of(group.length_input)[row])
            context.update({s.name: self.sequence(s.name)[row, :length] for s in group.sequences})
        return context

    def to_wire(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """Request tensors of the spec's ensemble for these rows (history width = longest row)."""
        values = {
            NUMERIC_INPUT: self.dense.astype(np.float32),
            spec.dense_missing_input: self.dense_missing.astype(bool),
            spec.categorical.name: self.categorical[:, list(spec.categorical.wire_columns)],
        }
        for i in spec.categorical.list_columns:
            column = spec.categorical.raw_columns[i]
            values[column.name] = split_list(self.categorical[:, i], column)
        for target in spec.targets:
            values[target.name] = self.target_ids(target.name)[:, None]
        for group in spec.attention_groups:
            lengths = self.lengths_of(group.length_input)
            width = max(int(lengths.max(initial=0)), 1)
            for sequence in group.sequences:
                values[sequence.name] = np.ascontiguousarray(
                    self.sequence(sequence.name)[:, :width], dtype=np.int64
                )
            values[group.length_input] = lengths.astype(np.int32)[:, None]
        return {tensor.name: values[tensor.name] for tensor in spec.wire_inputs()}


#: The former name of :class:`Rows` (the rows the build and the tests generate).
RawRows = Rows
