from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.build import configs
from tests.conftest import REPOSITORY


def test_committed_configs_match_the_spec(spec):
    """Drift test: regenerate every config.pbtxt from the spec and compare bytes."""
    for relative, config in configs.profile_configs(spec).items():
        committed = (REPOSITORY / relative).read_text()
        assert committed == configs.render(config), f"{relative} drifted: run 'recserve build'"


def test_configs_round_trip_through_protobuf(spec):
    for relative, config in configs.profile_configs(spec).items():
        parsed = text_format.Parse((REPOSITORY / relative).read_text(), mc.ModelConfig())
        assert parsed == config


def test_every_step_input_is_produced_upstream(spec):
    ensemble = configs.ensemble_config(spec)
    available = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        assert set(step.input_map.values()) <= available, step.model_name
        available |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= available


def test_steps_batch_dynamically_with_spec_values(spec):
    for step in configs.STEPS:
        config = configs.step_config(spec, step)
        assert config.max_batch_size == spec.max_batch_size
        assert config.dynamic_batching.max_queue_delay_microseconds == spec.max_queue_delay_microseconds
        assert config.instance_group[0].count == spec.instances[step]
        ragged = {i.name for i in config.input if i.allow_ragged_batch}
        assert ragged <= {"history_items", "history_keys", "history_mask", "history_embeddings"}
