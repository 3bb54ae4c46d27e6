"""Model artifacts on disk: ``.npy`` arrays and ONNX files described by a JSON manifest.

Every file is listed with its SHA-256, and arrays with their shape and dtype; a loader checks all of
them before it trusts a byte. Arrays load with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from recserve.errors import ArtifactError

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(root: Path, path: Path) -> dict[str, Any]:
    """Manifest entry for a file below ``root``."""
    return {
        "path": path.relative_to(root).as_posix(),
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
    }


def save_array(root: Path, relative: str, array: np.ndarray) -> dict[str, Any]:
    """Write ``array`` as ``.npy`` under ``root`` and return its manifest entry."""
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.ascontiguousarray(array), allow_pickle=False)
    return {**file_entry(root, path), "shape": list(array.shape), "dtype": str(array.dtype)}


def verified_path(root: Path, entry: dict[str, Any]) -> Path:
    """Resolve a manifest entry to a path inside ``root`` whose checksum matches.

    Raises:
        ArtifactError: the file is missing, outside ``root`` or its SHA-256 differs.
    """
    path = (root / entry["path"]).resolve()
    if root.resolve() not in path.parents:
        raise ArtifactError(f"artifact {entry['path']!r} points outside its model directory")
    if not path.is_file():
        raise ArtifactError(f"artifact {entry['path']!r} is missing")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise ArtifactError(
            f"artifact {entry['path']!r} fails its checksum "
            f"(manifest {entry['sha256'][:12]}…, file {actual[:12]}…)"
        )
    return path


def load_array(root: Path, entry: dict[str, Any], mmap: bool = False) -> np.ndarray:
    """Load a checked ``.npy`` entry; its shape and dtype must match the manifest."""
    path = verified_path(root, entry)
    array = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    if list(array.shape) != list(entry["shape"]) or str(array.dtype) != entry["dtype"]:
        raise ArtifactError(
            f"artifact {entry['path']!r} holds {array.dtype}{list(array.shape)}, "
            f"manifest says {entry['dtype']}{entry['shape']}"
        )
    return array


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` (sorted keys, so builds are byte-reproducible)."""
    path = root / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    """Read ``manifest.json`` from a model version directory."""
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{MANIFEST} is missing in the model version directory; run 'recserve build'")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{MANIFEST} is not valid JSON: {exc}") from None
