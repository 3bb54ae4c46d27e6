"""The learner's dense side: the network's weights trained with the rows, published, refused, rolled back."""

import dataclasses

import pytest
import torch

from recserve.backends.base.artifacts import write_manifest
from recserve.backends.dense import tensorrt_engine
from recserve.backends.dense.network import CTRNet
from recserve.build.repository import new_version_engine
from recserve.core.sections.base import SpecError
from recserve.errors import ArtifactError
from recserve.loop.dense import DenseTrainer
from recserve.loop.learner import Learner
from recserve.loop.metrics import learn_samples, text
from tests.loop_examples import examples
from tests.store_tables import spec_store


def learner(spec, dense_lr=0.05):
    torch.manual_seed(0)
    tables, store = spec_store(spec)
    net = CTRNet(spec)
    dense = DenseTrainer(net, dense_lr, version=1) if dense_lr else None
    return tables, Learner(spec, store, net, learning_rate=0.05, dense=dense)


def same(a, b):
    return all(torch.equal(a[name], b[name]) for name in a)


def test_the_weights_train_with_the_rows_only_when_asked(spec):
    tables, frozen = learner(spec, dense_lr=0.0)
    before = {k: v.clone() for k, v in frozen.net.state_dict().items()}
    batch = examples(spec, tables, [1, 0, 1, 0])
    frozen.train(batch)
    assert same(before, frozen.net.state_dict())  # frozen: only rows moved
    _, learn = learner(spec)
    assert same(before, learn.dense.net.state_dict())  # the same start
    for _ in range(5):
        learn.train(batch)
    assert not same(before, learn.dense.net.state_dict())
    assert same(before, learn.net.state_dict())  # the rows train through the weights as served
    assert learn.dense.pending == 20
    with pytest.raises(ValueError, match="network"):
        Learner(spec, learn.store, CTRNet(spec), dense=learn.dense)


def test_a_dense_version_worse_than_the_served_scores_is_refused_and_the_weights_go_back(spec):
    tables, learn = learner(spec)
    served = learn.dense.weights()
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.999))  # the served scores were right
    assert not same(served, learn.dense.net.state_dict())
    written = []
    assert learn.dense.publish(written.append, max_loss_increase=0.0) is None and not written
    assert same(served, learn.dense.net.state_dict()) and learn.dense.refused_publishes == 1
    assert same(served, learn.net.state_dict())
    assert not learn.dense.optimizer.state_dict()["state"] or all(
        float(s["step"]) == 0 for s in learn.dense.optimizer.state_dict()["state"].values()
    )  # the optimizer's state as served, too


def test_a_published_dense_version_that_scores_worse_than_the_weights_it_replaced_is_rolled_back(spec):
    tables, learn = learner(spec, dense_lr=0.5)
    start = learn.dense.weights()
    for _ in range(5):
        learn.train(examples(spec, tables, [1, 1, 0, 0]))
    written = []
    assert learn.dense.publish(lambda w: written.append(w) or 2) == 2 and learn.dense.version == 2
    assert same(written[0], learn.dense.net.state_dict()) and len(learn.dense.watching) == 1
    assert same(written[0], learn.net.state_dict())  # the rows train through it from now on
    learn.train(examples(spec, tables, [0, 0, 1, 1], dense_version=1))  # served by the old version
    assert learn.dense.watch(lambda w: 1 / 0, 4, 0.02) is None
    learn.train(examples(spec, tables, [0, 0, 1, 1], dense_version=2))  # the labels flipped
    assert learn.dense.watch(lambda w: written.append(w) or 3, 4, 0.02) == 3
    assert learn.dense.last_watch[0] > learn.dense.last_watch[1] + 0.02 and learn.dense.rollbacks == 1
    assert same(written[1], start) and same(start, learn.dense.net.state_dict()) and learn.dense.version == 3
    assert same(start, learn.net.state_dict())
    assert not learn.dense.watching
    found = text(learn_samples(learn))
    assert "recserve_learn_dense_version 3" in found and "recserve_learn_dense_rollbacks_total 1" in found


def test_a_dense_version_as_good_as_the_weights_it_replaced_is_kept(spec):
    tables, learn = learner(spec, dense_lr=0.01)
    batch = examples(spec, tables, [1, 0, 1, 0])
    learn.train(batch)
    assert learn.dense.publish(lambda w: 2) == 2
    learn.train(examples(spec, tables, [1, 0, 1, 0], dense_version=2))
    assert learn.dense.watch(lambda w: 1 / 0, 4, 0.02) is None and not learn.dense.watching
    assert learn.dense.rollbacks == 0 and learn.dense.version == 2


