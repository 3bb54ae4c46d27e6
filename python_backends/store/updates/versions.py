"""Online embedding updates: versioned deltas in a watched directory, applied atomically, rolled back.

A *delta* replaces or adds rows of one table. ``recserve update`` publishes it as the table's next
version; ``recserve rollback --to V`` publishes a new version whose content is version ``V``'s, so
version numbers only ever go forward. Layout of the update log (one folder per table)::

    <log>/<table>/v00000002/manifest.json   {"format", "table", "version", "parent", "created",
                                             "kind": "delta" | "revert", "files": {...sha256...}}
    <log>/<table>/v00000002/keys.npy        int64 [n]
    <log>/<table>/v00000002/vectors.npy     float32 [n, dim]
    <log>/<table>/HEAD.json                 {"version": 2}: the version servers must serve
    <log>/.lock                             held by every writer of the log

A version's content is its parent's content plus its own rows (a revert has no rows), down to the
base version built by ``recserve build``. A version folder is written under a temporary name and
renamed into place, then ``HEAD.json`` is replaced atomically, so a reader never sees half of one.
Writers (publish, rollback, a mirrored stream entry) hold the log's lock from reading the head to
moving it, so concurrent writers never lose a version. Servers poll ``HEAD.json``
(:class:`~recserve.backends.store.updates.apply.StoreUpdater`), build the new delta rows and the L1
cache for them aside, then swap one reference in the store.

Everything read back (heads, manifests, table names from the stream) is checked against
:mod:`~recserve.backends.store.updates.schema` before it is used as a number or a path.

Delta files (the input of ``recserve update``): ``.npz`` with ``keys`` (int64 ``[n]``) and
``vectors`` (float32 ``[n, dim]``), or ``.safetensors`` with the same two tensors.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.base.artifacts import load_array, save_array
from recserve.backends.base.bounded_files import read_json
from recserve.backends.store.updates.apply import StoreUpdater
from recserve.backends.store.updates.deltas import (
    DeltaError,
    check_delta,
    check_foreign_deltas,
    check_ownership,
    read_delta_file,
)
from recserve.backends.store.updates.schema import (
    DELTA_FORMAT,
    MANIFEST_FILE,
    MAX_HEAD_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    UpdateRefused,
    check_entry_files,
    check_table,
    inside,
    parse_head,
    parse_manifest,
)
from recserve.backends.store.updates.upkeep import HOT_KEYS_FILE, Maintainer, load_hot_keys, save_hot_keys
from recserve.core.files import write_text_atomically
from recserve.errors import ArtifactError

LOGGER = logging.getLogger(__name__)

HEAD_FILE = "HEAD.json"
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class DeltaRecord:
    """One published version of one table."""

    table: str
    version: int
    parent: int
    created: float
    kind: str
    folder: Path
    files: Mapping[str, Any]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The version's own rows, checksums verified (empty for a revert)."""
        if self.kind == "revert":
            return np.empty(0, np.int64), np.empty((0, 0), np.float32)
        return load_array(self.folder, self.files["keys"]), load_array(self.folder, self.files["vectors"])


