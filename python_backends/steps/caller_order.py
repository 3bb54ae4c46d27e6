"""A level answered in the caller's order (``[[degrade.levels]] caller_order``): nothing is scored.

Under a spike the access layer's door sends a request it chose this level for to
``<ensemble>__caller_order`` instead of the ensemble: one step beside it that reads only the shapes
of the request's inputs and answers every row (every candidate of a list) with ``[degrade]
fallback_score``, so the order the caller sent stands (a stable sort keeps it), the level in
``degrade_level`` and the versions 0 (no network and no table served it). No feature is
transformed, no table read, no network run: what such a request costs is tritonserver's and one
Python call's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from recserve.core.names import DENSE_VERSION, EMBEDDING_VERSION, PROBABILITY, WIRE_FORMS
from recserve.core.sections.degrade import DEGRADE_LEVEL
from recserve.core.spec.model import ModelSpec
from recserve.errors import InvalidInput


class CallerOrder:
    """The answer of the caller's-order level for one ensemble's requests.

    Args:
        spec: the served spec (its ``[degrade]`` has a ``caller_order`` level).
        lists: the candidates ensemble's requests (``[users, candidates, ...]`` per candidate),
            else the row ensemble's (``[rows, ...]``).
    """

    def __init__(self, spec: ModelSpec, lists: bool) -> None:
        level = spec.degrade.order_level
        if level is None:
            raise ValueError("[degrade] has no caller_order level")
        self.level, self.fallback, self.tables = level, spec.degrade.fallback_score, len(spec.table_names)
        forms = [spec.wire_form(form) for form in WIRE_FORMS] if lists else []
        self.per_candidate = frozenset(t.name for wire in forms for t in wire.candidate_inputs)
        self.lists = lists

    def answer(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The outputs for a request whose inputs have ``shapes`` (by name).

        Raises:
            InvalidInput: no input, inputs that disagree on the rows (users), or per-candidate
                inputs that disagree on the candidates.
        """
        users = rows = _one(shapes, lambda shape: shape[0] if shape else None, "rows")
        if self.lists:
            listed = {n: s for n, s in shapes.items() if n in self.per_candidate}
            if not listed:
                raise InvalidInput(next(iter(shapes)), "a candidate list carries its candidates' inputs")
            rows *= _one(listed, lambda shape: shape[1] if len(shape) > 1 else None, "candidates")
        return {
            PROBABILITY: np.full((rows, 1), self.fallback, np.float32),
            DENSE_VERSION: np.zeros((1, 1), np.int64),
            EMBEDDING_VERSION: np.zeros((1, self.tables), np.int64),
            DEGRADE_LEVEL: np.full((users, 1), self.level, np.int32),
        }


def _one(
    shapes: Mapping[str, tuple[int, ...]], size: Callable[[tuple[int, ...]], int | None], what: str
) -> int:
    """The one size ``size`` reads from every shape; InvalidInput naming an input that differs."""
    first: int | None = None
    for name, shape in shapes.items():
        found = size(shape)
        if found is None or found != (found if first is None else first):
            raise InvalidInput(name, f"has shape {list(shape)}: the inputs disagree on the {what}")
        first = found
    if first is None:
        raise InvalidInput("inputs", "a request needs at least one input")
    return first
