"""One user's candidate list per request: the same dense inputs as the row layout, the history once."""

from __future__ import annotations

import numpy as np
import pytest
import tomllib

from recserve.backends.base import batching
from recserve.backends.dense.candidate_lists import CandidateLists
from recserve.backends.dense.runner import DenseStep
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.build import configs
from recserve.build.export import candidate_inputs
from recserve.build.synthetic import generate
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_csv
from recserve.core.candidate_lists import (
    candidate_rows,
    candidate_step_inputs,
    per_candidate_dense_inputs,
)
from recserve.core.contract import sequence_inputs
from recserve.core.names import (
    BYTES_WIRE,
    CANDIDATE_PREFIX,
    DENSE,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    HISTORY_EMBEDDINGS,
    HISTORY_MASK,
    HISTORY_USER,
    IDS_WIRE,
    PROBABILITY,
    STEPS,
    WIRE_FORMS,
)
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import load_spec, parse_spec, spec_path
from recserve.errors import InvalidInput
from recserve.perf.bench.input_data import candidate_input_data
from tests.candidate_list_rows import served_store, user_rows
from tests.store_tables import spec_store
from tests.user_runs import with_runs


@pytest.mark.parametrize("name", ["ctr", "taobao"])
def test_a_candidate_list_gives_the_row_forms_dense_inputs(name):
    spec = load_spec(name)
    rows, lists = user_rows(spec)
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, served_store(spec, rows)))
    expected, expanded, listed = step(rows), step.candidates(lists, expand=True), step.candidates(lists)
    assert set(expanded) == set(expected)
    for key, array in expected.items():
        np.testing.assert_array_equal(expanded[key], array, err_msg=key)
    assert float(np.abs(expected[HISTORY_EMBEDDINGS]).sum()) > 0  # real vectors, not defaults
    # the list layout: per-candidate tensors [users, candidates, ...], the history once per user
    per_candidate = per_candidate_dense_inputs(spec)
    assert set(listed) == {
        *sequence_inputs(spec), EMBEDDING_VERSION,
        *(CANDIDATE_PREFIX + n for n in per_candidate),
    }  # fmt: skip
    for name in per_candidate:
        got = listed[CANDIDATE_PREFIX + name]
        assert got.shape[:2] == (2, 3)
        np.testing.assert_array_equal(got.reshape(expected[name].shape), expected[name], err_msg=name)
    for name in (HISTORY_EMBEDDINGS, HISTORY_MASK):
        assert listed[name].shape[0] == 2
        np.testing.assert_array_equal(listed[name][[0, 0, 0, 1, 1, 1]], expected[name], err_msg=name)
    np.testing.assert_array_equal(listed[EMBEDDING_VERSION], expected[EMBEDDING_VERSION])


@pytest.mark.parametrize("form", [IDS_WIRE, BYTES_WIRE])
@pytest.mark.parametrize("name", ["ctr", "taobao"])  # taobao: a history padded on the left, one on the right
def test_a_batch_of_lists_looked_up_together_gives_each_list_what_it_gets_alone(name, form):
    spec = load_spec(name)
    shapes = [(2, 3, 4), (1, 7, 5), (3, 2, 6), (1, 1, 9)]  # users, candidates, seed
    made = [user_rows(spec, users, count, seed, form) for users, count, seed in shapes]
    lists = [one for _, one in made]
    store = served_store(spec, batching.merge([rows for rows, _ in made])[0])
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store))
    alone = [step.candidates(one) for one in lists]
    assert len({step.history_width(one) for one in lists}) > 1  # histories of several widths joined
    calls = []
    original = store.lookup
    store.lookup = lambda keys, tables, record=True: calls.append(keys.size) or original(keys, tables, record)
    together = step.candidate_lists(lists)
    assert len(calls) == 1  # one store call for the whole batch
    for got, expected in zip(together, alone, strict=True):
        assert set(got) == set(expected)
        for key, array in expected.items():
            assert got[key].shape == array.shape, key
            np.testing.assert_array_equal(got[key], array, err_msg=key)


