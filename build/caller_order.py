"""The caller's-order models beside the ensembles: configs and adapters, where a level asks for them.

A ``[[degrade.levels]]`` entry with ``caller_order`` is answered by ``<ensemble>__caller_order``
(recserve.backends.steps.caller_order): the access layer's door rewrites a request's model name to
it. Its config takes exactly the ensemble's inputs and returns its outputs (the caller sends the
same request either way); its dynamic batcher hands the Python step what queued meanwhile in one
call (ragged: each request keeps its shapes, a list's users being its batch dimension). One CPU
instance of the Python backend, warmed up before it is ready, the served spec as its parameter.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from recserve.core.spec.model import ModelSpec

ADAPTER = "caller_order.py"


def caller_order_config(spec: ModelSpec, ensemble: mc.ModelConfig) -> mc.ModelConfig:
    """The config of the model answering ``ensemble``'s requests in the caller's order."""
    # the candidates ensemble has no batch dimension of its own: its users' is batched here
    lists = ensemble.max_batch_size == 0
    inputs = [(i, list(i.dims)[1:] if lists else list(i.dims)) for i in ensemble.input]
    # one request of every input, each dimension 1, before the model is ready: the first request of
    # a spike is not the one that finds the Python step cold
    warmup = mc.ModelWarmup(
        name="one_row",
        batch_size=1,
        count=1,
        inputs={
            i.name: mc.ModelWarmup.Input(
                data_type=i.data_type, dims=[max(d, 1) for d in dims], zero_data=True
            )
            for i, dims in inputs
        },
    )
    return mc.ModelConfig(
        name=spec.caller_order_models[ensemble.name],
        backend="python",
        max_batch_size=spec.model.max_batch_size if lists else ensemble.max_batch_size,
        input=[
            mc.ModelInput(
                name=i.name, data_type=i.data_type, dims=dims, optional=i.optional, allow_ragged_batch=True
            )
            for i, dims in inputs
        ],
        output=[
            mc.ModelOutput(name=o.name, data_type=o.data_type, dims=list(o.dims)[1:] if lists else o.dims)
            for o in ensemble.output
        ],
        instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)],
        dynamic_batching=mc.ModelDynamicBatching(),  # what queued meanwhile, answered in one call
        parameters={"spec": mc.ModelParameter(string_value=spec.to_json())},
        model_warmup=[warmup],
    )


def install_caller_order(spec: ModelSpec, repository: Path) -> None:
    """Copy the adapter into each caller's-order model's version folder (none without the level)."""
    source = resources.files("recserve.backends.triton.models").joinpath(ADAPTER).read_text()
    for model in spec.caller_order_models.values():
        folder = repository / model / str(spec.version)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.py").write_text(source)
