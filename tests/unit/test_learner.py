"""The minimal learner: only the touched rows train and are published, progressive loss, the 1/w weights."""

import dataclasses

import numpy as np
import pytest
import tomllib
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.hashing import missing_key
from recserve.backends.request_log.records import sequence_lengths
from recserve.backends.steps.lookup import EmbeddingLookup
from recserve.core.contract import attention_inputs
from recserve.core.names import DENSE_NORMALIZED, EMBEDDING_VERSION
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec
from recserve.loop.batch import trainable
from recserve.loop.learner import Learner
from recserve.loop.metrics import learn_samples, text
from recserve.loop.watch import Watch
from recserve.verify_log import _features
from tests.loop_examples import examples
from tests.model_exports import DEEPFM_SPEC
from tests.store_tables import spec_store
from tests.unit.helpers import (
    ctr_spec_document,
    tagged_ctr_spec,
    two_behaviour_ctr_spec,
    two_sequence_ctr_spec,
)


def learner(spec, lr=0.5):
    torch.manual_seed(0)
    tables, store = spec_store(spec)
    return tables, Learner(spec, store, CTRNet(spec), learning_rate=lr)


def test_training_moves_only_the_touched_rows_and_publishes_just_those(spec):
    tables, learn = learner(spec)
    batch = examples(spec, tables, [1, 1, 1, 1])
    for _ in range(5):
        learn.train(batch)
    assert learn.progressive_loss[-1] < learn.progressive_loss[0]  # scored before each step
    published = {}
    versions = learn.publish(
        lambda table, keys, vectors: published.setdefault(table, (keys, vectors)) and 7, now=12.0
    )
    assert learn.freshness == (10.0, 10.0)  # labelled at 2.0, published at 12.0
    assert set(versions) == set(published) and not learn.touched
    used: dict[str, set[int]] = {}
    names = [f.table for f in spec.categorical.features] + [t.table for t in spec.targets]
    for keys, history in zip(batch["keys"].to_pylist(), batch["history"].to_pylist(), strict=True):
        for name, key in zip(names, keys, strict=True):
            used.setdefault(name, set()).add(key)
        used.setdefault(spec.sequences[0].table, set()).update(history or [])
    assert {t: set(k.tolist()) for t, (k, _) in published.items()} == used
    for table, (keys, vectors) in published.items():
        ids = np.full(len(keys), learn.store.table_id(table), np.int16)
        served = learn.store.lookup(keys, ids, record=False).vectors
        assert vectors.shape == served.shape and not np.allclose(vectors, served)
    assert learn.publish(lambda *a: 1) == {}  # nothing touched since
    found = text(learn_samples(learn))
    assert (
        "recserve_learn_examples_total 20" in found
        and f"recserve_learn_published_rows_total {sum(map(len, used.values()))}" in found
    )


def test_a_negative_kept_at_rate_w_weighs_as_1_over_w_negatives(spec):
    tables, sampled = learner(spec)
    _, full = learner(spec)
    base = examples(spec, tables, [1, 0], rates=[1.0, 0.5])
    sampled.train(base)
    doubled = examples(spec, tables, [1, 0, 0], rates=[1.0, 1.0, 1.0])
    doubled = doubled.take([0, 1, 1])  # the negative twice, at rate 1
    full.train(doubled)
    assert sampled.rows.keys() == full.rows.keys()
    for key, row in sampled.rows.items():
        np.testing.assert_allclose(row, full.rows[key], rtol=1e-5, atol=1e-6)


def test_a_spec_the_learner_cannot_train_is_refused(spec):
    assert trainable(spec) == trainable(two_sequence_ctr_spec()) == trainable(two_behaviour_ctr_spec()) == ""
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True, "tokens": 96, "exact_tokens": 64, "tail": 32}
    assert "tail" in trainable(parse_spec(doc))  # the model saw a merged state the log does not hold
    with pytest.raises(ValueError, match="tail"):
        Learner(parse_spec(doc), None, None)  # type: ignore[arg-type]


