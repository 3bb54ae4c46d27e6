"""The ``embedding_lookup`` step with ``[user_state]`` on: today's step, plus users' states merged in.

:class:`StatefulFeaturesToEmbeddings` is :class:`~recserve.backends.steps.lookup.FeaturesToEmbeddings`
with the optional ``user_id`` and ``user_seq`` inputs read, the rows' states merged into their history
keys before the one store call (:class:`~recserve.backends.steps.user_history.UserHistories`), and
``history_log_weights`` in its outputs (all zero for rows served without a state). A candidate list
may carry them too, ``[users, 1]``: each user's state is then merged into the user's one history
row. Its counts go to the metrics endpoint (a list's counts are per user, a row's per row):

- ``recserve_user_state_total{outcome}``: rows carrying a user, by outcome (hit, miss, stale, gap, error);
- ``recserve_user_state_lag_events``: a histogram of how many events the merged state lacked that
  the request knew of (its newest sequence number minus the state's);
- ``recserve_user_state_mode_total{mode}``: merged states by mode (exact, clustered);
- ``recserve_user_state_rebuilds_total{result}``: users queued for a rebuild (queued, dropped, failed);
- ``recserve_user_state_set_aside_total``: corrupt local user-state databases set aside at load.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.steps.user_history import OUTCOMES, RowStates, UserHistories
from recserve.backends.store.user_state.state import MODES
from recserve.core.contract import attention_inputs
from recserve.core.names import HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.spec.model import ModelSpec

if TYPE_CHECKING:
    import torch

#: Upper edges of the lag histogram, in events (a last bucket, ``+Inf``, holds the rest).
LAG_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
LAG_METRIC = "recserve_user_state_lag_events"
LAG_HELP = "Events the merged user state lacked that the request knew of (a Prometheus histogram)"


class UserStateCounts:
    """Running counts of the rows' outcomes, lags and modes (thread-safe)."""

    def __init__(self) -> None:
        self.outcomes = [0] * len(OUTCOMES)  # by outcome code
        self.modes = [0] * len(MODES)  # by mode code
        self.lags = [0] * (len(LAG_EDGES) + 1)  # by bucket (the last: beyond the last edge)
        self.lag_sum = 0
        self._lock = threading.Lock()

    def record(self, rows: RowStates) -> None:
        """Count one batch's rows (those without a user are not counted).

        Plain Python over the batch's few rows: cheaper than numpy's calls on a request path whose
        code and data are cold between requests.
        """
        outcomes, modes, lags = (
            rows.outcome_codes.tolist(),
            rows.mode_codes.tolist(),
            rows.lag_events.tolist(),
        )
        with self._lock:
            for outcome, mode, lag in zip(outcomes, modes, lags, strict=True):
                if outcome < 0:
                    continue
                self.outcomes[outcome] += 1
                if mode >= 0:
                    self.modes[mode] += 1
                if lag >= 0:
                    self.lags[bisect_left(LAG_EDGES, lag)] += 1
                    self.lag_sum += lag

    def samples(
        self, queued: int = 0, dropped: int = 0, failed: int = 0, set_aside: int = 0
    ) -> list[MetricSample]:
        """The counts as metric samples (the rebuild queue's and the local file's counts passed in)."""
        with self._lock:
            outcomes = dict(zip(OUTCOMES, self.outcomes, strict=True))
            modes = dict(zip(MODES, self.modes, strict=True))
            cumulative, total = list(accumulate(self.lags)), float(self.lag_sum)
        help_rows = "Rows carrying a user, by how their user state was served"
        out = [
            MetricSample("recserve_user_state_total", "counter", help_rows, (("outcome", k),), float(v))
            for k, v in outcomes.items()
        ]
        out += [
            MetricSample(
                "recserve_user_state_mode_total", "counter", "Merged user states by mode", (("mode", k),), v
            )
            for k, v in modes.items()
        ]
        edges = [*(str(e) for e in LAG_EDGES), "+Inf"]
        out += [
            MetricSample(f"{LAG_METRIC}_bucket", "counter", LAG_HELP, (("le", le),), float(n))
            for le, n in zip(edges, cumulative, strict=True)
        ]
        out += [
            MetricSample(f"{LAG_METRIC}_sum", "counter", LAG_HELP, (), total),
            MetricSample(f"{LAG_METRIC}_count", "counter", LAG_HELP, (), float(cumulative[-1])),
        ]
        rebuild_help = "Users queued for a user-state rebuild by the lookup step"
        out += [
            MetricSample("recserve_user_state_rebuilds_total", "counter", rebuild_help, (("result", k),), v)
            for k, v in (("queued", queued), ("dropped", dropped), ("failed", failed))
        ]
        out.append(
            MetricSample(
                "recserve_user_state_set_aside_total",
                "counter",
                "Corrupt local user-state databases set aside (and replaced by an empty one) at load",
                (),
                float(set_aside),
            )
        )
        return out


