"""The echo ensembles of the hop-floor benchmark have the served steps' shapes, batching and wiring."""

from recserve import wire
from recserve.build import configs
from recserve.perf.hops import NAMED, echo_configs, ensemble_outputs, topologies


def test_the_served_echo_topology_has_the_served_steps_tensors(spec):
    served = topologies(spec)["echo_2_hops"]
    io = configs.step_io(spec)
    assert [(s.name, s.inputs, s.outputs) for s in served] == [(step, *io[step]) for step in wire.STEPS]


def test_every_echo_step_input_comes_from_the_request_or_an_earlier_step(spec):
    for name, steps in topologies(spec).items():
        available = {t.name for t in spec.wire_inputs()}
        for step in steps:
            missing = {t.name for t in step.inputs} - available
            assert not missing, (name, step.name, missing)
            assert step.width_from in {t.name for t in step.inputs}, (name, step.name)
            available |= {t.name for t in step.outputs}
        assert {wire.PROBABILITY, wire.DENSE_VERSION} <= available


def test_echo_steps_batch_as_the_served_steps_and_the_ensemble_chains_them(spec):
    generated = echo_configs(spec, "echo_3_hops", topologies(spec)["echo_3_hops"])
    ensemble = generated.pop("echo_3_hops")
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == list(generated)
    assert len(generated) == 3
    served = configs.step_config(spec, wire.DENSE).dynamic_batching
    for config in generated.values():
        assert config.backend == "python" and config.max_batch_size == spec.max_batch_size
        assert config.dynamic_batching.max_queue_delay_microseconds == served.max_queue_delay_microseconds
        assert list(config.dynamic_batching.preferred_batch_size) == list(served.preferred_batch_size)


def test_the_served_echo_packs_the_dense_inputs_the_named_one_passes_them_each(spec):
    served, named = topologies(spec)["echo_2_hops"], topologies(spec)[NAMED]
    assert [t.name for t in served[1].inputs] == [wire.PACKED_INPUTS]
    assert [t.name for t in named[1].inputs] == list(wire.dense_net_inputs(spec))
    packing = wire.dense_packing(spec)
    assert served[0].packed == (packing.fixed, packing.per_position)
    assert packing.fixed == len(spec.normalized_columns) + (spec.num_sparse + 1) * spec.embedding_dim
    assert packing.per_position == spec.embedding_dim + 1  # a history embedding and its mask
    assert [t.name for t in ensemble_outputs(served)] == [t.name for t in ensemble_outputs(named)]
