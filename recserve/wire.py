"""What travels on the wire: tensor names between the ensemble steps, and raw rows as clients hold them.

The wire inputs of ``ctr`` are named after the spec's features (see :mod:`recserve.spec`); the
tensors below are the contract between ``embedding_lookup`` and ``dense`` (and, in process, between
the feature transform and the lookup inside ``embedding_lookup``). The ONNX export, the generated
configs, the backends and the clients all read them from here. This module is the bottom layer with
the spec: it imports nothing else of recserve but the spec, its sections and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recserve.errors import InvalidInput
from recserve.sections import DENSE, EMBEDDING_LOOKUP
from recserve.spec import ModelSpec

#: The steps of the ensemble (:data:`recserve.sections.STEPS`): ``embedding_lookup`` takes the raw
#: features (feature transform and lookup in one Python hop) and hands ``dense`` exactly the inputs
#: of the dense contract (:func:`dense_contract`).
STEPS = (EMBEDDING_LOOKUP, DENSE)

DENSE_NORMALIZED = "dense_normalized"
SPARSE_KEYS = "sparse_keys"
TARGET_KEY = "target_key"
HISTORY_KEYS = "history_keys"
HISTORY_MASK = "history_mask"

SPARSE_EMBEDDINGS = "sparse_embeddings"
TARGET_EMBEDDING = "target_embedding"
HISTORY_EMBEDDINGS = "history_embeddings"

PROBABILITY = "probability"
#: The output of a dense ONNX that returns logits (``[model] output = "logit"``); served as its sigmoid.
LOGIT = "logit"
#: Per row, the version of the ``dense`` model that scored it (hot swaps are visible to clients).
DENSE_VERSION = "dense_version"
#: Per row, the version of every embedding table in the store snapshot that served it, in the order of
#: :attr:`recserve.spec.ModelSpec.table_names` (one snapshot per batch: all rows of a request agree).
EMBEDDING_VERSION = "embedding_version"
#: Request header (gRPC metadata key) naming the user: the access layer hashes it so that a user stays
#: on one model variant across calls.
USER_HEADER = "x-recserve-user"

#: Inputs of the dense network, in the order of its ``forward`` and of the ONNX graph.
DENSE_NET_INPUTS = (DENSE_NORMALIZED, SPARSE_EMBEDDINGS, TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)

#: Dynamic axes of the dense ONNX graph: rows of a batch and positions of a sequence.
BATCH_AXIS = "batch"
SEQUENCE_AXIS = "sequence"


@dataclass(frozen=True)
class ContractTensor:
    """One input or output of the dense network: name, Triton dtype, shape (-1: dynamic), contents."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    holds: str

    def to_json(self) -> dict[str, object]:
        """``{"name", "dtype", "shape", "holds"}``."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "holds": self.holds}


def dense_contract(spec: ModelSpec) -> tuple[tuple[ContractTensor, ...], tuple[ContractTensor, ...]]:
    """What the dense network receives and returns under ``spec``: ``(inputs, outputs)``.

    Inputs in the order of :data:`DENSE_NET_INPUTS`; every one FP32 with the batch first. The output
    is named after ``[model] output``: ``probability``, or ``logit`` (which recserve serves as its
    sigmoid). The built-in network and every imported ONNX follow this contract.
    """
    dim, columns, clip = spec.embedding_dim, spec.dense.columns, spec.dense
    features = spec.categorical.columns
    seq = spec.sequence
    inputs = (
        ContractTensor(
            DENSE_NORMALIZED,
            "FP32",
            (-1, len(columns)),
            f"{columns[0]}..{columns[-1]} as log1p(clip(x, {clip.clip_min:g}, {clip.clip_max:g})), missing 0",
        ),
        ContractTensor(
            SPARSE_EMBEDDINGS,
            "FP32",
            (-1, len(features), dim),
            f"{features[0]}..{features[-1]}: one embedding per feature, in this order",
        ),
        ContractTensor(
            TARGET_EMBEDDING, "FP32", (-1, dim), f"{spec.target.name}: its row of table {spec.target.table!r}"
        ),
        ContractTensor(
            HISTORY_EMBEDDINGS,
            "FP32",
            (-1, -1, dim),
            f"{seq.name}: rows of table {seq.table!r}, oldest first, padded to a sequence bucket",
        ),
        ContractTensor(
            HISTORY_MASK,
            "FP32",
            (-1, -1),
            f"{seq.name}: 1 on real positions, 0 on padding (whose embeddings the network must ignore)",
        ),
    )
    output = ContractTensor(
        spec.dense_output,
        "FP32",
        (-1, 1),
        "click probability" if spec.dense_output == PROBABILITY else "click logit (served as its sigmoid)",
    )
    return inputs, (output,)


#: Config parameter of ``embedding_lookup``: the torch device of its L1 and of the vectors it returns
#: (``cuda``: the instance's GPU, set by the ``cuda`` profile; ``cpu``: the same code on the host).
L1_DEVICE_PARAMETER = "l1_device"

_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i

#: Raw ``target_item`` value meaning "no target item".
ABSENT_ITEM = -1


def parse_hex(values: np.ndarray, max_digits: int, input_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse an array of hex byte strings into ``uint64`` values, vectorised.

    Args:
        values: object array of ``bytes`` (or ``str``), any shape.
        max_digits: longest accepted string (at most 16 digits fit 64 bits).
        input_name: named in errors.

    Returns:
        ``(values, missing)``: parsed values and a mask of empty strings, both of ``values.shape``.

    Raises:
        InvalidInput: a string is too long or holds a non-hex character.
    """
    width = max_digits + 1  # one extra byte to detect strings that are too long
    try:
        fixed = np.asarray(values, dtype=f"S{width}")
    except (UnicodeEncodeError, ValueError, TypeError):
        bad = next(v for v in values.ravel() if not _is_ascii(v))
        raise InvalidInput(input_name, f"value {bad!r} is not an ASCII hex string") from None
    flat = fixed.reshape(-1)
    lengths = np.char.str_len(flat)
    digits = _HEX_LUT[flat.view(np.uint8).reshape(-1, width)]
    positions = np.arange(width)[None, :] < lengths[:, None]
    bad_rows = (lengths > max_digits) | ((digits == 255) & positions).any(axis=1)
    if bad_rows.any():
        index = int(np.flatnonzero(bad_rows)[0])
        raw = values.reshape(-1)[index]
        raise InvalidInput(
            input_name,
            f"value {raw!r} at flat index {index} is not a hex string of at most {max_digits} digits",
        )
    acc = np.zeros(flat.shape[0], dtype=np.uint64)
    for pos in range(max_digits):
        take = positions[:, pos]
        acc = np.where(take, (acc << np.uint64(4)) | digits[:, pos].astype(np.uint64), acc)
    return acc.reshape(values.shape), (lengths == 0).reshape(values.shape)