class UpdateLog:
    """The update log of a model's tables (see the module docstring).

    Args:
        root: the log's folder.
        base_version: the version built by ``recserve build``; published versions are above it.
        tables: the spec's table names; a table outside them is refused (``None``: any plain name).
    """

    def __init__(self, root: Path, base_version: int, tables: Collection[str] | None = None) -> None:
        self.root = root
        self.base_version = base_version
        self.tables = None if tables is None else frozenset(tables)

    def _table_dir(self, table: str) -> Path:
        return self.root / check_table(table, self.tables)

    def _folder(self, table: str, version: int) -> Path:
        return self._table_dir(table) / f"v{version:08d}"

    def versions(self, table: str) -> list[int]:
        """Published versions of ``table`` (the base version not included)."""
        folder = self._table_dir(table)
        if not folder.is_dir():
            return []
        return sorted(
            number
            for p in folder.iterdir()
            if p.name.startswith("v")
            and p.name[1:].isdigit()
            and (number := int(p.name[1:])) > self.base_version
        )

    def head(self, table: str) -> int:
        """The version servers must serve (the base version until something is published).

        Raises:
            ArtifactError: ``HEAD.json`` is unreadable or names no integer version from the base on.
        """
        path = self._table_dir(table) / HEAD_FILE
        if not os.path.lexists(path):
            return self.base_version
        try:
            doc = read_json(path, MAX_HEAD_BYTES, f"{table}/", UpdateRefused)
        except OSError as exc:
            raise UpdateRefused(f"{table}/{HEAD_FILE} is unreadable: {exc.strerror}") from None
        return parse_head(doc, table, self.base_version)

    def manifest(self, table: str, version: int) -> Manifest:
        """The checked manifest of one published version."""
        folder = self._folder(table, version)
        try:
            doc = read_json(
                folder / MANIFEST_FILE,
                MAX_MANIFEST_BYTES,
                f"version {version} of table {table!r}: ",
                UpdateRefused,
            )
        except OSError as exc:
            raise UpdateRefused(
                f"version {version} of table {table!r} is unreadable: {exc.strerror}"
            ) from None
        return parse_manifest(doc, table, self.base_version, version)

    def record(self, table: str, version: int) -> DeltaRecord:
        """The record of one published version (its manifest checked, its files inside its folder)."""
        manifest = self.manifest(table, version)
        folder = self._folder(table, version)
        for entry in manifest.files.values():
            inside(folder, entry["path"])
        return DeltaRecord(
            table, version, manifest.parent, manifest.created, manifest.kind, folder, manifest.files
        )

    def chain(self, table: str, version: int) -> list[DeltaRecord]:
        """Records from the base version up to ``version``, oldest first (parents strictly decrease)."""
        records: list[DeltaRecord] = []
        while version != self.base_version:
            record = self.record(table, version)
            records.append(record)
            version = record.parent
        return records[::-1]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the log's lock: one writer at a time, from reading the head to moving it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_version(self, manifest: Manifest, write: Callable[[Path], None]) -> None:
        """Write a version folder under a temporary name, rename it into place (lock held)."""
        table_dir = self._table_dir(manifest.table)
        table_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=table_dir))
        write(staging)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest.as_json(), indent=2, sort_keys=True) + "\n")
        os.rename(staging, self._folder(manifest.table, manifest.version))

    def _next_version(self, table: str) -> int:
        try:
            head = self.head(table)
        except UpdateRefused:  # a rollback repairs an unreadable head
            head = self.base_version
        return max([self.base_version, head, *self.versions(table)]) + 1

    def publish(
        self,
        table: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        dim: int,
        check: Callable[[], None] | None = None,
    ) -> int:
        """Publish a checked delta on top of the current head; its new version.

        Args:
            table: the table.
            keys: int64 ``[n]`` keys.
            vectors: float32 ``[n, dim]`` rows.
            dim: the table's width.
            check: called with the log's lock held, before anything is written (raises to refuse:
                the ownership checks against what is published at that moment).
        """
        check_delta(table, keys, vectors, dim)
        with self._locked():
            if check is not None:
                check()
            parent = self.head(table)
            self.chain(table, parent)  # never publish on top of a broken history
            version = self._next_version(table)
            saved: dict[str, Any] = {}

            def write(folder: Path) -> None:
                saved["keys"] = save_array(folder, "keys.npy", keys)
                saved["vectors"] = save_array(folder, "vectors.npy", vectors)

            manifest = Manifest(table, version, parent, time.time(), "delta", saved)
            self._write_version(manifest, write)
            self._write_head(table, version)
            return version

    def rollback(self, table: str, to: int) -> int:
        """Publish a new version whose content is version ``to``'s; its new version."""
        with self._locked():
            known = [self.base_version, *self.versions(table)]
            if to not in known:
                raise DeltaError(f"table {table!r} has no version {to}; known versions: {known}")
            self.chain(table, to)  # refuse a broken history before pointing servers at it
            version = self._next_version(table)
            self._write_version(Manifest(table, version, to, time.time(), "revert", {}), lambda folder: None)
            self._write_head(table, version)
            return version

    def import_version(self, table: str, manifest: object, files: Mapping[str, object]) -> bool:
        """Write a version published elsewhere (same layout); False when it is already here.

        Everything is checked before anything is written: the table (a spec table, a plain name),
        the manifest (:func:`~recserve.backends.store.updates.schema.parse_manifest`), the files
        (exactly the manifest's, sizes and checksums matching), its place (right after the newest
        version here) and its parent (here already; the version before it for a delta). The head
        moves to it when it is newer.

        Raises:
            UpdateRefused: any of these checks failed; nothing was written.
        """
        checked = parse_manifest(manifest, check_table(table, self.tables), self.base_version)
        contents = check_entry_files(checked, files)
        with self._locked():
            folder = self._folder(table, checked.version)
            if folder.exists():
                return False
            known = [self.base_version, *(v for v in self.versions(table) if v < checked.version)]
            if known[-1] != checked.version - 1:
                raise UpdateRefused(
                    f"version {checked.version} of table {table!r} does not follow a version here "
                    f"(newest here: {known[-1]})"
                )
            if checked.parent not in known or (checked.kind == "delta" and checked.parent != known[-1]):
                raise UpdateRefused(
                    f"version {checked.version} of table {table!r}: parent {checked.parent} is not "
                    f"{'the version before it' if checked.kind == 'delta' else 'a version here'}"
                )

            def write(staging: Path) -> None:
                for name, entry in checked.files.items():
                    inside(staging, entry["path"]).write_bytes(contents[name])

            self._write_version(checked, write)
            if checked.version > self.head(table):
                self._write_head(table, checked.version)
            return True

    def _write_head(self, table: str, version: int) -> None:
        write_text_atomically(self._table_dir(table) / HEAD_FILE, json.dumps({"version": version}) + "\n")


__all__ = [
    "DELTA_FORMAT",
    "HEAD_FILE",
    "HOT_KEYS_FILE",
    "ArtifactError",
    "DeltaError",
    "DeltaRecord",
    "Maintainer",
    "StoreUpdater",
    "UpdateLog",
    "UpdateRefused",
    "check_delta",
    "check_foreign_deltas",
    "check_ownership",
    "load_hot_keys",
    "read_delta_file",
    "save_hot_keys",
]
