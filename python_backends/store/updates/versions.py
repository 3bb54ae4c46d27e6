"""Online embedding updates: versioned deltas in a watched directory, applied atomically, rolled back.

A *delta* replaces or adds rows of one table. ``recserve update`` publishes it as the table's next
version; ``recserve rollback --to V`` publishes a new version whose content is version ``V``'s, so
version numbers only ever go forward. Layout of the update log (one folder per table)::

    <log>/<table>/v00000002/manifest.json   {"format", "table", "version", "parent", "created",
                                             "kind": "delta" | "revert", "files": {...sha256...}}
    <log>/<table>/v00000002/keys.npy        int64 [n]
    <log>/<table>/v00000002/vectors.npy     float32 [n, dim]
    <log>/<table>/HEAD.json                 {"version": 2}: the version servers must serve

A version's content is its parent's content plus its own rows (a revert has no rows), down to the
base version built by ``recserve build``. A version folder is written under a temporary name and
renamed into place, then ``HEAD.json`` is replaced atomically, so a reader never sees half of one.
Servers poll ``HEAD.json`` (:class:`StoreUpdater`), build the new delta rows and the L1 cache for
them aside, then swap one reference in the store.

Delta files (the input of ``recserve update``): ``.npz`` with ``keys`` (int64 ``[n]``) and
``vectors`` (float32 ``[n, dim]``), or ``.safetensors`` with the same two tensors.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.artifacts import first_non_finite, load_array, map_safetensors, save_array
from recserve.backends.store.rows import RowBlock
from recserve.backends.store.tiered import TieredStore
from recserve.errors import ArtifactError

LOGGER = logging.getLogger(__name__)

DELTA_FORMAT = "recserve-delta/1"
HEAD_FILE = "HEAD.json"
HOT_KEYS_FILE = "hot_keys.npy"


class DeltaError(ArtifactError):
    """A delta that cannot be published or applied; nothing of it was applied."""


def read_delta_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` and ``vectors`` of a ``.npz`` or ``.safetensors`` delta file (never unpickles)."""
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in archive.files}
        except (OSError, ValueError) as exc:
            raise DeltaError(
                f"delta {path.name}: not a readable .npz without pickled objects ({exc})"
            ) from None
    elif path.suffix == ".safetensors":
        try:
            arrays = map_safetensors(path)
        except ArtifactError as exc:
            raise DeltaError(f"delta {path.name}: {exc}") from None
    else:
        raise DeltaError(f"delta {path.name}: use a .npz or .safetensors file")
    missing = {"keys", "vectors"} - set(arrays)
    if missing:
        raise DeltaError(
            f"delta {path.name}: missing array(s) {sorted(missing)}; it needs 'keys' and 'vectors'"
        )
    return arrays["keys"], arrays["vectors"]


def check_delta(
    table: str,
    keys: np.ndarray,
    vectors: np.ndarray,
    dim: int,
    dtypes: tuple[str, ...] = ("float32",),
    what: str = "delta for",
) -> None:
    """Refuse a delta whose dtypes, shapes or values do not fit ``table`` (width ``dim``).

    ``what`` starts each message (``recserve import`` checks whole keyed tables: ``table``).
    """
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise DeltaError(f"{what} {table!r}: keys are {keys.dtype}{list(keys.shape)}, expected int64[n]")
    if vectors.dtype.name not in dtypes:
        raise DeltaError(f"{what} {table!r}: vectors are {vectors.dtype}, expected {' or '.join(dtypes)}")
    if vectors.shape != (len(keys), dim):
        raise DeltaError(
            f"{what} {table!r}: vectors are {list(vectors.shape)}, "
            f"expected [{len(keys)}, {dim}] (table dim {dim})"
        )
    if len(keys) == 0:
        raise DeltaError(f"{what} {table!r} holds no rows")
    if len(np.unique(keys)) != len(keys):
        raise DeltaError(f"{what} {table!r} repeats keys")
    bad = first_non_finite(vectors)
    if bad is not None:
        raise DeltaError(f"{what} {table!r}: row {bad} holds NaN or Inf values")


