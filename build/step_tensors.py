"""The tensors each ensemble step takes and returns, and their ``config.pbtxt`` entries.

One source for the generated configs (:mod:`recserve.build.configs`) and the configs of the echo
and monolith peers, all derived from the spec's dense contract.
"""

from __future__ import annotations

import dataclasses

from tritonclient.grpc import model_config_pb2 as mc

from recserve import wire
from recserve.spec import ModelSpec, WireTensor

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
    contract, _ = wire.dense_contract(spec)
    sequence_inputs = wire.sequence_inputs(spec)  # each request at its own bucket
    items = (
        *(WireTensor(t.name, t.dtype, t.shape[1:], ragged=t.name in sequence_inputs) for t in contract),
        WireTensor(wire.PROBABILITY, "FP32", (1,)),
        WireTensor(wire.DENSE_VERSION, "INT64", (1,)),
        WireTensor(wire.EMBEDDING_VERSION, "INT64", (len(spec.table_names),)),
    )
    return {t.name: t for t in items}


def step_io(
    spec: ModelSpec, profile: str = "cpu"
) -> dict[str, tuple[tuple[WireTensor, ...], tuple[WireTensor, ...]]]:
    """Inputs and outputs of each ensemble step.

    ``embedding_lookup`` takes the raw features and returns the dense network's inputs (and the
    table versions); a TensorRT ``dense``, profile ``gpu``, has no version output.
    """
    t = intermediate_tensors(spec)
    dense_inputs = tuple(t[n] for n in wire.dense_net_inputs(spec))
    return {
        wire.EMBEDDING_LOOKUP: (spec.wire_inputs(), (*dense_inputs, t[wire.EMBEDDING_VERSION])),
        wire.DENSE: (
            dense_inputs,
            (t[wire.PROBABILITY],) if profile == "gpu" else (t[wire.PROBABILITY], t[wire.DENSE_VERSION]),
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
        WireTensor(wire.CANDIDATE_PREFIX + n, t[n].dtype, (-1, *t[n].dims), ragged=True, optional=True)
        for n in wire.per_candidate_dense_inputs(spec)
    )
    outputs = tuple(dataclasses.replace(x, ragged=False, optional=False) for x in per_candidate)
    return {
        wire.EMBEDDING_LOOKUP: (wire.candidate_step_inputs(spec), outputs),
        wire.DENSE: (per_candidate, ()),
    }


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
