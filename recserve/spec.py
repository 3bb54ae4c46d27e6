"""The model spec: one TOML file per model, the single source of truth.

Feature names, wire tensors, tables, embedding dims, network sizes, buckets, batch limits and
instance counts are all read from here; configs, the ONNX export, the client and perf data derive
from the objects below.
"""

from __future__ import annotations

import json
import math
import re
import zoneinfo
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from recserve.sections import (
    ENCODERS,
    MULTI_HOT_WIRE,
    PADDING_SIDES,
    POOLINGS,
    TIME_PARTS,
    TOP_LEVEL_KEYS,
    VALUE_TYPES,
    AccessSection,
    CategoricalFeatureSection,
    DenseNetSection,
    HashingSection,
    InputsSection,
    ModelSection,
    MultiHotFeatureSection,
    NumericFeatureSection,
    QueuePolicy,
    SequenceFeatureSection,
    ServingSection,
    SpecError,
    StoreSection,
    TableSection,
    TimeFeatureSection,
    TrainingSection,
    UnknownKeyError,
    parse_feature,
    parse_section,
)

DEFAULT_SPEC = "ctr"
#: Wire inputs: every numeric column in one FP32 tensor (and its missing mask), every categorical or
#: time column as a string in one BYTES tensor; the attention targets and sequences travel as ids.
NUMERIC_INPUT = "dense"
CATEGORICAL_INPUT = "categorical"
#: Storage dtypes of a table (``[tables.<name>] dtype``).
TABLE_DTYPES = ("fp32", "fp16")
DEFAULT_REPOSITORY = Path("model_repository")  # where recserve build writes and the commands read


def default_repository(spec: str) -> Path:
    """The repository the commands use for a spec: ``model_repository``, else ``model_repository_<name>``.

    Each spec gets its own folder: the ensemble steps of every spec have the same names.
    """
    return DEFAULT_REPOSITORY if spec == DEFAULT_SPEC else Path(f"{DEFAULT_REPOSITORY}_{Path(spec).stem}")


#: What a dense ONNX may return (``[model] output``); a logit is served as its sigmoid.
DENSE_OUTPUTS = ("probability", "logit")


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a request: Triton dtype name and per-row dims (-1: variable)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    ragged: bool = False  # rows of different requests may differ in the variable dim
    optional: bool = False  # a request may leave it out (a step that takes two request forms)


#: A candidate list's once-per-user part of a column-wise wire tensor: ``profile__categorical``.
PROFILE_PREFIX = "profile__"


@dataclass(frozen=True)
class ProfilePart:
    """A column-wise wire tensor split for candidate lists: profile columns once per user.

    The tensor is the numeric values, their missing mask or the categorical strings; its profile
    columns travel once per user, the others per candidate.
    """

    name: str  # the tensor of the row form; the candidates' part keeps this name
    profile: tuple[int, ...]  # its columns sent once per user, as ``profile__<name>``
    other: tuple[int, ...]  # its columns sent per candidate

    @property
    def profile_name(self) -> str:
        """The once-per-user tensor's name."""
        return PROFILE_PREFIX + self.name


