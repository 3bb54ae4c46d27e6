"""Reading files recserve did not write, with work bounded by what is on disk.

Sizes and shapes are checked before anything is inflated or allocated: ``.npy`` headers are read
with :mod:`numpy.lib.format` before a byte of data; an ``.npz`` member's size comes from the zip
directory and must match its ``.npy`` header, and the whole archive may inflate at most
:data:`MAX_INFLATION` times its size on disk (a larger table belongs in ``.safetensors``, which is
memory-mapped); JSON is size-capped before parsing and its depth cannot crash the reader; an ONNX
file is refused over protobuf's 2 GiB limit, and its external data must lie inside its folder.
Every refusal is an :class:`~recserve.errors.ArtifactError` naming the file; values echoed back are
shortened (:func:`recserve.errors.shorten`).
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from recserve.errors import ArtifactError, shorten

#: Characters of a library's explanation (which may quote the file) kept in a message.
EXPLANATION_LIMIT = 160
#: An ``.npz`` may inflate to at most this many times its size on disk ...
MAX_INFLATION = 20
#: ... or to this many bytes, whichever is larger.
INFLATION_FLOOR = 64 << 20
#: The largest message protobuf parses or writes: an ONNX model and the data it loads must fit.
PROTOBUF_LIMIT = (1 << 31) - 1

Header = tuple[tuple[int, ...], np.dtype]  # a .npy member's shape and dtype


def size_text(count: int) -> str:
    """A byte count for people: ``1.0 GiB``, ``3.5 MiB``, ``12 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count} bytes"


def npy_header(stream: IO[bytes], name: str) -> Header:
    """Shape and dtype from the ``.npy`` header at the start of ``stream`` (no data is read).

    Raises:
        ArtifactError: ``name`` is no ``.npy`` array of numbers (not a numpy file, a bad header,
            Python objects, a negative dim).
    """
    try:
        version = np.lib.format.read_magic(stream)
    except ValueError:
        raise ArtifactError(f"{name} is not a numpy file (no .npy header)") from None
    try:
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f".npy format version {version[0]}.{version[1]}, not 1.0 or 2.0")
    except Exception as exc:  # numpy's parser raises ValueError, SyntaxError, TypeError, TokenError...
        raise ArtifactError(
            f"{name} has no readable .npy header "
            f"({shorten(str(exc) or type(exc).__name__, EXPLANATION_LIMIT)})"
        ) from None
    if dtype.hasobject:
        raise ArtifactError(f"{name} holds Python objects; recserve reads arrays of numbers only")
    if any(d < 0 for d in shape):
        raise ArtifactError(f"{name} declares the shape {shorten(list(shape))}")
    return tuple(shape), dtype


def array_bytes(header: Header) -> int:
    """Bytes of the data of an array of this shape and dtype (exact, no overflow)."""
    shape, dtype = header
    return math.prod(shape) * dtype.itemsize


def sized_npy_header(stream: IO[bytes], name: str, size: int) -> Header:
    """The ``.npy`` header at the start of ``stream``, checked against the ``size`` bytes it comes in.

    What a header claims is never trusted: the data it declares must be exactly the bytes after it,
    so reading the array allocates at most ``size`` bytes (a header claiming 2**40 rows in a small
    file is refused here, before numpy allocates anything).

    Raises:
        ArtifactError: what :func:`npy_header` refuses, or a size that differs from the header's.
    """
    header = npy_header(stream, name)
    needed = stream.tell() + array_bytes(header)
    if size != needed:
        raise ArtifactError(
            f"{name} has {size:,} bytes; its header {header[1]}{shorten(list(header[0]))} needs "
            f"{needed:,} (truncated or padded, or the header lies)"
        )
    return header


def map_npy(path: Path) -> np.ndarray:
    """A ``.npy`` file memory-mapped read-only, after its header and size are checked.

    Raises:
        ArtifactError: not a numpy file, Python objects, or a size that differs from its header's.
    """
    if not path.is_file():
        raise ArtifactError(f"{path.name} is not a regular file")
    with open(path, "rb") as fh:
        sized_npy_header(fh, path.name, os.fstat(fh.fileno()).st_size)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{path.name} is not a readable .npy file ({shorten(str(exc), EXPLANATION_LIMIT)})"
        ) from None


