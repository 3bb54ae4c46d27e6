"""The spec's value objects: wire tensors, tables, columns, feature groups and attention groups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

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

    name: str  # the tensor of the row layout; the candidates' part keeps this name
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
    cardinality: int  # 0: not given (an imported table's rows come from its files)
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
    reads: str = ""  # the column it reads ("": its own column of ``dense``): a numeric or categorical one
    categorical: int = -1  # the index of the categorical raw column it reads (-1: a column of ``dense``)
    real: bool = False  # real values (prices), not counts: what synthetic rows hold
    indicator: bool = False  # the missing flag of the column it reads: 1.0 where missing, else 0.0

    def describe(self) -> str:
        """The ops as a formula, for the dense contract (``x``, or the column it reads by name)."""
        if self.indicator:
            return f"1 where {self.reads} is missing, else 0"
        text = self.reads or "x"
        if self.clip_min > -math.inf or self.clip_max < math.inf:
            text = f"clip({text}, {self.clip_min:g}, {self.clip_max:g})"
        if self.log1p:
            text = f"log1p({text})"
        if self.shift or self.scale != 1.0:
            text = f"({text} - {self.shift:g}) / {self.scale:g}"
        return f"{text}, missing {self.fill_na:g}"


@dataclass(frozen=True)
class DenseGroup:
    """The numeric features; those with a column of their own are sent as one FP32 tensor and a missing mask.

    A numeric feature may read another feature's column (``column = "C15"``): a numeric column of
    the wire tensor, or an int64 / uint64 column of ``categorical`` read as a number. The wire
    carries each column once.
    """

    name: str
    numeric: tuple[NumericColumn, ...]

    @cached_property  # these are read on every request
    def columns(self) -> tuple[str, ...]:
        """The wire tensor's column names, in wire order (the features reading a column of their own)."""
        return tuple(c.name for c in self.numeric if not c.reads)

    @cached_property
    def wire_index(self) -> tuple[int, ...]:
        """Per numeric feature, the wire column it reads (-1: a column of ``categorical``)."""
        return tuple(self.columns.index(c.reads or c.name) if c.categorical < 0 else -1 for c in self.numeric)

    @cached_property
    def derived(self) -> bool:
        """True when some numeric feature reads another feature's column."""
        return any(c.reads for c in self.numeric)

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
    def slot_tables(self) -> tuple[str, ...]:
        """The table of each embedding, parallel to :attr:`slot_names` (a slot is a feature and a table)."""
        return tuple(f.table for f in self.features) + tuple(f.table for f in self.multi_hot)

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

    @cached_property  # read on every request
    def single_by_type(self) -> dict[str, list[int]]:
        """Indices of the single-valued raw columns (multi-hot ones apart) by value type."""
        by_type: dict[str, list[int]] = {}
        for i, column in enumerate(self.raw_columns):
            if not column.separator:
                by_type.setdefault(column.value_type, []).append(i)
        return by_type


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
    combine: str = "sum"  # with the sequences sharing its positions: sum, or concat (side by side)


#: Any feature that has a name and a table.
Feature = CategoricalFeature | MultiHotFeature | SequenceFeature


@dataclass(frozen=True)
class AttentionGroup:
    """A sequence with its own positions, the sequences sharing them, and the target of each.

    The built-in network attends over each group with one query: the group's sequences are summed
    at each position, and so are their targets; or, with ``combine = "concat"``, laid side by side
    (each at its table's width), and so are their targets. Every group has its own length input and
    mask.
    """

    sequences: tuple[SequenceFeature, ...]
    targets: tuple[CategoricalFeature, ...]

    @property
    def primary(self) -> SequenceFeature:
        """The sequence whose positions the group shares."""
        return self.sequences[0]

    @property
    def combine(self) -> str:
        """How the group's sequences (and targets) reach the dense network: ``sum`` or ``concat``."""
        return self.primary.combine

    @property
    def length_input(self) -> str:
        """Wire name of the group's per-row length (``<first sequence>__length``)."""
        return f"{self.primary.name}__length"