NUMPY_DTYPES: dict[str, Any] = {
    "FP32": "float32",
    "INT64": "int64",
    "INT32": "int32",
    "BOOL": "bool",
    "BYTES": "object",
}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table keyed by 64-bit feature keys."""

    name: str
    dim: int
    cardinality: int
    zipf_exponent: float
    dtype: str = "fp32"


@dataclass(frozen=True)
class NumericColumn:
    """One numeric column and its ops: ``x -> (log1p?(clip(x or fill_na)) - shift) / scale``."""

    name: str
    fill_na: float = 0.0
    clip_min: float = -math.inf
    clip_max: float = math.inf
    log1p: bool = False
    shift: float = 0.0
    scale: float = 1.0
    boundaries: tuple[float, ...] = ()  # bucketized: a categorical feature, not a dense value

    def describe(self) -> str:
        """The ops as a formula, for the dense contract."""
        text = "x"
        if self.clip_min > -math.inf or self.clip_max < math.inf:
            text = f"clip({text}, {self.clip_min:g}, {self.clip_max:g})"
        if self.log1p:
            text = f"log1p({text})"
        if self.shift or self.scale != 1.0:
            text = f"({text} - {self.shift:g}) / {self.scale:g}"
        return f"{text}, missing {self.fill_na:g}"


@dataclass(frozen=True)
class DenseGroup:
    """The numeric columns, sent together as one FP32 tensor plus a missing mask."""

    name: str
    numeric: tuple[NumericColumn, ...]

    @cached_property  # these are read on every request
    def columns(self) -> tuple[str, ...]:
        """Column names in wire order."""
        return tuple(c.name for c in self.numeric)

    @cached_property
    def normalized(self) -> tuple[int, ...]:
        """Indices of the columns that are dense values (``dense_normalized``), not bucketized."""
        return tuple(i for i, c in enumerate(self.numeric) if not c.boundaries)


@dataclass(frozen=True)
class RawColumn:
    """One categorical column as clients send it: a string in the BYTES tensor ``categorical``.

    ``value_type`` is ``hex``, ``int64``, ``uint64``, ``string`` or ``time`` (parsed with
    ``time_format``, or unix seconds / milliseconds by ``time_unit``, in ``timezone``).
    """

    name: str
    value_type: str
    max_hex_digits: int = 16
    time_format: str = ""
    time_unit: str = ""
    timezone: str = "UTC"
    separator: str = ""  # multi-hot: values joined by this, at most ``max_length`` kept
    max_length: int = 1
    as_list: bool = False  # multi-hot sent as a BYTES list tensor of its own, not in ``categorical``

    @property
    def max_bytes(self) -> int:
        """The longest value a request may carry in this column (what shared memory reserves)."""
        one = {"hex": self.max_hex_digits, "int64": 20, "uint64": 20, "time": 32}.get(self.value_type, 256)
        return (one + len(self.separator)) * self.max_length


@dataclass(frozen=True)
class CategoricalFeature:
    """A single-valued categorical feature mapped to a key in its table.

    ``column`` is its raw column's index in the categorical tensor (-1: the attention target's own
    INT64 input, or a bucketized numeric column); ``part`` names the derived part of a time column
    (``""`` otherwise); ``numeric`` is the index of a bucketized numeric column in ``dense``.
    """

    name: str
    table: str
    encoder: str = "hash"
    column: int = -1
    part: str = ""
    numeric: int = -1


@dataclass(frozen=True)
class MultiHotFeature:
    """Up to ``max_length`` values in one raw column, each looked up in ``table``, pooled into one vector."""

    name: str
    table: str
    column: int
    max_length: int
    pooling: str  # sum, mean or sqrtn


@dataclass(frozen=True)
class CategoricalGroup:
    """The categorical raw columns, sent together as one BYTES tensor, and the features read from them.

    The features' embeddings are the slots of ``sparse_embeddings``: the single-valued ones first,
    then the pooled multi-hot ones.
    """

    name: str
    raw_columns: tuple[RawColumn, ...]
    features: tuple[CategoricalFeature, ...]
    multi_hot: tuple[MultiHotFeature, ...] = ()

    @property
    def slot_names(self) -> tuple[str, ...]:
        """The features in the order of their embeddings in ``sparse_embeddings``."""
        return tuple(f.name for f in self.features) + tuple(f.name for f in self.multi_hot)

    @property
    def columns(self) -> tuple[str, ...]:
        """Raw column names, in the order of files and of :attr:`wire_columns` then :attr:`list_columns`."""
        return tuple(c.name for c in self.raw_columns)

    @cached_property  # read on every request
    def wire_columns(self) -> tuple[int, ...]:
        """Indices of the raw columns sent as the fields of the BYTES tensor ``categorical``, in its order."""
        return tuple(i for i, c in enumerate(self.raw_columns) if not c.as_list)

    @cached_property  # read on every request
    def list_columns(self) -> tuple[int, ...]:
        """Indices of the multi-hot columns sent as BYTES list tensors of their own (named like them)."""
        return tuple(i for i, c in enumerate(self.raw_columns) if c.as_list)


@dataclass(frozen=True)
class SequenceFeature:
    """A variable-length list of ids, padded to a sequence bucket with a mask."""

    name: str
    table: str
    max_length: int
    mean_length: float
    positions: str = ""  # the sequence whose positions (length and mask) this one shares
    padding: str = "right"  # where the dense network finds the padding: right, or left (newest last)
    separator: str = ""  # between the ids in a file's field ("": whitespace or commas)


#: Any feature that has a name and a table.
Feature = CategoricalFeature | MultiHotFeature | SequenceFeature


@dataclass(frozen=True)
class AttentionGroup:
    """A sequence with its own positions, the sequences sharing them, and the target of each.

    The built-in network attends over each group with one query: the group's sequences are summed
    at each position, and so are their targets. Every group has its own length input and mask.
    """

    sequences: tuple[SequenceFeature, ...]
    targets: tuple[CategoricalFeature, ...]

    @property
    def primary(self) -> SequenceFeature:
        """The sequence whose positions the group shares."""
        return self.sequences[0]

    @property
    def length_input(self) -> str:
        """Wire name of the group's per-row length (``<first sequence>__length``)."""
        return f"{self.primary.name}__length"


