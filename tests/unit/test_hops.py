"""The echo ensembles of the hop-floor benchmark have the served steps' shapes, batching and wiring."""

from recserve.build import configs, step_tensors
from recserve.core.names import DENSE, DENSE_VERSION, PROBABILITY, STEPS
from recserve.perf.bench.hops import (
    PACKED,
    PACKED_TENSOR,
    echo_configs,
    ensemble_outputs,
    packed_widths,
    topologies,
)


def test_the_served_echo_topology_has_the_served_steps_tensors(spec):
    served = topologies(spec)["echo_2_hops"]
    io = step_tensors.step_io(spec)
    assert [(s.name, s.inputs, s.outputs) for s in served] == [(step, *io[step]) for step in STEPS]


def test_every_echo_step_input_comes_from_the_request_or_an_earlier_step(spec):
    for name, steps in topologies(spec).items():
        available = {t.name for t in step_tensors.request_inputs(spec)}  # both wire forms
        for step in steps:
            missing = {t.name for t in step.inputs} - available
            assert not missing, (name, step.name, missing)
            assert step.width_from in {t.name for t in step.inputs}, (name, step.name)
            available |= {t.name for t in step.outputs}
        assert {PROBABILITY, DENSE_VERSION} <= available


def test_echo_steps_batch_as_the_served_steps_and_the_ensemble_chains_them(spec):
    generated = echo_configs(spec, "echo_3_hops", topologies(spec)["echo_3_hops"])
    ensemble = generated.pop("echo_3_hops")
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == list(generated)
    assert len(generated) == 3
    served = configs.step_config(spec, DENSE).dynamic_batching
    for config in generated.values():
        assert config.backend == "python" and config.max_batch_size == spec.model.max_batch_size
        assert config.dynamic_batching.max_queue_delay_microseconds == served.max_queue_delay_microseconds
        assert list(config.dynamic_batching.preferred_batch_size) == list(served.preferred_batch_size)


def test_the_packed_echo_passes_the_same_values_in_one_tensor(spec):
    served, packed = topologies(spec)["echo_2_hops"], topologies(spec)[PACKED]
    dense_inputs = served[1].inputs
    assert [t.name for t in packed[1].inputs] == [PACKED_TENSOR]
    assert {t.dtype for t in dense_inputs} == {"FP32"}
    fixed, per_position = packed_widths(dense_inputs)
    assert fixed == len(spec.normalized_columns) + (spec.num_sparse + 1) * spec.model.embedding_dim
    assert per_position == spec.model.embedding_dim + 1  # a history embedding and its mask
    assert packed[0].packed == (fixed, per_position)
    assert [t.name for t in ensemble_outputs(packed)] == [t.name for t in ensemble_outputs(served)]