def test_the_dense_step_scores_a_list_as_its_rows_with_and_without_the_list_graph(tiny_spec, tiny_repository):
    step = DenseStep.load(tiny_spec, tiny_repository / DENSE / "1", instances=1)
    assert step.lists.session is not None  # the built-in network exports the candidate-list graph
    sample = candidate_inputs(
        tiny_spec, users=3, candidates=5, length=tiny_spec.serving.sequence_buckets[0], seed=2
    )
    owner = sample.pop(HISTORY_USER)
    rows = dict(sample)
    for name in (HISTORY_EMBEDDINGS, HISTORY_MASK):
        rows[name] = sample[name][owner]
    lists = {n: sample[n] for n in (HISTORY_EMBEDDINGS, HISTORY_MASK)}
    for name in per_candidate_dense_inputs(tiny_spec):
        lists[CANDIDATE_PREFIX + name] = sample[name].reshape(3, 5, *sample[name].shape[1:])
    expected = step.runner.predict(step.check(rows))
    np.testing.assert_allclose(step.lists(lists), expected, atol=1e-5)
    without = CandidateLists(
        tiny_spec, lambda rows: step.runner.predict(step.check(rows)), None
    )  # row graph only
    np.testing.assert_allclose(without(lists), expected, atol=1e-6)
    step.close()


def test_a_batch_of_lists_scores_each_list_as_alone_with_and_without_the_list_graph(
    tiny_spec, tiny_repository
):
    step = DenseStep.load(tiny_spec, tiny_repository / DENSE / "1", instances=1)
    buckets = tiny_spec.serving.sequence_buckets
    lists = []
    for seed, (users, count, length) in enumerate(
        [(3, 5, buckets[0]), (1, 9, buckets[-1]), (2, 1, buckets[0])]
    ):
        sample = candidate_inputs(tiny_spec, users=users, candidates=count, length=length, seed=seed)
        one = {n: sample[n] for n in sequence_inputs(tiny_spec)}
        for name in per_candidate_dense_inputs(tiny_spec):
            one[CANDIDATE_PREFIX + name] = sample[name].reshape(users, count, *sample[name].shape[1:])
        lists.append(one)
    without = CandidateLists(tiny_spec, lambda rows: step.runner.predict(step.check(rows)), None)
    for scorer in (step.lists, without):
        alone = [scorer(one) for one in lists]
        for got, expected in zip(scorer.together(lists), alone, strict=True):
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidInput, match="candidate_sparse_embeddings"):
        step.lists.together([lists[0], {**lists[1], CANDIDATE_PREFIX + "sparse_embeddings": np.zeros(3)}])
    step.close()


def test_each_users_history_keys_are_looked_up_once(spec):
    rows, lists = user_rows(spec, users=2, candidates=5)
    store = served_store(spec, rows)
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, store))
    seen = []
    original = store.lookup
    store.lookup = lambda keys, tables, record=True: seen.append(keys.size) or original(keys, tables, record)
    step.candidates(lists)
    step(rows)
    width = step.history_width(rows)
    per_row = len(step.lookup.column_tables)
    assert seen == [10 * per_row + 2 * width, 10 * (per_row + width)]


def test_bad_candidate_lists_name_the_input_the_client_sent(spec):
    _, lists = user_rows(spec, users=1, candidates=4)
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, spec_store(spec)[1]))
    group = spec.categorical.name
    short = dict(lists, **{CANDIDATE_PREFIX + group: lists[CANDIDATE_PREFIX + group][:, :3]})
    with pytest.raises(InvalidInput, match=f"'{group}'.*1 users x 3 candidates, other inputs have 1 x 4"):
        step.candidates(short)
    flat = dict(lists, **{CANDIDATE_PREFIX + group: lists[CANDIDATE_PREFIX + group][0]})
    with pytest.raises(
        InvalidInput, match=f"'{group}': has shape \\[4, 26\\], expected \\[users, candidates, 26\\]"
    ):
        step.candidates(flat)
    wide = {k: np.repeat(v, 65, axis=1) if k.startswith(CANDIDATE_PREFIX) else v for k, v in lists.items()}
    with pytest.raises(
        InvalidInput, match=f"1 users x 260 candidates = 260 rows, outside 1..{spec.model.max_batch_size}"
    ):
        step.candidates(wide)
    length = spec.sequence_length_input
    with pytest.raises(InvalidInput, match=f"'{length}': has 2 rows, other inputs have 1"):
        step.candidates(dict(lists, **{length: np.repeat(lists[length], 2, axis=0)}))