@dataclass(frozen=True)
class ModelSpec:
    """Everything recserve needs to know about one model."""

    name: str
    version: int
    max_batch_size: int
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    attention_heads: int
    batch_buckets: tuple[int, ...]
    sequence_buckets: tuple[int, ...]
    max_queue_delay_microseconds: int
    instances: dict[str, int]
    dense: DenseGroup | None  # None: no numeric features
    categorical: CategoricalGroup
    tables: dict[str, TableSpec]
    training: TrainingSection
    hash_namespace: str
    preferred_batch_sizes: tuple[int, ...] = ()
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    queue_profiles: dict[str, QueuePolicy] = field(default_factory=dict)
    store: StoreSection = field(default_factory=StoreSection)
    dense_output: str = "probability"
    source: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    access: AccessSection = field(default_factory=AccessSection)  # the proxy's: not in ``source``
    inputs: InputsSection = field(default_factory=InputsSection)
    # every sequence, group by group (see :attr:`attention_groups`), and the target of each
    sequences: tuple[SequenceFeature, ...] = ()
    targets: tuple[CategoricalFeature, ...] = ()

    # ---- derived names -------------------------------------------------------------------
    @property
    def target(self) -> CategoricalFeature | None:
        """The first attention target (over :attr:`sequence`); None without a sequence."""
        return self.targets[0] if self.targets else None

    @property
    def sequence(self) -> SequenceFeature | None:
        """The first group's sequence with its own positions; None without a sequence."""
        return self.sequences[0] if self.sequences else None

    @property
    def sequence_length_input(self) -> str:
        """Wire name of the first group's per-row sequence length (only specs with a sequence have one)."""
        assert self.sequence is not None
        return f"{self.sequence.name}__length"

    @property
    def target_names(self) -> tuple[str, ...]:
        """The attention targets' names, each once (a target may attend over several sequences)."""
        return tuple(dict.fromkeys(t.name for t in self.targets))

    @cached_property
    def attention_groups(self) -> tuple[AttentionGroup, ...]:
        """The sequences and their targets, one group per set of positions, in spec order."""
        groups: list[tuple[list[SequenceFeature], list[CategoricalFeature]]] = []
        for sequence, target in zip(self.sequences, self.targets, strict=True):
            if not sequence.positions:
                groups.append(([], []))
            groups[-1][0].append(sequence)
            groups[-1][1].append(target)
        return tuple(AttentionGroup(tuple(s), tuple(t)) for s, t in groups)

    @property
    def dense_missing_input(self) -> str:
        """Wire name of the dense missing-value mask."""
        return f"{NUMERIC_INPUT}__missing"

    def attention(self, needed_by: str) -> tuple[CategoricalFeature, SequenceFeature]:
        """The attention target and its sequence, for tools written for models that have them.

        Raises:
            SpecError: the spec has no sequence feature.
        """
        if self.target is None or self.sequence is None:
            raise SpecError(f"{needed_by} needs a spec with a sequence feature; {self.name!r} has none")
        return self.target, self.sequence

    @cached_property  # these are read on every request
    def numeric_columns(self) -> tuple[str, ...]:
        """Names of the numeric columns on the wire (none when the spec has no numeric feature)."""
        return self.dense.columns if self.dense else ()

    @cached_property
    def normalized_columns(self) -> tuple[str, ...]:
        """Names of the numeric columns the dense network gets as ``dense_normalized`` (not bucketized)."""
        return tuple(self.numeric_columns[i] for i in self.dense.normalized) if self.dense else ()

    def wire_inputs(self) -> tuple[WireTensor, ...]:
        """The raw-feature inputs of the ensemble, as clients send them."""
        return self._inputs[0]

    def user_inputs(self) -> tuple[WireTensor, ...]:
        """The wire inputs a candidate list carries once per user.

        The sequences and their lengths, and the profile columns (see :attr:`profile_parts` and
        :attr:`profile_lists`).
        """
        return self._inputs[1]

    def candidate_inputs(self) -> tuple[WireTensor, ...]:
        """The wire inputs a candidate list carries once per candidate (all but :meth:`user_inputs`)."""
        return self._inputs[2]

    @cached_property
    def _inputs(self) -> tuple[tuple[WireTensor, ...], tuple[WireTensor, ...], tuple[WireTensor, ...]]:
        """The wire inputs, those of them carried once per user, and those carried per candidate.

        Computed once: every request reads them.
        """
        tensors = []
        if self.dense is not None:
            width = len(self.dense.columns)
            tensors += [
                WireTensor(self.dense.name, "FP32", (width,)),
                WireTensor(self.dense_missing_input, "BOOL", (width,)),
            ]
        group = self.categorical
        tensors.append(WireTensor(group.name, "BYTES", (len(group.wire_columns),)))
        tensors += [
            WireTensor(group.raw_columns[i].name, "BYTES", (-1,), ragged=True) for i in group.list_columns
        ]
        # a target attending over several sequences travels once
        tensors += [WireTensor(name, "INT64", (1,)) for name in self.target_names]
        tensors += [WireTensor(sequence.name, "INT64", (-1,), ragged=True) for sequence in self.sequences]
        lengths = [WireTensor(g.length_input, "INT32", (1,)) for g in self.attention_groups]
        per_user = {s.name for s in self.sequences} | {t.name for t in lengths} | set(self.profile_lists)
        tensors += lengths
        users = [t for t in tensors if t.name in per_user]
        candidates = [t for t in tensors if t.name not in per_user]
        for part in self.profile_parts:
            at = next(i for i, t in enumerate(candidates) if t.name == part.name)
            users.append(WireTensor(part.profile_name, candidates[at].dtype, (len(part.profile),)))
            if part.other:
                candidates[at] = replace(candidates[at], dims=(len(part.other),))
            else:
                del candidates[at]
        return tuple(tensors), tuple(users), tuple(candidates)

    @cached_property
    def profile_columns(self) -> tuple[str, ...]:
        """The raw columns describing the user (``[inputs] user`` and ``profile``), in wire order."""
        named = {self.inputs.user, *(n for p in self.inputs.profile for n in expand_names(p))} - {""}
        numeric = self.dense.columns if self.dense else ()
        return tuple(n for n in (*numeric, *self.categorical.columns) if n in named)

    @cached_property
    def profile_parts(self) -> tuple[ProfilePart, ...]:
        """The column-wise wire tensors holding profile columns, split for candidate lists."""
        group = self.categorical
        tensors = {group.name: tuple(group.raw_columns[i].name for i in group.wire_columns)}
        if self.dense is not None:  # the values and their missing mask have the same columns
            tensors = {
                self.dense.name: self.dense.columns,
                self.dense_missing_input: self.dense.columns,
                **tensors,
            }
        parts = []
        for name, columns in tensors.items():
            inside = tuple(i for i, c in enumerate(columns) if c in self.profile_columns)
            if inside:
                parts.append(
                    ProfilePart(name, inside, tuple(i for i in range(len(columns)) if i not in inside))
                )
        return tuple(parts)

    @cached_property  # read on every candidate list
    def profile_lists(self) -> tuple[str, ...]:
        """The multi-hot list tensors among the profile columns: once per user in a candidate list."""
        group = self.categorical
        return tuple(
            group.raw_columns[i].name
            for i in group.list_columns
            if group.raw_columns[i].name in self.profile_columns
        )

    @property
    def candidates_model(self) -> str | None:
        """The ensemble taking one user's candidate list per request (None: a spec without sequences).

        Its requests carry each user's sequences once (``[users, length]``, the length ``[users, 1]``)
        and every other wire input per candidate, ``[users, candidates, ...]``.
        """
        return f"{self.name}_candidates" if self.sequences else None

    @property
    def table_names(self) -> tuple[str, ...]:
        """Embedding tables in spec order: ``[tables.*]`` first, then one per categorical column.

        The ``embedding_version`` output lists each table's served version in this order.
        """
        return tuple(self.tables)

    @property
    def num_sparse(self) -> int:
        """Number of categorical embeddings of ``embedding_dim`` (``sparse_embeddings``'s slots)."""
        return len(self.sparse_slots(self.embedding_dim))

    @cached_property
    def slot_dims(self) -> tuple[int, ...]:
        """Each categorical embedding's width, in the order of :attr:`CategoricalGroup.slot_names`."""
        group = self.categorical
        tables = [f.table for f in group.features] + [f.table for f in group.multi_hot]
        return tuple(self.tables[table].dim for table in tables)

    @property
    def other_widths(self) -> tuple[int, ...]:
        """The widths of categorical tables other than ``embedding_dim``, ascending."""
        return tuple(sorted(set(self.slot_dims) - {self.embedding_dim}))

    def sparse_slots(self, width: int) -> tuple[int, ...]:
        """The categorical embeddings of one width, as indices of :attr:`CategoricalGroup.slot_names`."""
        return tuple(i for i, d in enumerate(self.slot_dims) if d == width)

    def sequence_bucket(self, length: int) -> int:
        """Smallest sequence bucket holding ``length`` positions (at least the first bucket)."""
        for bucket in self.sequence_buckets:
            if length <= bucket:
                return bucket
        raise SpecError(f"sequence length {length} exceeds the largest bucket {self.sequence_buckets[-1]}")

    def batch_bucket(self, rows: int) -> int:
        """Smallest batch bucket holding ``rows`` rows."""
        for bucket in self.batch_buckets:
            if rows <= bucket:
                return bucket
        raise SpecError(f"batch of {rows} rows exceeds the largest bucket {self.batch_buckets[-1]}")

    def to_json(self) -> str:
        """JSON of the source document (what served models receive), in the document's own order."""
        # in the document's order: the tables' order is the order of ``embedding_version``
        return json.dumps(self.source, separators=(",", ":"))


