"""The ``embedding_lookup`` step: raw features to keys, then every key to its vector in one store call.

The step hands ``dense`` exactly the inputs of the dense contract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np

from recserve.backends.base.arrays import joined, take_rows
from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.features.pooling import pooling_matrix
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.request_log.step_log import TAPPED_PER_OWNER
from recserve.backends.steps.group_inputs import attention_spans, group_inputs
from recserve.backends.steps.list_batch import candidate_lists
from recserve.backends.store.tiered import Lookup, Snapshot, TieredStore
from recserve.core.candidate_lists import candidate_rows, candidate_step_inputs
from recserve.core.contract import (
    attention_inputs,
    left_padded_inputs,
    sequence_inputs,
    sparse_inputs,
)
from recserve.core.names import (
    ALL_KEYS,
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    EMBEDDING_VERSION,
    HISTORY_KEYS,
    IDS_WIRE,
    MULTI_HOT_KEYS,
    MULTI_HOT_WEIGHTS,
    SPARSE_EMBEDDINGS,
    SPARSE_KEYS,
    TARGET_KEY,
    WIRE_FORMS,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.wire_forms import request_form
from recserve.errors import ArtifactError

if TYPE_CHECKING:
    import torch

    from recserve.backends.features.device_keys import DeviceKeys
    from recserve.backends.store.device.cache import DeviceL1, DeviceLookup
    from recserve.backends.store.device.tier import DeviceTier
    from recserve.backends.store.served import ServedStore

#: keys as the transform makes them: numpy on the host, or torch tensors on the lookup's device
KeyArray: TypeAlias = "np.ndarray | torch.Tensor"


class EmbeddingLookup:
    """Map the keys produced by :class:`~recserve.backends.features.transform.FeatureTransform` to vectors.

    The sparse keys ``[B, F]``, the multi-hot keys ``[B, M]``, the target keys ``[B, T]`` and the
    history keys ``[B, S * L]`` are laid side by side as one key matrix with a matching table-id
    matrix, so the store serves every key of the batch in one vectorised call. The multi-hot vectors
    are then pooled with their weights; sequences sharing positions, and their targets, are summed
    (or concatenated: ``combine = "concat"``).

    Each batch also reports the store snapshot that served it: every table's version, in the spec's
    table order (``embedding_version``, one row ``[1, T]``). The store answers a whole batch from one
    snapshot, so that one row is every request's of the batch.

    Args:
        spec: the model spec.
        store: the tiered store.
        device_l1: when given, :meth:`lookup` looks keys up on its device (resident tables, else
            L1) and returns device tensors (the ``cuda`` profile); otherwise numpy arrays from the
            host path.
    """

    def __init__(
        self, spec: ModelSpec, store: TieredStore, device_l1: DeviceL1 | DeviceTier | None = None
    ) -> None:
        self.spec = spec
        self.store = store
        self.device_l1 = device_l1
        #: the lookup takes keys made on its device (the tables resident there: a device tier)
        self.takes_device_keys = False
        group = spec.categorical
        if device_l1 is not None and group.multi_hot:
            raise ArtifactError(
                "the device L1 does not pool multi-hot features; serve this spec on the host path"
            )
        self.single = len(group.features)
        self.multi_width = sum(f.max_length for f in group.multi_hot)
        tables = [f.table for f in group.features]
        tables += [f.table for f in group.multi_hot for _ in range(f.max_length)]
        tables += [t.table for t in spec.targets]
        self.column_tables = np.array([store.table_id(t) for t in tables], np.int16)
        self.sequence_tables = np.array([store.table_id(s.table) for s in spec.sequences], np.int16)
        # pools each multi-hot feature's weighted vectors: [sum of max_length, multi-hot features]
        self.pooling = pooling_matrix(spec)
        self.key_inputs = (SPARSE_KEYS,) + ((MULTI_HOT_KEYS,) if group.multi_hot else ())
        self.key_inputs += (TARGET_KEY, HISTORY_KEYS) if spec.sequences else ()
        self.version_columns = np.array([store.table_id(name) for name in spec.table_names], np.intp)
        #: per width of the spec's tables: its dense input, its slots and the width (None: one width)
        self.widths = (
            [(name, list(slots), width) for name, width, slots in sparse_inputs(spec)]
            if spec.other_widths
            else None
        )
        self.groups = attention_spans(spec)
        #: (a snapshot's versions, those versions in spec order)
        self._versions: tuple[tuple[int, ...], np.ndarray] = ((), np.empty(0, np.int64))

    @classmethod
    def for_instance(
        cls, spec: ModelSpec, served: ServedStore, l1_device: str = "", instance_device: str = "cpu"
    ) -> EmbeddingLookup:
        """The step as a served instance runs it; on a device when ``l1_device`` is set.

        There the tables that fit ``[store] device_memory_mib`` are resident on the device and the
        others behind the device L1 (:func:`~recserve.backends.store.device.tier.device_lookup`).

        torch is imported only then: the default profile's step stays numpy. The device copy of L1
        follows the store's upkeep rounds (rebuilds, updates) on the upkeep thread. With every table
        resident (and no L3) no key reads the host L1, so the upkeep stops rebuilding it.

        Args:
            spec: the model spec.
            served: the instance's store with its upkeep.
            l1_device: the config's :data:`~recserve.core.names.L1_DEVICE_PARAMETER` (``""``, ``cpu``,
                ``cuda``).
            instance_device: where Triton placed the instance (``cpu`` or ``cuda:N``).
        """
        if not l1_device:
            return cls(spec, served.store)
        from recserve.backends.store.device.cache import resolve_device
        from recserve.backends.store.device.tier import DeviceTier, device_lookup

        device = resolve_device(l1_device, instance_device)
        on_device = device_lookup(served.store, device, spec.store.device_memory_bytes)
        served.maintainer.after_step.append(on_device.follow)
        lookup = cls(spec, served.store, on_device)
        lookup.takes_device_keys = isinstance(on_device, DeviceTier)
        if isinstance(on_device, DeviceTier) and on_device.whole:  # no key reads the host L1
            served.maintainer.rebuild_l1 = False
        return lookup

    def key_blocks(
        self, inputs: Mapping[str, np.ndarray | torch.Tensor]
    ) -> tuple[tuple[KeyArray, np.ndarray], tuple[KeyArray, np.ndarray] | None]:
        """Keys and table ids of the transform's inputs, in two blocks.

        Per row ``[B, F + M + T]``: the single-valued features, the multi-hot values and the targets.
        Per history owner ``[H, S * W]`` (each row, or each user of a candidate list): each sequence's
        positions; None without a sequence.
        """
        row_keys = joined([inputs[n] for n in self.key_inputs if n != HISTORY_KEYS], axis=1)
        row_tables = np.broadcast_to(self.column_tables, tuple(row_keys.shape))
        if not len(self.sequence_tables):
            return (row_keys, row_tables), None
        history = inputs[HISTORY_KEYS]
        width = history.shape[1] // len(self.sequence_tables)
        history_tables = np.broadcast_to(np.repeat(self.sequence_tables, width), tuple(history.shape))
        return (row_keys, row_tables), (history, history_tables)

    def keys_and_tables(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The key and table-id matrices of the transform's row-layout inputs, side by side.

        ``[B, F + M + T + S * W]``: the single-valued features, the multi-hot values, the targets and
        each sequence's positions.
        """
        (keys, table_ids), history = self.key_blocks(inputs)
        if history is None:
            return np.asarray(keys), np.array(table_ids)
        return (
            np.concatenate([np.asarray(keys), np.asarray(history[0])], axis=1),
            np.concatenate([table_ids, history[1]], axis=1),
        )

    def lookup_keys(self, inputs: Mapping[str, np.ndarray | torch.Tensor]) -> Lookup | DeviceLookup:
        """The store's answer for every key of a batch (vectors, tiers, snapshot), in one call.

        The vectors come back as the row block, then the history block, of :meth:`key_blocks`. Keys
        made on the device (torch tensors) stay there: the device tier takes them as they are.
        """
        if ALL_KEYS in inputs:  # made on the device, flat: the device tier's constants by shape
            histories, count = inputs.get(HISTORY_KEYS), len(self.sequence_tables)
            owners, width = (0, 0) if histories is None else (histories.shape[0], histories.shape[1] // count)
            tier = cast("DeviceTier", self.device_l1)
            sequence_tables = np.repeat(self.sequence_tables, width)
            layout = tier.layout(self.column_tables, inputs[SPARSE_KEYS].shape[0], sequence_tables, owners)
            return tier.lookup(inputs[ALL_KEYS], layout)
        (keys, table_ids), history = self.key_blocks(inputs)
        if history is not None:
            keys = joined([keys.reshape(-1), history[0].reshape(-1)], axis=0)
            table_ids = np.concatenate([table_ids.reshape(-1), history[1].reshape(-1)])
        if isinstance(keys, np.ndarray):
            return (self.device_l1 or self.store).lookup(keys, table_ids)
        assert self.takes_device_keys  # keys are made on the device only for a device tier
        return cast("DeviceTier", self.device_l1).lookup(keys, table_ids)

    def table_versions(self, snapshot: Snapshot) -> np.ndarray:
        """int64 ``[T]``: each table's version in ``snapshot``, in the spec's table order.

        Computed once per set of versions (L1 refreshes keep the versions tuple), then reused.
        """
        cached = self._versions
        if cached[0] is not snapshot.versions:
            cached = (snapshot.versions, np.asarray(snapshot.versions, np.int64)[self.version_columns])
            self._versions = cached  # one reference swap: safe with concurrent callers
        return cached[1]

    def lookup(
        self, inputs: Mapping[str, np.ndarray | torch.Tensor], users: np.ndarray | None = None
    ) -> dict[str, np.ndarray | torch.Tensor]:
        """Vectors for one batch: ``[B, F, D]`` sparse, ``[B, W]`` target, ``[B, L, W]`` history per group.

        numpy arrays, or tensors on the device of ``device_l1`` when it is set. Also
        ``embedding_version`` ``[1, T]`` (numpy, on the host): the table versions of the snapshot
        that served the batch, once for the batch (every request of it gets that row).

        Args:
            inputs: the keys as :class:`~recserve.backends.features.transform.FeatureTransform` made
                them from the checked request tensors (not checked again here).
            users: for a candidate list, each row's user: the history keys have one row per user,
                looked up once, and so does the history returned. None: one history per row.
        """
        result = self.lookup_keys(inputs)
        rows, single, multi = inputs[SPARSE_KEYS].shape[0], self.single, self.multi_width
        width, dim = len(self.column_tables), self.store.dim
        vectors = result.vectors[: rows * width].reshape(rows, width, dim)
        versions = self.table_versions(result.snapshot)
        sparse = vectors[:, :single]
        if multi:  # host path only (see __init__)
            weighted = np.asarray(vectors[:, single : single + multi]) * inputs[MULTI_HOT_WEIGHTS][:, :, None]
            pooled = np.einsum("bmd,mk->bkd", weighted, self.pooling)
            sparse = np.concatenate([np.asarray(sparse), pooled], axis=1)
        out: dict[str, np.ndarray | torch.Tensor] = {EMBEDDING_VERSION: versions[None, :]}
        if self.widths is None:  # every table of embedding_dim: the slots as they are
            out[SPARSE_EMBEDDINGS] = sparse
        else:  # the store holds every vector at its widest width: each width's slots, cut to it
            for name, slots, slot_width in self.widths:
                out[name] = sparse[:, slots, :slot_width]
        count = len(self.sequence_tables)
        if count:
            targets = vectors[:, single + multi :]
            owners, positions = inputs[HISTORY_KEYS].shape
            histories = result.vectors[rows * width :].reshape(owners, count, positions // count, dim)
            out.update(group_inputs(targets, histories, self.groups, self.spec.model.embedding_dim))
        return out


class FeaturesToEmbeddings:
    """The served ``embedding_lookup`` step: raw request tensors in, the dense network's inputs out.

    The feature transform and the lookup run in one process, so the keys never cross a process
    boundary: one Python hop before ``dense`` instead of two.
    """

    def __init__(self, spec: ModelSpec, lookup: EmbeddingLookup) -> None:
        self.spec = spec
        self.transform = FeatureTransform(spec)
        self.lookup = lookup
        #: the host-device bytes of a device step (the device lookup's counter; none moved on the host)
        device = lookup.device_l1
        self.copies = device.copies if device is not None else DeviceCopies(EMBEDDING_LOOKUP)
        #: makes the keys of id-form requests on the lookup's device, where the spec allows
        self.device_keys: DeviceKeys | None = None
        if lookup.takes_device_keys:
            from recserve.backends.features.device_keys import DeviceKeys

            assert device is not None  # a lookup on its device
            if DeviceKeys.serves(spec):
                self.device_keys = DeviceKeys(spec, device.device, self.copies)
        #: the tensors of both wire forms (a request carries one: :mod:`recserve.core.wire_forms`)
        forms = [spec.wire_form(form) for form in WIRE_FORMS]
        self.input_names = tuple(dict.fromkeys(t.name for form in forms for t in form.inputs))
        #: the tensor only a request of the id form carries (it and the bytes form's merge apart)
        self.ids_marker = spec.wire_form(IDS_WIRE).marker
        #: what the transform computes that goes on to ``dense`` as it is: dense values and masks
        self.masks = tuple(g.mask for g in attention_inputs(spec))
        self.passed = (DENSE_NORMALIZED, *self.masks)
        #: the request log's tap (:meth:`FeatureLog.tap`): what it adds to the outputs; None: logging off
        self.log_tap: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
        self.histories = sequence_inputs(spec)
        self.left_padded = left_padded_inputs(spec)
        #: a request of the candidate-list layout carries these instead of the per-candidate wire inputs
        self.candidate_input_names = tuple(
            dict.fromkeys(
                t.name for t in (*candidate_step_inputs(spec), *(t for f in forms for t in f.user_inputs))
            )
        )

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | torch.Tensor]:
        """The dense contract's inputs and ``embedding_version`` for one (merged) batch of raw tensors.

        Raises:
            InvalidInput: naming the first offending input and value.
        """
        features = self.features(inputs)
        return {**self.passed_on(features), **self.lookup.lookup(features)}

    def passed_on(self, features: Mapping[str, Any]) -> dict[str, Any]:
        """What of the transform's ``features`` goes on as it is: to ``dense``, and to the log's tap."""
        passed = {n: features[n] for n in self.passed if n in features}
        return passed if self.log_tap is None else {**passed, **self.log_tap(features)}

    def features(
        self, inputs: Mapping[str, np.ndarray], users: int | None = None
    ) -> Mapping[str, np.ndarray | torch.Tensor]:
        """The transform's keys, masks and dense values: made on the device for the id form where it can.

        Raises:
            InvalidInput: naming the first offending input and value (the same checks either way).
        """
        if self.device_keys is not None and request_form(self.spec, inputs) == IDS_WIRE:
            return self.device_keys(inputs, users)
        return self.transform.transform(inputs, users=users)

    def candidates(
        self, inputs: Mapping[str, np.ndarray], expand: bool = False
    ) -> dict[str, np.ndarray | torch.Tensor]:
        """The same for one candidate-list request, each user's sequences transformed and looked up once.

        The per-candidate inputs of the dense contract come back as ``candidate_<name>``,
        ``[U, N, ...]``, and the history and its mask with one row per user, ``[U, L, ...]``
        (what ``dense`` takes from the candidates ensemble); ``embedding_version`` has one row for
        the list. With ``expand``, the row layout's outputs instead: every candidate row with its
        user's history (for a ``dense`` that takes rows only). See
        :func:`recserve.core.candidate_lists.candidate_rows` for the inputs.

        Raises:
            InvalidInput: naming the first offending input (as the client named it) and value.
        """
        if not expand:
            return candidate_lists(self, [inputs])[0]
        rows, users = candidate_rows(self.spec, inputs, request_form(self.spec, inputs))
        features = self.list_features(rows, [inputs], int(users[-1]) + 1)
        out: dict[str, np.ndarray | torch.Tensor] = self.passed_on(features)
        out.update(self.lookup.lookup(features, users))
        for name in (*self.histories, *TAPPED_PER_OWNER):  # a row per user to a row per candidate
            if name in out:
                out[name] = take_rows(out[name], users)
        return out

    def candidate_lists(self, lists: list[Mapping[str, np.ndarray]]) -> list[dict]:
        """Several candidate lists of one wire form, each answered as :meth:`candidates` answers it.

        Joined while their rows stay within ``max_batch_size``: one transform and one store call
        per join (:mod:`~recserve.backends.steps.list_batch`).

        Raises:
            InvalidInput: naming the first offending input of a list (the caller answers each alone).
        """
        return candidate_lists(self, lists)

    def list_features(
        self, rows: Mapping[str, np.ndarray], lists: Sequence[Mapping[str, np.ndarray]], users: int
    ) -> Mapping[str, np.ndarray | torch.Tensor]:
        """The transform of ``lists`` flattened to ``rows`` (with ``users`` users, their histories once)."""
        return self.features(rows, users=users)

    def list_widths(
        self, lists: Sequence[Mapping[str, np.ndarray]], outputs: Mapping[str, Any], users: Sequence[int]
    ) -> list[int]:
        """The history width each of ``lists`` gets back (``outputs``: their joined outputs)."""
        return [self.history_width(inputs) for inputs in lists]

    def history_width(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The sequence bucket of one request's longest history: the width it gets back (1: no sequence)."""
        if self.spec.sequence is None:
            return 1
        longest = max(int(np.max(inputs[g.length_input], initial=0)) for g in self.spec.attention_groups)
        return self.spec.sequence_bucket(max(longest, 1))