def test_a_version_worse_than_the_served_scores_is_not_published_and_its_rows_go_back(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.01))  # the served scores were poor
    published = {}
    assert learn.publish(lambda t, k, v: published.setdefault(t, v) is not None and 3, max_loss_increase=0.0)
    assert learn.last_check[0] < learn.last_check[1]
    before = {key: row.copy() for key, row in learn.rows.items()}
    learn.train(examples(spec, tables, [1, 1, 1, 1], seed=1, served=0.999))  # the served scores were right
    assert learn.publish(lambda *a: 1 / 0, max_loss_increase=0.0) == {}  # refused: nothing published
    assert learn.refused_publishes == 1 and not learn.touched
    assert learn.rows.keys() == before.keys()  # rows trained only since are dropped ...
    for key, row in learn.rows.items():  # ... and the published ones are as published
        np.testing.assert_array_equal(row, before[key])
    assert "recserve_learn_refused_publishes_total 1" in text(learn_samples(learn))


def test_a_published_version_whose_served_scores_got_worse_is_rolled_back(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.01))
    published = learn.publish(lambda table, keys, vectors: 5, max_loss_increase=0.0)
    assert published and len(learn.watching) == 1
    before = {key: value.copy() for key, value in learn.published.items()}
    reverted = []
    # served by the old versions (1): not counted; served by the new ones (5), much worse: rolled back
    learn.train(examples(spec, tables, [1] * 3, seed=2, served=0.0001))
    assert learn.watch(lambda table, version: reverted.append((table, version)) or 6, 4, 0.1) == {}
    learn.train(examples(spec, tables, [1] * 4, seed=3, served=0.0001, versions=dict.fromkeys(published, 5)))
    assert learn.watch(
        lambda table, version: reverted.append((table, version)) or 6, 4, 0.1
    ) == dict.fromkeys(published, 6)
    assert sorted(reverted) == sorted(published.items()) and learn.rollbacks == 1 and not learn.watching
    assert not learn.published and all(key not in learn.rows for key in before)  # back to the store's rows


def test_rows_trained_after_a_publish_that_is_rolled_back_go_back_with_it(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.01))
    published = learn.publish(lambda table, keys, vectors: 5, max_loss_increase=0.0)
    rolled = set(learn.published)
    learn.train(examples(spec, tables, [1] * 4, served=0.0001, versions=dict.fromkeys(published, 5)))
    assert rolled & learn.touched  # the same rows, trained again on top of the published ones
    assert learn.watch(lambda table, version: 6, 4, 0.1) == dict.fromkeys(published, 6)
    assert not rolled & learn.touched
    learn.publish(lambda table, keys, vectors: 7)  # the rows left to publish are all there


def test_a_new_versions_clicks_coming_before_its_negatives_do_not_roll_it_back(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 0, 0, 0], served=0.25))  # a quarter clicked
    published = learn.publish(lambda table, keys, vectors: 5, max_loss_increase=0.5)
    assert published and learn.watching[0].positive_share == 0.25
    new = dict.fromkeys(published, 5)
    rollback = lambda table, version: 6  # noqa: E731
    learn.train(examples(spec, tables, [1] * 4, seed=2, served=0.25, versions=new))  # the clicks first
    assert learn.watch(rollback, 4, 0.1) == {} and learn.watching  # not judged on clicks alone
    learn.train(examples(spec, tables, [0] * 4, seed=3, served=0.25, versions=new))  # windows closed
    assert learn.watch(rollback, 4, 0.1) == {} and not learn.watching  # as good as before: kept


def stored(learn, key):
    table, row_key = key
    vectors = learn.store.lookup(np.array([row_key]), np.array([table], np.int16), record=False).vectors
    return np.array(vectors[0, : learn.spec.model.embedding_dim])


def test_each_row_steps_by_its_own_accumulated_squared_gradient(spec):
    tables, learn = learner(spec, lr=0.05)
    batch = examples(spec, tables, [1, 0, 1, 0])
    learn.train(batch)
    before = {key: stored(learn, key) for key in learn.touched}
    first = {key: learn.rows[key] - before[key] for key in learn.touched}
    for key, step in first.items():  # the first step of every row is the rate, whatever its gradient's size
        assert np.sqrt(np.mean(step**2)) == pytest.approx(0.05, rel=1e-3)
        assert learn.accumulators[key] > 0
    kept = dict(learn.accumulators)
    learn.train(batch)
    for key in first:  # the accumulator grew: the same batch again moves every row less
        assert learn.accumulators[key] > kept[key]
        assert np.sqrt(np.mean((learn.rows[key] - before[key] - first[key]) ** 2)) < 0.05


def test_the_learning_rate_is_the_specs_unless_given(spec):
    _, store = spec_store(spec)
    assert Learner(spec, store, CTRNet(spec)).learning_rate == spec.loop.learning_rate
    assert Learner(spec, store, CTRNet(spec), learning_rate=0.2).learning_rate == 0.2
    with pytest.raises(SpecError, match="learning_rate"):
        dataclasses.replace(spec.loop, learning_rate=0.0).check()