def expand_names(pattern: str) -> tuple[str, ...]:
    """Names of a pattern with one range, ``C{1..26}`` -> ``C1 .. C26``; other names stay as they are.

    Raises:
        SpecError: an empty or reversed range.
    """
    match = _RANGE.search(pattern)
    if match is None:
        return (pattern,)
    low, high = int(match[1]), int(match[2])
    if high < low:
        raise SpecError(f"{pattern!r}: the range {match[0]} is empty")
    return tuple(f"{pattern[: match.start()]}{i}{pattern[match.end() :]}" for i in range(low, high + 1))


_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def _parallel(names: tuple[str, ...], pattern: str, what: str) -> tuple[str, ...]:
    """``pattern`` expanded alongside ``names``: one name each, or one shared by all."""
    expanded = expand_names(pattern)
    if len(expanded) == 1:
        return expanded * len(names)
    if len(expanded) != len(names):
        raise SpecError(f"{what} {pattern!r} names {len(expanded)} tables for {len(names)} features")
    return expanded


def _parse_tables(raw_tables: Any, dim: int) -> dict[str, TableSpec]:
    if not isinstance(raw_tables, dict):
        raise SpecError(f"[tables] must be a table, got {raw_tables!r}")
    tables: dict[str, TableSpec] = {}
    for pattern, raw in raw_tables.items():
        names = expand_names(pattern)
        if not isinstance(raw, dict):
            raise SpecError(f"[tables.{pattern}] must be a table, got {raw!r}")
        cards: Any = raw.get("cardinality")
        if len(names) > 1 and not (isinstance(cards, list) and len(cards) == len(names)):
            raise SpecError(
                f"[tables.{pattern}] names {len(names)} tables: cardinality must list {len(names)}"
            )
        for i, name in enumerate(names):
            one = dict(raw, cardinality=cards[i]) if len(names) > 1 else raw
            table = parse_section(TableSection, one, f"tables.{pattern}")
            if table.dtype not in TABLE_DTYPES:
                raise SpecError(f"[tables.{pattern}] dtype must be fp32 or fp16, got {table.dtype!r}")
            if name in tables:
                raise SpecError(f"table {name!r} is defined twice")
            tables[name] = TableSpec(
                name, table.dim or dim, table.cardinality, table.zipf_exponent, table.dtype
            )
    return tables