def check_ownership(store: TieredStore, table: str, keys: np.ndarray) -> None:
    """Refuse keys that the local tier stores for another table."""
    table_id = store.table_id(table)
    for number, shard in enumerate(store.shards):
        rows = shard.index.find(keys)
        owners = store.table_of_row(number, rows[rows >= 0])
        foreign = owners[owners != table_id]
        if foreign.size:
            bad = keys[rows >= 0][owners != table_id][0]
            raise DeltaError(
                f"delta for {table!r}: key {int(bad)} belongs to table {store.table_names[int(foreign[0])]!r}"
            )


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
    """The update log of a model's tables (see the module docstring)."""

    def __init__(self, root: Path, base_version: int) -> None:
        self.root = root
        self.base_version = base_version

    def _folder(self, table: str, version: int) -> Path:
        return self.root / table / f"v{version:08d}"

    def versions(self, table: str) -> list[int]:
        """Published versions of ``table`` (the base version not included)."""
        folder = self.root / table
        if not folder.is_dir():
            return []
        return sorted(
            int(p.name[1:]) for p in folder.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()
        )

    def head(self, table: str) -> int:
        """The version servers must serve (the base version until something is published)."""
        try:
            return int(json.loads((self.root / table / HEAD_FILE).read_text())["version"])
        except FileNotFoundError:
            return self.base_version
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"{table}/{HEAD_FILE} is unreadable: {exc}") from None

    def record(self, table: str, version: int) -> DeltaRecord:
        """The manifest of one published version."""
        folder = self._folder(table, version)
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"version {version} of table {table!r} is unreadable: {exc}") from None
        if (
            manifest.get("format") != DELTA_FORMAT
            or manifest.get("table") != table
            or manifest.get("version") != version
        ):
            raise ArtifactError(f"version {version} of table {table!r} has a mismatched manifest")
        return DeltaRecord(
            table,
            version,
            int(manifest["parent"]),
            float(manifest["created"]),
            manifest["kind"],
            folder,
            manifest.get("files", {}),
        )

    def chain(self, table: str, version: int) -> list[DeltaRecord]:
        """Records from the base version up to ``version``, oldest first."""
        records: list[DeltaRecord] = []
        while version != self.base_version:
            record = self.record(table, version)
            if record.parent >= version:
                raise ArtifactError(
                    f"version {version} of table {table!r} names a later parent {record.parent}"
                )
            records.append(record)
            version = record.parent
        return records[::-1]

    @contextmanager
    def _locked(self, table: str) -> Iterator[None]:
        folder = self.root / table
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _publish(self, table: str, parent: int, kind: str, write: Callable[[Path], dict[str, Any]]) -> int:
        with self._locked(table):
            version = max([self.base_version, *self.versions(table)]) + 1
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root / table))
            files = write(staging)
            manifest = {
                "format": DELTA_FORMAT,
                "table": table,
                "version": version,
                "parent": parent,
                "created": time.time(),
                "kind": kind,
                "files": files,
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.rename(staging, self._folder(table, version))
            self._write_head(table, version)
            return version

    def import_version(self, table: str, manifest: dict[str, Any], files: Mapping[str, bytes]) -> bool:
        """Write a version published elsewhere (same layout); False when it is already here.

        The head moves to it when it is newer; its checksums are verified when it is applied.
        """
        version = int(manifest["version"])
        if manifest.get("format") != DELTA_FORMAT or manifest.get("table") != table:
            raise DeltaError(f"version {version} of table {table!r} arrived with a mismatched manifest")
        with self._locked(table):
            if self._folder(table, version).exists():
                return False
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root / table))
            for name, entry in manifest.get("files", {}).items():
                (staging / Path(entry["path"]).name).write_bytes(files[name])
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.rename(staging, self._folder(table, version))
            if version > self.head(table):
                self._write_head(table, version)
            return True

    def _write_head(self, table: str, version: int) -> None:
        tmp = self.root / table / f".{HEAD_FILE}.tmp"
        tmp.write_text(json.dumps({"version": version}) + "\n")
        os.replace(tmp, self.root / table / HEAD_FILE)

    def publish(self, table: str, keys: np.ndarray, vectors: np.ndarray, dim: int) -> int:
        """Publish a checked delta on top of the current head; its new version."""
        check_delta(table, keys, vectors, dim)

        def write(folder: Path) -> dict[str, Any]:
            return {
                "keys": save_array(folder, "keys.npy", keys),
                "vectors": save_array(folder, "vectors.npy", vectors),
            }

        return self._publish(table, self.head(table), "delta", write)

    def rollback(self, table: str, to: int) -> int:
        """Publish a new version whose content is version ``to``'s; its new version."""
        if to != self.base_version and to not in self.versions(table):
            known = [self.base_version, *self.versions(table)]
            raise DeltaError(f"table {table!r} has no version {to}; known versions: {known}")
        self.chain(table, to)  # refuse a broken history before pointing servers at it
        return self._publish(table, to, "revert", lambda folder: {})


