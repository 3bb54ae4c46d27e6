"""The access layer's value door: under a spike, the lowest values refused before any tritonserver.

With ``[degrade]`` on, the first step chooses each request's level from its value and lambda
(docs/design/degrade.md). A request it refuses has still been received, queued behind the backlog
and handed to Python: about an eighth of a served request's compute, on the cores that serve. The
door moves that choice in front of the servers: Envoy's Lua filter (:mod:`recserve.access.lua.value_door`)
sees every request as it arrives, sets lambda from the arrivals of the last
:data:`~recserve.core.sections.degrade.WINDOW_S` against the servers' capacity (the rule of the
first step's own door), answers the requests whose level is the refusal at once, and hands the rest
on with the lambda it chose their level at (``recserve-lambda``), which the first step serves them
at, at least.

The door stands in front of the ``stable`` variant's servers when their spec has ``[degrade]`` on
and lambda is not held (``fixed_lambda``). It spends their capacity: ``[degrade] capacity``
(full-cost requests per second, per server), or else the capacity each server's first step learns
and keeps (:mod:`recserve.core.degrade_capacity`), which the door reads again every
:data:`REREAD_S` while the proxy runs, so that it follows what the steps learn. Until every server
has kept one, the door lets everything through and the first step decides alone, as before.
Each Envoy worker holds its share of the budget (``[access] workers``: one by default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from recserve.core.degrade_capacity import FILE_NAME, LIMITS, MAX_BYTES, CapacityFile
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.sections.degrade import (
    DEFAULT_TIER,
    MAX_REPORTED,
    NUMBER_TIER,
    WINDOW_S,
    DegradeSection,
)
from recserve.core.spec.model import ModelSpec

#: how often the door reads the servers' kept capacities again, in seconds (per Envoy worker)
REREAD_S = 1.0


@dataclass(frozen=True)
class ValueDoor:
    """What the door's Lua needs: the spec's ``[degrade]`` and the capacity it spends.

    Attributes:
        section: the served spec's ``[degrade]`` (enabled).
        capacity_per_s: full-cost requests per second the variant's servers serve together, as known
            when the proxy starts (0: not yet: the door lets everything through until it is).
        workers: Envoy's worker threads; each holds its share of the capacity.
        kept: each server's kept capacity file, read again while the proxy runs (absolute paths;
            none where the spec sets the capacity). The capacity is their sum once each holds one.
        ordered: by ensemble, the model answering its caller's-order level (``caller_order``),
            which the door names instead of the ensemble for a request at that level.
    """

    section: DegradeSection
    capacity_per_s: float
    workers: int = 1
    kept: tuple[str, ...] = ()
    ordered: Mapping[str, str] = field(default_factory=dict)

    def lua_table(self) -> str:
        """The Lua table of the door (``@DOOR@``); its levels by number from 1 (full), the step's from 0."""
        from recserve.access.front_door import lua_string

        section = self.section
        spend = (*section.costs[:-1], 0.0) if section.refuse else section.costs  # refused here: free
        tiers = ", ".join(f"[{lua_string(k)}] = {_number(v)}" for k, v in section.tiers.items())
        fields = {
            "tiers": "{" + tiers + "}",
            "default": _number(section.default_value),
            "costs": _numbers(section.costs),
            "qualities": _numbers(section.qualities),
            "spend": _numbers(spend),
            "grid": _numbers(section.lambda_grid),
            "full_value": _number(section.full_value),
            "capacity": _number(self.capacity_per_s),  # the budget: headroom x capacity / workers x window
            "headroom": _number(section.headroom),
            "workers": str(self.workers),
            "window_s": _number(WINDOW_S),
            "window_ms": _number(WINDOW_S * 1000.0),
            "kept": "{" + ", ".join(lua_string(path) for path in self.kept) + "}",
            "reread_ms": _number(REREAD_S * 1000.0),
            "limits": _numbers(LIMITS),
            "max_bytes": str(MAX_BYTES),
            "refuses": "true" if section.refuse else "false",
            "number_tier": lua_string(NUMBER_TIER),  # the count columns of a number and of no value
            "default_tier": lua_string(DEFAULT_TIER),
            "max_reported": str(MAX_REPORTED),  # a report's count per tier, as the step reads it
            # the caller's-order level (0: none) and its model by ensemble, where the spec has one
            "order": str(section.order_level + 1 if section.order_level is not None else 0),
            "ordered": "{"
            + ", ".join(f"[{lua_string(k)}] = {lua_string(v)}" for k, v in self.ordered.items())
            + "}",
        }
        return "{" + ", ".join(f"{k} = {v}" for k, v in fields.items()) + "}"

    @classmethod
    def in_front_of(
        cls, spec: ModelSpec | None, repositories: Sequence[Path], workers: int
    ) -> ValueDoor | None:
        """The door of a variant served by ``repositories`` (one per server) under ``spec``; None: no door.

        The capacity per server is the spec's ``[degrade] capacity``, else the one its first step
        keeps in its repository, read now and again while the proxy runs.
        """
        if spec is None or not spec.degrade.enabled or spec.degrade.fixed_lambda >= 0 or not repositories:
            return None  # off, or lambda held by the spec (a drill): the first step decides alone
        section, ordered = spec.degrade, spec.caller_order_models
        if section.capacity > 0:
            return cls(section, section.capacity * len(repositories), workers, ordered=ordered)
        files = tuple(Path(r).resolve() / EMBEDDING_LOOKUP / FILE_NAME for r in repositories)
        kept = [CapacityFile(path).load() for path in files]
        known = sum(c for c in kept if c is not None) if None not in kept else 0.0
        return cls(section, known, workers, tuple(str(path) for path in files), ordered)


def _number(value: float) -> str:
    """A finite float as a Lua literal that reads back to the same double."""
    return repr(float(value))


def _numbers(values: Sequence[float]) -> str:
    return "{" + ", ".join(_number(v) for v in values) + "}"
