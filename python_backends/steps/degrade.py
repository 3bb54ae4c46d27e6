"""What a cheaper level does to a request, and the counts of the levels served.

A level of ``[[degrade.levels]]`` keeps a list's first ``max_candidates`` candidates (the caller's
order is its prior) and each row's newest ``history_length`` history items; ``dense`` answers the
candidates past the cap with ``fallback_score`` (:func:`pad_list`). Plain numpy, without Triton: the
first step's adapter (recserve.backends.triton.degrade_requests) applies it to a request's tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from recserve.backends.base.metrics import MetricSample
from recserve.core.names import CANDIDATE_PREFIX
from recserve.core.sections.degrade import VALUE_HEADER, DegradeSection
from recserve.core.spec.model import ModelSpec


def newest(sequence: np.ndarray, lengths: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's newest ``keep`` items of a right-padded sequence ``[n, L]`` (values first, newest last).

    Returns the sequence ``[n, min(L, keep)]`` (still values first) and the lengths ``[n, 1]``.
    """
    if sequence.shape[1] <= keep:
        return sequence, lengths
    length = np.minimum(lengths.reshape(-1).astype(np.int64), sequence.shape[1])
    kept = np.minimum(length, keep)
    columns = (length - kept)[:, None] + np.arange(keep)[None, :]  # the first kept item onwards
    valid = np.arange(keep)[None, :] < kept[:, None]
    rows = np.arange(sequence.shape[0])[:, None]
    trimmed = np.where(valid, sequence[rows, np.minimum(columns, sequence.shape[1] - 1)], 0)
    return trimmed.astype(sequence.dtype, copy=False), kept.astype(lengths.dtype).reshape(lengths.shape)


def pad_list(probability: np.ndarray, users: int, requested: int, fallback: float) -> np.ndarray:
    """A list's scores ``[users * scored, 1]`` answered for all ``requested`` candidates, user by user."""
    scored = probability.shape[0] // max(users, 1)
    if scored >= requested:
        return probability
    full = np.full((users, requested), fallback, dtype=probability.dtype)
    full[:, :scored] = probability.reshape(users, scored)
    return full.reshape(users * requested, 1)


class LevelInputs:
    """The tensors a level changes in a request: the histories, and a list's candidates.

    Args:
        spec: the model spec (its sequences and their lengths, its ``[degrade]`` levels).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.levels = spec.degrade.levels
        self.groups = tuple(
            (g.length_input, tuple(s.name for s in g.sequences)) for g in spec.attention_groups
        )

    def changed(self, level: int, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors of a request (by name) that level ``level`` changes, as it changes them.

        Level 0 (full) and the refusal change nothing; the cap applies to a list's per-candidate
        tensors (``candidate_<name>``, ``[users, candidates, ...]``).
        """
        if not 1 <= level <= len(self.levels):
            return {}
        spec_level = self.levels[level - 1]
        out: dict[str, np.ndarray] = {}
        if spec_level.history_length:
            for length_name, names in self.groups:
                if length_name not in arrays:
                    continue
                for name in names:
                    if name in arrays and arrays[name].ndim == 2:
                        out[name], out[length_name] = newest(
                            arrays[name], arrays[length_name], spec_level.history_length
                        )
        if spec_level.max_candidates:
            for name, array in arrays.items():
                if name.startswith(CANDIDATE_PREFIX) and array.ndim >= 2:
                    if array.shape[1] > spec_level.max_candidates:
                        out[name] = array[:, : spec_level.max_candidates]
        return out


class LevelCounts:
    """Requests served per level and tier, the controller's lambda and load, the door's lambda, as samples."""

    def __init__(self, section: DegradeSection) -> None:
        self.levels = section.level_names
        self.tiers = section.tier_columns
        self.counts = np.zeros((len(self.levels), len(self.tiers)), dtype=np.int64)
        self.section = section
        self.lock = threading.Lock()
        self.door_lambda = 0.0  # the largest lambda the access layer's door set since the last samples

    def door(self, lam: float) -> None:
        """A request came with the lambda the access layer's door chose its level at (0: none)."""
        if lam > self.door_lambda:
            with self.lock:
                self.door_lambda = max(self.door_lambda, lam)

    def tier_of(self, parameters: Mapping[str, object]) -> int:
        """The tier column of a request's parameters."""
        raw = parameters.get(VALUE_HEADER)
        if raw is None or raw == "":
            return len(self.tiers) - 1
        return (
            self.tiers.index(raw)
            if isinstance(raw, str) and raw in self.section.tiers
            else len(self.tiers) - 2
        )

    def count(self, level: int, tier: int, requests: int = 1) -> None:
        """``requests`` served at ``level`` of tier column ``tier``."""
        with self.lock:
            self.counts[level, tier] += requests

    def samples(self, lam: float, load: float, capacity: float = 0.0) -> list[MetricSample]:
        """Every level and tier's count (declared at 0), lambda, the load over the target, the capacity.

        And the door's lambda: the largest the access layer's door set on a request since the last
        call (the metrics are published once a second), then 0 again.
        """
        with self.lock:
            counts = self.counts.copy()
            door, self.door_lambda = self.door_lambda, 0.0
        out = [
            MetricSample(
                "recserve_degrade_requests_total",
                "counter",
                "Requests by the level that served them (full, the spec's levels, refused) and value tier",
                (("level", level), ("tier", tier)),
                float(counts[i, j]),
            )
            for i, level in enumerate(self.levels)
            for j, tier in enumerate(self.tiers)
        ]
        out.append(
            MetricSample(
                "recserve_degrade_lambda", "gauge", "The value per unit of cost a level must earn", (), lam
            )
        )
        out.append(
            MetricSample(
                "recserve_degrade_door_lambda",
                "gauge",
                "The largest lambda the access layer's door set on a request since the last publication",
                (),
                door,
            )
        )
        out.append(
            MetricSample(
                "recserve_degrade_load",
                "gauge",
                "The steps' mean queue wait over [degrade] target_queue_ms, as last measured",
                (),
                load,
            )
        )
        out.append(
            MetricSample(
                "recserve_degrade_capacity",
                "gauge",
                "Full-cost requests per second the steps serve, as learned from backlogs (0: not yet known)",
                (),
                capacity,
            )
        )
        return out
