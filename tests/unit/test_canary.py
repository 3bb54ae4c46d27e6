"""The canary's parts as plain code: figures, comparison, stages, the saved decision, the exposition.

The live rollout and rollbacks through a real Envoy are in ``tests/integration/test_canary.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from recserve.access import AccessError
from recserve.access.canary import controller as canary
from recserve.access.canary import figures as canary_figures
from recserve.access.canary.controller import (
    CanaryState,
    Stage,
    Verdict,
    Window,
    decide,
    judge,
    psi,
    quantile,
)
from recserve.backends.base.metrics import PROBABILITY_EDGES, ScoreHistogram
from recserve.backends.base.request_errors import RequestErrorCounts
from recserve.backends.dense.runner import DenseStep
from recserve.core.names import PROBABILITY
from recserve.core.sections.serving import AccessSection, CanarySection
from recserve.core.spec.parse import load_spec
from recserve.errors import NonFiniteOutput

INF = math.inf
SETTINGS = CanarySection(
    steps=(1.0, 50.0, 100.0), shadow_fraction=0.2, dwell_s=10, min_requests=100, min_judged=50
)


def _scores(shares: list[float], rows: int = 1000, mean: float = 0.1) -> tuple[dict[float, float], float]:
    """A cumulative score histogram over the served edges with these bucket shares."""
    edges = [*PROBABILITY_EDGES, INF]
    cumulative = np.cumsum(np.asarray(shares) * rows)
    return dict(zip(edges, cumulative.tolist(), strict=True)), mean * rows


BASE_SHARES = [0.05, 0.1, 0.2, 0.25, 0.2, 0.1, 0.05, 0.03, 0.01, 0.01]


def _window(requests=1000.0, failures=0.0, p99_ms=10.0, shares=None, mean=0.1, rows=1000) -> Window:
    latency = {1.0: 0.0, 5.0: requests * 0.5, p99_ms: requests * 0.99, 2 * p99_ms: requests, INF: requests}
    scores, total = _scores(shares or BASE_SHARES, rows=rows, mean=mean)
    return Window(requests, failures, latency, scores, total)


# --- figures -----------------------------------------------------------------------------------


def test_psi_is_zero_for_equal_distributions_and_grows_with_the_shift():
    assert psi([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert psi([0.5, 0.5], [0.6, 0.4]) == pytest.approx(
        0.1 * math.log(1.2 / 1.0) + 0.1 * math.log(1.25), rel=1e-6
    )
    small, large = psi(BASE_SHARES, BASE_SHARES[1:] + BASE_SHARES[:1]), psi(BASE_SHARES, BASE_SHARES[::-1])
    assert 0 < small < large
    assert math.isfinite(psi([1.0, 0.0], [0.0, 1.0]))  # empty buckets are floored
    with pytest.raises(ValueError, match="same buckets"):
        psi([1.0], [0.5, 0.5])


def test_quantiles_interpolate_within_a_bucket():
    cumulative = {1.0: 0.0, 10.0: 100.0, INF: 100.0}
    assert quantile(cumulative, 0.5) == pytest.approx(5.5)
    assert quantile(cumulative, 0.99) == pytest.approx(1 + 9 * 0.99)
    assert quantile({5.0: 10.0, INF: 20.0}, 0.99) == 5.0  # in the open bucket: its lower edge
    assert quantile({}, 0.99) is None and quantile({1.0: 0.0, INF: 0.0}, 0.5) is None


def test_a_window_is_the_difference_of_running_totals_and_survives_a_counter_reset():
    start, now = _window(requests=100, failures=2), _window(requests=300, failures=5)
    delta = now.since(start)
    assert (delta.requests, delta.failures) == (200, 3) and delta.error_rate == 3 / 200
    assert delta.latency[INF] == 200 and delta.scored == 0  # the same score totals: nothing new
    restarted = now.since(_window(requests=1000, failures=50))  # the server restarted: counts from 0
    assert (restarted.requests, restarted.failures, restarted.timed) == (300, 5, 300)
    assert Window().error_rate == 0.0 and Window().p99_ms() is None and Window().mean_score() is None


# --- the comparison ----------------------------------------------------------------------------


def test_an_equal_candidate_passes_every_check_once_there_is_enough_traffic():
    verdict = judge(SETTINGS, _window(), _window())
    compared = {"error_rate_increase": 0.0, "p99_ratio": 1.0, "psi": 0.0, "mean_ratio": 1.0}
    clients = {"client_errors_stable": 0.0, "client_errors_canary": 0.0}
    assert verdict == Verdict("", True, {**compared, **clients}, ())
    assert not judge(SETTINGS, _window(), _window(requests=10)).judged  # too few to judge


def test_p99s_wait_for_a_hundred_timed_requests_and_a_stage_for_its_minimum():
    verdict = judge(SETTINGS, _window(requests=80), _window(requests=80))
    assert "error_rate_increase" in verdict.figures and "p99_ratio" not in verdict.figures
    assert not verdict.judged  # 80 >= min_judged, but a p99 of 80 requests is nearly their maximum
    many = dataclasses.replace(SETTINGS, min_requests=5000)
    assert not judge(many, _window(), _window()).judged and not judge(many, _window(), _window()).rollback


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        (_window(failures=50), "error rate 0.050 vs stable's 0.000"),
        (_window(p99_ms=40), "p99 40.0 ms vs stable's 10.0 ms"),
        (_window(shares=BASE_SHARES[::-1]), "score distribution moved: PSI"),
        (_window(mean=0.05), "mean probability 0.500x stable's"),
    ],
)
def test_a_candidate_crossing_a_threshold_is_rolled_back_with_the_reason(canary, reason):
    verdict = judge(SETTINGS, _window(), canary)
    assert reason in verdict.rollback


def test_small_differences_are_not_held_against_the_candidate():
    assert not judge(SETTINGS, _window(failures=5), _window(failures=10)).rollback  # +0.005 < 0.01
    assert not judge(SETTINGS, _window(p99_ms=2), _window(p99_ms=6)).rollback  # 3x, but only 4 ms
    assert not judge(SETTINGS, _window(), _window(mean=0.11)).rollback


def test_a_failing_comparison_rolls_back_even_before_the_others_can_be_made():
    few_rows = dataclasses.replace(_window(failures=500), scores={}, score_sum=0.0)
    verdict = judge(SETTINGS, _window(), few_rows)
    assert "error rate" in verdict.rollback and "scores" in verdict.skipped[0]


def test_without_a_score_histogram_the_score_checks_are_skipped_and_said_so():
    bare = dataclasses.replace(_window(), scores={}, score_sum=0.0)
    verdict = judge(SETTINGS, bare, bare)
    assert verdict.judged and not verdict.rollback and "no served-probability histogram" in verdict.skipped[0]


# --- stages and decisions ----------------------------------------------------------------------


def test_the_stages_are_a_shadow_stage_then_the_steps_with_whole_weights():
    plan = canary.stages(SETTINGS)
    assert [s.name for s in plan] == ["shadow", "1%", "50%", "100%"]
    assert plan[0] == Stage("shadow", 0.0, 0.2) and plan[0].weights() == {"stable": 10_000, "canary": 0}
    assert Stage("0.5%", 0.5, 0.0).weights() == {"stable": 9_950, "canary": 50}
    assert [s.name for s in canary.stages(dataclasses.replace(SETTINGS, shadow_fraction=0.0))][0] == "1%"


def test_a_stage_advances_only_after_its_dwell_time_with_enough_traffic_and_then_promotes():
    state = CanaryState(stage_started=100.0)
    passed = Verdict("", True, {"psi": 0.01})
    assert decide(SETTINGS, state, passed, 105.0) == state  # dwell not over
    assert decide(SETTINGS, state, Verdict(judged=False), 200.0) == state  # not enough traffic
    for stage in range(1, 4):
        state = decide(SETTINGS, state, passed, state.stage_started + 10)
        assert state.stage == stage and state.events[-1]["event"] == "step"
    assert state.routing(SETTINGS) == ({"stable": 0, "canary": 10_000}, 0.0)  # at 100 %
    state = decide(SETTINGS, state, passed, state.stage_started + 10)
    assert state.status == canary.PROMOTED and state.count("step") == 3 and state.count("promote") == 1
    assert decide(SETTINGS, state, Verdict("bad"), 1e9) == state  # decided: nothing changes it


def test_a_rollback_records_its_reason_and_how_long_the_candidate_was_exposed():
    state = decide(SETTINGS, CanaryState(stage=2, stage_started=100.0), Verdict("error rate 0.2"), 101.5)
    assert state.status == canary.ROLLED_BACK and state.reason == "error rate 0.2"
    assert state.events[-1] | {"time": 0} == {
        "event": "rollback",
        "reason": "error rate 0.2",
        "time": 0,
        "stage": "50%",
        "after_s": 1.5,
        "figures": {},
    }
    assert state.routing(SETTINGS) == ({"stable": 10_000, "canary": 0}, 0.0)


def test_the_saved_decision_is_read_back_and_routes_a_restarted_proxy(tmp_path):
    access = dataclasses.replace(AccessSection(), canary=SETTINGS)
    assert canary.routed(access, tmp_path) is access  # nothing saved: the spec's routing
    state = CanaryState(stage=2, stage_started=5.0, events=({"event": "step"},))
    state.save(tmp_path / canary.STATE_FILE)
    assert CanaryState.load(tmp_path / canary.STATE_FILE) == state
    routed = canary.routed(access, tmp_path)
    assert routed.weights == {"stable": 5_000, "canary": 5_000} and routed.shadow_fraction == 0.0
    dataclasses.replace(state, status=canary.ROLLED_BACK).save(tmp_path / canary.STATE_FILE)
    assert canary.routed(access, tmp_path).weights == {"stable": 10_000, "canary": 0}
    (tmp_path / canary.STATE_FILE).write_text("{}")
    with pytest.raises(AccessError, match="is not a canary state"):
        canary.routed(access, tmp_path)


# --- reading the stack -------------------------------------------------------------------------

TRITON = """# HELP nv_inference_request_success x
nv_inference_request_success{model="tiny",version="1"} 90
nv_inference_request_success{model="dense",version="1"} 95
nv_inference_request_failure{model="tiny",reason="BACKEND",version="1"} 10
recserve_served_probability_bucket{dense_version="1",le="0.1"} 30
recserve_served_probability_bucket{dense_version="1",le="+Inf"} 40
recserve_served_probability_sum{dense_version="1"} 6.5
recserve_served_probability_count{dense_version="1"} 40
"""
ENVOY = """envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="canary_grpc",le="5"} 3
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="canary_grpc",le="+Inf"} 4
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="canary_http_shadow",le="5"} 1
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="canary_http_shadow",le="+Inf"} 1
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="stable_grpc",le="+Inf"} 100
"""


def test_the_ensembles_counters_and_the_score_histogram_are_read_from_tritons_metrics():
    window = canary.triton_window(TRITON, "tiny")
    # steps without error counts by code: every failure of the ensemble is held against the server
    assert (window.requests, window.failures, window.client_errors) == (100, 10, 0)
    assert window.scores == {0.1: 30, INF: 40} and window.score_sum == 6.5 and window.mean_score() == 6.5 / 40
    clusters = ["canary_grpc", "canary_http", "canary_grpc_shadow", "canary_http_shadow"]
    assert canary.envoy_latency(ENVOY, clusters) == {5.0: 4, INF: 5}  # live and mirrored, summed


def test_a_half_published_score_histogram_is_read_again(tmp_path, monkeypatch):
    # the step publishes _count first and le="+Inf" last: a read between them is inside a publication
    half = TRITON.replace('_count{dense_version="1"} 40', '_count{dense_version="1"} 52')
    assert canary_figures.scores_settled(TRITON) and not canary_figures.scores_settled(half)
    reads = [half, half, TRITON]
    monkeypatch.setattr(canary, "_get", lambda url, timeout_s: reads.pop(0))
    monkeypatch.setattr(canary, "SETTLE_PAUSE_S", 0.0)
    stack = canary.Stack("127.0.0.1:1", {"stable": [], "canary": ["127.0.0.1:1"]})
    controller = canary.CanaryController("tiny", SETTINGS, stack, tmp_path)
    assert controller._server_metrics("canary", "127.0.0.1:1") == TRITON and not reads


def test_the_stack_file_round_trips_and_a_missing_one_says_what_to_run(tmp_path):
    stack = canary.Stack("127.0.0.1:9901", {"stable": ["127.0.0.1:8002"], "canary": ["127.0.0.1:18002"]})
    stack.save(tmp_path / canary.STACK_FILE)
    assert canary.Stack.load(tmp_path / canary.STACK_FILE) == stack
    with pytest.raises(AccessError, match="no running access layer"):
        canary.Stack.load(tmp_path / "absent.json")
    with pytest.raises(AccessError, match="needs a running 'canary'"):
        canary.CanaryController("tiny", SETTINGS, canary.Stack("a:1", {"stable": []}), tmp_path)


def test_the_controller_exports_its_stage_status_and_counts(tmp_path):
    stack = canary.Stack("127.0.0.1:1", {"stable": [], "canary": []})
    controller = canary.CanaryController("tiny", SETTINGS, stack, tmp_path)
    controller.state = CanaryState(status=canary.ROLLED_BACK, stage=1, events=({"event": "rollback"},))
    controller.verdict = Verdict("x", True, {"psi": 0.5})
    series = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in controller.exposition().splitlines()
        if not line.startswith("#")
    }
    assert series == {
        "recserve_access_canary_stage": 1,
        'recserve_access_canary_status{status="running"}': 0,
        'recserve_access_canary_status{status="promoted"}': 0,
        'recserve_access_canary_status{status="rolled_back"}': 1,
        "recserve_access_canary_percent": 0,
        "recserve_access_candidate_percent": 0,
        "recserve_access_shadow_fraction": 0,
        "recserve_access_canary_steps_total": 0,
        "recserve_access_canary_rollbacks_total": 1,
        "recserve_access_canary_periods_total": 0,
        'recserve_access_canary_figure{figure="psi"}': 0.5,
    }


def test_an_unreachable_candidate_is_rolled_back_after_two_periods(tmp_path):
    stack = canary.Stack("127.0.0.1:1", {"stable": [], "canary": ["127.0.0.1:1"]})
    controller = canary.CanaryController("tiny", SETTINGS, stack, tmp_path, timeout_s=0.5)
    controller.state = CanaryState(stage_started=0.0)

    def observe():
        raise canary.Unreachable("canary", "canary's tritonserver metrics at 127.0.0.1:1: refused")

    controller.observe = observe  # the proxy is not there either: apply() only logs
    assert controller.tick().status == canary.RUNNING
    state = controller.tick()
    assert state.status == canary.ROLLED_BACK and "did not answer for 2 periods" in state.reason
    saved = json.loads((tmp_path / canary.STATE_FILE).read_text())
    assert saved["status"] == canary.ROLLED_BACK
    assert json.loads((tmp_path / canary.LOG_FILE).read_text().splitlines()[-1])["event"] == "rollback"


class _Scripted(canary.CanaryController):
    """A controller over scripted running totals and a scripted clock (no stack behind it)."""

    def __init__(self, settings, workdir, totals):
        stack = canary.Stack("127.0.0.1:1", {"stable": [], "canary": []})
        self.times = iter(range(0, 10_000, 10))
        super().__init__(
            "tiny", settings, stack, workdir, clock=lambda: float(next(self.times)), timeout_s=0.2
        )
        self.totals = iter(totals)

    def observe(self):
        return next(self.totals)


def test_at_100_percent_stables_last_stage_stands_in_for_it(tmp_path):
    settings = dataclasses.replace(SETTINGS, shadow_fraction=0.0, steps=(50.0, 100.0), dwell_s=0, settle_s=0)
    once, twice = _window(), _window(requests=2000, rows=2000)
    controller = _Scripted(
        settings,
        tmp_path,
        [
            {"stable": Window(), "canary": Window()},
            {"stable": once, "canary": once},
            {"stable": once, "canary": twice},  # stable served nothing more
        ],
    )
    controller.begin()
    assert controller.tick().stage == 1  # 50 %: both compared, on to 100 %
    state = controller.tick()  # 100 %: stable's 50 % window is the reference
    assert state.status == canary.PROMOTED, controller.verdict
    assert controller.verdict.figures["psi"] == 0.0 and controller.verdict.judged


def test_latency_counts_only_from_settle_s_into_a_stage(tmp_path):
    settings = dataclasses.replace(SETTINGS, shadow_fraction=0.0, dwell_s=0, settle_s=15)
    fast = {1.0: 0.0, 5.0: 1000.0, 400.0: 1000.0, INF: 1000.0}
    cold = dataclasses.replace(_window(), latency={1.0: 0.0, 5.0: 0.0, 400.0: 1000.0, INF: 1000.0})
    warm = dataclasses.replace(
        _window(requests=2000, rows=2000), latency={k: v + fast[k] for k, v in cold.latency.items()}
    )
    stable = dataclasses.replace(_window(), latency=fast)
    stable_later = dataclasses.replace(
        _window(requests=2000, rows=2000), latency={k: 2 * v for k, v in fast.items()}
    )
    controller = _Scripted(
        settings,
        tmp_path,
        [
            {"stable": Window(), "canary": Window()},
            {"stable": stable, "canary": cold},  # t=10: before settle_s, p99 not compared
            {"stable": stable, "canary": cold},  # t=20: settled here
            {"stable": stable_later, "canary": warm},  # t=30: only the warm requests count
        ],
    )
    controller.begin()
    controller.tick()
    assert "p99_ratio" not in controller.verdict.figures and controller.state.status == canary.RUNNING
    controller.tick()
    state = controller.tick()
    assert controller.verdict.figures["p99_ratio"] == 1.0 and not controller.verdict.rollback
    assert state.stage == 1


# --- the dense step's side: the served-probability histogram and the finite-output guard ------


def test_the_score_histogram_is_cumulative_with_sum_and_count():
    histogram = ScoreHistogram((("dense_version", "3"),))
    histogram.observe(np.array([[0.005], [0.01], [0.15], [0.95]], np.float32))
    samples = {(s.name, dict(s.labels).get("le")): s.value for s in histogram.samples()}
    assert samples[("recserve_served_probability_bucket", "0.01")] == 2  # an edge value is in its bucket
    assert samples[("recserve_served_probability_bucket", "0.2")] == 3
    assert samples[("recserve_served_probability_bucket", "+Inf")] == 4
    assert samples[("recserve_served_probability_count", None)] == 4
    assert samples[("recserve_served_probability_sum", None)] == pytest.approx(1.115, abs=1e-6)
    assert all(dict(s.labels)["dense_version"] == "3" for s in histogram.samples())
    # published in this order, a scrape inside a publication reads _count ahead of +Inf
    order = [(s.name.rsplit("_", 1)[1], dict(s.labels).get("le")) for s in histogram.samples()]
    assert order[:2] == [("count", None), ("sum", None)] and order[-1] == ("bucket", "+Inf")


def test_a_request_with_a_non_finite_probability_fails_alone_and_is_not_counted():
    step = DenseStep(load_spec("tiny"), runner=None, version="2")  # type: ignore[arg-type]
    step.accept({PROBABILITY: np.array([[0.2], [0.4]], np.float32)})
    with pytest.raises(NonFiniteOutput, match=r"returned nan as the probability of row 1 \(2 of 3 rows"):
        step.accept({PROBABILITY: np.array([[0.2], [np.nan], [np.inf]], np.float32)})
    assert NonFiniteOutput.code == "INTERNAL"
    assert step.scores.counts.sum() == 2  # only the served rows


# --- the server is judged, not its clients ------------------------------------------------------


def _triton(served: float, client: float = 0.0, internal: float = 0.0, rejected: float = 0.0) -> str:
    """One server's metrics as Triton 2.51 exports them: the ensemble counts each failed request
    twice (reason OTHER) whatever its code; the steps count their errors by code."""
    failed = client + internal
    return f"""nv_inference_request_success{{model="tiny",version="1"}} {served}
