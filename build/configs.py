"""Generate every ``config.pbtxt`` of the repository from the spec, through protobuf.

Nothing here is written as text by hand: each config is a ``ModelConfig`` message rendered by
``text_format``, so a drift test can regenerate and compare bytes.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.build.caller_order import caller_order_config, install_caller_order
from recserve.build.dense_configs import dense_tensorrt_config, dense_warmup
from recserve.build.step_tensors import (
    candidate_io,
    intermediate_tensors,
    model_input,
    model_output,
    request_inputs,
    served_spec_parameter,
    step_io,
    with_degrade,
)
from recserve.core.contract import sequence_inputs
from recserve.core.gpu_batches import gpu_spec
from recserve.core.names import (
    CANDIDATE_PREFIX,
    DENSE,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    GPU_PROFILES,
    L1_DEVICE_PARAMETER,
    PROFILES,
    STEPS,
)
from recserve.core.sections.serving import QueuePolicy
from recserve.core.spec.model import ModelSpec


def profile_spec(spec: ModelSpec, profile: str) -> ModelSpec:
    """The spec a profile's configs carry: the GPU profiles' with their larger batches (:func:`gpu_spec`)."""
    return gpu_spec(spec) if profile in GPU_PROFILES else spec


def queue_policy(policy: QueuePolicy, step: str) -> mc.ModelQueuePolicy | None:
    """One step's load-shedding policy (the first step is the admission gate); None: no limit at all.

    A step without a policy keeps Triton's payload prefetching, which any limit turns off.
    """
    entry = step == STEPS[0]
    limits = mc.ModelQueuePolicy(
        timeout_action=mc.ModelQueuePolicy.TimeoutAction.Value(policy.timeout_action),
        default_timeout_microseconds=policy.entry_timeout if entry else policy.default_timeout_microseconds,
        max_queue_size=policy.entry_max_queue_size if entry else policy.max_queue_size,
    )
    return limits if limits.default_timeout_microseconds or limits.max_queue_size else None


def spec_queue(spec: ModelSpec, queue: str | None = None) -> QueuePolicy:
    """The spec's ``[serving.queue]`` (None) or one of its ``[serving.queue_policies]``."""
    if queue is None:
        return spec.serving.queue
    if queue not in spec.serving.queue_policies:
        raise ValueError(
            f"unknown queue policy {queue!r}; the spec has {sorted(spec.serving.queue_policies)}"
        )
    return spec.serving.queue_policies[queue]


@dataclass(frozen=True)
class ServingPlan:
    """How the steps are scheduled: dynamic batching, preferred batch sizes, instances per step.

    The spec's ``[serving]`` section gives the tuned plan (:meth:`from_spec`); benchmarks compare it
    with :meth:`naive` and the tuning sweep tries others. ``max_queue_delay_microseconds=None``
    turns dynamic batching off: each request is executed alone.
    """

    max_queue_delay_microseconds: int | None
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: Mapping[str, int] = field(default_factory=lambda: {step: 1 for step in STEPS})

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ServingPlan:
        """The plan written in the spec."""
        return cls(
            spec.serving.max_queue_delay_microseconds,
            spec.serving.preferred_batch_size,
            dict(spec.serving.instances),
        )

    @classmethod
    def naive(cls) -> ServingPlan:
        """No dynamic batching, one instance per step: Triton as configured without tuning."""
        return cls(None)


