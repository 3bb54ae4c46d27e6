from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.build import configs
from recserve.core.names import DENSE, STEPS
from tests.unit.conftest import COMMITTED_CONFIGS


def test_committed_configs_match_the_spec(spec):
    """Drift test: regenerate every config.pbtxt from the spec and compare bytes."""
    for relative, config in configs.profile_configs(spec).items():
        committed = (COMMITTED_CONFIGS / relative).read_text()
        assert committed == configs.render(config), f"{relative} drifted: run 'recserve build'"


def test_configs_round_trip_through_protobuf(spec):
    for relative, config in configs.profile_configs(spec).items():
        parsed = text_format.Parse((COMMITTED_CONFIGS / relative).read_text(), mc.ModelConfig())
        assert parsed == config


def test_every_step_input_is_produced_upstream(spec):
    for ensemble in (configs.ensemble_config(spec), configs.candidates_ensemble_config(spec)):
        available = {t.name for t in ensemble.input}
        for step in ensemble.ensemble_scheduling.step:
            assert set(step.input_map.values()) <= available, step.model_name
            available |= set(step.output_map.values())
        assert {t.name for t in ensemble.output} <= available


def test_steps_batch_dynamically_with_spec_values(spec):
    for step in STEPS:
        config = configs.step_config(spec, step)
        assert config.max_batch_size == spec.model.max_batch_size
        assert (
            config.dynamic_batching.max_queue_delay_microseconds == spec.serving.max_queue_delay_microseconds
        )
        assert config.instance_group[0].count == spec.serving.instances[step]
        ragged = {
            i.name for i in config.input if i.allow_ragged_batch and not i.name.startswith("candidate_")
        }
        assert ragged <= {"history_items", "history_keys", "history_mask", "history_embeddings"}


def test_queue_policies_are_variants_of_the_cpu_steps(spec):
    files = configs.profile_configs(spec)
    for queue in spec.serving.queue_policies:
        for step in STEPS:
            variant = files[configs.config_path(Path(), step, queue)]
            default = configs.step_config(spec, step)
            assert (
                variant.dynamic_batching.max_queue_delay_microseconds
                == default.dynamic_batching.max_queue_delay_microseconds
            )
            assert variant.instance_group == default.instance_group and variant.input == default.input
        assert configs.config_path(Path(), spec.name, queue) not in files  # the ensemble has no queue


def test_latency_first_admits_by_time_at_the_entry_only(spec):
    """The budget is a timeout at the first step; no size limit anywhere, no policy after the entry."""
    policy = spec.serving.queue_policies["latency_first"]
    entry = configs.step_config(spec, STEPS[0], queue="latency_first")
    limits = entry.dynamic_batching.default_queue_policy
    assert limits.default_timeout_microseconds == policy.entry_timeout > 0 and limits.max_queue_size == 0
    assert limits.timeout_action == limits.REJECT
    for step in STEPS[1:]:
        later = configs.step_config(spec, step, queue="latency_first")
        assert not later.dynamic_batching.HasField("default_queue_policy"), step


def test_an_unknown_queue_policy_is_refused(spec):
    with pytest.raises(ValueError, match="unknown queue policy"):
        configs.step_config(spec, DENSE, queue="nope")