def _is_ascii(value: object) -> bool:
    if isinstance(value, bytes):
        return value.isascii()
    return isinstance(value, str) and value.isascii()


@dataclass
class RawRows:
    """Raw feature values of ``N`` rows, as a client would have them."""

    dense: np.ndarray  # float32 [N, 13]
    dense_missing: np.ndarray  # bool [N, 13]
    categorical: np.ndarray  # uint64 [N, 26], the value each hex string encodes
    categorical_empty: np.ndarray  # bool [N, 26]
    target: np.ndarray  # int64 [N], -1 when absent
    history: np.ndarray  # int64 [N, max_length], newest last, valid below ``lengths``
    lengths: np.ndarray  # int32 [N]
    labels: np.ndarray  # float32 [N]

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def take(self, index: slice | np.ndarray) -> RawRows:
        """Rows selected by a slice or an index array."""
        return RawRows(**{name: getattr(self, name)[index] for name in self.__dataclass_fields__})

    def to_wire(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """Request tensors of the ``ctr`` ensemble for these rows (history width = longest row)."""
        width = max(int(self.lengths.max(initial=0)), 1)
        hex_digits = np.char.mod("%08x", self.categorical).astype(object)
        hex_digits[self.categorical_empty] = ""
        return {
            spec.dense.name: self.dense.astype(np.float32),
            spec.dense_missing_input: self.dense_missing.astype(bool),
            spec.categorical.name: np.vectorize(str.encode, otypes=[object])(hex_digits),
            spec.target.name: self.target.astype(np.int64)[:, None],
            spec.sequence.name: np.ascontiguousarray(self.history[:, :width], dtype=np.int64),
            spec.sequence_length_input: self.lengths.astype(np.int32)[:, None],
        }
