"""Reading a spec: a TOML or JSON document checked and built into a ``ModelSpec``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from recserve.core.name_ranges import expand_names
from recserve.core.sections.base import SpecError, UnknownKeyError, parse_section
from recserve.core.sections.degrade import DegradeSection
from recserve.core.sections.features import TOP_LEVEL_KEYS
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
    current_names,
)
from recserve.core.sections.user_state import UserStateSection
from recserve.core.spec.defaults import (
    check_first_order,
    default_dense_net,
    default_embedding_dim,
    default_serving,
)
from recserve.core.spec.features import attention_features, parse_features, parse_tables
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import (
    CATEGORICAL_INPUT,
    DEFAULT_SPEC,
    DENSE_OUTPUTS,
    NUMERIC_INPUT,
    CategoricalGroup,
    DenseGroup,
    Feature,
)


def parse_spec(doc: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed TOML/JSON document, checking consistency.

    Raises:
        SpecError: a key is unknown or missing, a value has the wrong type, or parts disagree.
    """
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            raise UnknownKeyError("spec", str(key), sorted(TOP_LEVEL_KEYS))
    for key in ("model", "features"):  # [dense_net] and [serving] have defaults
        if key not in doc:
            raise SpecError(f"the spec needs a [{key}] section")
    model = parse_section(ModelSection, doc["model"], "model")
    net = parse_section(DenseNetSection, doc.get("dense_net", {}), "dense_net")
    serving = parse_section(ServingSection, current_names("serving", doc.get("serving", {})), "serving")
    inputs = parse_section(InputsSection, doc.get("inputs", {}), "inputs")
    tables = parse_tables(doc.get("tables", {}), model.embedding_dim)
    dim = default_embedding_dim(model.embedding_dim, tables)
    model, net = replace(model, embedding_dim=dim), default_dense_net(net, dim)
    features = parse_features(doc["features"], tables)
    tables = {name: replace(t, dim=t.dim or dim) for name, t in tables.items()}
    if not any(not c.as_list for c in features.raw_columns):
        raise SpecError(
            "a spec needs at least one categorical, time or multi-hot feature in the categorical tensor "
            "(multi-hot lists alone are not enough)"
        )
    targets, sequences = attention_features(features)
    named: list[Feature] = [*features.categorical, *features.multi_hot, *targets, *sequences]
    used = [f.table for f in named]
    for feature in named:
        if feature.table not in tables:
            raise SpecError(f"feature {feature.name!r} uses undefined table {feature.table!r}")
    unused = sorted(set(tables) - set(used))
    if unused:
        raise SpecError(f"tables {unused} are used by no feature")
    for sequence in sequences:  # a target shares its sequence's table
        width = tables[sequence.table].dim
        if sequence.combine == "sum" and width != dim:
            raise SpecError(
                f"sequence {sequence.name!r} is summed with its group: its table {sequence.table!r} needs "
                f'embedding_dim={dim}, got dim {width} (or combine = "concat" on the group\'s first sequence)'
            )
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
    columns = {c.name for c in features.numeric if not c.reads} | {c.name for c in features.raw_columns}
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
    check_first_order(net, dim, [tables[t].dim for t in slots])
    serving = default_serving(
        serving, model.max_batch_size, max((s.max_length for s in sequences), default=0)
    )
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
    if serving.gpu_max_batch_size and serving.gpu_max_batch_size < max_batch:
        raise SpecError(
            f"[serving] gpu_max_batch_size {serving.gpu_max_batch_size} is below max_batch_size {max_batch} "
            "(0: the GPU profiles take max_batch_size)"
        )
    serving.check()
    serving.queue.check("serving.queue")
    for name, policy in serving.queue_policies.items():
        if not name.isidentifier():
            raise SpecError(f"serving.queue_policies: {name!r} must be an identifier (it names config files)")
        policy.check(f"serving.queue_policies.{name}")
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
    access = parse_section(AccessSection, current_names("access", doc.get("access", {})), "access")
    access.check()
    user_state = parse_section(UserStateSection, doc.get("user_state", {}), "user_state")
    user_state.check(seq_buckets[-1])
    apart = [s.name for s in sequences[1:] if s.positions != sequences[0].name]
    if user_state.enabled and apart:  # refused here, not first by the server
        raise SpecError(
            f"[user_state] keeps one behaviour sequence per user, with the sequences aligned to it "
            f"(positions = {sequences[0].name!r}) as its events' attributes; not aligned to it: "
            f"{', '.join(apart)}. Serve the spec with [user_state] enabled = false"
        )
    seq_buckets = user_state.state_buckets(seq_buckets)
    request_log = parse_section(LoggingSection, doc.get("logging", {}), "logging")
    request_log.check()
    loop = parse_section(LoopSection, doc.get("loop", {}), "loop")
    loop.check(tables)
    degrade = parse_section(DegradeSection, doc.get("degrade", {}), "degrade")
    degrade.check(seq_buckets)
    numeric = tuple(features.numeric)
    spec = ModelSpec(
        model=model,
        dense_net=net,
        serving=replace(
            serving, batch_buckets=batch_buckets, sequence_buckets=seq_buckets, preferred_batch_size=preferred
        ),
        dense=DenseGroup(NUMERIC_INPUT, numeric) if numeric else None,
        categorical=CategoricalGroup(
            CATEGORICAL_INPUT,
            tuple(features.raw_columns),
            tuple(features.categorical),
            tuple(features.multi_hot),
        ),
        tables=tables,
        training=parse_section(TrainingSection, doc.get("training", {}), "training"),
        hashing=parse_section(HashingSection, doc.get("hashing", {}), "hashing"),
        store=store,
        source={key: value for key, value in doc.items() if key != "access"},
        access=access,
        inputs=inputs,
        sequences=sequences,
        targets=targets,
        user_state=user_state,
        logging=request_log,
        loop=loop,
        degrade=degrade,
    )
    try:
        small_dense_spec(spec)  # the smaller network's sizes are checked as [dense_net]'s
    except SpecError as exc:
        raise SpecError(f"[degrade.small_dense]: {exc}") from None
    return spec


def small_dense_spec(spec: ModelSpec) -> ModelSpec | None:
    """The spec of ``[degrade.small_dense]``'s network: ``spec`` with those sizes as its ``[dense_net]``.

    The same features, tables and buckets (so the same inputs), ``first_order`` as the full network's
    unless the section sets it, and ``[degrade]`` off (the smaller network has no smaller one).
    None: no level of the spec is scored by a smaller network.
    """
    if not spec.degrade.small_levels:
        return None
    degrade = spec.source["degrade"]
    net = {"first_order": spec.dense_net.first_order, **degrade["small_dense"]}
    return parse_spec({**spec.source, "dense_net": net, "degrade": {**degrade, "enabled": False}})


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
