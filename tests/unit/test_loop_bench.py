"""bench-loop's pure parts: the drifting stream, the two sides' specs, and the figures of a recording."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recserve.perf.bench.loop.bench import LoopGrid, Recorded, Served, bench_specs
from recserve.perf.bench.loop.figures import auc_figures, cost_figures, freshness_figures
from recserve.perf.bench.loop.stream import NEW_ITEM_BASE, DriftingStream, StreamSettings
from tests.unit.helpers import two_behaviour_ctr_spec


@pytest.fixture(scope="module")
def stream(spec):
    return DriftingStream(spec, rounds=4, settings=StreamSettings(items=10, new_items=3))


def test_the_stream_is_seeded_and_its_items_drift(spec, stream):
    again = DriftingStream(spec, rounds=4, settings=StreamSettings(items=10, new_items=3))
    first, second = stream.request(0.5, 16), again.request(0.5, 16)
    assert (first[0].target == second[0].target).all() and (first[2] == second[2]).all()
    assert not np.allclose(stream.appeal(0.0), stream.appeal(1.5))  # appeal rises and falls
    assert not np.allclose(stream.popularity(0.0)[:10], stream.popularity(1.5)[:10])


def test_the_candidate_is_the_query_of_every_behaviour_over_the_items():
    """A cart's target is the candidate as the view's is: the items that drift are the ones scored."""
    two = DriftingStream(two_behaviour_ctr_spec(), rounds=2, settings=StreamSettings(items=10))
    rows, items, _ = two.request(0.5, 64)
    assert two.also_candidate == ("cart_target",)
    assert (rows.target == two.ids[items]).all() and (rows.target_ids("cart_target") == rows.target).all()
    assert not (two.pool.target_ids("cart_target") == two.pool.target).all()  # drawn apart in the pool


def test_new_items_appear_at_their_round_with_ids_training_never_saw(stream):
    assert len(stream.ids) == 10 + 3 * 3
    assert stream.popularity(0.9)[10:].sum() == 0.0  # none before round 1
    assert (stream.popularity(1.0)[10:13] > 0).all() and stream.popularity(1.0)[13:].sum() == 0.0
    assert (stream.ids[10:] >= NEW_ITEM_BASE).all()
    assert stream.popularity(3.2).sum() == pytest.approx(1.0)


def test_clicks_follow_the_hidden_model(stream):
    items = np.arange(len(stream.ids))
    p = stream.click_probability(np.zeros(len(items), np.int64), items, 2.0)
    assert np.allclose(p, 1 / (1 + np.exp(-(stream.settings.bias + stream.appeal(2.0)))))
    _, drawn, clicks = stream.request(2.0, 4000)
    assert abs(clicks.mean() - p[drawn].mean()) < 0.03


def test_the_starting_model_knows_the_rows_and_not_the_drift(spec):
    logits = DriftingStream(spec, 2, row_logits=lambda rows: np.where(rows.dense[:, 0] > 3, 9.0, -9.0))
    assert set(np.unique(logits.row_logits)) == {-4.0, 4.0}  # bounded
    one = np.array([0, 1])
    high = logits.click_probability(np.flatnonzero(logits.row_logits > 0)[:1].repeat(2), one, 0.0)
    low = logits.click_probability(np.flatnonzero(logits.row_logits < 0)[:1].repeat(2), one, 0.0)
    assert (high > low).all()


def test_the_frozen_side_differs_only_in_logging(spec, tmp_path):
    loop, frozen = bench_specs(spec, tmp_path, LoopGrid.quick())
    assert loop.logging.enabled and loop.logging.sample_rate == 1.0 and not frozen.logging.enabled
    assert loop.loop == frozen.loop and loop.loop.window_seconds == LoopGrid.quick().window_seconds
    assert {k: v for k, v in loop.source.items() if k != "logging"} == {
        k: v for k, v in frozen.source.items() if k != "logging"
    }


def _recorded(tmp_path: Path) -> Recorded:
    grid = LoopGrid(rounds=2)
    recorded = Recorded(grid, tmp_path, tmp_path / "log", tmp_path / "examples", tmp_path, "item")
    clicks = np.array([True, False, True, False])
    for k in range(8):  # round 1: the loop ranks the clicks first, the frozen side backwards
        recorded.served.append(
            Served(
                k // 4,
                f"r{k // 4}-{k % 4}",
                100.0 + k,
                clicks,
                np.array([0.9, 0.1, 0.8, 0.2]),
                np.array([0.1, 0.9, 0.2, 0.8]),
                0.01 * (1 + k % 2),
                0.01,
                k % 2 == 0,
                1 if k < 6 else 3,
            )  # fmt: skip
        )
    return recorded


def test_auc_is_pooled_over_the_later_rounds(tmp_path):
    figures = auc_figures(_recorded(tmp_path))
    assert figures["loop_auc"] == 1.0 and figures["frozen_auc"] == 0.0 and figures["loop_auc_gain"] == 1.0
    assert figures["later_rounds_from"] == 1 and len(figures["auc_by_round"]) == 2


def test_a_click_is_fresh_once_the_server_answers_with_a_version_trained_on_it(tmp_path):
    recorded = _recorded(tmp_path)
    recorded.learner_lines = [
        (103.5, {"published": {}, "trained": 1}),  # refused: its clicks are never served
        (104.5, {"published": {"item": 3, "C1": 2}, "trained": 2}),
    ]
    at = [datetime.datetime.fromtimestamp(t, datetime.UTC) for t in (101.0, 102.0, 103.0)]
    paths = []
    for seq, (label, when) in enumerate([(1, at[0]), (1, at[1]), (0, at[2])], start=1):
        paths.append((seq, tmp_path / f"examples-{seq}.parquet"))
        stamps = pa.array([when], pa.timestamp("us", "UTC"))
        pq.write_table(pa.table({"label": [label], "labelled_at": stamps}), paths[-1][1])
    figures, seconds = freshness_figures(recorded, lambda _: paths)
    assert figures["loop_freshness_unserved"] == 1 and figures["loop_published_versions"] == 1
    assert seconds == [106.0 - 102.0]  # the first answer with item version 3 was sent at 106
    assert figures["loop_publish_freshness_p50_s"] == 2.5 and figures["loop_refused_publishes"] == 1


def test_logging_cost_figures(tmp_path):
    recorded = _recorded(tmp_path)
    recorded.throughput_rows = {"loop": 900.0, "frozen": 1000.0}
    recorded.throughput_seconds = {"loop": 1.0, "frozen": 1.0}
    recorded.latency_s = {"loop": [0.004] * 98 + [0.012] * 2, "frozen": [0.004] * 100}
    recorded.latency_s["control"] = [0.005] * 100
    figures = cost_figures(recorded)
    assert figures["logging_throughput_ratio"] == 0.9
    assert figures["logging_p99_ratio"] == 3.0  # the latency phase's
    assert figures["logging_aa_p99_ratio"] == 1.25  # the control against the frozen server
    assert figures["frozen_p50_ms"] == 4.0 and figures["control_p99_ms"] == 5.0
    assert figures["rounds_p99_ratio"] == pytest.approx(2.0, abs=0.02)  # the rounds' requests


def test_the_replay_runs_the_benchs_stream_through_the_join_and_the_learner(spec):
    import torch

    from recserve.backends.dense.network import CTRNet
    from recserve.perf.bench.loop.replay import replay, stream_requests
    from tests.store_tables import spec_store

    torch.manual_seed(0)
    _, store = spec_store(spec)
    settings = StreamSettings(items=10, new_items=3)
    grid = LoopGrid(rounds=2, round_seconds=6.0, rate=2.0, rows=8, stream=settings)
    requests = stream_requests(spec, grid)
    assert len(requests) == 24 and requests[0].features[0]["request_id"] == "r0-0"  # the bench's ids
    first = stream_requests(spec, grid)[0]
    assert first.features == requests[0].features and (first.clicks == requests[0].clicks).all()  # seeded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batches of 8 rows: more threads only wait for each other
    try:
        figures = replay(spec, store, CTRNet(spec), grid, 0.05, requests)
        still = replay(spec, store, CTRNet(spec), grid, 1e-9, requests)
    finally:
        torch.set_num_threads(threads)
    assert figures.examples == 24 * 8  # every row labelled: its click, or its window's end
    assert figures.published_versions > 0 and figures.frozen_auc is not None
    assert still.loop_auc_gain == 0.0  # nothing learned: the loop serves what the frozen side does
