"""The model spec: one TOML file per model, the single source of truth.

Feature names, wire tensors, tables, embedding dims, network sizes, buckets, batch limits and
instance counts are all read from here; configs, the ONNX export, the client and perf data derive
from the objects below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

DEFAULT_SPEC = "ctr"


class SpecError(ValueError):
    """The spec file is inconsistent."""


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a request: Triton dtype name and per-row dims (-1: variable)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    ragged: bool = False  # rows of different requests may differ in the variable dim


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


@dataclass(frozen=True)
class DenseGroup:
    """Integer count features sent together as one FP32 tensor plus a missing mask."""

    name: str
    columns: tuple[str, ...]
    clip_min: float
    clip_max: float


@dataclass(frozen=True)
class CategoricalFeature:
    """A single-valued categorical column mapped to a key in its table."""

    name: str
    table: str
    encoding: str  # "hex" (string of hex digits) or "int" (non-negative id)
    pooling: str


@dataclass(frozen=True)
class HexGroup:
    """Hex-string categorical columns sent together as one BYTES tensor."""

    name: str
    features: tuple[CategoricalFeature, ...]
    max_hex_digits: int

    @property
    def columns(self) -> tuple[str, ...]:
        """Column names in wire order."""
        return tuple(f.name for f in self.features)


@dataclass(frozen=True)
class SequenceFeature:
    """A variable-length list of ids, padded to a sequence bucket with a mask."""

    name: str
    table: str
    max_length: int
    mean_length: float


@dataclass(frozen=True)
class QueuePolicy:
    """How the steps' queues shed load (Triton's ``default_queue_policy`` of each step).

    The first step is the admission gate: at most ``entry_max_queue_size`` requests wait there and
    a request that waited ``entry_timeout_microseconds`` without starting is refused (UNAVAILABLE),
    before any work is spent on it. Later steps hold up to ``max_queue_size`` requests for up to
    ``default_timeout_microseconds``. 0 means no limit (and a step without any limit gets no
    policy at all).
    """

    entry_max_queue_size: int = 32
    max_queue_size: int = 128
    default_timeout_microseconds: int = 1_000_000
    entry_timeout_microseconds: int | None = None  # None: default_timeout_microseconds
    timeout_action: str = "REJECT"

    @property
    def entry_timeout(self) -> int:
        """The first step's queue timeout in microseconds (0: none)."""
        return self.default_timeout_microseconds if self.entry_timeout_microseconds is None else self.entry_timeout_microseconds

    def check(self, name: str) -> None:
        """Raise :class:`SpecError` on negative limits or an unknown action."""
        limits = (self.entry_max_queue_size, self.max_queue_size, self.default_timeout_microseconds, self.entry_timeout)
        if min(limits) < 0 or self.timeout_action not in ("REJECT", "DELAY"):
            raise SpecError(f"{name} needs limits >= 0 (0: none) and timeout_action REJECT or DELAY, got {self}")


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
    dense: DenseGroup
    categorical: HexGroup
    target: CategoricalFeature
    sequence: SequenceFeature
    tables: dict[str, TableSpec]
    training: dict[str, Any]
    hash_namespace: str
    preferred_batch_sizes: tuple[int, ...] = ()
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    queue_profiles: dict[str, QueuePolicy] = field(default_factory=dict)
    source: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    # ---- derived names -------------------------------------------------------------------
    @property
    def sequence_length_input(self) -> str:
        """Wire name of the per-row sequence length."""
        return f"{self.sequence.name}__length"

    @property
    def dense_missing_input(self) -> str:
        """Wire name of the dense missing-value mask."""
        return f"{self.dense.name}__missing"

    def wire_inputs(self) -> tuple[WireTensor, ...]:
        """The raw-feature inputs of the ensemble, as clients send them."""
        return (
            WireTensor(self.dense.name, "FP32", (len(self.dense.columns),)),
            WireTensor(self.dense_missing_input, "BOOL", (len(self.dense.columns),)),
            WireTensor(self.categorical.name, "BYTES", (len(self.categorical.features),)),
            WireTensor(self.target.name, "INT64", (1,)),
            WireTensor(self.sequence.name, "INT64", (-1,), ragged=True),
            WireTensor(self.sequence_length_input, "INT32", (1,)),
        )

    @property
    def table_names(self) -> tuple[str, ...]:
        """Embedding tables in spec order: ``[tables.*]`` first, then one per categorical column.

        The ``embedding_version`` output lists each table's served version in this order.
        """
        return tuple(self.tables)

    @property
    def num_sparse(self) -> int:
        """Number of single-valued categorical embeddings fed to the interaction."""
        return len(self.categorical.features)

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
        """Canonical JSON of the source document (what served models receive)."""
        return json.dumps(self.source, sort_keys=True, separators=(",", ":"))


def _table(name: str, raw: dict[str, Any], dim: int) -> TableSpec:
    return TableSpec(
        name=name,
        dim=int(raw.get("dim", dim)),
        cardinality=int(raw["cardinality"]),
        zipf_exponent=float(raw.get("zipf_exponent", 1.05)),
    )


