"""The tensors each ensemble step takes and returns, and their ``config.pbtxt`` entries.

One source for the generated configs (:mod:`recserve.build.configs`) and the configs of the echo
and monolith peers, all derived from the spec's dense contract.
"""

from __future__ import annotations

import dataclasses

from tritonclient.grpc import model_config_pb2 as mc

from recserve.core.candidate_lists import candidate_step_inputs, per_candidate_dense_inputs
from recserve.core.contract import dense_contract, dense_net_inputs, sequence_inputs
from recserve.core.names import (
    CANDIDATE_PREFIX,
    DENSE,
    DENSE_VERSION,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    PROBABILITY,
    WIRE_FORMS,
)
from recserve.core.sections.degrade import DEGRADE_LEVEL, REQUESTED_CANDIDATES
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import WireTensor
from recserve.core.user_state_wire import user_state_inputs

#: The spec's wire dtypes as config data types.
CONFIG_DTYPES = {
    "FP32": mc.TYPE_FP32,
    "INT64": mc.TYPE_INT64,
    "INT32": mc.TYPE_INT32,
    "BOOL": mc.TYPE_BOOL,
    "BYTES": mc.TYPE_STRING,
}


def intermediate_tensors(spec: ModelSpec) -> dict[str, WireTensor]:
    """Per-row shapes of the tensors passed between steps: the dense contract's inputs and the outputs."""
    contract, _ = dense_contract(spec)
    ragged = set(sequence_inputs(spec))  # each request at its own bucket
    items = (
        *(WireTensor(t.name, t.dtype, t.shape[1:], ragged=t.name in ragged) for t in contract),
        WireTensor(PROBABILITY, "FP32", (1,)),
        WireTensor(DENSE_VERSION, "INT64", (1,)),
        WireTensor(EMBEDDING_VERSION, "INT64", (len(spec.table_names),)),
    )
    return {t.name: t for t in items}


def request_inputs(spec: ModelSpec, part: str = "inputs") -> tuple[WireTensor, ...]:
    """The tensors of both wire forms (:mod:`recserve.core.wire_forms`), each once, the id form's first.

    A request carries one form, so every tensor is optional where Triton sees it: with optional
    inputs tritonserver 2.51 checks only how many inputs a request has, so a request missing a
    tensor both forms need (and carrying another) would pass it and stall the ensemble; the step
    refuses it instead, naming the input. The row layout and a list's user inputs end with the
    optional ``user_id`` and ``user_seq`` where ``[user_state]`` is on.

    Args:
        spec: the model spec.
        part: ``inputs`` (the row layout), ``user_inputs`` or ``candidate_inputs`` (a candidate list).
    """
    forms = [getattr(spec.wire_form(form), part) for form in WIRE_FORMS]
    union: dict[str, WireTensor] = {}
    for tensors in forms:
        for t in tensors:
            union.setdefault(t.name, dataclasses.replace(t, optional=True))
    return tuple(union.values()) + (user_state_inputs(spec) if part != "candidate_inputs" else ())


def step_io(
    spec: ModelSpec, profile: str = "cpu"
) -> dict[str, tuple[tuple[WireTensor, ...], tuple[WireTensor, ...]]]:
    """Inputs and outputs of each ensemble step.

    ``embedding_lookup`` takes the raw features (either wire form) and returns the dense network's
    inputs (and the table versions); a TensorRT ``dense``, profile ``gpu``, has no version output.
    """
    t = intermediate_tensors(spec)
    dense_inputs = tuple(t[n] for n in dense_net_inputs(spec))
    return {
        EMBEDDING_LOOKUP: (request_inputs(spec), (*dense_inputs, t[EMBEDDING_VERSION])),
        DENSE: (
            dense_inputs,
            (t[PROBABILITY],) if profile == "gpu" else (t[PROBABILITY], t[DENSE_VERSION]),
        ),
    }