@dataclass
class _Features:
    """The ``[[features]]`` entries sorted into the parts the model is made of."""

    numeric: list[NumericColumn] = field(default_factory=list)
    raw_columns: list[RawColumn] = field(default_factory=list)
    categorical: list[CategoricalFeature] = field(default_factory=list)
    multi_hot: list[MultiHotFeature] = field(default_factory=list)
    sequences: list[SequenceFeature] = field(default_factory=list)
    targets: list[tuple[CategoricalFeature, str]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)

    def add_name(self, name: str, where: str) -> None:
        if name in self.names:
            raise SpecError(f"{where}: the name {name!r} is used twice")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SpecError(f"{where}: {name!r} is not a valid feature name (letters, digits, _)")
        self.names.add(name)


def _numeric(section: NumericFeatureSection, name: str, where: str) -> NumericColumn:
    pairs = {"clip": section.clip, "standardize": section.standardize, "minmax": section.minmax}
    for key, pair in pairs.items():
        if pair and len(pair) != 2:
            raise SpecError(f"{where}: {key} takes two numbers, got {list(pair)}")
    if section.standardize and section.minmax:
        raise SpecError(f"{where}: standardize and minmax exclude each other")
    shift, scale = 0.0, 1.0
    if section.standardize:
        shift, scale = section.standardize
    if section.minmax:
        shift, scale = section.minmax[0], section.minmax[1] - section.minmax[0]
    if scale <= 0:
        raise SpecError(f"{where}: the std or the max - min must be positive, got {scale:g}")
    low, high = section.clip or (-math.inf, math.inf)
    edges = section.bucketize
    if edges and any(b <= a for a, b in zip(edges[:-1], edges[1:], strict=True)):
        raise SpecError(f"{where}: bucketize needs increasing boundaries, got {list(edges)}")
    if section.log1p and low <= -1:
        raise SpecError(f"{where}: log1p needs clip with a minimum above -1, got {list(section.clip)}")
    if section.log1p and section.fill_na <= -1:
        raise SpecError(f"{where}: log1p needs fill_na above -1, got {section.fill_na:g}")
    return NumericColumn(name, section.fill_na, low, high, section.log1p, shift, scale, edges)


def _parse_features(raw_features: Any, tables: dict[str, TableSpec]) -> _Features:
    if not isinstance(raw_features, list):
        raise SpecError("features must be a list of [[features]] tables")
    out = _Features()
    for position, raw in enumerate(raw_features):
        section = parse_feature(raw, position)
        where = f"features[{position}] ({section.name})"
        names = expand_names(section.name)
        for name in names:
            out.add_name(name, where)
        if isinstance(section, NumericFeatureSection):
            for name in names:
                column = _numeric(section, name, where)
                if column.boundaries:
                    tables.setdefault(name, TableSpec(name, 0, len(column.boundaries) + 1, 0.0))
                    out.categorical.append(CategoricalFeature(name, name, numeric=len(out.numeric)))
                out.numeric.append(column)
        elif isinstance(section, SequenceFeatureSection):
            if re.search(r"[\d\-+]", section.separator):
                raise SpecError(f"{where}: separator {section.separator!r} may not hold digits, '-' or '+'")
            out.sequences += [
                SequenceFeature(
                    name,
                    section.table,
                    section.max_length,
                    section.mean_length,
                    section.positions,
                    section.padding,
                    section.separator,
                )
                for name in names
            ]
        elif isinstance(section, MultiHotFeatureSection):
            _multi_hot(section, names, where, out)
        elif isinstance(section, TimeFeatureSection):
            _time(section, names, where, tables, out)
        else:
            _categorical(section, names, where, out)
    return out