def parse_spec(doc: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed TOML/JSON document, checking consistency."""
    model = doc["model"]
    dim = int(model["embedding_dim"])
    tables: dict[str, TableSpec] = {
        name: _table(name, raw, dim) for name, raw in doc.get("tables", {}).items()
    }
    dense = categorical = target = sequence = None
    for raw in doc["features"]:
        kind = raw["kind"]
        if kind == "dense":
            cols = tuple(f"{raw['prefix']}{i + 1}" for i in range(int(raw["count"])))
            dense = DenseGroup(raw["name"], cols, float(raw["clip_min"]), float(raw["clip_max"]))
        elif kind == "categorical" and raw.get("encoding", "hex") == "hex":
            count = int(raw["count"])
            cards = list(raw["cardinalities"])
            if len(cards) != count:
                raise SpecError(f"{raw['name']}: {count} columns but {len(cards)} cardinalities")
            feats = []
            for i in range(count):
                col = f"{raw['prefix']}{i + 1}"
                tables[col] = TableSpec(col, dim, int(cards[i]), float(raw.get("zipf_exponent", 1.05)))
                feats.append(CategoricalFeature(col, col, "hex", raw.get("pooling", "sum")))
            categorical = HexGroup(raw["name"], tuple(feats), int(raw.get("max_hex_digits", 16)))
        elif kind == "categorical":
            target = CategoricalFeature(raw["name"], raw["table"], "int", raw.get("pooling", "sum"))
        elif kind == "sequence":
            sequence = SequenceFeature(
                raw["name"], raw["table"], int(raw["max_length"]), float(raw["mean_length"])
            )
        else:
            raise SpecError(f"unknown feature kind {kind!r} for feature {raw.get('name')!r}")
    if dense is None or categorical is None or target is None or sequence is None:
        raise SpecError("a spec needs one dense, one hex categorical, one int categorical and one sequence feature")
    for feat in (target, sequence):
        if feat.table not in tables:
            raise SpecError(f"feature {feat.name!r} uses undefined table {feat.table!r}")
    if any(t.dim != dim for t in tables.values()):
        raise SpecError(f"every table must have embedding_dim={dim} for the dot interaction")
    net = doc["dense_net"]
    bottom = tuple(int(x) for x in net["bottom_mlp"])
    if bottom[-1] != dim:
        raise SpecError(f"bottom_mlp must end at embedding_dim={dim}, got {bottom[-1]}")
    serving = doc["serving"]
    batch_buckets = tuple(sorted(int(x) for x in serving["batch_buckets"]))
    seq_buckets = tuple(sorted(int(x) for x in serving["sequence_buckets"]))
    max_batch = int(model["max_batch_size"])
    if batch_buckets[-1] != max_batch:
        raise SpecError(f"largest batch bucket {batch_buckets[-1]} must equal max_batch_size {max_batch}")
    if seq_buckets[-1] != sequence.max_length:
        raise SpecError(
            f"largest sequence bucket {seq_buckets[-1]} must equal max_length {sequence.max_length}"
        )
    preferred = tuple(sorted(int(x) for x in serving.get("preferred_batch_size", ())))
    if any(not 1 <= size <= max_batch for size in preferred):
        raise SpecError(f"preferred_batch_size {list(preferred)} must lie in 1..max_batch_size {max_batch}")
    queue = QueuePolicy(**serving.get("queue", {}))
    queue.check("serving.queue")
    queue_profiles = {name: QueuePolicy(**raw) for name, raw in serving.get("queue_profiles", {}).items()}
    for name, policy in queue_profiles.items():
        if not name.isidentifier():
            raise SpecError(f"serving.queue_profiles: {name!r} must be an identifier (it names config files)")
        policy.check(f"serving.queue_profiles.{name}")
    if dim % int(net["attention_heads"]):
        raise SpecError("embedding_dim must be divisible by attention_heads")
    return ModelSpec(
        name=model["name"],
        version=int(model.get("version", 1)),
        max_batch_size=max_batch,
        embedding_dim=dim,
        bottom_mlp=bottom,
        top_mlp=tuple(int(x) for x in net["top_mlp"]),
        attention_heads=int(net["attention_heads"]),
        batch_buckets=batch_buckets,
        sequence_buckets=seq_buckets,
        max_queue_delay_microseconds=int(serving["max_queue_delay_microseconds"]),
        instances={k: int(v) for k, v in serving["instances"].items()},
        dense=dense,
        categorical=categorical,
        target=target,
        sequence=sequence,
        tables=tables,
        training=dict(doc.get("training", {})),
        hash_namespace=doc.get("hashing", {}).get("namespace", "recserve"),
        preferred_batch_sizes=preferred,
        queue=queue,
        queue_profiles=queue_profiles,
        source=doc,
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
    with open(path, "rb") as fh:
        return parse_spec(tomllib.load(fh))


def spec_from_json(text: str) -> ModelSpec:
    """Rebuild a spec from :meth:`ModelSpec.to_json` (as passed to served models)."""
    return parse_spec(json.loads(text))


__all__ = [
    "CategoricalFeature",
    "DenseGroup",
    "HexGroup",
    "ModelSpec",
    "QueuePolicy",
    "SequenceFeature",
    "SpecError",
    "TableSpec",
    "WireTensor",
    "NUMPY_DTYPES",
    "load_spec",
    "parse_spec",
    "spec_from_json",
    "spec_path",
]
