"""The dense step's candidate lists: per-candidate inputs ``[U, N, ...]``, each user's history once.

One list is scored by itself, or a dynamic batch's lists together in one call
(:meth:`CandidateLists.together`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.base import batching
from recserve.backends.base.inputs import dtype_name
from recserve.backends.dense.buckets import Arrays
from recserve.core.candidate_lists import per_candidate_dense_inputs
from recserve.core.contract import left_padded_inputs, sequence_inputs
from recserve.core.names import CANDIDATE_PREFIX, HISTORY_USER, PROBABILITY, SPARSE_EMBEDDINGS
from recserve.core.spec.model import ModelSpec
from recserve.errors import InvalidInput

if TYPE_CHECKING:
    import onnxruntime as ort


class CandidateLists:
    """The dense step's candidate lists: per-candidate inputs ``[U, N, ...]``, each user's history once.

    With the candidate-list graph of the built-in network (``session``, the CPU profile) or its
    candidate-list forward on the device (``scorer``, the ``cuda`` profile: the inputs stay torch
    tensors there, padded to a bucket's static shape, a CUDA graph per bucket:
    :class:`~recserve.backends.dense.list_graphs.ListGraphs`), every user's history is projected
    once for all of their candidates. Without
    either (an imported model has only the row graph), each candidate row gets its user's history
    and the rows go to ``rows``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        rows: Callable[[Arrays], np.ndarray],
        session: ort.InferenceSession | None,
        scorer: Callable[[Mapping[str, Any], np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.spec = spec
        self.rows = rows
        self.session = session
        #: ``scorer(inputs, owners)``: probabilities of flat per-candidate and per-user inputs
        self.scorer = scorer
        #: the scorer refuses scores that are not finite itself (on the device: ``checks_finite``)
        self.checks_finite = bool(getattr(scorer, "checks_finite", False))
        self.per_candidate = per_candidate_dense_inputs(spec)
        self.per_user = sequence_inputs(spec)
        self.left_padded = left_padded_inputs(spec)
        self.input_names = (*(CANDIDATE_PREFIX + n for n in self.per_candidate), *self.per_user)

    def __call__(self, inputs: Arrays) -> np.ndarray:
        """Probabilities ``[U * N, 1]``, user by user (raises ``InvalidInput`` on inconsistent shapes)."""
        flat, per_user, users, count = self.checked(inputs)
        return self.score(flat, per_user, np.repeat(np.arange(users, dtype=np.int64), count))

    def together(self, lists: list[Arrays]) -> list[np.ndarray]:
        """Each list's probabilities, as :meth:`__call__` gives them, from few calls for the batch.

        Lists are joined while their rows stay within ``max_batch_size``
        (:func:`~recserve.backends.base.batching.groups_within`): their candidate rows one list
        after the other, their users' histories and masks likewise, zero-padded (mask 0) to the
        widest on their padding side; each row keeps its own user.

        Raises:
            InvalidInput: naming the first offending input of a list (the caller answers each alone).
        """
        checked = [self.checked(inputs) for inputs in lists]
        rows = [users * count for _, _, users, count in checked]
        scores: list[np.ndarray] = []
        for group in batching.groups_within(rows, self.spec.model.max_batch_size):
            scores += self._joined([checked[i] for i in group])
        return scores

    def _joined(self, checked: list[tuple[dict[str, Any], dict[str, Any], int, int]]) -> list[np.ndarray]:
        """Checked lists scored in one call, the probabilities split back per list."""
        users = [each for _, _, each, _ in checked]
        starts = np.cumsum(users) - users
        owners = np.concatenate(
            [
                np.repeat(np.arange(each, dtype=np.int64) + start, count)
                for (_, _, each, count), start in zip(checked, starts.tolist(), strict=True)
            ]
        )
        flat = batching.merge([part for part, _, _, _ in checked])[0]
        per_user = batching.merge([part for _, part, _, _ in checked], left=self.left_padded)[0]
        probabilities = self.score(flat, per_user, owners)
        edges = np.cumsum([each * count for _, _, each, count in checked])[:-1]
        return np.split(probabilities, edges)

    def checked(self, inputs: Arrays) -> tuple[dict[str, Any], dict[str, Any], int, int]:
        """One list's per-candidate inputs flat, its per-user inputs, its users and candidates per user.

        Raises:
            InvalidInput: naming the first inconsistent or malformed input.
        """
        sparse = inputs.get(CANDIDATE_PREFIX + SPARSE_EMBEDDINGS)
        if sparse is None or sparse.ndim != 4:
            raise InvalidInput(
                CANDIDATE_PREFIX + SPARSE_EMBEDDINGS, "is missing or not [users, candidates, F, D]"
            )
        users, count = sparse.shape[:2]
        flat = {}
        for name in self.per_candidate:
            array = inputs.get(CANDIDATE_PREFIX + name)
            if array is None or array.shape[:2] != (users, count):
                raise InvalidInput(
                    CANDIDATE_PREFIX + name, f"is not [{users}, {count}, ...] as the other inputs"
                )
            flat[name] = array.reshape(users * count, *array.shape[2:])
        per_user: dict[str, Any] = {}
        for name in self.per_user:
            array = inputs.get(name)
            if array is None or array.ndim < 2 or array.shape[0] != users:
                raise InvalidInput(name, f"is not one row per user ({users})")
            per_user[name] = array
        if len({array.shape[1] for array in per_user.values()}) > 1:
            raise InvalidInput(self.per_user[0], "and the other histories differ in their positions")
        if self.scorer is not None:
            for name, array in {**flat, **per_user}.items():
                if dtype_name(array) != "float32":
                    raise InvalidInput(name, f"is {dtype_name(array)}, expected float32")
        return flat, per_user, int(users), int(count)

    def score(self, flat: dict[str, Any], per_user: dict[str, Any], owners: np.ndarray) -> np.ndarray:
        """Probabilities ``[rows, 1]`` of checked per-candidate rows whose users are ``owners``."""
        if self.scorer is not None:
            return self.scorer({**flat, **per_user}, owners)
        if self.session is None:
            rows = {**flat, **{name: array[owners] for name, array in per_user.items()}}
            return self.rows(rows)
        feeds = {name: np.ascontiguousarray(array) for name, array in flat.items()}
        feeds.update({**per_user, HISTORY_USER: owners})
        return self.session.run([PROBABILITY], feeds)[0]
