"""Applying the update log to a served store: each table on the newest version whose chain is valid.

A version is applied only when its whole chain (manifests, checksums, shapes, values, key ownership
against the local tier and against the other tables' deltas) checks out. A table whose head does
not is kept on the newest valid version of that chain: the head's parent, its parent, and so on
down to the base version, so a malformed or hostile version never stops a model from loading and
a restart serves what the server served before it. Any failure while loading a version (a refused
artifact, or anything a reader raises) refuses that version; each is counted once. A table
whose ``HEAD.json`` is unreadable serves the newest valid published version.

Tables whose heads changed are applied in the order their oldest pending versions were published,
so when two tables' deltas claim one key the table that published first keeps it, on a running
server and after a restart alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from recserve.backends.store.table_data import RowBlock
from recserve.backends.store.tiered import TieredStore
from recserve.backends.store.updates.deltas import (
    DeltaError,
    check_delta,
    check_foreign_deltas,
    check_ownership,
)
from recserve.errors import ArtifactError

if TYPE_CHECKING:
    from recserve.backends.store.updates.versions import UpdateLog

LOGGER = logging.getLogger(__name__)

Rows = tuple[np.ndarray, np.ndarray]
_UNREADABLE = -1  # the head of a table whose HEAD.json is refused


class StoreUpdater:
    """Keeps a :class:`TieredStore` on the heads of an :class:`UpdateLog` (call :meth:`poll`)."""

    def __init__(self, store: TieredStore, log: UpdateLog) -> None:
        self.store = store
        self.log = log
        self.applied = {name: store.base_version for name in store.table_names}
        self.rows: dict[str, Rows] = {}  # table -> merged delta rows of its applied version
        self.created: dict[str, float] = {}
        self.rejected = 0  # versions (and heads) refused, each counted once
        self.problems: dict[str, str] = {}  # table -> why its head is not the applied version
        self._heads = dict(self.applied)  # the head each table was last resolved from
        self._refused: set[tuple[str, int]] = set()

    def poll(self) -> bool:
        """Apply new heads, all changed tables in one swap; False when no served version changed."""
        heads = {name: self._head(name) for name in self.store.table_names}
        changed = [name for name in self.store.table_names if heads[name] != self._heads[name]]
        if not changed:
            return False
        rows, applied, created = dict(self.rows), dict(self.applied), dict(self.created)
        for name in sorted(changed, key=self._pending_since):
            self._heads[name] = heads[name]
            # an unreadable head: the newest published version that is valid
            start = heads[name] if heads[name] != _UNREADABLE else self._newest_below(name, None)
            version, table_rows, stamp = self._resolve(name, start, rows, applied)
            if heads[name] == _UNREADABLE:
                self.problems[name] = f"{name}/HEAD.json is unreadable"
            applied[name] = version
            rows[name] = table_rows
            if stamp is None:
                created.pop(name, None)
            else:
                created[name] = stamp
        moved = {name: v for name, v in applied.items() if v != self.applied[name]}
        if not moved:
            return False
        block = self._block(rows)
        self.store.install(moved, block)
        self.rows, self.applied, self.created = rows, applied, created
        LOGGER.info("embedding tables now at %s", moved)
        return True

    def check_publishable(self, table: str, keys: np.ndarray) -> None:
        """Refuse a delta for ``table`` that the servers would refuse, before it is published.

        Raises:
            DeltaError: the table's head is not applicable here, or ``keys`` belong to another
                table (its local rows or its published delta).
        """
        self.poll()
        if table in self.problems:
            raise DeltaError(
                f"table {table!r}: its head cannot be applied ({self.problems[table]}); "
                f"roll back to a valid version first"
            )
        check_ownership(self.store, table, keys)
        check_foreign_deltas(self.rows, self.applied, table, keys)

    def _head(self, name: str) -> int:
        try:
            head = self.log.head(name)
        except ArtifactError as exc:
            self._refuse(name, _UNREADABLE, exc)
            return _UNREADABLE
        self._refused.discard((name, _UNREADABLE))
        return head

    def _pending_since(self, name: str) -> float:
        """When the oldest version of ``name`` above the applied one was published (inf: none readable)."""
        stamps = []
        for version in self.log.versions(name):
            if version > self.applied[name]:
                try:
                    stamps.append(self.log.record(name, version).created)
                except ArtifactError:
                    continue
        return min(stamps, default=float("inf"))

    def _resolve(
        self, name: str, head: int, rows: Mapping[str, Rows], applied: Mapping[str, int]
    ) -> tuple[int, Rows, float | None]:
        """The newest valid version of ``head``'s chain with its rows and publication time."""
        version = head
        self.problems.pop(name, None)
        while version != self.log.base_version:
            try:
                table_rows, stamp = self._rows_of(name, version)
                others = {n: r for n, r in rows.items() if n != name}
                check_foreign_deltas(others, applied, name, table_rows[0])
                return version, table_rows, stamp
            except Exception as exc:  # whatever loading a version raises refuses that version alone
                reason = exc if isinstance(exc, ArtifactError) else f"{type(exc).__name__}: {exc}"
                self._refuse(name, version, reason)
                self.problems.setdefault(name, f"version {version}: {reason}")
                version = self._fallback(name, version)
        return version, (np.empty(0, np.int64), np.empty((0, self.store.dim), np.float32)), None

    def _fallback(self, name: str, version: int) -> int:
        """The version to try after ``version``: its parent, else the newest published one below it."""
        try:
            return self.log.record(name, version).parent
        except ArtifactError:
            return self._newest_below(name, version)

    def _newest_below(self, name: str, version: int | None) -> int:
        below = [v for v in self.log.versions(name) if version is None or v < version]
        return max(below, default=self.log.base_version)

    def _refuse(self, name: str, version: int, exc: object) -> None:
        if (name, version) in self._refused:
            return
        self._refused.add((name, version))
        self.rejected += 1
        LOGGER.error(
            "embedding update refused: table %r %s; serving the newest valid version: %s",
            name,
            "head" if version == _UNREADABLE else f"version {version}",
            exc,
        )

    def _rows_of(self, table: str, version: int) -> tuple[Rows, float | None]:
        keys, vectors, stamp = [], [], None
        for record in self.log.chain(table, version):
            stamp = record.created
            k, v = record.arrays()
            if record.kind == "revert":
                continue
            check_delta(table, k, v, self.store.table_dim(table))
            if v.shape[1] < self.store.dim:  # the delta rows hold every table at the widest width
                v = np.pad(np.asarray(v, np.float32), ((0, 0), (0, self.store.dim - v.shape[1])))
            check_ownership(self.store, table, k)
            keys.append(k)
            vectors.append(v)
        if not keys:
            return (np.empty(0, np.int64), np.empty((0, self.store.dim), np.float32)), stamp
        # later versions win: keep each key's last occurrence
        all_keys, all_vectors = np.concatenate(keys), np.concatenate(vectors)
        _, last = np.unique(all_keys[::-1], return_index=True)
        keep = len(all_keys) - 1 - last
        return (all_keys[keep], all_vectors[keep]), stamp

    def _block(self, rows: Mapping[str, Rows]) -> RowBlock | None:
        parts = [(name, k, v) for name, (k, v) in rows.items() if len(k)]
        if not parts:
            return None
        keys = np.concatenate([k for _, k, _ in parts])
        return RowBlock.of(keys, np.concatenate([v for _, _, v in parts]))

    def lag_seconds(self) -> dict[str, float]:
        """Seconds between publishing each table's served version and now (0 for base versions)."""
        now = time.time()
        return {
            name: now - self.created[name] if name in self.created else 0.0 for name in self.store.table_names
        }


__all__ = ["StoreUpdater"]