def load_npz(path: Path, check: Callable[[dict[str, Header]], None] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file, inflated only after every member's size and shape is checked.

    Args:
        path: the archive.
        check: called with each member's shape and dtype (by array name) before anything is
            inflated; it raises to refuse the archive (e.g. shapes that do not fit the spec).

    Raises:
        ArtifactError: not a zip of ``.npy`` arrays, a member whose size in the zip directory
            differs from its header's, an archive that inflates over :data:`MAX_INFLATION` times its
            size, a corrupt stream, or whatever ``check`` raises.
    """
    name, size = path.name, path.stat().st_size
    if not zipfile.is_zipfile(path):
        raise ArtifactError(f"{name} is not a numpy file (an .npz is a zip archive of .npy arrays)")
    try:
        with zipfile.ZipFile(path) as archive:
            members = _npz_headers(name, archive)
            inflated = sum(info.file_size for info, _ in members.values())
            if inflated > max(INFLATION_FLOOR, MAX_INFLATION * size):
                raise ArtifactError(
                    f"{name} inflates to {size_text(inflated)} from {size_text(size)} on disk "
                    f"({inflated / max(size, 1):,.0f} times; at most {MAX_INFLATION} times, or "
                    f"{size_text(INFLATION_FLOOR)}): refused before inflating; store a large table as "
                    ".safetensors, which is memory-mapped"
                )
            if check is not None:
                check({key: header for key, (_, header) in members.items()})
            arrays = {}
            for key, (info, _) in members.items():
                with archive.open(info) as stream:
                    arrays[key] = np.lib.format.read_array(stream, allow_pickle=False)
            return arrays
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as exc:
        reason = shorten(str(exc) or type(exc).__name__, EXPLANATION_LIMIT)
        raise ArtifactError(f"{name} is not a readable .npz file ({reason})") from None


def _npz_headers(name: str, archive: zipfile.ZipFile) -> dict[str, tuple[zipfile.ZipInfo, Header]]:
    """Each member's zip entry and ``.npy`` header, read without inflating its data."""
    members: dict[str, tuple[zipfile.ZipInfo, Header]] = {}
    for info in archive.infolist():
        where = f"{name}: member {shorten(info.filename)}"
        if info.is_dir() or not info.filename.endswith(".npy"):
            raise ArtifactError(f"{where} is not an .npy array")
        key = info.filename[: -len(".npy")]
        if key in members:
            raise ArtifactError(f"{where} appears twice")
        with archive.open(info) as stream:
            header = npy_header(stream, where)
            needed = stream.tell() + array_bytes(header)
        if info.file_size != needed:
            raise ArtifactError(
                f"{where}: the zip directory says it inflates to {info.file_size:,} bytes, its header "
                f"{header[1]}{shorten(list(header[0]))} needs {needed:,}"
            )
        members[key] = (info, header)
    if not members:
        raise ArtifactError(f"{name} holds no arrays")
    return members


def read_json(
    path: Path, max_bytes: int, what: str = "", refused: type[ArtifactError] = ArtifactError
) -> Any:
    """Parse a JSON file of at most ``max_bytes`` (checked before reading); depth cannot crash it.

    Raises:
        ArtifactError: (or ``refused``) the file is missing or not a regular file, is larger, is not UTF-8
            JSON, or is nested too deeply to parse.
        OSError: the file could not be read.
    """
    label = f"{what}{path.name}"
    if not path.is_file():
        raise refused(f"{label} is not a regular file")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise refused(f"{label} has {size_text(size)}; at most {size_text(max_bytes)} are read")
        data = fh.read(max_bytes + 1)
    return parse_json(data, max_bytes, label, refused)


def parse_json(
    data: bytes | str, max_bytes: int, label: str, refused: type[ArtifactError] = ArtifactError
) -> Any:
    """``data`` (a file's or a message's bytes) as JSON, refused when over ``max_bytes`` or not JSON.

    Raises:
        ArtifactError: (or ``refused``) ``data`` is larger, not UTF-8 JSON, or nested too deeply to parse.
    """
    if len(data) > max_bytes:
        raise refused(f"{label} has over {size_text(max_bytes)}; at most {size_text(max_bytes)} are read")
    try:
        return json.loads(data)
    except RecursionError:
        raise refused(f"{label} is nested too deeply to be read") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer too long for Python's int()
        raise refused(f"{label} is not valid JSON ({shorten(str(exc), EXPLANATION_LIMIT)})") from None


def check_onnx_file(path: Path) -> None:
    """Refuse an ONNX file protobuf cannot hold, or whose external data lies outside its folder.

    The file (at most 2 GiB) is parsed without its external data; each external tensor's file must
    be a relative path inside the model's folder (no ``..``, no absolute path, no symlink out) with
    the bytes it names, and the model plus its external data must fit one protobuf (2 GiB), as the
    served model is written in one piece.

    Raises:
        ArtifactError: naming the file, and the tensor for external data.
    """
    import onnx

    label = f"dense model {path.name}"
    size = path.stat().st_size
    if size > PROTOBUF_LIMIT:
        raise ArtifactError(
            f"{label} has {size_text(size)}, over the 2 GiB a protobuf (an ONNX file) can hold; "
            "refused before reading it"
        )
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a file that is no model
        raise ArtifactError(
            f"{label} is not an ONNX model ({shorten(str(exc), EXPLANATION_LIMIT)})"
        ) from None
    folder, total = path.parent.resolve(), size
    for tensor in _tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        total += _external_bytes(label, folder, tensor)
    if total > PROTOBUF_LIMIT:
        raise ArtifactError(
            f"{label} with its external data has {size_text(total)}, over the 2 GiB of one protobuf "
            "(the served model is written in one piece)"
        )


def _external_bytes(label: str, folder: Path, tensor: Any) -> int:
    """Bytes an external tensor loads, after its file is checked to lie inside ``folder``."""
    where = f"{label}: tensor {shorten(tensor.name)}"
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    parts = Path(location).parts
    if not location or os.path.isabs(location) or ".." in parts or "\\" in location:
        raise ArtifactError(
            f"{where} keeps its data at {shorten(location)}, outside the model's folder "
            "(external data must be a relative path without '..')"
        )
    target = (folder / location).resolve()
    if folder not in target.parents:
        raise ArtifactError(
            f"{where} keeps its data at {shorten(location)}, which leads outside the model's folder"
        )
    if not target.is_file():
        raise ArtifactError(f"{where} keeps its data in {shorten(location)}, which is missing")
    available = target.stat().st_size
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else available - offset
    except ValueError:
        raise ArtifactError(f"{where} has an external offset or length that is no integer") from None
    if offset < 0 or length < 0 or offset + length > available:
        raise ArtifactError(
            f"{where} reads bytes {offset:,}..{offset + length:,} of {shorten(location)}, "
            f"which has {available:,}"
        )
    return length


def _tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of a graph: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _tensors(subgraph)
