"""Several candidate-list requests of one dynamic batch transformed and looked up in one call.

Each list is checked and flattened alone (:func:`~recserve.core.candidate_lists.candidate_rows`: a
bad list raises naming its own input, and the caller then answers every list alone, as for rows).
The lists' candidate rows are joined one list after the other, and their users likewise (each
list's user numbers shifted past the previous lists'); the join is transformed and looked up once,
every user's history once; then the outputs are cut back per list: the per-candidate ones to
``[U, N, ...]``, the histories and masks to the list's users at the list's own width (the
sequence bucket of its longest history, from the padding side). So a list gets what it gets alone,
bit for bit, and the host work of a batch of lists is one transform and one store call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.base import batching
from recserve.backends.request_log.step_log import TAPPED_PER_OWNER
from recserve.core.candidate_lists import candidate_rows, per_candidate_dense_inputs
from recserve.core.names import CANDIDATE_PREFIX
from recserve.core.wire_forms import request_form

if TYPE_CHECKING:
    from recserve.backends.steps.lookup import FeaturesToEmbeddings


def candidate_lists(step: FeaturesToEmbeddings, lists: Sequence[Mapping[str, np.ndarray]]) -> list[dict]:
    """Each list's outputs, as :meth:`FeaturesToEmbeddings.candidates` gives them, from few calls.

    The lists (of one wire form) are joined while their rows stay within ``max_batch_size``
    (:func:`~recserve.backends.base.batching.groups_within`).

    Raises:
        InvalidInput: naming the first offending input of a list.
    """
    spec = step.spec
    flat = [candidate_rows(spec, inputs, request_form(spec, inputs)) for inputs in lists]
    answers = []
    for group in batching.groups_within([owners.size for _, owners in flat], spec.model.max_batch_size):
        answers += _joined(step, [lists[i] for i in group], [flat[i] for i in group])
    return answers


def _joined(
    step: FeaturesToEmbeddings,
    lists: Sequence[Mapping[str, np.ndarray]],
    flat: Sequence[tuple[dict[str, np.ndarray], np.ndarray]],
) -> list[dict]:
    """The lists' flattened rows joined, transformed and looked up once, and cut back per list."""
    users = [int(owners[-1]) + 1 for _, owners in flat]
    rows = [owners.size for _, owners in flat]
    joined = batching.merge([part for part, _ in flat])[0]
    starts = np.cumsum(users) - users
    owners = np.concatenate([o + start for (_, o), start in zip(flat, starts.tolist(), strict=True)])
    features = step.list_features(joined, lists, sum(users))
    out: dict[str, Any] = step.passed_on(features)
    out.update(step.lookup.lookup(features, owners))
    # histories and masks have a row per user, cut to each list's own width (what the log taps of
    # them: as served, whole); the rest a row per candidate
    tapped = {n: out.pop(n) for n in TAPPED_PER_OWNER if n in out}
    per_user = {n: a for n, a in out.items() if n in {*step.histories, *step.masks}}
    widths = step.list_widths(lists, out, users)
    by_user = batching.split(per_user, users, dict.fromkeys(per_user, widths), step.left_padded)
    if tapped:
        by_user = [
            {**cut, **whole} for cut, whole in zip(by_user, batching.split(tapped, users), strict=True)
        ]
    by_row = batching.split({n: a for n, a in out.items() if n not in per_user}, rows)
    per_candidate = set(per_candidate_dense_inputs(step.spec))
    answers = []
    for count, size, user_part, row_part in zip(users, rows, by_user, by_row, strict=True):
        for name in per_candidate & row_part.keys():
            part = row_part.pop(name)
            row_part[CANDIDATE_PREFIX + name] = part.reshape(count, size // count, *part.shape[1:])
        answers.append({**row_part, **user_part})
    return answers
