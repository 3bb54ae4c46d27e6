"""How ``dense`` handles a dynamic batch: rows checked alone and scored together, lists together.

Row-form requests are checked one by one (a bad one fails alone) and the valid ones scored in one
bucketed call; candidate lists (from the candidates ensemble) are scored in one call, or each alone
when that call is refused. Requests served at a ``[degrade]`` level of the smaller network are
scored by it, apart. Triton's warm-up requests come first: their scores are neither counted nor
logged.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from recserve.backends.dense.runner import DenseStep
from recserve.backends.request_log.step_log import ScoreLog
from recserve.backends.triton.adapter import (
    execute_alone,
    execute_apart,
    execute_by_input,
    execute_checked_merged,
    read_inputs,
)
from recserve.core.contract import dense_net_inputs, left_padded_inputs
from recserve.core.names import DENSE_VERSION, PROBABILITY
from recserve.core.sections.degrade import DEGRADE_LEVEL
from recserve.core.spec.model import ModelSpec


class DenseRequests:
    """The dense step's requests, one response each, every served probability finite.

    Args:
        spec: the model spec (the network's inputs, those padded on the left, ``[degrade]``'s levels).
        step: the dense step.
        version: the dense model's version, returned once per request.
        warmup_requests: how many of the first requests are Triton's warm-up.
        log: the request log (None: logging off).
    """

    def __init__(
        self, spec: ModelSpec, step: DenseStep, version: int, warmup_requests: int, log: ScoreLog | None
    ) -> None:
        self.step, self.version, self.warmup_left, self.log = step, version, warmup_requests, log
        self.input_names = dense_net_inputs(spec)
        self.version_row = np.full((1, 1), version, np.int64)
        self.left_padded = left_padded_inputs(spec)
        #: [degrade]: the levels scored by the smaller network (by the full one where this version lacks it)
        self.small_levels = spec.degrade.small_levels

    def execute(self, requests: list) -> tuple[list, bool]:
        """The responses, and whether these requests were served (not Triton's warm-up)."""
        served = self.warmup_left <= 0
        self.warmup_left -= len(requests)
        small = self.step.small
        if small is None or not self.small_levels:
            responses = self.run(requests, self.step, served)
        else:  # each request by the network of the level it was served at
            responses = execute_apart(
                requests,
                [level_of(request) in self.small_levels for request in requests],
                lambda group: self.run(group, small, served),
                lambda group: self.run(group, self.step, served),
            )
        self.step.copies.executed()
        return responses, served

    def run(self, requests: list, step: DenseStep, served: bool) -> list:
        """The responses of ``requests`` scored by ``step`` (row-form requests and lists apart).

        The smaller network's scores are not logged: the log's versions name the full network.
        """
        accept = step.accept if served else functools.partial(step.accept, count=False)
        accept_all = step.accept_all if served else functools.partial(step.accept_all, count=False)
        observe = self.log if served and step is self.step else None  # Triton's warm-up is not logged

        def score_list(inputs: dict, requested: frozenset) -> dict:
            """One candidate list: a row per candidate; refused whole if any is not finite."""
            outputs = {PROBABILITY: step.lists(inputs)}
            step.accept(outputs)
            return self.versioned(outputs)

        def score_lists(lists: list, requested: list) -> list:
            """A batch's lists in one call; if any is not finite, refused (then each alone)."""
            return [self.versioned({PROBABILITY: probability}) for probability in step.score_lists(lists)]

        return execute_by_input(
            requests,
            step.lists.input_names[0],
            lambda rows: execute_checked_merged(
                rows,
                self.input_names,
                step.check,
                lambda merged: self.versioned(step.compute(merged)),
                accept=accept,
                left_padded=self.left_padded,
                tensors=step.tensors,
                observe=observe,
                accept_merged=accept_all,
            ),
            lambda lists: execute_alone(
                lists, step.lists.input_names, score_list, step.tensors, score_lists, observe=observe
            ),
        )

    def versioned(self, outputs: dict) -> dict:
        """``outputs`` with the version that computed them: ``[1, 1]``, once per request, not per row."""
        return {**outputs, DENSE_VERSION: self.version_row}


def level_of(request: Any) -> int:
    """The ``[degrade]`` level a request was served at by the first step (0, full, where it has none)."""
    level = read_inputs(request, (DEGRADE_LEVEL,)).get(DEGRADE_LEVEL)
    return int(level.reshape(-1)[0]) if level is not None and level.size else 0