nv_inference_request_success{{model="tiny_candidates",version="1"}} 5
nv_inference_request_success{{model="embedding_lookup",version="1"}} {served + failed + 7}
nv_inference_request_failure{{model="tiny",reason="OTHER",version="1"}} {2 * failed}
nv_inference_request_failure{{model="tiny",reason="REJECTED",version="1"}} 0
nv_inference_request_failure{{model="dense",reason="REJECTED",version="1"}} {rejected}
nv_inference_request_failure{{model="dense",reason="OTHER",version="1"}} 3
recserve_request_errors_total{{code="INVALID_ARG"}} {client}
recserve_request_errors_total{{code="INTERNAL"}} {internal}
"""


def test_client_errors_are_counted_apart_from_the_servers_failures():
    window = canary.triton_window(
        _triton(1000, client=400, internal=30, rejected=2), ["tiny", "tiny_candidates"]
    )
    # judged: both ensembles' successes and the server-side failures (INTERNAL, a step's queue refusals)
    assert (window.requests, window.failures, window.client_errors) == (1037, 32, 400)
    assert canary.triton_window(_triton(1000, client=400), "tiny").error_rate == 0.0
    two = canary_figures.plus(window, window)
    assert (two.requests, two.failures, two.client_errors) == (2074, 64, 800)
    later = canary.triton_window(
        _triton(1500, client=900, internal=30, rejected=2), ["tiny", "tiny_candidates"]
    )
    assert later.since(window).client_errors == 500 and later.since(window).failures == 0


def test_envoy_timeouts_of_a_variants_clusters_are_its_failures():
    text = """envoy_cluster_upstream_rq_timeout{envoy_cluster_name="canary_grpc"} 3
