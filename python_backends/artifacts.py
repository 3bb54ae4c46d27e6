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


#: safetensors dtype names of the arrays recserve reads.
SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U64": "uint64",
}


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file as read-only memory maps (nothing is read up front).

    Raises:
        ArtifactError: the file is no well-formed safetensors file, or holds a dtype recserve does not read.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            header_bytes = int.from_bytes(fh.read(8), "little")
            if not 2 <= header_bytes <= size - 8:
                raise ValueError(f"header of {header_bytes} bytes in a file of {size}")
            header = json.loads(fh.read(header_bytes))
        arrays = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']}")
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            if end - begin != int(np.prod(shape)) * dtype.itemsize or 8 + header_bytes + end > size:
                raise ValueError(f"tensor {name!r}: its byte range does not fit its shape {list(shape)}")
            arrays[name] = (
                np.memmap(path, dtype, "r", 8 + header_bytes + begin, shape)
                if end > begin
                else np.empty(shape, dtype)
            )
        return arrays
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path.name} is not a readable safetensors file ({exc})") from None


def first_non_finite(array: np.ndarray, block_rows: int = 1 << 16) -> int | None:
    """Index of the first row of ``array`` with NaN or Inf (None: all finite), a block at a time."""
    for start in range(0, len(array), block_rows):
        bad = ~np.isfinite(np.asarray(array[start : start + block_rows])).reshape(
            min(block_rows, len(array) - start), -1
        ).all(axis=1)
        if bad.any():
            return start + int(np.flatnonzero(bad)[0])
    return None


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
