"""How ``dense`` handles a dynamic batch: rows checked alone and scored together, lists together.

Row-form requests are checked one by one (a bad one fails alone) and the valid ones scored in one
bucketed call; candidate lists (from the candidates ensemble) are scored in one call, or each alone
when that call is refused. Triton's warm-up requests come first: their scores are neither counted
nor logged.
"""

from __future__ import annotations

import functools

import numpy as np

from recserve.backends.dense.runner import DenseStep
from recserve.backends.request_log.step_log import ScoreLog
from recserve.backends.triton.adapter import execute_alone, execute_by_input, execute_checked_merged
from recserve.core.contract import dense_net_inputs, left_padded_inputs
from recserve.core.names import DENSE_VERSION, PROBABILITY
from recserve.core.spec.model import ModelSpec


class DenseRequests:
    """The dense step's requests, one response each, every served probability finite.

    Args:
        spec: the model spec (the network's inputs, those padded on the left).
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

    def execute(self, requests: list) -> tuple[list, bool]:
        """The responses, and whether these requests were served (not Triton's warm-up)."""
        served = self.warmup_left <= 0
        self.warmup_left -= len(requests)
        accept = self.step.accept if served else functools.partial(self.step.accept, count=False)
        accept_all = self.step.accept_all if served else functools.partial(self.step.accept_all, count=False)
        observe = self.log if served else None  # Triton's warm-up is not logged
        responses = execute_by_input(
            requests,
            self.step.lists.input_names[0],
            lambda rows: execute_checked_merged(
                rows,
                self.input_names,
                self.step.check,
                self.score,
                accept=accept,
                left_padded=self.left_padded,
                tensors=self.step.tensors,
                observe=observe,
                accept_merged=accept_all,
            ),
            lambda lists: execute_alone(
                lists,
                self.step.lists.input_names,
                self.score_list,
                self.step.tensors,
                self.score_lists,
                observe=observe,
            ),
        )
        self.step.copies.executed()
        return responses, served

    def score(self, merged: dict) -> dict:
        """The network's outputs and the version that computed them (one row, every request's)."""
        return self.versioned(self.step.compute(merged))

    def score_list(self, inputs: dict, requested: frozenset) -> dict:
        """One candidate list: a row per candidate, user by user; refused whole if any is not finite."""
        outputs = {PROBABILITY: self.step.lists(inputs)}
        self.step.accept(outputs)
        return self.versioned(outputs)

    def score_lists(self, lists: list, requested: list) -> list:
        """A batch's candidate lists scored in one call; if any is not finite, refused (then each alone)."""
        return [self.versioned({PROBABILITY: probability}) for probability in self.step.score_lists(lists)]

    def versioned(self, outputs: dict) -> dict:
        """``outputs`` with the version that computed them: ``[1, 1]``, once per request, not per row."""
        return {**outputs, DENSE_VERSION: self.version_row}