envoy_cluster_upstream_rq_timeout{envoy_cluster_name="canary_http_shadow"} 1
envoy_cluster_upstream_rq_timeout{envoy_cluster_name="stable_grpc"} 7
"""
    assert canary.envoy_timeouts(text, ["canary_grpc", "canary_http_shadow"]) == 4


def test_client_errors_never_move_the_decision_and_never_fill_a_stage():
    flooded = dataclasses.replace(_window(), client_errors=5000)
    verdict = judge(SETTINGS, _window(), flooded)
    assert not verdict.rollback and verdict.judged, verdict
    assert verdict.figures["client_errors_canary"] == 5000 and verdict.figures["error_rate_increase"] == 0
    # aimed at stable, they do not hide a canary failing by its own fault
    bad = judge(SETTINGS, dataclasses.replace(_window(), client_errors=5000), _window(failures=50))
    assert "error rate 0.050 vs stable's 0.000" in bad.rollback
    # a stage needs min_requests served or failed by the server; malformed requests are neither
    few = dataclasses.replace(_window(requests=60), client_errors=5000)
    assert not judge(dataclasses.replace(SETTINGS, min_judged=50), _window(), few).judged


def _from_metrics(text: str, requests: float) -> Window:
    window = canary.triton_window(text, ["tiny", "tiny_candidates"])
    return dataclasses.replace(window, latency=_window(requests=requests).latency)


def test_malformed_requests_at_either_variant_move_no_decision_but_server_failures_do(tmp_path):
    settings = dataclasses.replace(SETTINGS, shadow_fraction=0.0, steps=(50.0, 100.0), dwell_s=0, settle_s=0)
    zero = {"stable": _from_metrics(_triton(0), 0), "canary": _from_metrics(_triton(0), 0)}
    attacked = [
        zero,
        {  # malformed requests at the canary (its user id): 4 of them, then many
            "stable": _from_metrics(_triton(1000), 1000),
            "canary": _from_metrics(_triton(1000, client=4), 1000),
        },
        {
            "stable": _from_metrics(_triton(2000), 2000),
            "canary": _from_metrics(_triton(2000, client=3000), 2000),
        },
    ]
    controller = _Scripted(settings, tmp_path, attacked)
    controller.begin()
    assert controller.tick().stage == 1, controller.verdict  # advanced on the server's merits
    state = controller.tick()
    assert state.status == canary.PROMOTED, controller.verdict
    assert controller.verdict.figures["client_errors_canary"] == 2996

    hiding = [  # stable flooded with malformed requests; the canary fails 5 % by its own fault
        zero,
        {
            "stable": _from_metrics(_triton(1000, client=3000), 1000),
            "canary": _from_metrics(_triton(950, internal=50), 1000),
        },
    ]
    controller = _Scripted(settings, tmp_path / "hiding", hiding)
    (tmp_path / "hiding").mkdir()
    controller.begin(new=True)
    state = controller.tick()
    assert state.status == canary.ROLLED_BACK and "error rate 0.050 vs stable's 0.000" in state.reason


def test_steps_count_the_errors_they_answer_with_by_code():
    counts = RequestErrorCounts()
    assert {dict(s.labels)["code"]: s.value for s in counts.samples()} == {"INVALID_ARG": 0, "INTERNAL": 0}
    for code in ("INVALID_ARG", "INVALID_ARG", "UNAVAILABLE"):
        counts.count(code)
    samples = counts.samples()
    assert {s.name for s in samples} == {canary.REQUEST_ERRORS} and {s.kind for s in samples} == {"counter"}
    assert {dict(s.labels)["code"]: s.value for s in samples} == {
        "INVALID_ARG": 2,
        "INTERNAL": 0,
        "UNAVAILABLE": 1,
    }


def test_the_score_histogram_counts_what_waits_to_be_folded():
    histogram = ScoreHistogram((("dense_version", "3"),))
    batch = np.array([[0.25]], np.float32)
    histogram.observe(batch)
    batch[0, 0] = 0.95  # the caller's buffer may be reused: what was served is what is counted
    histogram.observe(np.full((2, 1), 0.005, np.float32))
    assert histogram.counts.tolist() == [2, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    samples = {(s.name, dict(s.labels).get("le")): s.value for s in histogram.samples()}
    assert samples[("recserve_served_probability_sum", None)] == pytest.approx(0.26, abs=1e-6)


def test_a_merged_batch_is_accepted_at_once_only_when_every_probability_is_finite():
    step = DenseStep(load_spec("tiny"), runner=None, version="2")  # type: ignore[arg-type]
    assert step.accept_all({PROBABILITY: np.array([[0.2], [0.4]], np.float32)})
    assert not step.accept_all({PROBABILITY: np.array([[0.2], [np.nan]], np.float32)})
    assert step.accept_all({PROBABILITY: np.array([[0.5]], np.float32)}, count=False)
    assert step.scores.counts.sum() == 2  # neither the refused batch nor the uncounted one
