"""The update log's schema: what a head, a manifest or a stream entry must be before anything trusts it.

Everything read from the update log or the ``rs:updates`` stream was written by someone else: a
table name becomes a folder, a file name a path, a version a number compared with others. Each
reader here turns untrusted JSON into typed values or raises :class:`UpdateRefused` (an
:class:`~recserve.errors.ArtifactError`) naming the table, version and the offending value,
shortened. Nothing is created, written or loaded before these checks pass.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from recserve.backends.base.bounded_files import sized_npy_header
from recserve.errors import ArtifactError, shorten

DELTA_FORMAT = "recserve-delta/1"
KINDS = ("delta", "revert")
DELTA_FILES = ("keys", "vectors")
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest lists two files: anything larger is not one
MAX_HEAD_BYTES = 1024

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class UpdateRefused(ArtifactError):
    """A head, manifest or stream entry that does not fit the update log's schema; nothing of it is used."""


def is_int(value: object) -> TypeGuard[int]:
    """True for a JSON integer (not a bool, not a float such as ``8.7`` or ``8.0``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_table(table: object, tables: Collection[str] | None = None) -> str:
    """A table name that is safe as one folder name and, when ``tables`` is given, one of them.

    Raises:
        UpdateRefused: not a string, a path (separators, ``..``, absolute) or an unknown table.
    """
    if not isinstance(table, str) or not _PLAIN_NAME.fullmatch(table) or table in (".", ".."):
        raise UpdateRefused(f"update for table {shorten(table)}: not a plain table name")
    if tables is not None and table not in tables:
        raise UpdateRefused(f"update for table {shorten(table)}: no such table in the spec")
    return table


def check_version(value: object, what: str, base: int, allow_base: bool = False) -> int:
    """An integer version above ``base`` (or equal to it when ``allow_base``).

    Raises:
        UpdateRefused: ``what`` holds a float, bool, string, or a version at or below the base.
    """
    if not is_int(value):
        raise UpdateRefused(f"{what}: version {shorten(value)} is not an integer")
    if value < base or (value == base and not allow_base):
        raise UpdateRefused(f"{what}: version {value} is not above the base version {base}")
    return value


def parse_head(doc: object, table: str, base: int) -> int:
    """The version a ``HEAD.json`` document names (``{"version": N}``, N an integer ≥ the base)."""
    what = f"{table}/HEAD.json"
    if not isinstance(doc, dict) or "version" not in doc:
        raise UpdateRefused(f'{what}: expected {{"version": N}}, found {shorten(doc)}')
    return check_version(doc["version"], what, base, allow_base=True)


@dataclass(frozen=True)
class Manifest:
    """A checked manifest of one version of one table."""

    table: str
    version: int
    parent: int
    created: float
    kind: str
    files: Mapping[str, Mapping[str, Any]]

    def as_json(self) -> dict[str, Any]:
        """The manifest as written in ``manifest.json``."""
        return {
            "format": DELTA_FORMAT,
            "table": self.table,
            "version": self.version,
            "parent": self.parent,
            "created": self.created,
            "kind": self.kind,
            "files": {name: dict(entry) for name, entry in self.files.items()},
        }


def parse_manifest(doc: object, table: str, base: int, version: int | None = None) -> Manifest:
    """Check a manifest of ``table`` (of ``version`` when given) field by field.

    Raises:
        UpdateRefused: a field is missing, mistyped or out of range (``parent`` an integer from the
            base up to below the version, ``created`` a finite number of seconds, ``files`` plain
            ``.npy`` names inside the version folder with checksums, none for a revert).
    """
    what = f"version {shorten(version if version is not None else '?')} of table {table!r}"
    if not isinstance(doc, dict):
        raise UpdateRefused(f"{what}: the manifest is {type(doc).__name__}, expected an object")
    if doc.get("format") != DELTA_FORMAT:
        raise UpdateRefused(f"{what}: format {shorten(doc.get('format'))}, expected {DELTA_FORMAT!r}")
    if doc.get("table") != table:
        raise UpdateRefused(f"{what}: the manifest names table {shorten(doc.get('table'))}")
    number = check_version(doc.get("version"), what, base)
    if version is not None and number != version:
        raise UpdateRefused(f"{what}: the manifest names version {number}")
    what = f"version {number} of table {table!r}"
    parent = doc.get("parent")
    if not is_int(parent):
        raise UpdateRefused(f"{what}: parent {shorten(parent)} is not an integer")
    if not base <= parent < number:
        raise UpdateRefused(f"{what}: parent {parent} is not a version from {base} up to {number - 1}")
    created = doc.get("created")
    if not isinstance(created, int | float) or isinstance(created, bool) or not math.isfinite(created):
        raise UpdateRefused(f"{what}: created {shorten(created)} is not a time in seconds")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise UpdateRefused(f"{what}: kind {shorten(kind)}, expected one of {list(KINDS)}")
    files = doc.get("files", {})
    if not isinstance(files, dict):
        raise UpdateRefused(f"{what}: files {shorten(files)} is not an object")
    expected = DELTA_FILES if kind == "delta" else ()
    if sorted(files) != sorted(expected):
        raise UpdateRefused(
            f"{what}: a {kind} lists files {shorten(sorted(files))}, expected {list(expected)}"
        )
    checked = {name: _file_entry(files[name], f"{what}, file {name!r}") for name in expected}
    return Manifest(table, number, parent, float(created), str(kind), checked)


def _file_entry(entry: object, what: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise UpdateRefused(f"{what}: entry {shorten(entry)} is not an object")
    path = entry.get("path")
    if (
        not isinstance(path, str)
        or not _PLAIN_NAME.fullmatch(path)
        or not path.endswith(".npy")
        or path == MANIFEST_FILE
    ):
        raise UpdateRefused(
            f"{what}: path {shorten(path)} is not a plain .npy name inside the version folder"
        )
    sha = entry.get("sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise UpdateRefused(f"{what}: sha256 {shorten(sha)} is not a SHA-256 hex digest")
    size = entry.get("bytes")
    if not is_int(size) or size < 0:
        raise UpdateRefused(f"{what}: bytes {shorten(size)} is not a size")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > 2 or not all(is_int(n) and n >= 0 for n in shape):
        raise UpdateRefused(f"{what}: shape {shorten(shape)} is not a list of up to two sizes")
    dtype = entry.get("dtype")
    if dtype not in ("int64", "float32"):
        raise UpdateRefused(f"{what}: dtype {shorten(dtype)} is not int64 or float32")
    return {"path": path, "sha256": sha, "bytes": size, "shape": shape, "dtype": dtype}


def inside(folder: Path, name: str) -> Path:
    """``folder / name``, refused unless it resolves to a direct child of ``folder``."""
    try:
        path, parent = (folder / name).resolve(), folder.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, an unreadable link
        raise UpdateRefused(f"file {shorten(name)} does not resolve ({shorten(str(exc), 120)})") from None
    if path.parent != parent:
        raise UpdateRefused(f"file {shorten(name)} resolves outside its version folder")
    return path


def check_entry_files(manifest: Manifest, files: Mapping[str, object]) -> dict[str, bytes]:
    """The file contents of a stream entry: the manifest's files, sizes, checksums and headers matching."""
    what = f"version {manifest.version} of table {manifest.table!r}"
    if sorted(files) != sorted(manifest.files):
        raise UpdateRefused(
            f"{what}: the entry carries files {shorten(sorted(files))}, "
            f"the manifest lists {sorted(manifest.files)}"
        )
    checked = {}
    for name, data in files.items():
        entry = manifest.files[name]
        if not isinstance(data, bytes) or len(data) != entry["bytes"]:
            raise UpdateRefused(f"{what}: file {name!r} is not the {entry['bytes']} bytes its manifest lists")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise UpdateRefused(f"{what}: file {name!r} fails its checksum")
        check_npy_bytes(data, entry, f"{what}: file {name!r}")
        checked[name] = data
    return checked


def check_npy_bytes(data: bytes, entry: Mapping[str, Any], what: str) -> None:
    """Refuse ``.npy`` bytes whose header is not the manifest entry's shape and dtype in exactly ``data``.

    Raises:
        UpdateRefused: no ``.npy`` header, a header claiming more (or fewer) bytes than ``data``
            holds, or another shape or dtype than the manifest lists.
    """
    try:
        with io.BytesIO(data) as stream:
            shape, dtype = sized_npy_header(stream, what, len(data))
    except ArtifactError as exc:
        raise UpdateRefused(str(exc)) from None
    if list(shape) != list(entry["shape"]) or str(dtype) != entry["dtype"]:
        raise UpdateRefused(
            f"{what} holds {dtype}{shorten(list(shape))}, the manifest lists {entry['dtype']}{entry['shape']}"
        )


__all__ = [
    "DELTA_FORMAT",
    "Manifest",
    "UpdateRefused",
    "check_entry_files",
    "check_npy_bytes",
    "check_table",
    "check_version",
    "inside",
    "parse_head",
    "parse_manifest",
    "shorten",
]
