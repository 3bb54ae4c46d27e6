"""The model spec: everything recserve needs to know about one model, derived from its TOML file.

Feature names, wire tensors, tables, embedding dims, network sizes, buckets, batch limits and
instance counts are all read from here; configs, the ONNX export, the client and perf data derive
from the objects below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from recserve.core.name_ranges import expand_names
from recserve.core.names import BYTES_WIRE, IDS_WIRE
from recserve.core.sections.base import SpecError
from recserve.core.sections.degrade import CALLER_ORDER_SUFFIX, DegradeSection
from recserve.core.sections.logging import LoggingSection
from recserve.core.sections.loop import LoopSection
from recserve.core.sections.serving import (
    AccessSection,
    DenseNetSection,
    HashingSection,
    InputsSection,
    ModelSection,
    ServingSection,
    StoreSection,
    TrainingSection,
)
from recserve.core.sections.user_state import UserStateSection
from recserve.core.spec.types import (
    NUMERIC_INPUT,
    AttentionGroup,
    CategoricalFeature,
    CategoricalGroup,
    DenseGroup,
    ProfilePart,
    SequenceFeature,
    TableSpec,
    WireTensor,
)
from recserve.core.wire_forms import WireForm, bytes_form, check_form, id_form, split_user_inputs


@dataclass(frozen=True)
class ModelSpec:
    """Everything recserve needs to know about one model."""

    model: ModelSection
    dense_net: DenseNetSection
    serving: ServingSection  # buckets and preferred sizes sorted
    dense: DenseGroup | None  # None: no numeric features
    categorical: CategoricalGroup
    tables: dict[str, TableSpec]
    training: TrainingSection = field(default_factory=TrainingSection)
    hashing: HashingSection = field(default_factory=HashingSection)
    store: StoreSection = field(default_factory=StoreSection)
    source: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    access: AccessSection = field(default_factory=AccessSection)  # the proxy's: not in ``source``
    inputs: InputsSection = field(default_factory=InputsSection)
    # every sequence, group by group (see :attr:`attention_groups`), and the target of each
    sequences: tuple[SequenceFeature, ...] = ()
    targets: tuple[CategoricalFeature, ...] = ()
    user_state: UserStateSection = field(default_factory=UserStateSection)  # off by default
    logging: LoggingSection = field(default_factory=LoggingSection)  # request logging: off by default
    loop: LoopSection = field(default_factory=LoopSection)  # the joiner (recserve join)
    degrade: DegradeSection = field(default_factory=DegradeSection)  # value-aware degradation: off by default

    # ---- derived names -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The served model's name (``[model] name``)."""
        return self.model.name

    @property
    def version(self) -> int:
        """The served model's version (``[model] version``)."""
        return self.model.version

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
        return tuple(self.dense.numeric[i].name for i in self.dense.normalized) if self.dense else ()

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
        # no numeric tensor when every numeric feature reads another feature's column
        if self.dense is not None and self.dense.columns:
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
        return (tuple(tensors), *split_user_inputs(tensors, per_user, self.profile_parts))

    def wire_form(self, form: str = BYTES_WIRE) -> WireForm:
        """One form of the wire (``ids`` or ``bytes``, see :mod:`recserve.core.wire_forms`).

        The bytes form's tensors are :meth:`wire_inputs`, :meth:`user_inputs` and :meth:`candidate_inputs`.

        Raises:
            ValueError: ``form`` is neither.
        """
        return self._wire_forms[check_form(form)]

    @cached_property
    def _wire_forms(self) -> dict[str, WireForm]:
        return {BYTES_WIRE: bytes_form(self), IDS_WIRE: id_form(self)}

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
        if self.dense is not None and self.dense.columns:  # the values and their mask: same columns
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
    def caller_order_models(self) -> dict[str, str]:
        """By ensemble, the model answering its caller's-order level (``[degrade]``); none without one."""
        if self.degrade.order_level is None:
            return {}
        ensembles = (self.name, *((self.candidates_model,) if self.candidates_model else ()))
        return {name: name + CALLER_ORDER_SUFFIX for name in ensembles}

    @property
    def table_names(self) -> tuple[str, ...]:
        """Embedding tables in spec order: ``[tables.*]`` first, then one per categorical column.

        The ``embedding_version`` output lists each table's served version in this order.
        """
        return tuple(self.tables)

    @property
    def num_sparse(self) -> int:
        """Number of categorical embeddings of ``embedding_dim`` (``sparse_embeddings``'s slots)."""
        return len(self.sparse_slots(self.model.embedding_dim))

    @cached_property
    def slot_dims(self) -> tuple[int, ...]:
        """Each categorical embedding's width, in the order of :attr:`CategoricalGroup.slot_names`."""
        return tuple(self.tables[table].dim for table in self.categorical.slot_tables)

    @property
    def other_widths(self) -> tuple[int, ...]:
        """The widths of categorical tables other than ``embedding_dim``, ascending."""
        return tuple(sorted(set(self.slot_dims) - {self.model.embedding_dim}))

    def sparse_slots(self, width: int) -> tuple[int, ...]:
        """The categorical embeddings of one width, as indices of :attr:`CategoricalGroup.slot_names`."""
        return tuple(i for i, d in enumerate(self.slot_dims) if d == width)

    def sequence_bucket(self, length: int) -> int:
        """Smallest sequence bucket holding ``length`` positions (at least the first bucket)."""
        for bucket in self.serving.sequence_buckets:
            if length <= bucket:
                return bucket
        raise SpecError(
            f"sequence length {length} exceeds the largest bucket {self.serving.sequence_buckets[-1]}"
        )

    def batch_bucket(self, rows: int) -> int:
        """Smallest batch bucket holding ``rows`` rows."""
        for bucket in self.serving.batch_buckets:
            if rows <= bucket:
                return bucket
        raise SpecError(f"batch of {rows} rows exceeds the largest bucket {self.serving.batch_buckets[-1]}")

    def to_json(self) -> str:
        """JSON of the source document (what served models receive), in the document's own order."""
        # in the document's order: the tables' order is the order of ``embedding_version``
        return json.dumps(self.source, separators=(",", ":"))
