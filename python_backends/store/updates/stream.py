"""Online updates over Redis Streams: every machine mirrors published versions into its own update log.

``recserve update``/``rollback`` publish a version in the local update log and, when the spec names
a Redis Cluster, also append it to the stream ``rs:updates`` (manifest and array files as bytes).
Each serving instance reads the stream from the start in its upkeep thread and writes versions it
does not have into its local log, where
:class:`~recserve.backends.store.updates.versions.StoreUpdater` applies them as usual. Checksums
travel in the manifest and are verified when a version is applied.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from recserve.backends.store.updates.versions import UpdateLog

LOGGER = logging.getLogger(__name__)

STREAM = "rs:updates"


class UpdateStream:
    """Publish versions of an :class:`UpdateLog` to a Redis stream, or mirror the stream into one."""

    def __init__(self, client: Any, log: UpdateLog, stream: str = STREAM) -> None:
        self.client = client
        self.log = log
        self.stream = stream
        self.last_id = "0"
        self.mirrored = 0

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
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                written += self._import(fields)
            if len(entries) < count:
                self.mirrored += written
                return written

    def _import(self, fields: dict) -> int:
        text = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        table = text["table"].decode() if isinstance(text["table"], bytes) else text["table"]
        manifest = json.loads(text["manifest"])
        files = {name[len("file:") :]: value for name, value in text.items() if name.startswith("file:")}
        return int(self.log.import_version(table, manifest, files))
