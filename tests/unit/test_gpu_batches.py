"""The GPU profiles' larger batches: derived from ``[serving] gpu_max_batch_size`` into their configs only."""

import copy
import json

import pytest

from recserve.backends.dense.buckets import spec_buckets
from recserve.backends.features.transform import FeatureTransform
from recserve.build import configs
from recserve.build.synthetic import generate
from recserve.core.gpu_batches import gpu_batch_buckets, gpu_spec
from recserve.core.names import DENSE, EMBEDDING_LOOKUP
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec, spec_from_json
from recserve.errors import InvalidInput


def with_gpu_batches(spec, largest):
    doc = copy.deepcopy(spec.source)
    doc.setdefault("serving", {})["gpu_max_batch_size"] = largest
    return parse_spec(doc)


def test_buckets_double_up_to_the_gpu_maximum(spec):
    cpu = tuple(spec.serving.batch_buckets)
    assert cpu[-1] == spec.model.max_batch_size == 256
    unset = with_gpu_batches(spec, 0)
    assert gpu_batch_buckets(unset) == cpu  # not set: the CPU's
    assert gpu_spec(unset) is unset
    assert gpu_batch_buckets(with_gpu_batches(spec, 4096)) == (*cpu, 512, 1024, 2048, 4096)
    assert gpu_batch_buckets(with_gpu_batches(spec, 3000)) == (*cpu, 512, 1024, 2048, 3000)
    assert gpu_batch_buckets(with_gpu_batches(spec, 256)) == cpu
    with pytest.raises(SpecError, match="gpu_max_batch_size 100 is below max_batch_size 256"):
        with_gpu_batches(spec, 100)


def test_the_gpu_spec_serves_the_larger_batches_and_derives_to_itself(spec):
    wide = gpu_spec(with_gpu_batches(spec, 8192))
    assert wide.model.max_batch_size == 8192 and wide.serving.batch_buckets[-1] == 8192
    assert wide.serving.sequence_buckets == spec.serving.sequence_buckets
    assert (
        wide.tables == spec.tables and wide.serving.preferred_batch_size == spec.serving.preferred_batch_size
    )
    assert gpu_spec(wide).model.max_batch_size == 8192 and "gpu_max_batch_size" not in wide.to_json()
    assert max(b.rows for b in spec_buckets(wide)) == 8192


def test_the_bundled_spec_serves_one_users_list_of_4096_on_the_gpu_profiles(spec):
    assert spec.serving.gpu_max_batch_size == 4096
    for profile in ("gpu", "cuda"):
        carried = spec_from_json(
            configs.all_configs(spec, profile)[EMBEDDING_LOOKUP].parameters["spec"].string_value
        )
        assert carried.model.max_batch_size == 4096  # a list of 4,096 candidates is one request
    assert configs.all_configs(spec)[EMBEDDING_LOOKUP].max_batch_size == 256  # the cpu profile keeps its own


def test_only_the_gpu_profiles_configs_take_them(spec):
    gpu_ready = with_gpu_batches(spec, 4096)
    for profile in ("cpu", "gpu", "cuda"):
        want = 256 if profile == "cpu" else 4096
        found = configs.all_configs(gpu_ready, profile)
        assert found[EMBEDDING_LOOKUP].max_batch_size == want, profile
        assert found[DENSE].max_batch_size == want, profile
        assert found[spec.name].max_batch_size == want, profile
        carried = spec_from_json(found[EMBEDDING_LOOKUP].parameters["spec"].string_value)
        assert carried.model.max_batch_size == want  # the step checks and buckets by what it carries
    cuda_dense = configs.step_config(gpu_ready, DENSE, "cuda")
    assert max(w.batch_size for w in cuda_dense.model_warmup) == 4096
    assert {w.batch_size for w in configs.step_config(gpu_ready, DENSE, "gpu").model_warmup} >= {512, 4096}
    # the spec as written is unchanged: the cpu configs equal those of a spec without the key
    assert configs.all_configs(gpu_ready)[EMBEDDING_LOOKUP].max_batch_size == 256
    assert json.loads(configs.all_configs(spec)[DENSE].parameters["spec"].string_value) == spec.source


def test_the_step_takes_a_gpu_batch_that_the_cpu_profile_refuses(spec):
    gpu_ready = with_gpu_batches(spec, 1024)
    wire = generate(spec, 1000, seed=3).to_wire(spec)
    with pytest.raises(InvalidInput, match="outside 1..256"):
        FeatureTransform(spec).transform(wire)
    keys = FeatureTransform(gpu_spec(gpu_ready)).transform(wire)
    assert len(next(iter(keys.values()))) == 1000