def test_a_refused_publish_and_a_rollback_put_the_accumulators_back_with_their_rows(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.01))
    published = learn.publish(lambda table, keys, vectors: 5, max_loss_increase=0.0)
    assert learn.published_accumulators == learn.accumulators  # published with their rows
    at_publish = dict(learn.accumulators)
    learn.train(examples(spec, tables, [1, 1, 1, 1], seed=1, served=0.999))
    assert learn.publish(lambda *a: 1 / 0, max_loss_increase=0.0) == {}  # refused
    assert learn.accumulators == at_publish  # the published rows' as published; the new rows' dropped
    learn.train(examples(spec, tables, [1] * 4, seed=3, served=0.0001, versions=dict.fromkeys(published, 5)))
    assert learn.watch(lambda table, version: 6, 4, 0.1) == dict.fromkeys(published, 6)
    assert not learn.published_accumulators and not set(at_publish) & set(learn.accumulators)  # as before


def test_a_good_version_is_kept_on_a_stretch_of_harder_rows(spec):
    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 0, 1, 0], served=[0.99, 0.01, 0.99, 0.01]))  # an easy stretch
    published = learn.publish(lambda table, keys, vectors: 5, max_loss_increase=None)
    watch, new = learn.watching[0], dict.fromkeys(published, 5)
    labels = [0, 1, 0, 1]
    before = learn.score(examples(spec, tables, labels, seed=2), watch.previous, learn.published)
    better = [float(p + 0.05 * (y - p)) for p, y in zip(before, labels, strict=True)]  # a little better
    learn.train(examples(spec, tables, labels, seed=2, served=better, versions=new))
    # its served log loss is far above the easy stretch's before it, but below the replaced rows'
    assert learn.watch(lambda table, version: 1 / 0, 4, 0.02) == {} and not learn.watching
    assert learn.last_watch[0] < learn.last_watch[1] and learn.rollbacks == 0


def test_a_version_whose_rows_score_worse_than_those_it_replaced_is_rolled_back(spec):
    tables, learn = learner(spec)
    for _ in range(5):
        learn.train(examples(spec, tables, [1, 1, 0, 0]))  # no served scores: they never came
    published = learn.publish(lambda table, keys, vectors: 5)
    watched = examples(spec, tables, [0, 0, 1, 1], versions=dict.fromkeys(published, 5))  # the same rows
    learn.train(watched)
    reverted = []
    assert learn.watch(lambda table, version: reverted.append(version) or 6, 4, 0.02) == dict.fromkeys(
        published, 6
    )
    assert learn.last_watch[0] > learn.last_watch[1] + 0.02 and set(reverted) == {5}
    assert not learn.published and not learn.accumulators


def test_a_rollback_takes_the_later_versions_of_its_tables_with_it(spec):
    tables, learn = learner(spec)
    batch = examples(spec, tables, [1, 1, 0, 0])
    for _ in range(5):
        learn.train(batch)
    first = learn.publish(lambda table, keys, vectors: 5)
    learn.train(batch)
    second = learn.publish(lambda table, keys, vectors: 6)
    assert set(first) == set(second) and len(learn.watching) == 2
    learn.train(examples(spec, tables, [0, 0, 1, 1], versions=dict.fromkeys(second, 6)))  # served by both
    calls = []
    assert learn.watch(lambda table, version: calls.append(version) or 7, 4, 0.02) == dict.fromkeys(first, 7)
    assert calls == [5] * len(first)  # one revert per table, to before the first: the log drops both
    assert not learn.watching and learn.rollbacks == 1 and not learn.published


def test_a_restarted_learner_keeps_the_published_rows_accumulators(spec, tmp_path):
    from recserve.loop import learner_state

    tables, learn = learner(spec)
    learn.train(examples(spec, tables, [1, 1, 1, 1], served=0.01))
    learn.publish(lambda table, keys, vectors: 5, max_loss_increase=0.0)
    learn.train(examples(spec, tables, [1, 0, 1, 0], seed=2))  # trained after the publish: not kept
    learner_state.save(learn, tmp_path / "kept.npz")
    _, again = learner(spec)
    assert learner_state.restore(again, tmp_path / "kept.npz") == len(learn.published_accumulators)
    assert again.accumulators == learn.published_accumulators
    again.train(examples(spec, tables, [1, 1, 1, 1], seed=1, served=0.999))
    assert again.publish(lambda *a: 1 / 0, max_loss_increase=0.0) == {}  # refused: back to as kept
    assert again.accumulators == learn.published_accumulators
    learner_state.save(again, tmp_path / "kept.npz")  # what it kept is saved again with what it publishes
    assert learner_state.restore(learner(spec)[1], tmp_path / "kept.npz") == len(learn.published_accumulators)
    assert learner_state.restore(again, tmp_path / "none.npz") == 0