def _categorical(
    section: CategoricalFeatureSection, names: tuple[str, ...], where: str, out: _Features
) -> None:
    if section.value_type not in VALUE_TYPES:
        raise SpecError(
            f"{where}: value_type must be one of {', '.join(VALUE_TYPES)}, got {section.value_type!r}"
        )
    if section.encoder not in ENCODERS:
        raise SpecError(f"{where}: encoder must be one of {', '.join(ENCODERS)}, got {section.encoder!r}")
    if section.encoder == "identity" and section.value_type != "int64":
        raise SpecError(f"{where}: the identity encoder needs value_type int64 (the value is the key)")
    if not 1 <= section.max_hex_digits <= 16:
        raise SpecError(f"{where}: max_hex_digits must lie in 1..16 (64-bit values)")
    tables = _parallel(names, section.table or section.name, f"{where}: table")
    for name, table in zip(names, tables, strict=True):
        if section.attends:
            if section.value_type != "int64" or section.encoder == "identity":
                raise SpecError(f"{where}: an attention target is an int64 id with the hash encoder")
            target = CategoricalFeature(name, table, section.encoder)
            out.targets += [(target, over) for over in section.attends]
            continue
        out.categorical.append(CategoricalFeature(name, table, section.encoder, len(out.raw_columns)))
        out.raw_columns.append(RawColumn(name, section.value_type, section.max_hex_digits))


def _multi_hot(section: MultiHotFeatureSection, names: tuple[str, ...], where: str, out: _Features) -> None:
    if section.value_type not in VALUE_TYPES:
        raise SpecError(
            f"{where}: value_type must be one of {', '.join(VALUE_TYPES)}, got {section.value_type!r}"
        )
    if section.pooling not in POOLINGS:
        raise SpecError(f"{where}: pooling must be one of {', '.join(POOLINGS)}, got {section.pooling!r}")
    if not section.separator or section.max_length < 1:
        raise SpecError(f"{where}: a multi-hot feature needs a separator and max_length >= 1")
    if section.wire not in MULTI_HOT_WIRE:
        raise SpecError(f"{where}: wire must be one of {', '.join(MULTI_HOT_WIRE)}, got {section.wire!r}")
    tables = _parallel(names, section.table or section.name, f"{where}: table")
    for name, table in zip(names, tables, strict=True):
        column = len(out.raw_columns)
        out.raw_columns.append(
            RawColumn(
                name,
                section.value_type,
                section.max_hex_digits,
                separator=section.separator,
                max_length=section.max_length,
                as_list=section.wire == "list",
            )
        )
        out.multi_hot.append(MultiHotFeature(name, table, column, section.max_length, section.pooling))


