"""Synthetic rows rewritten into users' runs: consecutive rows sharing one user's profile and sequences."""

from __future__ import annotations

from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec


def with_runs(spec: ModelSpec, raw: Rows, runs: list[slice]) -> Rows:
    """``raw`` rewritten so that each run of rows has its first row's user, profile and sequences."""
    columns = [
        spec.categorical.columns.index(n) for n in spec.profile_columns if n in spec.categorical.columns
    ]
    numeric = [spec.numeric_columns.index(n) for n in spec.profile_columns if n in spec.numeric_columns]
    for run in runs:
        first = run.start
        raw.categorical[run, columns] = raw.categorical[first, columns]
        raw.dense[run, numeric] = raw.dense[first, numeric]
        raw.dense_missing[run, numeric] = raw.dense_missing[first, numeric]
        raw.lengths[run] = raw.lengths[first]
        raw.history[run] = raw.history[first]
        for name, values in raw.side.items():
            if values.ndim == 2 or name.endswith("__length"):  # a sequence or its length (not a target)
                values[run] = values[first]
    return raw
