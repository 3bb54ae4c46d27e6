"""Names of the tensors passed between the ensemble steps.

The wire inputs of ``ctr`` are named after the spec's features (see :mod:`recserve.spec`); the
intermediate tensors below are the contract between ``feature_transform``, ``embedding_lookup`` and
``dense``. The ONNX export, the generated configs and the backends all read them from here.
"""

from __future__ import annotations

DENSE_NORMALIZED = "dense_normalized"
SPARSE_KEYS = "sparse_keys"
TARGET_KEY = "target_key"
HISTORY_KEYS = "history_keys"
HISTORY_MASK = "history_mask"

SPARSE_EMBEDDINGS = "sparse_embeddings"
TARGET_EMBEDDING = "target_embedding"
HISTORY_EMBEDDINGS = "history_embeddings"

PROBABILITY = "probability"
#: Per row, the version of the ``dense`` model that scored it (hot swaps are visible to clients).
DENSE_VERSION = "dense_version"
#: Per row, the version of every embedding table in the store snapshot that served it, in the order of
#: :attr:`recserve.spec.ModelSpec.table_names` (one snapshot per batch: all rows of a request agree).
EMBEDDING_VERSION = "embedding_version"

#: Inputs of the dense network, in the order of its ``forward`` and of the ONNX graph.
DENSE_NET_INPUTS = (DENSE_NORMALIZED, SPARSE_EMBEDDINGS, TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)

#: Config parameter of ``embedding_lookup``: the torch device of its L1 and of the vectors it returns
#: (``cuda``: the instance's GPU, set by the ``cuda`` profile; ``cpu``: the same code on the host).
L1_DEVICE_PARAMETER = "l1_device"