def _time(
    section: TimeFeatureSection,
    names: tuple[str, ...],
    where: str,
    tables: dict[str, TableSpec],
    out: _Features,
) -> None:
    if bool(section.format) == bool(section.unit) or section.unit not in ("", "s", "ms"):
        raise SpecError(f"{where}: give either format (strptime) or unit (s or ms)")
    try:
        zoneinfo.ZoneInfo(section.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise SpecError(f"{where}: unknown timezone {section.timezone!r}") from None
    unknown = [part for part in section.parts if part not in TIME_PARTS]
    if unknown or not section.parts:
        raise SpecError(f"{where}: parts must be some of {', '.join(TIME_PARTS)}, got {list(section.parts)}")
    for name in names:
        column = len(out.raw_columns)
        out.raw_columns.append(
            RawColumn(
                name, "time", time_format=section.format, time_unit=section.unit, timezone=section.timezone
            )
        )
        for part in section.parts:
            table = f"{name}_{part}"
            out.add_name(table, where)
            tables.setdefault(table, TableSpec(table, 0, TIME_PARTS[part], 0.0))
            out.categorical.append(CategoricalFeature(table, table, "hash", column, part))


def _attention(features: _Features) -> tuple[tuple[CategoricalFeature, ...], tuple[SequenceFeature, ...]]:
    """Every sequence, group by group, and the target of each.

    A group is a sequence with its own positions followed by the sequences sharing them (items and
    their categories); the built-in network attends over each group with one query: the group's
    sequences are summed per position, and so are their targets.
    """
    own = [s for s in features.sequences if not s.positions]
    if not own:
        if features.sequences or features.targets:
            raise SpecError(
                "a sequence shares the positions of another, or a target attends, but no sequence has its own"
            )
        return (), ()
    names = {s.name for s in own}
    for sequence in features.sequences:
        if sequence.positions and sequence.positions not in names:
            raise SpecError(
                f"sequence {sequence.name!r} shares the positions of {sequence.positions!r}, "
                "not a sequence with positions of its own"
            )
    sequences: list[SequenceFeature] = []
    for primary in own:
        if primary.padding not in ("", *PADDING_SIDES):
            raise SpecError(
                f"sequence {primary.name!r}: padding must be one of {', '.join(PADDING_SIDES)}, "
                f"got {primary.padding!r}"
            )
        if primary.max_length < 1:
            raise SpecError(f"sequence {primary.name!r} needs max_length >= 1")
        primary = replace(primary, padding=primary.padding or "right")
        sequences.append(primary)
        for sequence in features.sequences:
            if sequence.positions != primary.name:
                continue
            if sequence.max_length not in (0, primary.max_length):
                raise SpecError(
                    f"sequence {sequence.name!r} shares positions with {primary.name!r}: "
                    "no max_length of its own"
                )
            if sequence.padding not in ("", primary.padding):
                raise SpecError(
                    f"sequence {sequence.name!r} shares positions with {primary.name!r}: its padding is "
                    f"{primary.padding!r}, got {sequence.padding!r}"
                )
            sequences.append(replace(sequence, max_length=primary.max_length, padding=primary.padding))
    by_sequence: dict[str, CategoricalFeature] = {}
    for target, over in features.targets:
        if over not in {s.name for s in sequences}:
            raise SpecError(f"feature {target.name!r} attends over {over!r}, which is not a sequence feature")
        if over in by_sequence:
            raise SpecError(f"sequence {over!r} has two targets attending over it")
        by_sequence[over] = target
    for sequence in sequences:
        found = by_sequence.get(sequence.name)
        if found is None:
            raise SpecError(
                f"sequence {sequence.name!r} needs a categorical feature with attends = {sequence.name!r}"
            )
        if found.table != sequence.table:
            raise SpecError(
                f"{found.name!r} and {sequence.name!r} must share a table to attend, "
                f"got {found.table!r} and {sequence.table!r}"
            )
    return tuple(by_sequence[s.name] for s in sequences), tuple(sequences)


def parse_spec(doc: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed TOML/JSON document, checking consistency.

    Raises:
        SpecError: a key is unknown or missing, a value has the wrong type, or parts disagree.
    """
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            raise UnknownKeyError("spec", str(key), sorted(TOP_LEVEL_KEYS))
    for key in ("model", "dense_net", "serving", "features"):
        if key not in doc:
            raise SpecError(f"the spec needs a [{key}] section")
    model = parse_section(ModelSection, doc["model"], "model")
    net = parse_section(DenseNetSection, doc["dense_net"], "dense_net")
    serving = parse_section(ServingSection, doc["serving"], "serving")
    inputs = parse_section(InputsSection, doc.get("inputs", {}), "inputs")
    dim = model.embedding_dim
    tables = _parse_tables(doc.get("tables", {}), dim)
    features = _parse_features(doc["features"], tables)
    tables = {name: replace(t, dim=t.dim or dim) for name, t in tables.items()}
    if not any(not c.as_list for c in features.raw_columns):
        raise SpecError(
            "a spec needs at least one categorical, time or multi-hot feature in the categorical tensor "
            "(multi-hot lists alone are not enough)"
        )
    targets, sequences = _attention(features)
    named: list[Feature] = [*features.categorical, *features.multi_hot, *targets, *sequences]
    used = [f.table for f in named]
    for feature in named:
        if feature.table not in tables:
            raise SpecError(f"feature {feature.name!r} uses undefined table {feature.table!r}")
    unused = sorted(set(tables) - set(used))
    if unused:
        raise SpecError(f"tables {unused} are used by no feature")
    attending = sorted({t.table for t in targets} | {s.table for s in sequences})
    narrow = [name for name in attending if tables[name].dim != dim]
    if narrow:
        raise SpecError(f"tables {narrow} of sequences and their targets must have embedding_dim={dim}")
    slots = [f.table for f in features.categorical] + [f.table for f in features.multi_hot]
    if not any(tables[table].dim == dim for table in slots):
        raise SpecError(f"at least one categorical or multi-hot feature needs a table of embedding_dim={dim}")
    clashes = sorted({*inputs.ignore, inputs.label} & features.names)
    if clashes:
        raise SpecError(f"[inputs] names feature columns {clashes} as label or ignored")
    if inputs.user and inputs.user not in {c.name for c in features.raw_columns if not c.separator}:
        raise SpecError(f"[inputs] user {inputs.user!r} is not a single-valued categorical column")
    if inputs.user and not sequences:
        raise SpecError(f"[inputs] user {inputs.user!r}: a spec without a sequence has no candidate lists")
    columns = {c.name for c in features.numeric} | {c.name for c in features.raw_columns}
    for pattern in inputs.profile:
        unknown = [name for name in expand_names(pattern) if name not in columns]
        if unknown:
            raise SpecError(
                f"[inputs] profile {pattern!r}: {unknown} not numeric, categorical or multi-hot columns"
            )
    if inputs.profile and not sequences:
        raise SpecError("[inputs] profile: a spec without a sequence has no candidate lists")
    if net.bottom_mlp[-1] != dim:
        raise SpecError(f"bottom_mlp must end at embedding_dim={dim}, got {net.bottom_mlp[-1]}")
    batch_buckets = tuple(sorted(serving.batch_buckets))
    seq_buckets = tuple(sorted(serving.sequence_buckets))
    max_batch = model.max_batch_size
    if batch_buckets[-1] != max_batch:
        raise SpecError(f"largest batch bucket {batch_buckets[-1]} must equal max_batch_size {max_batch}")
    if not sequences and seq_buckets != (1,):
        raise SpecError(f"a spec without a sequence has sequence_buckets = [1], got {list(seq_buckets)}")
    longest = max((s.max_length for s in sequences), default=0)
    if sequences and seq_buckets[-1] != longest:
        raise SpecError(
            f"largest sequence bucket {seq_buckets[-1]} must equal the longest max_length {longest}"
        )
    preferred = tuple(sorted(serving.preferred_batch_size))
    if any(not 1 <= size <= max_batch for size in preferred):
        raise SpecError(f"preferred_batch_size {list(preferred)} must lie in 1..max_batch_size {max_batch}")
    serving.check()
    serving.queue.check("serving.queue")
    for name, policy in serving.queue_profiles.items():
        if not name.isidentifier():
            raise SpecError(f"serving.queue_profiles: {name!r} must be an identifier (it names config files)")
        policy.check(f"serving.queue_profiles.{name}")
    if model.output not in DENSE_OUTPUTS:
        raise SpecError(f"model.output must be one of {', '.join(DENSE_OUTPUTS)}, got {model.output!r}")
    if dim % net.attention_heads:
        raise SpecError("embedding_dim must be divisible by attention_heads")
    if isinstance(doc.get("store"), dict) and "redis_password" in doc["store"]:
        raise SpecError(  # the spec is copied into every config.pbtxt: no secret may live in it
            "[store] redis_password: the spec does not hold passwords; put it in an environment "
            "variable of the servers and name that variable in redis_password_env"
        )
    store = parse_section(StoreSection, doc.get("store", {}), "store")
    store.check(tables)
    fp16 = tuple(name for name, t in tables.items() if t.dtype == "fp16")
    store = replace(store, float16_tables=tuple(dict.fromkeys((*store.float16_tables, *fp16))))
    access = parse_section(AccessSection, doc.get("access", {}), "access")
    access.check()
    numeric = tuple(features.numeric)
    return ModelSpec(
        name=model.name,
        version=model.version,
        max_batch_size=max_batch,
        embedding_dim=dim,
        bottom_mlp=net.bottom_mlp,
        top_mlp=net.top_mlp,
        attention_heads=net.attention_heads,
        batch_buckets=batch_buckets,
        sequence_buckets=seq_buckets,
        max_queue_delay_microseconds=serving.max_queue_delay_microseconds,
        instances=dict(serving.instances),
        dense=DenseGroup(NUMERIC_INPUT, numeric) if numeric else None,
        categorical=CategoricalGroup(
            CATEGORICAL_INPUT,
            tuple(features.raw_columns),
            tuple(features.categorical),
            tuple(features.multi_hot),
        ),
        tables=tables,
        training=parse_section(TrainingSection, doc.get("training", {}), "training"),
        hash_namespace=parse_section(HashingSection, doc.get("hashing", {}), "hashing").namespace,
        preferred_batch_sizes=preferred,
        queue=serving.queue,
        queue_profiles=dict(serving.queue_profiles),
        store=store,
        dense_output=model.output,
        source={key: value for key, value in doc.items() if key != "access"},
        access=access,
        inputs=inputs,
        sequences=sequences,
        targets=targets,
    )


def spec_path(name: str = DEFAULT_SPEC) -> Path:
    """Path of a bundled spec (``build/specs/<name>.toml``) or of a file given by path."""
    candidate = Path(name)
    if candidate.suffix in (".toml", ".json") and candidate.exists():
        return candidate
    return Path(str(resources.files("recserve.build").joinpath("specs", f"{name}.toml")))


def load_spec(name: str | Path = DEFAULT_SPEC) -> ModelSpec:
    """Load and check a spec by bundled name or by path (``.toml``, or ``.json`` as served models get it)."""
    path = spec_path(str(name))
    if path.suffix == ".json":
        return spec_from_json(path.read_text())
    text = path.read_text()
    try:
        return parse_spec(tomllib.loads(text))
    except UnknownKeyError as exc:
        line = key_line(text, exc.where, exc.key)
        if line is None:
            raise
        raise SpecError(f"{path}, line {line}: {exc}") from None


def key_line(text: str, where: str, key: str) -> int | None:
    """The line (1-based) of a TOML text where ``key`` of table ``where`` is written, or None.

    ``where`` is a table path (``store``, ``serving.queue``), ``features[N] (...)`` for the N-th
    ``[[features]]`` entry, or ``spec`` for the top level.
    """
    array = re.match(r"(\w+)\[(\d+)\]", where)
    seen, inside = -1, where == "spec"
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"^\s*(\[\[?)\s*([\w.\"{}]+)\s*\]", line)
        if header:
            brackets, name = header[1], header[2].replace('"', "")  # [tables."C{1..3}"]: tables.C{1..3}
            if where == "spec" and name.split(".")[0] == key:
                return number
            if array and brackets == "[[" and name == array[1]:
                seen += 1
                inside = seen == int(array[2])
            else:
                inside = not array and brackets == "[" and name == where
        elif inside and re.match(rf"^\s*{re.escape(key)}\s*=", line):
            return number
    return None


def spec_from_json(text: str) -> ModelSpec:
    """Rebuild a spec from :meth:`ModelSpec.to_json` (as passed to served models)."""
    return parse_spec(json.loads(text))


__all__ = [
    "AttentionGroup",
    "CategoricalFeature",
    "DenseGroup",
    "CategoricalGroup",
    "NumericColumn",
    "RawColumn",
    "expand_names",
    "ModelSpec",
    "QueuePolicy",
    "SequenceFeature",
    "SpecError",
    "StoreSection",
    "TableSpec",
    "TrainingSection",
    "WireTensor",
    "NUMPY_DTYPES",
    "load_spec",
    "parse_spec",
    "spec_from_json",
    "spec_path",
]
