"""``[degrade]`` at the steps: the first step's door (levels chosen and applied) and a list's full answer.

:class:`DegradeGate` stands before ``embedding_lookup``'s request loop: it reads each request's
value (the ``recserve-value`` parameter, or header forwarded as one), asks the controller for its
level (at the lambda the access layer's door chose it at, at least: ``recserve-lambda``), refuses
the requests whose level is the refusal (UNAVAILABLE, before the step's own work is spent on them),
hands the others on with their tensors as their level changes them, and adds
``degrade_level`` to each response. A background thread feeds the controller the steps' expected
queue wait and the rate they serve at, from the metrics endpoint every ``[degrade] interval_s``;
each batch's values set the door's floor under lambda as they arrive. :func:`answer_lists` lets
``dense`` answer a list cut short with a score for every requested candidate.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from recserve.backends.base.metrics import MetricSample
from recserve.backends.steps.degrade import LevelCounts, LevelInputs, pad_list
from recserve.backends.steps.degrade_control import DegradeController
from recserve.backends.steps.queue_wait import QueueWait
from recserve.backends.triton.adapter import error_response, read_inputs
from recserve.core.degrade_capacity import FILE_NAME as CAPACITY_FILE
from recserve.core.degrade_capacity import CapacityFile
from recserve.core.names import DENSE_VERSION, PROBABILITY, STEPS
from recserve.core.sections.degrade import (
    DEGRADE_LEVEL,
    LAMBDA_HEADER,
    METRICS_URL_ENV,
    ORDERED_HEADER,
    REFUSED_HEADER,
    REQUESTED_CANDIDATES,
)
from recserve.core.spec.model import ModelSpec
from recserve.errors import InvalidParameter, Refused

LOGGER = logging.getLogger(__name__)


def parameters_of(request: Any) -> dict[str, Any]:
    """A request's parameters (Triton hands them as a JSON object's text); unreadable ones: none."""
    try:
        values = json.loads(request.parameters() or "{}")
    except (TypeError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


class LeveledRequest:
    """A request as its level serves it: some input tensors replaced; everything else the request's own."""

    def __init__(self, request: Any, replaced: dict[str, np.ndarray]) -> None:
        self._request = request
        kept = [t for t in request.inputs() if t.name() not in replaced]
        self._inputs = kept + [pb_utils.Tensor(name, np.ascontiguousarray(a)) for name, a in replaced.items()]

    def inputs(self) -> list:
        """The input tensors, those the level changed replaced."""
        return self._inputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class DegradeGate:
    """The first step's door with ``[degrade]`` on: each request's level chosen, applied and reported.

    Args:
        spec: the model spec (its ``[degrade]`` section is enabled).
        handle: the step's request loop (requests in, one response each).
        input_names: every input the step reads (what a level may change is read from them).
        metrics_url: the server's metrics endpoint; None: from the environment (no URL: no feedback,
            every request served in full unless ``fixed_lambda`` holds lambda).
        keep_in: the folder where the learned capacity is kept for the next run, and read from at
            this one's start where the spec sets none (:mod:`~recserve.core.degrade_capacity`).
    """

    def __init__(
        self,
        spec: ModelSpec,
        handle: Callable[[list], list],
        input_names: Sequence[str],
        metrics_url: str | None = None,
        keep_in: Path | None = None,
    ) -> None:
        self.section = spec.degrade
        self.handle, self.input_names = handle, tuple(input_names)
        self.controller = DegradeController(self.section)
        self.kept: CapacityFile | None = None
        if keep_in is not None and self.section.capacity <= 0:
            self.kept = CapacityFile(keep_in / CAPACITY_FILE)
            carried = self.kept.load()
            if carried is not None:
                self.controller.capacity_per_s = carried
                LOGGER.info("[degrade]: the capacity the last run learned: %.1f per second", carried)
        self.level_inputs = LevelInputs(spec)
        # what the access layer's door answered itself, reported on the next request it let through
        self.door_reports = tuple(
            (level, header)
            for level, header in (
                (self.controller.refused_level, REFUSED_HEADER),
                (self.section.order_level, ORDERED_HEADER),
            )
            if level is not None
        )
        self.counts = LevelCounts(self.section)
        url = metrics_url or os.environ.get(METRICS_URL_ENV, "")
        self.wait = QueueWait(url, STEPS) if url else None
        if self.wait is None and not self.controller.fixed:
            LOGGER.warning("[degrade]: no metrics endpoint (%s unset): no load is measured", METRICS_URL_ENV)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Update lambda and the capacity from the steps' counters every ``interval_s``, from a daemon thread.

        A reading is busy when the expected wait was over the target at it and at the one before: a
        backlog kept the steps serving all the while, so their rate is their capacity.
        """
        if self.wait is None or self.controller.fixed:
            return
        wait = self.wait

        def run() -> None:
            over = False
            while not self._stop.wait(self.section.interval_s):
                try:
                    waited = wait.sample()
                    busy = over and waited is not None and waited > self.section.target_queue_ms
                    over = waited is not None and waited > self.section.target_queue_ms
                    self.controller.update(waited)
                    capacity = self.controller.capacity(wait.served_per_s, busy)
                    if self.kept is not None:
                        self.kept.keep(capacity)
                except Exception:  # a missed reading leaves lambda where it is
                    LOGGER.debug("reading the queue wait failed", exc_info=True)

        self._thread = threading.Thread(target=run, name="recserve-degrade", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the feedback thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.kept is not None:
            self.kept.keep(self.controller.capacity_per_s, force=True)

    def execute(self, requests: list) -> list:
        """One response per request: refused, or served at its level with ``degrade_level`` added."""
        responses: list = [None] * len(requests)
        passed, levels = [], []
        refused = self.controller.refused_level
        parameters: list[dict[str, Any]] = []
        values: list[float | None] = []
        floors: list[float] = []  # the lambda the access layer's door chose each level at (0: none)
        for i, request in enumerate(requests):
            parameters.append(parameters_of(request))
            try:
                floor = self.section.lambda_of(parameters[-1].get(LAMBDA_HEADER))
                reported = [
                    (level, self.section.door_counts(parameters[-1].get(header), header))
                    for level, header in self.door_reports
                ]
                values.append(self.section.value_from(parameters[-1]))
                floors.append(floor)
            except InvalidParameter as exc:
                responses[i] = error_response(exc)
                values.append(None)
                continue
            for level, counts in reported:  # what the access layer's door answered, reported with this
                for tier, count in counts.items():
                    self.counts.count(level, self.counts.tiers.index(tier), count)
        valued = [v for v in values if v is not None]
        self.counts.door(max(floors, default=0.0))
        self.controller.arrived(time.monotonic(), valued)
        chosen = iter(self.controller.levels(valued, floors))  # one call for the batch
        for i, request in enumerate(requests):
            if values[i] is None:
                continue
            level = next(chosen)
            self.counts.count(level, self.counts.tier_of(parameters[i]))
            if level == refused:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(
                        str(Refused(f"refused under load (lambda {self.controller.lam:.3g}); retry later")),
                        pb_utils.TritonError.UNAVAILABLE,
                    )
                )
                continue
            changed = (
                self.level_inputs.changed(level, read_inputs(request, self.input_names)) if level else {}
            )
            passed.append((i, LeveledRequest(request, changed) if changed else request))
            levels.append(level)
        if passed:
            served = self.handle([request for _, request in passed])
            for (i, request), level, response in zip(passed, levels, served, strict=True):
                responses[i] = with_level(response, request, level)
        return responses

    def samples(self) -> list[MetricSample]:
        """Requests per level and tier, lambda, the load and the capacity (0 until known)."""
        capacity = self.controller.capacity_per_s
        return self.counts.samples(
            self.controller.lam, self.controller.load, 0.0 if math.isinf(capacity) else capacity
        )


def with_level(response: Any, request: Any, level: int) -> Any:
    """``response`` with ``degrade_level`` ``[rows or users, 1]`` added (an error stays as it is)."""
    if response.has_error():
        return response
    tensors = request.inputs()
    rows = int(tensors[0].as_numpy().shape[0]) if tensors else 1
    level_tensor = pb_utils.Tensor(DEGRADE_LEVEL, np.full((rows, 1), level, np.int32))
    return pb_utils.InferenceResponse(output_tensors=[*response.output_tensors(), level_tensor])


def answer_lists(requests: list, responses: list, fallback: float) -> list:
    """``dense``'s responses with every list cut short answered for all its requested candidates."""
    out = []
    for request, response in zip(requests, responses, strict=True):
        requested = read_inputs(request, (REQUESTED_CANDIDATES,)).get(REQUESTED_CANDIDATES)
        if requested is None or response.has_error():
            out.append(response)
            continue
        users, count = requested.shape[0], requested.shape[1]
        tensors = {t.name(): t.as_numpy() for t in response.output_tensors()}
        scored = tensors[PROBABILITY].shape[0]
        if scored >= users * count:
            out.append(response)
            continue
        tensors[PROBABILITY] = pad_list(tensors[PROBABILITY], users, count, fallback)
        version = tensors.get(DENSE_VERSION)
        if version is not None and version.shape[0] == scored:  # one row per candidate
            tensors[DENSE_VERSION] = np.resize(version, (users * count, *version.shape[1:]))
        out.append(
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()])
        )
    return out
