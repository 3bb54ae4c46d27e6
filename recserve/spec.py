"""The model spec: one TOML file per model, the single source of truth.

Feature names, wire tensors, tables, embedding dims, network sizes, buckets, batch limits and
instance counts are all read from here; configs, the ONNX export, the client and perf data derive
from the objects below.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from recserve.sections import (
    TOP_LEVEL_KEYS,
    AccessSection,
    DenseNetSection,
    HashingSection,
    ModelSection,
    QueuePolicy,
    ServingSection,
    SpecError,
    StoreSection,
    TableSection,
    TrainingSection,
    UnknownKeyError,
    check_feature_keys,
    parse_section,
)

DEFAULT_SPEC = "ctr"
DEFAULT_REPOSITORY = Path("model_repository")  # where recserve build writes and the commands read
#: What a dense ONNX may return (``[model] output``); a logit is served as its sigmoid.
DENSE_OUTPUTS = ("probability", "logit")


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
    training: TrainingSection
    hash_namespace: str
    preferred_batch_sizes: tuple[int, ...] = ()
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    queue_profiles: dict[str, QueuePolicy] = field(default_factory=dict)
    store: StoreSection = field(default_factory=StoreSection)
    dense_output: str = "probability"
    source: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    access: AccessSection = field(default_factory=AccessSection)  # the proxy's: not in ``source``

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
    dim = model.embedding_dim
    tables: dict[str, TableSpec] = {}
    for name, raw in doc.get("tables", {}).items():
        table = parse_section(TableSection, raw, f"tables.{name}")
        tables[name] = TableSpec(name, table.dim or dim, table.cardinality, table.zipf_exponent)
    dense = categorical = target = sequence = None
    for position, raw in enumerate(doc["features"]):
        check_feature_keys(raw, position)
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
        else:
            sequence = SequenceFeature(
                raw["name"], raw["table"], int(raw["max_length"]), float(raw["mean_length"])
            )
    if dense is None or categorical is None or target is None or sequence is None:
        raise SpecError(
            "a spec needs one dense, one hex categorical, one int categorical and one sequence feature"
        )
    for feat in (target, sequence):
        if feat.table not in tables:
            raise SpecError(f"feature {feat.name!r} uses undefined table {feat.table!r}")
    if any(t.dim != dim for t in tables.values()):
        raise SpecError(f"every table must have embedding_dim={dim} for the dot interaction")
    if net.bottom_mlp[-1] != dim:
        raise SpecError(f"bottom_mlp must end at embedding_dim={dim}, got {net.bottom_mlp[-1]}")
    batch_buckets = tuple(sorted(serving.batch_buckets))
    seq_buckets = tuple(sorted(serving.sequence_buckets))
    max_batch = model.max_batch_size
    if batch_buckets[-1] != max_batch:
        raise SpecError(f"largest batch bucket {batch_buckets[-1]} must equal max_batch_size {max_batch}")
    if seq_buckets[-1] != sequence.max_length:
        raise SpecError(
            f"largest sequence bucket {seq_buckets[-1]} must equal max_length {sequence.max_length}"
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
    store = parse_section(StoreSection, doc.get("store", {}), "store")
    store.check(tables)
    access = parse_section(AccessSection, doc.get("access", {}), "access")
    access.check()
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
        dense=dense,
        categorical=categorical,
        target=target,
        sequence=sequence,
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
        header = re.match(r"^\s*(\[\[?)\s*([\w.]+)\s*\]", line)
        if header:
            if where == "spec" and header[2].split(".")[0] == key:
                return number
            if array and header[1] == "[[" and header[2] == array[1]:
                seen += 1
                inside = seen == int(array[2])
            else:
                inside = not array and header[1] == "[" and header[2] == where
        elif inside and re.match(rf"^\s*{re.escape(key)}\s*=", line):
            return number
    return None


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