def test_a_users_profile_travels_once_and_a_bad_one_names_its_input():
    taobao = load_spec("taobao")
    rows, lists = user_rows(taobao, users=2, candidates=3)
    assert taobao.profile_columns == (
        "clicks_7d", "user", "cms_segid", "cms_group_id", "final_gender_code", "age_level",
        "shopping_level", "tags",
    )  # fmt: skip
    categorical = lists[CANDIDATE_PREFIX + taobao.categorical.name]
    assert lists["profile__categorical"].shape == (2, 6) and categorical.shape == (2, 3, 4)
    assert lists["profile__dense"].shape == (2, 1) and lists["tags"].shape[0] == 2
    got, users = candidate_rows(taobao, lists)
    for name in ("categorical", "dense", "dense__missing", "tags"):
        np.testing.assert_array_equal(got[name], rows[name], err_msg=name)
    assert users.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(InvalidInput, match="'profile__categorical': is required but missing"):
        candidate_rows(taobao, {k: v for k, v in lists.items() if k != "profile__categorical"})
    with pytest.raises(InvalidInput, match="'profile__dense': has shape \\[1, 1\\], expected \\[2, 1\\]"):
        candidate_rows(taobao, dict(lists, profile__dense=lists["profile__dense"][:1]))
    with pytest.raises(InvalidInput, match="'tags': has shape \\[6, 8\\], expected \\[2, ...\\]"):
        candidate_rows(taobao, dict(lists, tags=np.repeat(lists["tags"], 3, axis=0)))
    narrow = dict(lists, **{CANDIDATE_PREFIX + "categorical": categorical[:, :, :3]})
    with pytest.raises(InvalidInput, match="'categorical': has 3 columns, expected 4"):
        candidate_rows(taobao, narrow)


def test_profile_columns_are_columns_of_a_spec_with_a_sequence():
    doc = tomllib.loads(spec_path("taobao").read_text())
    doc["inputs"]["profile"] = ["age_level", "hist_item_ids"]
    with pytest.raises(
        SpecError, match="profile 'hist_item_ids': \\['hist_item_ids'\\] not numeric, categorical"
    ):
        parse_spec(doc)
    avazu = tomllib.loads(spec_path("avazu").read_text())
    avazu.setdefault("inputs", {})["profile"] = ["device_id", "device_ip"]
    with pytest.raises(SpecError, match="profile: a spec without a sequence has no candidate lists"):
        parse_spec(avazu)


def test_the_candidates_ensemble_feeds_the_lookup_both_forms_and_batches_rows(spec):
    built = configs.all_configs(spec)
    ensemble, lookup = built[spec.candidates_model], built[EMBEDDING_LOOKUP]
    assert ensemble.max_batch_size == 0 and [s.model_name for s in ensemble.ensemble_scheduling.step] == list(
        STEPS
    )
    step_inputs = {i.name: i for i in lookup.input}
    first = ensemble.ensemble_scheduling.step[0]
    assert set(first.input_map.values()) == {i.name for i in ensemble.input}
    assert all(step_inputs[name].optional for name in first.input_map)
    assert all(
        step_inputs[name].allow_ragged_batch for name in first.input_map if name.startswith("candidate_")
    )
    row_layout = built[spec.name].ensemble_scheduling.step[0]
    both = {t.name for form in WIRE_FORMS for t in spec.wire_form(form).inputs}
    assert set(row_layout.input_map) == both
    assert {i.name: list(i.dims) for i in ensemble.output}[PROBABILITY] == [-1, 1]


def test_a_spec_without_sequences_has_no_candidates_ensemble():
    avazu = load_spec("avazu")
    assert avazu.candidates_model is None and candidate_step_inputs(avazu) == ()
    assert set(configs.all_configs(avazu)) == {*STEPS, avazu.name}
    # only the tensors of one wire form are optional: a request carries one form
    optional = {i.name for i in configs.all_configs(avazu)[EMBEDDING_LOOKUP].input if i.optional}
    assert optional == {"categorical", "categorical__ids", "categorical__missing"}


