"""``[degrade.small_dense]``: a level scored by a smaller network, distilled from the full one."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from recserve.backends.dense.runner import DenseStep
from recserve.build.configs import all_configs
from recserve.build.export import example_inputs
from recserve.build.repository import add_small_dense, is_built, version_dir
from recserve.core.names import DENSE, SMALL_DENSE_DIR
from recserve.core.sections.base import SpecError
from recserve.core.sections.degrade import DEGRADE_LEVEL
from recserve.core.spec.parse import parse_spec, small_dense_spec

SMALL = {"top_mlp": [8], "bottom_mlp": [8], "attention_heads": 1}
LEVELS = [
    {"name": "trimmed", "cost": 0.5, "quality": 0.95, "max_candidates": 4},
    {"name": "lean", "cost": 0.3, "quality": 0.9, "small_dense": True},
]


def with_small(spec, **changes):
    return parse_spec(
        {**spec.source, "degrade": {"enabled": True, "levels": LEVELS, "small_dense": SMALL, **changes}}
    )


def test_a_level_names_the_smaller_network_whose_spec_is_the_served_one_with_its_sizes(tiny_spec):
    spec = with_small(tiny_spec)
    assert spec.degrade.small_levels == frozenset({2})
    small = small_dense_spec(spec)
    assert small is not None and not small.degrade.enabled
    assert (small.dense_net.top_mlp, small.dense_net.bottom_mlp, small.dense_net.attention_heads) == (
        (8,),
        (8,),
        1,
    )
    assert small.tables == spec.tables and small.serving == spec.serving  # the same inputs and buckets
    assert small_dense_spec(tiny_spec) is None
    assert small_dense_spec(with_small(tiny_spec, enabled=False)) is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"small_dense": None}, "small_dense needs the network's sizes"),
        (
            {"small_dense": {"bottom_mlp": [4]}},
            r"\[degrade.small_dense\]: bottom_mlp must end at embedding_dim=8",
        ),
        ({"small_dense": {"width": 3}}, "width"),
    ],
)
def test_a_smaller_network_without_valid_sizes_is_refused_when_the_spec_is_read(tiny_spec, changes, message):
    source = {"enabled": True, "levels": LEVELS, "small_dense": SMALL, **changes}
    if source["small_dense"] is None:
        del source["small_dense"]
    with pytest.raises(SpecError, match=message):
        parse_spec({**tiny_spec.source, "degrade": source})


def test_the_python_dense_step_takes_each_requests_level_where_a_level_needs_the_smaller_network(tiny_spec):
    spec = with_small(tiny_spec)
    configs = all_configs(spec)
    assert DEGRADE_LEVEL in {i.name for i in configs[DENSE].input}
    for ensemble in (spec.name, spec.candidates_model):
        dense = next(s for s in configs[ensemble].ensemble_scheduling.step if s.model_name == DENSE)
        assert dense.input_map[DEGRADE_LEVEL] == DEGRADE_LEVEL
    plain = all_configs(with_small(tiny_spec, levels=LEVELS[:1]))  # no level of the smaller network
    assert DEGRADE_LEVEL not in {i.name for i in plain[DENSE].input}
    gpu = all_configs(spec, "gpu")  # TensorRT's dense scores every level with the full network
    assert DEGRADE_LEVEL not in {i.name for i in gpu[DENSE].input}


@pytest.fixture(scope="module")
def distilled(tiny_spec, tiny_repository, tmp_path_factory):
    """A copy of the tiny repository with the smaller network distilled into its dense version."""
    spec = with_small(tiny_spec)
    root = tmp_path_factory.mktemp("small") / "repository"
    shutil.copytree(tiny_repository, root)
    assert not is_built(spec, root)  # the smaller network is part of what a build makes
    add_small_dense(spec, root, progress=lambda _: None)
    return spec, root


def test_the_smaller_network_is_distilled_beside_the_full_one_and_loaded_with_it(distilled, tiny_spec):
    spec, root = distilled
    assert is_built(spec, root) and is_built(tiny_spec, root)
    folder = version_dir(root, DENSE, spec)
    step = DenseStep.load(spec, folder, instances=1)
    assert step.small is not None and DenseStep.load(tiny_spec, folder, 1).small is None
    inputs = example_inputs(spec, rows=64, length=8, seed=3)
    full, small = step.compute(dict(inputs))["probability"], step.small.compute(dict(inputs))["probability"]
    assert full.shape == small.shape == (64, 1) and np.isfinite(small).all()
    assert not np.allclose(full, small)  # another network ...
    assert np.corrcoef(full.ravel(), small.ravel())[0, 1] > 0.5  # ... taught by the full one
    step.close()


def test_a_version_without_the_smaller_network_scores_every_level_with_the_full_one(distilled, caplog):
    spec, root = distilled
    folder = version_dir(root, DENSE, spec)
    bare = folder.parent / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns(SMALL_DENSE_DIR))
    with caplog.at_level("WARNING"):
        step = DenseStep.load(spec, bare, instances=1)
    assert step.small is None and "has no smaller network" in caplog.text
    step.close()