def test_the_dense_settings_are_checked(spec):
    for bad in ({"dense_learning_rate": -0.1}, {"dense_publish_seconds": 0.5}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            dataclasses.replace(spec.loop, **bad).check()


def test_a_dense_version_with_an_engine_is_not_trained_where_no_engine_can_be_built(tmp_path):
    (tmp_path / "dense" / "1").mkdir(parents=True)
    write_manifest(tmp_path / "dense" / "1", {"files": {}})
    assert new_version_engine(tmp_path) is None
    (tmp_path / "dense" / "2").mkdir()
    write_manifest(tmp_path / "dense" / "2", {"files": {}, "tensorrt": {"precision": "fp16"}})
    if tensorrt_engine.tensorrt_available():
        assert new_version_engine(tmp_path) == {"precision": "fp16"}
    else:
        with pytest.raises(ArtifactError, match="TensorRT is not installed"):
            new_version_engine(tmp_path)


def test_a_restarted_learner_takes_back_the_dense_optimizers_state_of_the_version_it_serves(spec, tmp_path):
    from recserve.loop import learner_state

    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 0, 1, 0]))
    learn.dense.publish(lambda w: 2)
    learner_state.save_dense(learn.dense, tmp_path / "dense.safetensors")
    sums = {i: s["sum"].clone() for i, s in learn.dense.optimizer.state_dict()["state"].items()}
    served = CTRNet(spec)
    served.load_state_dict(learn.dense.published[0])
    restarted = DenseTrainer(served, 0.05, version=2)  # the newest served version, a fresh optimizer
    assert learner_state.restore_dense(restarted, tmp_path / "dense.safetensors")
    for i, entry in restarted.optimizer.state_dict()["state"].items():
        assert torch.equal(entry["sum"], sums[i]) and float(entry["step"]) == 1
    assert not learner_state.restore_dense(
        DenseTrainer(served, 0.05, version=3), tmp_path / "dense.safetensors"
    )


def test_a_restarted_learner_still_judges_and_rolls_back_the_dense_version_it_was_watching(spec, tmp_path):
    from recserve.loop import learner_state

    tables, learn = learner(spec, dense_lr=0.5)
    start = learn.dense.weights()
    for _ in range(5):
        learn.train(examples(spec, tables, [1, 1, 0, 0]))
    written = []
    assert learn.dense.publish(lambda w: written.append(w) or 2) == 2
    kept = tmp_path / "state" / "dense-watches.safetensors"
    learner_state.save_dense_watches(learn.dense, kept)
    served = CTRNet(spec)
    served.load_state_dict(written[0])
    # a new process: the newest served version, nothing watched
    restarted = Learner(
        spec, learn.store, served, learning_rate=0.05, dense=DenseTrainer(served, 0.5, version=2)
    )
    assert learner_state.restore_dense_watches(restarted.dense, kept) == 1
    assert learner_state.restore_dense_watches(DenseTrainer(served, 0.5, version=1), kept) == 0
    (watch,) = restarted.dense.watching
    assert watch.version == 2 and same(watch.weights, written[0]) and same(watch.replaced[0], start)
    restarted.train(examples(spec, tables, [0, 0, 1, 1], dense_version=2))  # the labels flipped
    assert restarted.dense.watch(lambda w: written.append(w) or 3, 4, 0.02) == 3
    assert same(written[1], start) and same(start, restarted.dense.net.state_dict())
    learner_state.save_dense_watches(restarted.dense, kept)
    assert learner_state.restore_dense_watches(DenseTrainer(served, 0.5, version=3), kept) == 0


def test_dense_watches_published_one_after_the_other_are_kept_and_taken_back(spec, tmp_path):
    from recserve.loop import learner_state

    tables, learn = learner(spec, dense_lr=0.05)
    for version in (2, 3):  # the second replaces the first's weights: the same tensors in both watches
        learn.train(examples(spec, tables, [1, 0, 1, 0]))
        assert learn.dense.publish(lambda w, v=version: v) == version
    learner_state.save_dense_watches(learn.dense, tmp_path / "watches.safetensors")
    served = CTRNet(spec)
    served.load_state_dict(learn.dense.published[0])
    restarted = DenseTrainer(served, 0.05, version=3)
    assert learner_state.restore_dense_watches(restarted, tmp_path / "watches.safetensors") == 2
    for kept, before in zip(restarted.watching, learn.dense.watching, strict=True):
        assert kept.version == before.version and same(kept.weights, before.weights)
        assert same(kept.replaced[0], before.replaced[0])
