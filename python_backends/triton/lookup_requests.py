"""How ``embedding_lookup`` handles a dynamic batch: by request form, then merged or alone.

Row-form requests are merged per wire form (ids, or bytes) and, with ``[user_state]``, apart for
requests carrying a user; candidate lists (from the candidates ensemble) are looked up together,
each user's sequences once, unless one asks for the row layout (a TensorRT ``dense`` takes rows).
"""

from __future__ import annotations

import functools

from recserve.backends.request_log.step_log import FeatureLog
from recserve.backends.steps.lookup import FeaturesToEmbeddings
from recserve.backends.steps.stateful_lookup import StatefulFeaturesToEmbeddings
from recserve.backends.triton.adapter import (
    execute_alone,
    execute_by_input,
    execute_merged_or_alone,
    input_names,
)
from recserve.core.names import CANDIDATE_PREFIX, SPARSE_EMBEDDINGS, USER_ID


class LookupRequests:
    """The lookup step's requests, one response each (a bad request fails alone with INVALID_ARG).

    Args:
        step: the step (features to embeddings).
        stateful: the same step when it merges users' states (``[user_state]``), else None.
        log: the request log (None: logging off).
    """

    def __init__(
        self,
        step: FeaturesToEmbeddings,
        stateful: StatefulFeaturesToEmbeddings | None,
        log: FeatureLog | None,
    ) -> None:
        self.step, self.stateful, self.log = step, stateful, log
        if log is not None:  # the step hands the log the keys it served; the log takes them out
            step.log_tap = log.tap

    def execute(self, requests: list) -> list:
        """Row-form requests as one merged batch per wire form; candidate lists likewise."""
        names = input_names(requests)  # read once: the requests are split by two markers (three with users)
        merged = functools.partial(self.merged, names=names)
        responses = execute_by_input(
            requests,
            self.step.candidate_input_names[0] if self.step.candidate_input_names else "",
            lambda rows: execute_by_input(rows, self.step.ids_marker, merged, merged, names),
            lambda lists: execute_by_input(lists, self.step.ids_marker, self.lists, self.lists, names),
            names,
        )
        self.step.copies.executed()
        return responses

    def merged(self, requests: list, names: dict[int, frozenset[str]] | None = None) -> list:
        """Row-form requests of one wire form (ids, or bytes), transformed and looked up together.

        With ``[user_state]`` on, requests carrying a user and those without are merged apart, and
        each gets its history back at the width its own rows were served with. ``names``: the
        requests' input names (:func:`input_names`), when already read.
        """
        if self.stateful is not None:
            stateful = self.stateful
            return execute_by_input(
                requests,
                USER_ID,
                lambda plain: self._merged(plain, stateful.served_width),
                lambda users: self._merged(users, stateful.served_width),
                names,
            )
        return self._merged(requests, None)

    def _merged(self, requests: list, output_width) -> list:
        return execute_merged_or_alone(
            requests,
            self.step.input_names,
            self.step,
            ragged_outputs=self.step.histories,
            ragged_width=self.step.history_width,
            left_padded=self.step.left_padded,
            output_width=output_width,
            observe=self.log,
        )

    def lists(self, requests: list) -> list:
        """Candidate lists of one wire form: looked up together, unless one asks for the row layout."""
        return execute_alone(
            requests,
            self.step.candidate_input_names,
            self.candidate_list,
            together=self.together,
            observe=self.log,
        )

    def together(self, inputs: list, requested: list) -> list | None:
        """Every list's outputs from one call; None when a list wants the row layout (handled alone)."""
        if any(CANDIDATE_PREFIX + SPARSE_EMBEDDINGS not in wanted for wanted in requested):
            return None
        return self.step.candidate_lists(inputs)

    def candidate_list(self, inputs: dict, requested: frozenset) -> dict:
        """One candidate list; as rows when the next step asks for the row layout (a TensorRT ``dense``)."""
        expand = CANDIDATE_PREFIX + SPARSE_EMBEDDINGS not in requested
        return self.step.candidates(inputs, expand=expand)
