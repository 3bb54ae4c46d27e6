"""Model artifacts on disk: ``.npy`` arrays and ONNX files described by a JSON manifest.

Every file is listed with its SHA-256, and arrays with their shape and dtype; a loader checks all of
them before it trusts a byte. Arrays load with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from recserve.backends.base.bounded_files import sized_npy_header
from recserve.errors import ArtifactError, shorten

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
    """Load a checked ``.npy`` entry; its shape and dtype must match the manifest.

    The header is read and checked (against the manifest and the file's size) before numpy
    allocates anything, so a header that lies about its size is refused, never a ``MemoryError``.

    Raises:
        ArtifactError: the file is missing, outside ``root``, fails its checksum, or is no ``.npy``
            array of the manifest's shape and dtype in exactly its size.
    """
    path = verified_path(root, entry)
    name = f"artifact {shorten(entry['path'])}"
    with open(path, "rb") as fh:
        shape, dtype = sized_npy_header(fh, name, os.fstat(fh.fileno()).st_size)
    if list(shape) != list(entry["shape"]) or str(dtype) != entry["dtype"]:
        raise ArtifactError(
            f"{name} holds {dtype}{shorten(list(shape))}, manifest says {entry['dtype']}{entry['shape']}"
        )
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{name} is not a readable .npy file ({shorten(str(exc), 160)})") from None


#: safetensors dtype names of the arrays recserve reads.
SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U64": "uint64",
}


#: safetensors' own bound on its JSON header (its reference reader refuses a larger one).
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file as read-only memory maps (nothing is read up front).

    The header's length is bounded before it is read; it must be a JSON object of flat entries,
    each a known dtype, a shape of non-negative ints and two integral ``data_offsets`` in bounds,
    consistent with the shape and not overlapping another tensor's bytes.

    Raises:
        ArtifactError: the file is no well-formed safetensors file, or holds a dtype recserve does not read.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{size} bytes, fewer than the 8 of the header's length")
            header_bytes = int.from_bytes(prefix, "little")
            if not 2 <= header_bytes <= min(size - 8, SAFETENSORS_MAX_HEADER):
                raise ValueError(f"a header of {header_bytes:,} bytes in a file of {size:,}")
            header = json.loads(fh.read(header_bytes), object_pairs_hook=_unique_keys)
        if not isinstance(header, dict):
            raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
        data_bytes = size - 8 - header_bytes
        places = {}
        for name, info in header.items():
            if name == "__metadata__":
                _check_metadata(info)
            else:
                places[name] = _safetensors_place(name, info, data_bytes)
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in places.items() if end > begin)
        for (_, end, before), (begin, _, after) in zip(spans, spans[1:], strict=False):
            if begin < end:
                raise ValueError(f"tensors {shorten(before)} and {shorten(after)} share bytes")
        return {
            name: np.memmap(path, dtype, "r", 8 + header_bytes + begin, shape)
            if end > begin
            else np.empty(shape, dtype)
            for name, (dtype, shape, begin, end) in places.items()
        }
    except RecursionError:
        raise ArtifactError(
            f"{path.name} is not a readable safetensors file (its header is nested too deeply)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path.name} is not a readable safetensors file ({exc})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"its header names {shorten(next(k for k in keys if keys.count(k) > 1))} twice")
    return dict(pairs)


def _check_metadata(info: object) -> None:
    """Raise ValueError unless ``__metadata__`` is a flat object of strings."""
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise ValueError("__metadata__ is not an object of strings")


def _safetensors_place(
    name: str, info: object, data_bytes: int
) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """Dtype, shape and byte range of one header entry, each checked (raises ValueError)."""
    tensor = f"tensor {shorten(name)}"
    if not isinstance(info, dict) or set(info) != SAFETENSORS_ENTRY_KEYS:
        raise ValueError(f"{tensor} is not an object of {sorted(SAFETENSORS_ENTRY_KEYS)}")
    if not isinstance(info["dtype"], str) or info["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{tensor} has dtype {shorten(info['dtype'])}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise ValueError(f"{tensor} has shape {shorten(shape)}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(x) for x in offsets):
        raise ValueError(f"{tensor} has data_offsets {shorten(offsets)}, not two non-negative integers")
    dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
    begin, end = offsets
    if not begin <= end <= data_bytes or end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(
            f"{tensor}: bytes {begin}..{end} of {data_bytes} do not hold its shape {shorten(shape)}"
        )
    return dtype, tuple(shape), begin, end


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The largest magnitude of an embedding value recserve serves, from any source (import, update,
#: Redis). Trained embeddings are orders of magnitude smaller; a finite value near float32's limit
#: (3.4e38) overflows the first product or sum it enters and turns the request's scores into Inf
#: or NaN, while 1e6 squared times any table width stays far inside float32's range.
MAX_EMBEDDING_VALUE = 1e6


def first_unservable(array: np.ndarray, block_rows: int = 1 << 16) -> int | None:
    """Index of the first row of ``array`` holding NaN, Inf or a value over :data:`MAX_EMBEDDING_VALUE`.

    None when every value is servable; read a block of rows at a time (``array`` may be a memory map).
    """
    for start in range(0, len(array), block_rows):
        block = np.asarray(array[start : start + block_rows]).reshape(min(block_rows, len(array) - start), -1)
        bad = ~(np.abs(block) <= MAX_EMBEDDING_VALUE).all(axis=1)  # NaN compares False: refused too
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


def model_versions(model_dir: Path) -> list[int]:
    """The version folders of a model's folder in a Triton repository (numbered ones only), ascending."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