def test_a_users_consecutive_rows_with_the_same_sequences_are_one_run(tmp_path):
    taobao = load_spec("taobao")
    runs = [slice(0, 4), slice(4, 6), slice(6, 7), slice(7, 10)]
    raw = with_runs(taobao, generate(taobao, 10, seed=21), runs)
    rows = read_rows(write_csv(tmp_path / "rows.csv", raw, taobao), taobao)
    assert rows.user_runs(taobao) == runs
    user = rows.user_of(taobao, 4)
    assert set(user) == {s.name for s in taobao.sequences} and len(user["hist_cate_ids"]) == rows.lengths[4]
    raw.history[2, 0] += 1  # the same user, a history that moved on: a new run
    assert read_rows(write_csv(tmp_path / "moved.csv", raw, taobao), taobao).user_runs(taobao)[:2] == [
        slice(0, 2),
        slice(2, 3),
    ]
    raw.dense[8:, taobao.numeric_columns.index("clicks_7d")] += 1  # a profile column changed: a new run
    assert read_rows(write_csv(tmp_path / "clicked.csv", raw, taobao), taobao).user_runs(taobao)[-2:] == [
        slice(7, 8),
        slice(8, 10),
    ]
    ctr = load_spec("ctr")  # no [inputs] user: every row alone
    ctr_rows = read_rows(write_csv(tmp_path / "ctr.csv", generate(ctr, 3, seed=1), ctr), ctr)
    assert ctr_rows.user_runs(ctr) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_the_user_column_is_a_single_valued_categorical_of_a_spec_with_a_sequence():
    doc = tomllib.loads(spec_path("taobao").read_text())
    doc["inputs"]["user"] = "tags"
    with pytest.raises(SpecError, match="\\[inputs\\] user 'tags' is not a single-valued categorical column"):
        parse_spec(doc)
    avazu = tomllib.loads(spec_path("avazu").read_text())
    avazu.setdefault("inputs", {})["user"] = "device_id"
    with pytest.raises(SpecError, match="a spec without a sequence has no candidate lists"):
        parse_spec(avazu)


@pytest.mark.parametrize("name", ["ctr", "taobao"])
def test_perf_input_data_for_candidate_lists_holds_one_users_list_per_entry(name):
    spec = load_spec(name)
    document = candidate_input_data(spec, candidates=5, lists=3, seed=2)
    assert len(document["data"]) == 3
    for entry in document["data"]:
        ids = spec.wire_form("ids")  # the form perf data is written in by default
        assert set(entry) == {t.name for t in (*ids.user_inputs, *ids.candidate_inputs)}
        for tensor in ids.candidate_inputs:
            assert entry[tensor.name]["shape"][:2] == [1, 5]
        for tensor in ids.user_inputs:
            assert entry[tensor.name]["shape"][0] == 1
        for value in entry.values():
            assert len(value["content"]) == int(np.prod(value["shape"]))
    with pytest.raises(ValueError, match="no candidate-list layout"):
        candidate_input_data(load_spec("avazu"), candidates=5)


@pytest.mark.parametrize("name", ["ctr", "taobao"])
def test_the_log_records_a_list_as_its_rows_each_users_history_once(name, tmp_path):
    """Rows, a list answered alone as rows, lists answered together: the same records logged."""
    from recserve.backends.request_log.read import read_kind
    from recserve.backends.request_log.records import FEATURES
    from recserve.backends.request_log.segments import ParquetSegments
    from recserve.backends.request_log.step_log import FeatureLog
    from recserve.backends.request_log.writer import RecordWriter
    from recserve.core.sections.logging import LoggingSection
    from tests.triton_requests import Request

    spec = load_spec(name)
    rows, lists = user_rows(spec)
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, served_store(spec, rows)))
    logged = {}
    for layout in ("rows", "expanded", "listed"):
        writer = RecordWriter(ParquetSegments(tmp_path / layout, 1 << 30, 3600.0), capacity=4)
        log = FeatureLog(spec, LoggingSection(enabled=True), writer)
        step.log_tap = log.tap
        outputs = {
            "rows": lambda: step(rows),
            "expanded": lambda: step.candidates(lists, expand=True),
            "listed": lambda: step.candidate_lists([lists])[0],
        }[layout]()
        log(Request("r"), {}, outputs)
        assert not any(n.startswith("__") for n in outputs)  # what the log took is never sent
        writer.close()
        logged[layout] = read_kind(tmp_path / layout, FEATURES).drop_columns(["time"]).to_pydict()
    assert logged["rows"]["history_row"] == [0, 0, 0, 3, 3, 3]  # two users, three candidates each
    assert logged["expanded"] == logged["rows"] and logged["listed"] == logged["rows"]
