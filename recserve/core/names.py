"""Names defined once: the ensemble's steps and the tensors between them, and their axes.

The ONNX export, the generated configs, the backends and the clients read these names from here.
"""

from __future__ import annotations

#: The steps of the ensemble, in request order: each a separately configured Triton model (and a
#: key of ``[serving.instances]``). ``embedding_lookup`` takes the raw features (feature transform and
#: lookup in one Python hop) and hands ``dense`` exactly the inputs of the dense contract
#: (:func:`recserve.core.contract.dense_contract`).
EMBEDDING_LOOKUP = "embedding_lookup"
DENSE = "dense"
#: In a ``dense`` version folder: the smaller network of ``[degrade.small_dense]`` (its own manifest).
SMALL_DENSE_DIR = "small"
STEPS = (EMBEDDING_LOOKUP, DENSE)

#: Config profiles: ``cpu`` (Python backends, ONNX Runtime buckets), ``gpu`` (``dense`` as a
#: TensorRT engine on Triton's TensorRT backend) and ``cuda`` (the Python ``dense`` on GPU instances:
#: the engine's profiles where TensorRT is installed, else CUDA graphs). The variants are written as
#: ``<model>/configs/<profile>.pbtxt``, which tritonserver picks with ``--model-config-name=<profile>``.
PROFILES = ("cpu", "gpu", "cuda")
#: Profiles whose Python ``embedding_lookup`` runs as KIND_GPU instances:
#: each instance its own process and CUDA stream; inputs may stay on the GPU (read through DLPack).
GPU_PROFILES = ("gpu", "cuda")


DENSE_NORMALIZED = "dense_normalized"
SPARSE_KEYS = "sparse_keys"
TARGET_KEY = "target_key"
HISTORY_KEYS = "history_keys"
#: every key of a batch made on the device, flat (the device lookup's one input; never on the wire)
ALL_KEYS = "all_keys"
HISTORY_MASK = "history_mask"
#: Keys and pooling weights of the multi-hot features, side by side (only for specs that have them).
MULTI_HOT_KEYS = "multi_hot_keys"
MULTI_HOT_WEIGHTS = "multi_hot_weights"

SPARSE_EMBEDDINGS = "sparse_embeddings"
TARGET_EMBEDDING = "target_embedding"
HISTORY_EMBEDDINGS = "history_embeddings"
#: Per history position, a log-weight added to its attention logit (a user state's ``ln count``;
#: optional: without it, or all zero, the attention is today's).
HISTORY_LOG_WEIGHTS = "history_log_weights"
#: With ``[user_state]`` on, optional wire inputs per row: the user whose stored state the step merges
#: the history (then the real-time tail, at most ``[user_state] tail`` events) into, and the sequence
#: number of the tail's newest event (its events are ``user_seq - length + 1 .. user_seq``).
USER_ID = "user_id"
USER_SEQ = "user_seq"

PROBABILITY = "probability"
#: The output of a dense ONNX that returns logits (``[model] output = "logit"``); served as its sigmoid.
LOGIT = "logit"
#: Per request, the version of the ``dense`` model that scored its rows (hot swaps are visible to
#: clients): one row, ``[1, 1]``, whatever the rows of the request.
DENSE_VERSION = "dense_version"
#: Per request, the version of every embedding table in the store snapshot that served it, in the order
#: of :attr:`recserve.core.spec.model.ModelSpec.table_names` (one snapshot per batch, so every row of a
#: request agrees): one row, ``[1, T]``, whatever the rows of the request.
EMBEDDING_VERSION = "embedding_version"
#: The outputs a step returns once per request, not once per row: a merged batch's one row is every
#: request's own (:func:`recserve.backends.base.batching.split`).
PER_REQUEST_OUTPUTS = (DENSE_VERSION, EMBEDDING_VERSION)
#: Prefix of ``embedding_lookup``'s candidate-list inputs: the candidates ensemble
#: (:attr:`recserve.core.spec.model.ModelSpec.candidates_model`) hands it each per-candidate wire input ``x``,
#: ``[users, candidates, ...]``, as ``candidate_x``; the user's sequences keep their names.
CANDIDATE_PREFIX = "candidate_"

#: For a candidate list at ``dense``: each row's user, the row of ``history_embeddings`` and
#: ``history_mask`` (which then hold one row per user) that the row attends over.
HISTORY_USER = "history_user"

#: Request header (gRPC metadata key) naming the user: the access layer hashes it so that a user stays
#: on one model variant across calls.
USER_HEADER = "x-recserve-user"

#: Request header (gRPC metadata key) the access layer sets to the variant it routed a request to
#: (``stable``, ``canary``); tritonserver forwards it to every step as a request parameter.
VARIANT_HEADER = "recserve-variant"
#: Request header the access layer sets to ``live``, or ``shadow`` on a mirrored copy (never an impression).
TRAFFIC_HEADER = "recserve-traffic"

#: Inputs of the dense network, in the order of its ``forward`` and of the ONNX graph.
DENSE_NET_INPUTS = (DENSE_NORMALIZED, SPARSE_EMBEDDINGS, TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)

#: The inputs of every further attention group are these names with ``__<sequence>`` appended.
GROUP_INPUTS = (TARGET_EMBEDDING, HISTORY_EMBEDDINGS, HISTORY_MASK)


#: Dynamic axes of the dense ONNX graph: rows of a batch and positions of a sequence.
BATCH_AXIS = "batch"
SEQUENCE_AXIS = "sequence"


#: Config parameter of ``embedding_lookup``: the torch device of its L1 and of the vectors it returns
#: (``cuda``: the instance's GPU, set by the ``cuda`` profile; ``cpu``: the same code on the host).
L1_DEVICE_PARAMETER = "l1_device"
#: Config parameter of ``dense``: ``cpu`` runs its device path (PyTorch, inputs taken as torch tensors
#: through DLPack) on torch's CPU device, as CI tests the ``cuda`` profile's code; unset, a KIND_GPU
#: instance runs it on its GPU and a CPU instance runs ONNX Runtime.
DENSE_DEVICE_PARAMETER = "dense_device"


#: The two forms of a request's categorical, multi-hot (and time) values, named by ``CTRClient(wire=...)``
#: and ``recserve predict --wire``: ``ids``, each value as its 64-bit id in INT64 tensors (hex and
#: integers as their value, strings as their FNV-1a 64, times as unix seconds), or ``bytes``, each
#: value as text in BYTES tensors (for curl and generic clients). The targets and sequences travel as
#: INT64 ids in both. A request carries one form; the ``ids`` form is the SDK's default.
IDS_WIRE = "ids"
BYTES_WIRE = "bytes"
WIRE_FORMS = (IDS_WIRE, BYTES_WIRE)
#: The id form's tensors are named after the BYTES tensor they stand for: ``categorical__ids`` (INT64,
#: the single-valued columns) with ``categorical__missing`` (BOOL, True where a value is empty), and per
#: multi-hot column ``<column>__ids`` (INT64, ragged: a row's values first) with ``<column>__length``.
IDS_SUFFIX = "__ids"
MISSING_SUFFIX = "__missing"
LENGTH_SUFFIX = "__length"