def test_a_version_ranking_worse_than_the_served_scores_is_not_published(spec):
    tables, learn = learner(spec)
    labels = [1, 0] * 8
    served = [0.02, 0.01] * 8  # ranked perfectly, calibrated badly: its log loss is far above the learner's
    learn.train(examples(spec, tables, labels, served=served))
    assert learn.publish(lambda *a: 1 / 0, max_loss_increase=0.0, max_auc_drop=0.02) == {}
    assert learn.last_check[0] < learn.last_check[1] and learn.last_auc[0] < 0.98 == learn.last_auc[1] - 0.02
    assert learn.refused_publishes == 1 and 'recserve_learn_check_auc{scores="served"} 1\n' in text(
        learn_samples(learn)
    )
    learn.train(examples(spec, tables, labels, served=served))
    assert learn.publish(lambda t, k, v: 2, max_loss_increase=0.0)  # AUC not checked: published


def test_rows_of_tables_narrower_than_the_embeddings_train_in_their_own_columns():
    deepfm = parse_spec(tomllib.loads(DEEPFM_SPEC))  # 16- and 8-wide tables, 1-wide first-order ones
    assert trainable(deepfm) == "" and deepfm.other_widths
    torch.manual_seed(0)
    tables, store = spec_store(deepfm)
    learn = Learner(deepfm, store, CTRNet(deepfm), learning_rate=0.05)
    learn.train(examples(deepfm, tables, [1, 0, 1, 0]))
    published = {}
    learn.publish(lambda table, keys, vectors: published.setdefault(table, vectors) is not None and 2)
    assert {"site_id", "site_id_linear", "C15"} <= set(published)
    for name, vectors in published.items():
        assert vectors.shape[1] == store.table_dim(name) == deepfm.tables[name].dim
    for (table, key), row in learn.rows.items():
        width = deepfm.tables[store.table_names[table]].dim
        assert not row[width:].any()  # the padding past a table's width never moves
        step = row[:width] - stored(learn, (table, key))[:width]
        assert np.sqrt(np.mean(step**2)) == pytest.approx(0.05, rel=1e-3)  # a first step: the rate


def test_a_publish_watched_when_the_learner_restarts_is_judged_and_rolled_back_after_it(spec, tmp_path):
    from recserve.loop import learner_state

    tables, learn = learner(spec)
    for _ in range(5):
        learn.train(examples(spec, tables, [1, 1, 0, 0]))
    published = learn.publish(lambda table, keys, vectors: 5)
    learner_state.save(learn, tmp_path / "kept.npz")
    learner_state.save_watches(learn, tmp_path / "watches.npz")
    _, again = learner(spec)  # started again: the store would serve the published rows; here, as before
    learner_state.restore(again, tmp_path / "kept.npz")
    assert learner_state.restore_watches(again, tmp_path / "watches.npz") == 1
    kept, watch = again.watching[0], learn.watching[0]
    assert kept.versions == watch.versions and kept.positive_share == watch.positive_share
    assert kept.rows.keys() == watch.rows.keys() and all(
        np.array_equal(kept.rows[k], watch.rows[k]) for k in kept.rows
    )
    assert kept.replaced == dict.fromkeys(watch.replaced)  # all were the store's rows before it
    again.train(examples(spec, tables, [0, 0, 1, 1], versions=dict.fromkeys(published, 5)))
    reverted = []
    assert again.watch(lambda table, version: reverted.append(version) or 6, 4, 0.02) == dict.fromkeys(
        published, 6
    )
    assert set(reverted) == {5} and not again.watching and not again.restored
    learner_state.save_watches(again, tmp_path / "watches.npz")
    assert learner_state.restore_watches(learner(spec)[1], tmp_path / "watches.npz") == 0