class StoreUpdater:
    """Keeps a :class:`TieredStore` on the heads of an :class:`UpdateLog` (call :meth:`poll`)."""

    def __init__(self, store: TieredStore, log: UpdateLog) -> None:
        self.store = store
        self.log = log
        self.applied = {name: store.base_version for name in store.table_names}
        self.rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table -> merged delta rows of its head
        self.created: dict[str, float] = {}
        self.rejected = 0

    def poll(self) -> bool:
        """Apply new heads, all tables at once; False when nothing changed or the update was refused."""
        try:
            heads = {name: self.log.head(name) for name in self.store.table_names}
            changed = {name: v for name, v in heads.items() if v != self.applied[name]}
            if not changed:
                return False
            rows = dict(self.rows)
            for name, version in changed.items():
                rows[name] = self._rows_of(name, version)
            block = self._block(rows)
        except ArtifactError as exc:
            self.rejected += 1
            LOGGER.error("embedding update refused, still serving %s: %s", self.applied, exc)
            return False
        self.store.install(changed, block)
        self.rows, self.applied = rows, heads
        LOGGER.info("embedding tables now at %s", changed)
        return True

    def _rows_of(self, table: str, version: int) -> tuple[np.ndarray, np.ndarray]:
        keys, vectors = [], []
        for record in self.log.chain(table, version):
            self.created[table] = record.created
            k, v = record.arrays()
            if record.kind == "revert":
                continue
            check_delta(table, k, v, self.store.table_dim(table))
            if v.shape[1] < self.store.dim:  # the delta rows hold every table at the widest width
                v = np.pad(np.asarray(v, np.float32), ((0, 0), (0, self.store.dim - v.shape[1])))
            check_ownership(self.store, table, k)
            keys.append(k)
            vectors.append(v)
        if version == self.log.base_version:
            self.created.pop(table, None)
        if not keys:
            return np.empty(0, np.int64), np.empty((0, self.store.dim), np.float32)
        # later versions win: keep each key's last occurrence
        all_keys, all_vectors = np.concatenate(keys), np.concatenate(vectors)
        _, last = np.unique(all_keys[::-1], return_index=True)
        keep = len(all_keys) - 1 - last
        return all_keys[keep], all_vectors[keep]

    def _block(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> RowBlock | None:
        parts = [(name, k, v) for name, (k, v) in rows.items() if len(k)]
        if not parts:
            return None
        keys = np.concatenate([k for _, k, _ in parts])
        if len(np.unique(keys)) != len(keys):
            raise DeltaError(f"deltas of tables {[n for n, _, _ in parts]} share keys")
        return RowBlock.of(keys, np.concatenate([v for _, _, v in parts]))

    def lag_seconds(self) -> dict[str, float]:
        """Seconds between publishing each table's served version and now (0 for base versions)."""
        now = time.time()
        return {
            name: now - self.created[name] if name in self.created else 0.0 for name in self.store.table_names
        }


def save_hot_keys(folder: Path, keys: np.ndarray) -> None:
    """Record the hot keys (hottest first) for the next start's warm-up; atomic replace."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".npy", delete=False) as fh:
        np.save(fh, np.asarray(keys, np.int64), allow_pickle=False)
    os.replace(fh.name, folder / HOT_KEYS_FILE)


def load_hot_keys(folder: Path) -> np.ndarray:
    """The recorded hot keys, or none."""
    try:
        keys = np.load(folder / HOT_KEYS_FILE, allow_pickle=False)
    except (OSError, ValueError):
        return np.empty(0, np.int64)
    return keys.astype(np.int64).reshape(-1) if keys.dtype.kind == "i" else np.empty(0, np.int64)


class Maintainer:
    """Background upkeep of a served store: apply updates, rebuild L1, record hot keys."""

    def __init__(
        self,
        store: TieredStore,
        updater: StoreUpdater,
        state_dir: Path,
        interval_s: float,
        stream: Any | None = None,
    ) -> None:
        self.store = store
        self.updater = updater
        self.stream = stream  # an UpdateStream to mirror before each poll (Redis transport), or None
        self.state_dir = state_dir
        self.interval_s = interval_s
        self.after_step: list[Callable[[], None]] = []  # run after each round, on the upkeep thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recserve-store", daemon=True)

    def _mirror(self) -> None:
        if self.stream is not None:
            try:
                self.stream.mirror()
            except Exception as exc:  # the directory transport keeps working
                LOGGER.warning("update stream unavailable: %s", type(exc).__name__)

    def warm_up(self) -> int:
        """Apply the current heads and preload L1 from the recorded hot keys; rows cached."""
        self._mirror()
        self.updater.poll()
        return self.store.refresh_cache(seed=load_hot_keys(self.state_dir))

    def start(self) -> Maintainer:
        """Start the background thread."""
        self._thread.start()
        return self

    def step(self) -> None:
        """One round of upkeep (what the thread does every ``interval_s``)."""
        self._mirror()
        self.updater.poll()
        if self.store.refresh_due():
            self.store.refresh_cache()
            save_hot_keys(self.state_dir, self.store.hot_keys())
        for hook in self.after_step:
            hook()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # upkeep must never stop serving
                LOGGER.exception("store upkeep failed; serving the current snapshot")

    def stop(self) -> None:
        """Stop the thread (waits for the current round)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


__all__ = ["DeltaError", "Maintainer", "StoreUpdater", "UpdateLog", "check_delta", "read_delta_file"]