def step_config(
    spec: ModelSpec,
    step: str,
    profile: str = "cpu",
    plan: ServingPlan | None = None,
    queue: str | None = None,
) -> mc.ModelConfig:
    """Config of one step: Python backend, batching and instances from ``plan``, the spec as parameter.

    Args:
        spec: the model spec.
        step: one of :data:`STEPS`.
        profile: ``cpu``; ``gpu`` for the TensorRT ``dense``; ``cuda`` for the Python ``dense`` on
            GPU instances, with ``embedding_lookup``'s L1 and output on the GPU (``l1_device``). In
            both GPU profiles ``embedding_lookup`` runs as KIND_GPU instances.
        plan: scheduling of the Python steps; None uses the spec's ``[serving]`` values.
        queue: a queue policy of the spec (``[serving.queue_policies]``); None: ``[serving.queue]``.
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown config profile {profile!r}; use one of {PROFILES}")
    spec = profile_spec(spec, profile)
    if step == DENSE and profile == "gpu":
        return dense_tensorrt_config(spec)
    plan = plan or ServingPlan.from_spec(spec)
    inputs, outputs = step_io(spec)[step]
    if step in candidate_io(spec):  # two request forms: each request carries one form's inputs
        extra_inputs, extra_outputs = candidate_io(spec)[step]
        inputs = (*(dataclasses.replace(t, optional=True) for t in inputs), *extra_inputs)
        outputs = (*outputs, *extra_outputs)
    on_gpu = profile in GPU_PROFILES and (step != DENSE or profile == "cuda")
    kind = mc.ModelInstanceGroup.KIND_GPU if on_gpu else mc.ModelInstanceGroup.KIND_CPU
    config = mc.ModelConfig(
        name=step,
        backend="python",
        max_batch_size=spec.model.max_batch_size,
        input=[model_input(t) for t in inputs],
        output=[model_output(t) for t in outputs],
        instance_group=[mc.ModelInstanceGroup(count=plan.instances[step], kind=kind)],
    )
    if plan.max_queue_delay_microseconds is not None:  # the naive plan has no dynamic batcher (and no queue)
        config.dynamic_batching.max_queue_delay_microseconds = plan.max_queue_delay_microseconds
        config.dynamic_batching.preferred_batch_size.extend(plan.preferred_batch_sizes)
        policy = spec_queue(spec, queue)
        limits = queue_policy(policy, step)
        if limits is not None:
            config.dynamic_batching.default_queue_policy.CopyFrom(limits)
    if step == DENSE:
        config.model_warmup.extend(dense_warmup(spec))
    config.parameters["spec"].string_value = spec.to_json()
    if on_gpu:  # GPU-resident inputs reach the step (read through DLPack)
        config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "no"
    if (
        step == EMBEDDING_LOOKUP and profile == "cuda"
    ):  # L1 and the looked-up vectors stay on the GPU for dense
        config.parameters[L1_DEVICE_PARAMETER].string_value = "cuda"
    return with_degrade(spec, config)


def ensemble_config(spec: ModelSpec, profile: str = "cpu") -> mc.ModelConfig:
    """The ``ctr`` ensemble: raw features in; click probability and the versions that served each row out.

    ``dense_version`` comes from ``dense`` (absent from a TensorRT ``dense``), ``embedding_version``
    (every table's version, spec table order) from ``embedding_lookup``.
    """
    spec = profile_spec(spec, profile)
    io = step_io(spec, profile)
    steps = []
    for step in STEPS:
        inputs, outputs = io[step]
        steps.append(
            mc.ModelEnsembling.Step(
                model_name=step,
                model_version=-1,
                input_map={t.name: t.name for t in inputs},
                output_map={t.name: t.name for t in outputs},
            )
        )
    config = mc.ModelConfig(
        name=spec.name,
        platform="ensemble",
        max_batch_size=spec.model.max_batch_size,
        input=[model_input(t) for t in request_inputs(spec)],
        output=[model_output(t) for t in (*io[DENSE][1], intermediate_tensors(spec)[EMBEDDING_VERSION])],
        ensemble_scheduling=mc.ModelEnsembling(step=steps),
        parameters=served_spec_parameter(spec),
    )
    return with_degrade(spec, config, profile)


def single_form_ensemble(spec: ModelSpec, form: str, profile: str = "cpu") -> mc.ModelConfig:
    """The row ensemble taking one wire form only, none of its inputs optional: ``<name>__<form>``.

    For clients that cannot leave inputs out (perf_analyzer's shared memory refuses a model with
    optional inputs); the same steps as :func:`ensemble_config`.
    """
    config = ensemble_config(spec, profile)
    names = {t.name for t in spec.wire_form(form).inputs}
    kept = [
        mc.ModelInput(name=i.name, data_type=i.data_type, dims=i.dims)
        for i in config.input
        if i.name in names
    ]
    del config.input[:]
    config.input.extend(kept)
    step = config.ensemble_scheduling.step[0]
    for name in [n for n in step.input_map if n not in names]:
        del step.input_map[name]
    config.name = f"{spec.name}__{form}"
    return config


def candidates_ensemble_config(spec: ModelSpec, profile: str = "cpu") -> mc.ModelConfig:
    """The candidate-list ensemble (``ModelSpec.candidates_model``): one request per user.

    Its inputs have no batch dimension of their own (``max_batch_size`` 0): the user inputs are
    ``[users, ...]``, the per-candidate ones ``[users, candidates, ...]``. Both steps batch such
    requests (ragged, one user per batch entry): ``embedding_lookup`` hands ``dense`` the
    per-candidate inputs and each user's history once (on ``gpu``, where ``dense`` is a TensorRT
    engine taking rows, every row with its user's history). The outputs have a row per candidate,
    user by user: ``[users * candidates, ...]``.
    """
    assert spec.candidates_model is not None
    spec = profile_spec(spec, profile)
    io = step_io(spec, profile)
    lookup_outputs, (dense_inputs, dense_outputs) = io[EMBEDDING_LOOKUP][1], io[DENSE]
    if profile != "gpu":  # a TensorRT dense takes rows: the lookup then expands each user's history
        per_candidate = candidate_io(spec)[DENSE][0]
        history = tuple(t for t in dense_inputs if t.name in sequence_inputs(spec))
        dense_inputs = (*per_candidate, *history)
        lookup_outputs = (*dense_inputs, intermediate_tensors(spec)[EMBEDDING_VERSION])
    # input_map: the step's input name -> the ensemble's tensor
    users, candidates = request_inputs(spec, "user_inputs"), request_inputs(spec, "candidate_inputs")
    inputs = {t.name: t.name for t in users}
    inputs.update({CANDIDATE_PREFIX + t.name: t.name for t in candidates})
    steps = [
        mc.ModelEnsembling.Step(
            model_name=EMBEDDING_LOOKUP,
            model_version=-1,
            input_map=inputs,
            output_map={t.name: t.name for t in lookup_outputs},
        ),
        mc.ModelEnsembling.Step(
            model_name=DENSE,
            model_version=-1,
            input_map={t.name: t.name for t in dense_inputs},
            output_map={t.name: t.name for t in dense_outputs},
        ),
    ]
    unbatched = [dataclasses.replace(t, dims=(-1, *t.dims)) for t in users]
    unbatched += [dataclasses.replace(t, dims=(-1, -1, *t.dims)) for t in candidates]
    outputs = (*dense_outputs, intermediate_tensors(spec)[EMBEDDING_VERSION])
    config = mc.ModelConfig(
        name=spec.candidates_model,
        platform="ensemble",
        max_batch_size=0,
        input=[model_input(dataclasses.replace(t, ragged=False)) for t in unbatched],
        output=[model_output(dataclasses.replace(t, dims=(-1, *t.dims))) for t in outputs],
        ensemble_scheduling=mc.ModelEnsembling(step=steps),
        parameters=served_spec_parameter(spec),
    )
    return with_degrade(spec, config, profile)


def ensemble_names(spec: ModelSpec) -> tuple[str, ...]:
    """The repository's ensembles: the row layout, and the candidate-list layout where the spec has one."""
    return (spec.name,) + ((spec.candidates_model,) if spec.candidates_model else ())


def all_configs(
    spec: ModelSpec, profile: str = "cpu", plan: ServingPlan | None = None
) -> dict[str, mc.ModelConfig]:
    """Every model of the repository by name, in one config profile (``plan`` as in :func:`step_config`)."""
    configs = {step: step_config(spec, step, profile, plan) for step in STEPS}
    configs[spec.name] = ensemble_config(spec, profile)
    if spec.candidates_model:
        configs[spec.candidates_model] = candidates_ensemble_config(spec, profile)
    for ensemble, model in spec.caller_order_models.items():
        configs[model] = caller_order_config(spec, configs[ensemble])
    return configs


def config_path(repository: Path, name: str, profile: str = "cpu") -> Path:
    """Where a model's config of a profile lives: ``config.pbtxt``, or ``configs/<profile>.pbtxt``."""
    return repository / name / ("config.pbtxt" if profile == "cpu" else f"configs/{profile}.pbtxt")


def profile_configs(spec: ModelSpec) -> dict[Path, mc.ModelConfig]:
    """Every config file of the repository, relative to it: the ``cpu`` ones and the differing others.

    Besides the hardware profiles, each queue policy of the spec is a variant of the ``cpu`` steps,
    ``<step>/configs/<queue policy>.pbtxt`` (served with ``--model-config-name=<queue policy>``).
    """
    cpu = all_configs(spec)
    files = {config_path(Path(), name): config for name, config in cpu.items()}
    for profile in PROFILES[1:]:
        for name, config in all_configs(spec, profile).items():
            if config != cpu[name]:
                files[config_path(Path(), name, profile)] = config
    return files | queue_configs(spec)


def queue_configs(spec: ModelSpec) -> dict[Path, mc.ModelConfig]:
    """Each queue policy's step configs, relative to the repository (``<step>/configs/<policy>.pbtxt``)."""
    if clash := set(spec.serving.queue_policies) & set(PROFILES):
        raise ValueError(f"queue policies {sorted(clash)} would overwrite hardware profiles' configs")
    policies = spec.serving.queue_policies
    return {config_path(Path(), s, q): step_config(spec, s, queue=q) for q in policies for s in STEPS}


def render(config: mc.ModelConfig) -> str:
    """``config.pbtxt`` text of a config."""
    return text_format.MessageToString(config)


def write_configs(
    spec: ModelSpec, repository: Path, files: dict[Path, mc.ModelConfig] | None = None
) -> list[Path]:
    """Write the configs (``files``, by path; None: :func:`profile_configs`) and the version folders.

    The ensembles' (empty) and the caller's-order models' (their adapter) where a level asks for them.
    """
    written = []
    for relative, config in (profile_configs(spec) if files is None else files).items():
        path = repository / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(config))
        written.append(path)
    for name in ensemble_names(spec):
        (repository / name / str(spec.version)).mkdir(parents=True, exist_ok=True)
    install_caller_order(spec, repository)
    return written


def write_variant(
    spec: ModelSpec, source: Path, target: Path, profile: str = "cpu", plan: ServingPlan | None = None
) -> Path:
    """A repository serving the built artifacts of ``source`` under other configs.

    Each step's version folder in ``target`` links to the one in ``source`` (nothing is copied);
    only the ``config.pbtxt`` files (of ``profile``, scheduled by ``plan``) differ. The ``cpu``
    profile unscheduled also gets the spec's queue policies, as a built repository has them (served
    with ``--model-config-name``). An existing ``target`` is replaced.
    """
    if target.resolve() == source.resolve():
        raise ValueError("a variant repository needs its own folder")
    shutil.rmtree(target, ignore_errors=True)
    for step in STEPS:
        built = (source / step / str(spec.version)).resolve()
        if not built.is_dir():
            raise FileNotFoundError(f"{built} is missing; run 'recserve build' first")
        (target / step).mkdir(parents=True)
        (target / step / str(spec.version)).symlink_to(built, target_is_directory=True)
    files = {config_path(Path(), name): config for name, config in all_configs(spec, profile, plan).items()}
    write_configs(spec, target, files | (queue_configs(spec) if profile == "cpu" and plan is None else {}))
    return target