def candidate_io(spec: ModelSpec) -> dict[str, tuple[tuple[WireTensor, ...], tuple[WireTensor, ...]]]:
    """What each Python step takes and returns besides :func:`step_io` for candidate lists.

    ``embedding_lookup`` takes the per-candidate wire inputs as ``candidate_<name>`` and returns the
    per-candidate dense inputs so named, ``[users, candidates, ...]``; ``dense`` takes those (the
    history and its mask, one row per user, travel under their own names). Empty for a spec
    without a candidates ensemble.
    """
    if spec.candidates_model is None:
        return {}
    t = intermediate_tensors(spec)
    per_candidate = tuple(
        WireTensor(CANDIDATE_PREFIX + n, t[n].dtype, (-1, *t[n].dims), ragged=True, optional=True)
        for n in per_candidate_dense_inputs(spec)
    )
    outputs = tuple(dataclasses.replace(x, ragged=False, optional=False) for x in per_candidate)
    return {
        EMBEDDING_LOOKUP: (candidate_step_inputs(spec), outputs),
        DENSE: (per_candidate, ()),
    }


def served_spec_parameter(spec: ModelSpec) -> dict[str, mc.ModelParameter]:
    """An ensemble's ``spec`` parameter: clients of the public models read the served spec from it."""
    return {"spec": mc.ModelParameter(string_value=spec.to_json())}


def model_input(t: WireTensor) -> mc.ModelInput:
    """A config ``input`` entry for a tensor."""
    return mc.ModelInput(
        name=t.name,
        data_type=CONFIG_DTYPES[t.dtype],
        dims=list(t.dims),
        allow_ragged_batch=t.ragged,
        optional=t.optional,
    )


def model_output(t: WireTensor) -> mc.ModelOutput:
    """A config ``output`` entry for a tensor."""
    return mc.ModelOutput(name=t.name, data_type=CONFIG_DTYPES[t.dtype], dims=list(t.dims))


def with_degrade(spec: ModelSpec, config: mc.ModelConfig, profile: str = "cpu") -> mc.ModelConfig:
    """``config`` with ``[degrade]``'s tensors added (as it is when the section is off).

    ``embedding_lookup`` returns each request's served level (``degrade_level``: a row per row, or
    per user of a list), an output of both ensembles. In the candidates ensemble ``dense`` also
    takes the list's targets as requested (``requested_candidates``), so a list scored only in part
    is answered for every candidate; a TensorRT ``dense`` (profile ``gpu``) scores what it gets.
    Where a level is scored by ``[degrade.small_dense]``'s network, the Python ``dense`` also takes
    each request's level (``degrade_level``), to score those requests with it.
    With ``priority_value``, the Python steps' batchers get two priority levels (the default: 2).
    """
    if not spec.degrade.enabled:
        return config
    level = WireTensor(DEGRADE_LEVEL, "INT32", (1,))
    requested = WireTensor(REQUESTED_CANDIDATES, "INT64", (-1, 1), ragged=True, optional=True)
    lists = spec.candidates_model is not None and profile != "gpu"
    if config.backend == "python" and config.HasField("dynamic_batching") and spec.degrade.priority_value > 0:
        config.dynamic_batching.priority_levels = 2  # the requests worth most are batched first
        config.dynamic_batching.default_priority_level = 2
    small = bool(spec.degrade.small_levels) and profile != "gpu"
    if config.name == EMBEDDING_LOOKUP:
        config.output.append(model_output(level))
    elif config.name == DENSE and config.backend == "python":
        if lists:
            config.input.append(model_input(requested))
        if small:
            config.input.append(model_input(dataclasses.replace(level, optional=True)))
    elif config.platform == "ensemble":
        steps = {step.model_name: step for step in config.ensemble_scheduling.step}
        steps[EMBEDDING_LOOKUP].output_map[DEGRADE_LEVEL] = DEGRADE_LEVEL
        batched = config.max_batch_size > 0  # the candidates ensemble: [users, 1]
        config.output.append(model_output(level if batched else dataclasses.replace(level, dims=(-1, 1))))
        if not batched and lists:
            steps[DENSE].input_map[REQUESTED_CANDIDATES] = spec.target_names[0]
        if small:
            steps[DENSE].input_map[DEGRADE_LEVEL] = DEGRADE_LEVEL
    return config