def test_a_version_ranking_its_examples_worse_than_the_rows_it_replaced_is_rolled_back(spec):
    for margin, rolled in ((None, False), (0.05, True)):
        _, learn = learner(spec)
        # label, weight, the version's score, the replaced rows': log loss within 0.3, AUC 0.5 against 1
        scored = np.array([[1, 1, 0.4, 0.6], [1, 1, 0.6, 0.6], [0, 1, 0.6, 0.4], [0, 1, 0.4, 0.4]], float)
        learn.watching.append(Watch({"item": 5}, {}, {}, 0.5, [scored]))
        reverted = learn.watch(lambda table, version: 6, 4, 0.3, max_auc_drop=margin)
        assert (reverted == {"item": 6}) is rolled and learn.last_watch_auc == (0.5, 1.0)
        assert learn.last_watch[0] < learn.last_watch[1] + 0.3
        assert 'recserve_learn_watch_auc{rows="replaced"} 1\n' in text(learn_samples(learn))


def served_scores(spec, learn, batch):
    """``batch`` scored as the served steps score it: its logged features rebuilt as ``verify --log``
    rebuilds them, the lookup step's outputs from the learner's store, through the learner's network."""
    keys = np.array(batch["keys"].to_pylist(), np.int64)  # as logged: slots, multi-hot, targets
    dense = np.array(batch["dense"].to_pylist(), np.float32)
    split = sequence_lengths(batch["history"], batch["history_lengths"], len(spec.sequences))
    features = _features(spec, keys, dense, [h or [] for h in batch["history"].to_pylist()], split)
    looked = EmbeddingLookup(spec, learn.store).lookup(features)
    named = {n: torch.as_tensor(np.asarray(v)) for n, v in looked.items() if n != EMBEDDING_VERSION}
    masks = tuple(group.mask for group in attention_inputs(spec))
    named |= {n: torch.as_tensor(features[n]) for n in (DENSE_NORMALIZED, *masks)}
    with torch.no_grad():
        return learn.net.score(named).reshape(-1).numpy()


def test_multi_hot_rows_train_through_the_pooling_weights_the_lookup_step_served():
    spec = tagged_ctr_spec()
    tables, learn = learner(spec)
    batch = examples(spec, tables, [1, 0, 1, 1, 0])  # rows with 0, 1, 2, 3 and 4 tags
    np.testing.assert_allclose(learn.score(batch, {}), served_scores(spec, learn, batch), atol=1e-6)
    learn.train(batch)
    keys = np.array(batch["keys"].to_pylist(), np.int64)
    single, tags = len(spec.categorical.features), learn.store.table_id("tags")
    logged = keys[:, single : single + 4]
    padding = missing_key(spec.hashing.namespace, "tags")
    trained = {key for table, key in learn.touched if table == tags}
    assert trained == set(logged[logged != padding].tolist())  # each value's row; padding never


@pytest.mark.parametrize("combine", ["sum", "concat"])
def test_two_sequences_of_one_attention_group_train_as_the_lookup_step_combines_them(combine):
    spec = two_sequence_ctr_spec(combine)
    tables, learn = learner(spec)
    batch = examples(spec, tables, [1, 0, 1, 1, 0, 1])  # every other row with a history
    np.testing.assert_allclose(learn.score(batch, {}), served_scores(spec, learn, batch), atol=1e-6)
    learn.train(batch)
    cates = {int(k[-1]) for k in batch["keys"].to_pylist()}  # the candidates' categories
    cates |= {k for h in batch["history"].to_pylist() if h for k in h[len(h) // 2 :]}  # the histories'
    assert {key for table, key in learn.touched if table == learn.store.table_id("cate")} == cates


def test_behaviours_with_lengths_of_their_own_train_as_the_lookup_step_serves_them():
    spec = two_behaviour_ctr_spec()  # items viewed (3 a row here) and carted (4), both of table item
    tables, learn = learner(spec)
    batch = examples(spec, tables, [1, 0, 1, 1, 0, 1])  # every other row with its two histories
    assert [n for n in batch["history_lengths"].to_pylist() if n] == [[3, 4]] * 3
    np.testing.assert_allclose(learn.score(batch, {}), served_scores(spec, learn, batch), atol=1e-6)
    learn.train(batch)
    items = {int(k) for keys in batch["keys"].to_pylist() for k in keys[-2:]}  # both targets
    items |= {k for h in batch["history"].to_pylist() if h for k in h}
    # every position of both behaviours trains; the views' padding (as wide as the carts) never does
    assert {key for table, key in learn.touched if table == learn.store.table_id("item")} == items
