"""Online updates over Redis Streams: every machine mirrors published versions into its own update log.

``recserve update``/``rollback`` publish a version in the local update log and, when the spec names
a Redis Cluster, also append it to the stream ``rs:updates`` (manifest and array files as bytes).
Each serving instance reads the stream from the start in its upkeep thread and writes versions it
does not have into its local log, where
:class:`~recserve.backends.store.updates.apply.StoreUpdater` applies them as usual. Checksums
travel in the manifest and are verified when a version is imported and again when it is applied.

Anyone who can write to Redis can append to the stream, so an entry is checked field by field
(:meth:`UpdateLog.import_version`) before anything is created: an entry that fails is skipped,
counted in :attr:`UpdateStream.refused` and logged, and mirroring goes on with the next one.
"""

from __future__ import annotations

import logging
from typing import Any

from recserve.backends.base.bounded_files import parse_json
from recserve.backends.store.updates.schema import (
    MAX_MANIFEST_BYTES,
    UpdateRefused,
    check_version,
    shorten,
)
from recserve.backends.store.updates.versions import UpdateLog

LOGGER = logging.getLogger(__name__)

STREAM = "rs:updates"
#: The longest version number an entry may carry (Python refuses to convert over 4,300 digits).
MAX_VERSION_DIGITS = 18


class UpdateStream:
    """Publish versions of an :class:`UpdateLog` to a Redis stream, or mirror the stream into one."""

    def __init__(self, client: Any, log: UpdateLog, stream: str = STREAM) -> None:
        self.client = client
        self.log = log
        self.stream = stream
        self.last_id = "0"
        self.mirrored = 0
        self.refused = 0  # entries skipped because they did not fit the schema

    def publish(self, table: str, version: int) -> str:
        """Append one published version (as found in the local log) to the stream; its entry id."""
        record = self.log.record(table, version)
        fields: dict[str, Any] = {
            "table": table,
            "version": str(version),
            "manifest": (record.folder / "manifest.json").read_bytes(),
        }
        for name, entry in record.files.items():
            fields[f"file:{name}"] = (record.folder / entry["path"]).read_bytes()
        entry_id = self.client.xadd(self.stream, fields)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def mirror(self, count: int = 100) -> int:
        """Copy new stream entries into the local log; versions written."""
        written = 0
        while True:
            answer = self.client.xread({self.stream: self.last_id}, count=count)
            entries = answer[0][1] if answer else []
            for entry_id, fields in entries:
                previous = self.last_id
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                try:
                    written += self._import(fields)
                except UpdateRefused as exc:
                    self.refused += 1
                    LOGGER.error("update stream entry %s refused: %s", self.last_id, exc)
                except Exception:  # not the entry's fault (disk, lock): read it again next round
                    self.last_id = previous
                    raise
            if len(entries) < count:
                self.mirrored += written
                return written

    def _import(self, fields: dict) -> int:
        text = {
            (k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)): v for k, v in fields.items()
        }
        table = text.get("table")
        if isinstance(table, bytes):
            try:
                table = table.decode()
            except UnicodeDecodeError:
                raise UpdateRefused(f"entry for table {shorten(table)}: not UTF-8") from None
        what = f"entry for table {shorten(table)}"
        if not isinstance(table, str):
            raise UpdateRefused(f"{what}: no table name")
        manifest = text.get("manifest")
        if not isinstance(manifest, bytes | str):
            raise UpdateRefused(f"{what}: no manifest")
        doc = parse_json(manifest, MAX_MANIFEST_BYTES, f"{what}: the manifest", UpdateRefused)
        version = text.get("version", b"")
        raw = version.decode("ascii", "replace") if isinstance(version, bytes) else version
        digits = isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= MAX_VERSION_DIGITS
        number = check_version(int(raw) if digits else raw, what, self.log.base_version)
        if not isinstance(doc, dict) or doc.get("version") != number:
            raise UpdateRefused(f"{what}: the entry's version {shorten(version)} is not its manifest's")
        files = {name[len("file:") :]: value for name, value in text.items() if name.startswith("file:")}
        return int(self.log.import_version(table, doc, files))