class StatefulFeaturesToEmbeddings(FeaturesToEmbeddings):
    """The served step with users' states merged (see the module docstring).

    Args:
        spec: the model spec (``[user_state]`` on).
        lookup: the store lookup.
        histories: the states, their cache and the rebuild queue.
    """

    def __init__(self, spec: ModelSpec, lookup: EmbeddingLookup, histories: UserHistories) -> None:
        super().__init__(spec, lookup)
        self.users = histories
        self.input_names = (*self.input_names, USER_ID, USER_SEQ)
        self.candidate_input_names = (*self.candidate_input_names, USER_ID, USER_SEQ)
        self.passed = (*self.passed, HISTORY_LOG_WEIGHTS)  # set by the merge (a list without users: below)
        self.counts = UserStateCounts()
        self.masks_of_groups = tuple(g.mask for g in attention_inputs(spec))
        self.last_rows = RowStates.without_users(0)  # the last batch's (for explain in process)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | torch.Tensor]:
        """Today's outputs with the rows' states merged, and ``history_log_weights``.

        Raises:
            InvalidInput: naming the first offending input and value.
        """
        with self.users.serving():
            features = self.transform.transform(inputs)
            self.merge_states(inputs, features)
            return {**self.passed_on(features), **self.lookup.lookup(features)}

    def merge_states(self, inputs: Mapping[str, np.ndarray], features: dict[str, np.ndarray]) -> None:
        """Merge the users' states into ``features`` (one row per user of ``inputs``) and count them."""
        rows = self.users.apply(inputs, features)
        self.counts.record(rows)
        self.last_rows = rows

    def candidates(
        self, inputs: Mapping[str, np.ndarray], expand: bool = False
    ) -> dict[str, np.ndarray | torch.Tensor]:
        """Today's candidate-list outputs, the user's state merged where the list carries ``user_id``.

        A list without a user gets all-zero ``history_log_weights``.
        """
        with self.users.serving():
            return self._weighted(super().candidates(inputs, expand))

    def candidate_lists(self, lists: list[Mapping[str, np.ndarray]]) -> list[dict]:
        """Several lists, as :meth:`candidates` answers each: those with users and those without apart."""
        answers: list[dict] = [{}] * len(lists)
        with self.users.serving():
            for users in (True, False):
                part = [i for i, inputs in enumerate(lists) if (USER_ID in inputs) == users]
                if part:
                    for i, out in zip(part, super().candidate_lists([lists[i] for i in part]), strict=True):
                        answers[i] = self._weighted(out)
        return answers

    def list_features(
        self, rows: Mapping[str, np.ndarray], lists: Sequence[Mapping[str, np.ndarray]], users: int
    ) -> Mapping[str, np.ndarray | torch.Tensor]:
        """Lists that carry ``user_id`` (all or none of ``lists``): each user's state merged.

        The transform then runs on the host, where the merge is (the id form's keys are not made
        on the device for them).
        """
        if USER_ID not in lists[0]:
            return super().list_features(rows, lists, users)
        features = self.transform.transform(rows, users=users)
        given = {  # one missing from a list: refused by the merge, naming it
            name: np.concatenate([inputs[name] for inputs in lists])
            for name in (USER_ID, USER_SEQ)
            if all(name in inputs for inputs in lists)
        }
        self.merge_states({**rows, **given}, features)
        return features

    def list_widths(
        self, lists: Sequence[Mapping[str, np.ndarray]], outputs: Mapping[str, Any], users: Sequence[int]
    ) -> list[int]:
        """With users: each list's width is the bucket of its longest merged history."""
        if USER_ID not in lists[0]:
            return super().list_widths(lists, outputs, users)
        starts = np.cumsum(users) - users
        return [
            self.served_width({m: outputs[m][start : start + count] for m in self.masks_of_groups})
            for start, count in zip(starts.tolist(), users, strict=True)
        ]

    def _weighted(self, out: dict) -> dict:
        """``out`` with all-zero ``history_log_weights`` where no state was merged."""
        if HISTORY_LOG_WEIGHTS not in out:
            out[HISTORY_LOG_WEIGHTS] = np.zeros(np.shape(out[self.masks_of_groups[0]]), np.float32)
        return out

    def served_width(self, outputs: Mapping[str, np.ndarray | torch.Tensor]) -> int:
        """The history width one request's rows need: the sequence bucket of their longest (masks)."""
        longest = max(int(np.asarray(outputs[m]).sum(axis=1).max(initial=0)) for m in self.masks_of_groups)
        return self.spec.sequence_bucket(max(longest, 1))

    def samples(self) -> list[MetricSample]:
        """The user-state metric samples."""
        queue, set_aside = self.users.rebuilds, int(getattr(self.users.states, "set_aside", 0))
        if queue is None:
            return self.counts.samples(set_aside=set_aside)
        return self.counts.samples(queue.queued, queue.dropped, queue.failed, set_aside)
