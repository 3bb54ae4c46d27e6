"""The canary: the new version (``canary``) through shadow → 1 → … → 100 %, back at once if it misbehaves.

Every ``period_s`` the controller reads what each variant did since its current stage began (the
same traffic window for both), compares the canary with stable and decides:

* **roll back** at once when the canary's share of server-side failures exceeds stable's by more
  than ``max_error_rate_increase``, its p99 through the proxy exceeds ``max_p99_ratio`` × stable's
  (and stable's by more than ``p99_slack_ms``; latency counts from ``settle_s`` into a stage, so that a
  freshly started canary may warm up), the population stability index of its served
  probabilities against stable's exceeds ``max_psi``, or its mean probability over stable's leaves
  ``mean_ratio``; or when its servers stop answering for two periods in a row;
* **advance** to the next stage once the stage lasted ``dwell_s``, the canary served
  ``min_requests`` in it and every comparison had ``min_judged`` requests (and rows) on both sides;
* otherwise wait.

Once stable gets no live traffic (the 100 % stage), its window of the last stage stands in for it.

Where the figures come from (:mod:`~recserve.access.canary.figures`): the canary judges the
server, not its clients. Failures are the server's own (``INTERNAL`` or ``UNAVAILABLE`` answered by
a step, a non-finite output included; a step's queue refusals; Envoy's timeouts), counted over the
judged requests (the ensembles' successes plus those failures). Client errors (malformed input,
unknown names) are counted apart, reported as the figures ``client_errors_stable`` and
``client_errors_canary``, and move no decision: a client choosing its user id (so its variant)
cannot roll a healthy canary back, hide a bad one, or fill a stage's ``min_requests``. On every
server of the variant, mirrored copies included. Latency is Envoy's per-cluster request-time
histogram (live and shadow clusters of the variant); scores are the dense step's
``recserve_served_probability`` histogram. A dense step that is not a Python model (TensorRT or
ONNX Runtime backends on GPUs) exports no score histogram: the score checks are then skipped and
the decision says so.

The decision is written to ``rules.json`` in the access layer's folder before the proxy is told:
a restarted proxy (:class:`~recserve.access.process.AccessLayer` reads the file) and a restarted
controller both continue from it. Every stage change and rollback is appended to ``rules.log``
(JSON lines) and counted on the controller's ``/metrics`` (``recserve_access_*``).

The comparison, the stages and the saved decision are :mod:`~recserve.access.canary.rules`; this
module is the controller, and re-exports the names of both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from recserve.access.admin import AdminClient
from recserve.access.canary.figures import (
    CLIENT_CODES,
    PROBABILITY,
    REQUEST_ERRORS,
    SERVER_REASONS,
    Window,
    envoy_latency,
    envoy_timeouts,
    plus,
    psi,
    quantile,
    scores_settled,
    triton_window,
)
from recserve.access.canary.rules import (
    P99_MIN_REQUESTS,
    PROMOTED,
    ROLLED_BACK,
    RUNNING,
    STATE_FILE,
    WEIGHT_TOTAL,
    CanaryState,
    Stage,
    Verdict,
    decide,
    judge,
    routed,
    stages,
)
from recserve.access.config import PROTOCOLS, AccessError, cluster_name
from recserve.core.sections.serving import CanarySection
from recserve.server.metrics_endpoint import serve_metrics

LOGGER = logging.getLogger(__name__)

__all__ = [  # the figures' and the decision rules' names stay importable from here
    "CLIENT_CODES",
    "P99_MIN_REQUESTS",
    "PROBABILITY",
    "PROMOTED",
    "REQUEST_ERRORS",
    "ROLLED_BACK",
    "RUNNING",
    "SERVER_REASONS",
    "STATE_FILE",
    "WEIGHT_TOTAL",
    "CanaryController",
    "CanaryState",
    "Stack",
    "Stage",
    "Unreachable",
    "Verdict",
    "Window",
    "decide",
    "envoy_latency",
    "envoy_timeouts",
    "judge",
    "psi",
    "quantile",
    "routed",
    "stages",
    "triton_window",
]

LOG_FILE = "rules.log"
#: Written by ``recserve access``: the admin address and every variant's metrics endpoints.
STACK_FILE = "stack.json"
#: Periods in a row without an answer from the canary's servers before it is rolled back.
UNREACHABLE_PERIODS = 2
#: A server's metrics read inside a publication of its score histogram are read again, this often
#: and at most this many times (a publication is a few messages from the step to the server).
SETTLE_PAUSE_S, SETTLE_READS = 0.02, 25


# --- reading the running stack -----------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """Where the running access layer answers (:data:`STACK_FILE`)."""

    admin: str  # host:port of Envoy's admin API
    metrics: Mapping[str, Sequence[str]]  # variant -> host:port of its servers' metrics endpoints

    def save(self, path: Path) -> None:
        """Write as JSON."""
        path.write_text(json.dumps({"admin": self.admin, "metrics": dict(self.metrics)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Stack:
        """Read what ``recserve access`` wrote.

        Raises:
            AccessError: no such file (is ``recserve access --workdir`` running there?).
        """
        try:
            raw = json.loads(path.read_text())
            return cls(str(raw["admin"]), {k: list(v) for k, v in raw["metrics"].items()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AccessError(f"no running access layer described in {path}: {exc}") from exc


class Unreachable(AccessError):
    """A part of the stack did not answer: ``who`` is ``proxy``, ``stable`` or ``canary``."""

    def __init__(self, who: str, message: str) -> None:
        super().__init__(message)
        self.who = who


def _get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


# --- the controller ----------------------------------------------------------------------------


class CanaryController:
    """Drives one rollout against a running access layer; see the module docstring.

    Args:
        model: the ensemble's name (the spec's model), or the names of every ensemble the
            variants serve (e.g. the spec's model and its candidate-list model).
        rules: the thresholds and stages.
        stack: the running access layer.
        workdir: the access layer's folder (:data:`STATE_FILE`, :data:`LOG_FILE`).
        clock: wall-clock seconds (tests pass their own).
        timeout_s: per scrape and admin call.
    """

    def __init__(
        self,
        model: str | Sequence[str],
        rules: CanarySection,
        stack: Stack,
        workdir: Path,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
    ) -> None:
        if "canary" not in stack.metrics:
            raise AccessError("the canary needs a running 'canary' variant (recserve access --canary)")
        self.model = model
        self.rules = rules
        self.stack = stack
        self.admin = AdminClient(stack.admin, timeout_s)
        self.workdir = workdir
        self.clock = clock
        self.timeout_s = timeout_s
        self.state_path = workdir / STATE_FILE
        self.state = CanaryState()
        self.verdict = Verdict()
        self.start: dict[str, Window] = {}  # each variant's totals when the stage began
        self.settled: dict[str, Window] = {}  # ... and ``settle_s`` into it (latency counts from here)
        self.reference: Window | None = None  # stable over the last stage it had traffic in
        self.unreachable = 0
        self.periods = 0
        self.lock = threading.Lock()  # the state and figures, read by the metrics endpoint

    def begin(self, new: bool = False) -> CanaryState:
        """Resume the saved rollout, or start one (``new``, or nothing saved) at the first stage."""
        if self.state_path.is_file() and not new:
            self.state = CanaryState.load(self.state_path)
            LOGGER.info("resuming the canary: %s at stage %d", self.state.status, self.state.stage)
        else:
            self.state = CanaryState(stage_started=self.clock())
            self._log(
                {"event": "start", "time": self.state.stage_started, "stage": stages(self.rules)[0].name}
            )
        self.state.save(self.state_path)
        self.apply()
        self._stage_began(self.observe())  # a resumed stage is judged on traffic from now on
        return self.state

    def observe(self) -> dict[str, Window]:
        """Each variant's running totals now.

        Raises:
            Unreachable: a server or the proxy did not answer.
        """
        try:
            envoy = _get(f"http://{self.stack.admin}/stats/prometheus", self.timeout_s)
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable("proxy", f"Envoy's admin at {self.stack.admin}: {exc}") from exc
        windows = {}
        for variant in ("stable", "canary"):
            totals = Window()
            for target in self.stack.metrics.get(variant, ()):
                totals = plus(totals, triton_window(self._server_metrics(variant, target), self.model))
            clusters = [cluster_name(variant, p, shadow) for p in PROTOCOLS for shadow in (False, True)]
            timeouts = envoy_timeouts(envoy, clusters)
            windows[variant] = dataclasses.replace(
                totals,
                requests=totals.requests + timeouts,
                failures=totals.failures + timeouts,
                latency=envoy_latency(envoy, clusters),
            )
        return windows

    def _server_metrics(self, variant: str, target: str) -> str:
        """One server's metrics, read whole where it can be.

        A read inside a publication of the server's score histograms (buckets half counted, which
        would move a second of rows across their edges) is made again, up to :data:`SETTLE_READS`
        times.
        """
        for _ in range(SETTLE_READS):
            try:
                text = _get(f"http://{target}/metrics", self.timeout_s)
            except (urllib.error.URLError, OSError) as exc:
                raise Unreachable(variant, f"{variant}'s tritonserver metrics at {target}: {exc}") from exc
            if scores_settled(text):
                return text
            time.sleep(SETTLE_PAUSE_S)
        LOGGER.warning("%s's score histograms at %s did not settle: read half published", variant, target)
        return text

    def tick(self) -> CanaryState:
        """One period: observe, compare, decide, save, and put the decision on the proxy."""
        self.periods += 1
        if self.state.status != RUNNING:
            self.apply()
            return self.state
        stable: Window | None = None
        try:
            now = self.observe()
            self.unreachable = 0
        except Unreachable as exc:  # only a silent canary is held against it
            self.unreachable = self.unreachable + 1 if exc.who == "canary" else 0
            LOGGER.warning("canary period %d: %s", self.periods, exc)
            if self.unreachable < UNREACHABLE_PERIODS:
                return self.state
            verdict = Verdict(rollback=f"the canary did not answer for {self.unreachable} periods: {exc}")
            now = self.start
        else:
            if not self.settled and self.clock() - self.state.stage_started >= self.rules.settle_s:
                self.settled = now
            stable, canary = self._window(now, "stable"), self._window(now, "canary")
            if stable.requests < self.rules.min_judged and self.reference is not None:
                stable = (
                    self.reference
                )  # stable has no live traffic left (at 100 %): its last stage stands in
            verdict = judge(self.rules, stable, canary)
        state = decide(self.rules, self.state, verdict, self.clock())
        with self.lock:
            self.verdict = verdict
            changed, self.state = state != self.state, state
        if changed:
            state.save(self.state_path)  # before the proxy is told: the decision outlives both
            self._log(state.events[-1])
            self._stage_began(now)
            if stable is not None and stable.requests >= self.rules.min_judged:
                self.reference = stable
        self.apply()
        return state

    def _stage_began(self, now: dict[str, Window]) -> None:
        self.start = now
        self.settled = now if self.rules.settle_s <= 0 else {}

    def _window(self, now: Mapping[str, Window], variant: str) -> Window:
        """What ``variant`` did in this stage; its latency only from ``settle_s`` into the stage."""
        window = now[variant].since(self.start[variant])
        settled = now[variant].since(self.settled[variant]).latency if self.settled else {}
        return dataclasses.replace(window, latency=settled)

    def apply(self) -> None:
        """Put the current decision's weights and mirrored share on the proxy.

        Idempotent: a proxy restarted since the last period gets them again.
        """
        weights, shadow = self.state.routing(self.rules)
        try:
            self.admin.set_weights(weights)
            self.admin.set_shadow_fraction(shadow)
        except AccessError as exc:
            LOGGER.warning("canary: the proxy did not take the routing: %s", exc)

    def run(self, stop: threading.Event, new: bool = False) -> CanaryState:
        """:meth:`begin`, then :meth:`tick` every period until decided or ``stop`` is set."""
        self.begin(new)
        while self.state.status == RUNNING and not stop.wait(self.rules.period_s):
            self.tick()
        return self.state

    def _log(self, event: Mapping[str, Any]) -> None:
        LOGGER.info("canary: %s", json.dumps(event))
        with open(self.workdir / LOG_FILE, "a") as log:
            log.write(json.dumps(event) + "\n")

    def exposition(self) -> str:
        """The controller's own series (Prometheus text)."""
        with self.lock:
            state, verdict = self.state, self.verdict
        weights, shadow = state.routing(self.rules)
        rollbacks = [e for e in state.events if e["event"] == "rollback"]
        percent = 100 * weights["canary"] / WEIGHT_TOTAL
        lines = [
            "# HELP recserve_access_canary_stage Index of the canary's stage (0: the first)",
            "# TYPE recserve_access_canary_stage gauge",
            f"recserve_access_canary_stage {state.stage}",
            "# HELP recserve_access_canary_status 1 for the canary's current status",
            "# TYPE recserve_access_canary_status gauge",
            *(
                f'recserve_access_canary_status{{status="{s}"}} {int(state.status == s)}'
                for s in (RUNNING, PROMOTED, ROLLED_BACK)
            ),
            "# HELP recserve_access_canary_percent The canary's share of live requests, percent",
            "# TYPE recserve_access_canary_percent gauge",
            f"recserve_access_canary_percent {percent:g}",
            # the former name of the same gauge, kept for dashboards that plot it
            "# HELP recserve_access_candidate_percent Deprecated: recserve_access_canary_percent",
            "# TYPE recserve_access_candidate_percent gauge",
            f"recserve_access_candidate_percent {percent:g}",
            "# HELP recserve_access_shadow_fraction Share of live requests mirrored to the canary",
            "# TYPE recserve_access_shadow_fraction gauge",
            f"recserve_access_shadow_fraction {shadow:g}",
            "# HELP recserve_access_canary_steps_total Stages the canary advanced through",
            "# TYPE recserve_access_canary_steps_total counter",
            f"recserve_access_canary_steps_total {state.count('step') + state.count('promote')}",
            "# HELP recserve_access_canary_rollbacks_total Rollbacks of the canary",
            "# TYPE recserve_access_canary_rollbacks_total counter",
            f"recserve_access_canary_rollbacks_total {len(rollbacks)}",
            "# HELP recserve_access_canary_periods_total Comparisons made by this controller",
            "# TYPE recserve_access_canary_periods_total counter",
            f"recserve_access_canary_periods_total {self.periods}",
            "# HELP recserve_access_canary_figure The last comparison of the canary with stable",
            "# TYPE recserve_access_canary_figure gauge",
            *(
                f'recserve_access_canary_figure{{figure="{k}"}} {v:g}'
                for k, v in sorted(verdict.figures.items())
            ),
        ]
        return "\n".join(lines) + "\n"

    def serve_metrics(self, port: int | None = None) -> ThreadingHTTPServer:
        """Serve :meth:`exposition` at ``http://127.0.0.1:<port>/metrics`` on a daemon thread."""
        return serve_metrics(
            self.rules.metrics_port if port is None else port, self.exposition, "canary-metrics"
        )
