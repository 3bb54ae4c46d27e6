"""Keys of the id form made on the step's device: one upload, one fused hash, nothing comes back.

On a device instance whose tables are resident (:mod:`recserve.backends.store.device.tier`), a
request of the id form is checked on the host as the host transform checks it
(:mod:`.request_checks`, :class:`~recserve.backends.features.id_inputs.IdReader`). The host then
lays every value to be hashed side by side in one staging buffer, already XORed with its table's
salt (vectorised numpy over whole arrays), with the normalised dense values and the history masks
behind them; the buffer goes to the device in one copy (pinned, asynchronous on a GPU) and
:func:`~.device_transform.splitmix64` runs once over every key of the batch: a dozen elementwise
operators whatever the batch's size, no host synchronisation::

    host:   checks ── picked ids, targets, history windows (aligned) ^ salt ─┐ one staging buffer
            dense ─ fill, clip, log1p, shift, scale; masks ──────────────────┘ (int64 words)
    device: ── one copy ──► splitmix64(all values) ─► all keys [N] (views: sparse, target, history keys)
                        └─► dense values, masks (views)

An empty value, an absent target and a padded history position get their feature's missing key
without a branch on the device: splitmix64 is a bijection, so the host writes the one value whose
hash is that key (:func:`~.device_transform.unmix64` of it), and the same for an identity-encoded
feature's value. So the keys are bit for bit
:class:`~recserve.backends.features.transform.FeatureTransform`'s.

Specs whose key making needs host-only ops are left to the host transform (:meth:`DeviceKeys.serves`):
multi-hot lists, time parts, bucketized and derived numeric features.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.base.inputs import require
from recserve.backends.features.device_transform import splitmix64, unmix64
from recserve.backends.features.hashing import missing_key, table_salt
from recserve.backends.features.id_inputs import IdReader
from recserve.backends.features.numeric import NumericOps
from recserve.backends.features.request_checks import check_history, check_target
from recserve.backends.features.transform import right_align
from recserve.core.contract import attention_inputs
from recserve.core.names import (
    ALL_KEYS,
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    HISTORY_KEYS,
    IDS_WIRE,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.values import ABSENT_ITEM


def _words(count: int, itemsize: int) -> int:
    """int64 words that hold ``count`` items of ``itemsize`` bytes."""
    return -(-count * itemsize // 8)


class DeviceKeys:
    """:meth:`FeatureTransform.transform` of id-form requests, the keys computed on ``device``.

    Besides the transform's outputs (views of one device buffer), :data:`~recserve.core.names.ALL_KEYS`:
    every key of the batch flat, in the order :meth:`EmbeddingLookup.key_blocks
    <recserve.backends.steps.lookup.EmbeddingLookup.key_blocks>` joins them (per row the features
    and targets, then per history owner each sequence's positions).

    Args:
        spec: the model spec (:meth:`serves` it).
        device: the step's torch device.
        copies: where the host-to-device bytes of the inputs are counted.
    """

    def __init__(
        self, spec: ModelSpec, device: str | torch.device, copies: DeviceCopies | None = None
    ) -> None:
        if not self.serves(spec):
            raise ValueError(f"spec {spec.name!r} needs host-only key making")
        self.spec = spec
        self.device = torch.device(device)
        self.copies = copies or DeviceCopies(EMBEDDING_LOOKUP)
        self.ids = IdReader(spec)
        ns = spec.hashing.namespace
        features = spec.categorical.features
        single = list(self.ids.form.single)
        self.columns = np.array([single.index(f.column) for f in features], np.intp)
        # per row: each feature's, then each target's salt; the value written where a key is missing
        salts = [table_salt(ns, f.table) for f in features] + [table_salt(ns, t.table) for t in spec.targets]
        absent = [missing_key(ns, f.name) for f in features] + [missing_key(ns, t.name) for t in spec.targets]
        self.salts = np.array(salts, np.uint64).view(np.int64)[None, :]
        self.absent = unmix64(np.array(absent, np.int64))[None, :]
        self.identity = np.flatnonzero([f.encoder == "identity" for f in features])
        self.numeric = NumericOps(spec) if spec.normalized_columns else None
        self.groups = tuple(
            (group, names.mask)
            for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
        )
        # per sequence (in the groups' order): its salt and the value written at a padded position
        self.sequences = tuple(
            (s, np.int64(np.uint64(table_salt(ns, s.table)).view(np.int64)), unmix64(missing_key(ns, s.name)))
            for group, _ in self.groups
            for s in group.sequences
        )

    @staticmethod
    def serves(spec: ModelSpec) -> bool:
        """Whether the device makes every key of ``spec``: no list, time part, bucket, categorical number."""
        group = spec.categorical
        return (
            not group.multi_hot
            and not spec.wire_form(IDS_WIRE).lists
            and not any(f.part or f.numeric >= 0 for f in group.features)
            and not (spec.dense is not None and any(c.categorical >= 0 for c in spec.dense.numeric))
        )

    def staging(self, words: int) -> torch.Tensor:
        """An int64 host buffer of ``words`` words: pinned when the device is a GPU (an asynchronous copy)."""
        return torch.empty(words, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def __call__(self, inputs: Mapping[str, np.ndarray], users: int | None = None) -> dict[str, torch.Tensor]:
        """The transform's outputs for one (merged) request of the id form, as tensors on the device.

        Args:
            inputs: the row-layout wire inputs (host arrays).
            users: as :meth:`FeatureTransform.transform`'s: the history owners of a candidate list.

        Raises:
            InvalidInput: the host transform's error for the same request (the same checks, in order).
        """
        spec = self.spec
        ids, empty = self.ids.single_ids(inputs)
        rows, owners = ids.shape[0], ids.shape[0] if users is None else users
        dense = None
        if self.numeric is not None and spec.dense is not None:
            width = len(spec.dense.columns)
            values = require(inputs, spec.dense.name, "FP32", rows, width)
            missing = require(inputs, spec.dense_missing_input, "BOOL", rows, width)
            dense = self.numeric.normalize(values, missing)
        row_values, row_absent = [ids[:, self.columns]], [empty[:, self.columns]]
        histories: list[tuple[np.ndarray, np.ndarray]] = []
        bucket = 0
        if spec.sequences:
            lengths = [require(inputs, g.length_input, "INT32", owners, 1)[:, 0] for g, _ in self.groups]
            for feature in spec.targets:
                target = require(inputs, feature.name, "INT64", rows, 1)
                check_target(target, feature)
                row_values.append(target)
                row_absent.append(target == ABSENT_ITEM)
            histories, bucket = self._histories(inputs, lengths, owners)
        width = self.salts.shape[1]
        key_count = rows * width + owners * len(self.sequences) * bucket
        dense_words = 0 if dense is None else _words(dense.size, 4)
        mask_words = _words(owners * bucket, 4)
        buffer = self.staging(key_count + dense_words + len(self.groups) * mask_words)
        host = buffer.numpy()
        block = host[: rows * width].reshape(rows, width)
        np.bitwise_xor(np.concatenate(row_values, axis=1), self.salts, out=block)
        if self.identity.size:  # an identity feature's key is its value: the value whose hash it is
            block[:, self.identity] = (
                unmix64(ids[:, self.columns[self.identity]]) ^ self.salts[0, self.identity]
            )
        np.copyto(block, np.broadcast_to(self.absent, block.shape), where=np.concatenate(row_absent, axis=1))
        if histories:
            windows = host[rows * width : key_count].reshape(owners, len(self.sequences), bucket)
            for index, ((_, salt, absent), (window, mask)) in enumerate(
                zip(self.sequences, histories, strict=True)
            ):
                np.bitwise_xor(window, salt, out=windows[:, index])
                np.copyto(windows[:, index], absent, where=~mask)
        start = key_count
        if dense is not None:
            host[start : start + dense_words].view(np.float32)[: dense.size] = dense.ravel()
            start += dense_words
        masks = [mask for _, mask in histories]
        mask_starts = []
        for group_index in range(len(self.groups)):
            mask = masks[sum(len(g.sequences) for g, _ in self.groups[: group_index + 1]) - 1]
            host[start : start + mask_words].view(np.float32)[: mask.size] = mask.ravel()
            mask_starts.append(start)
            start += mask_words
        self.copies.to_device(buffer.numel() * 8)
        on_device = buffer.to(self.device, non_blocking=True)
        keys = splitmix64(on_device[:key_count])
        by_row = keys[: rows * width].view(rows, width)
        out: dict[str, torch.Tensor] = {}
        if dense is not None:
            out[DENSE_NORMALIZED] = (
                on_device[key_count : key_count + dense_words]
                .view(torch.float32)[: dense.size]
                .view(dense.shape)
            )
        out[SPARSE_KEYS] = by_row[:, : self.columns.size]
        if spec.sequences:
            out[TARGET_KEY] = by_row[:, self.columns.size :]
            for (_, mask_name), begin in zip(self.groups, mask_starts, strict=True):
                flat = on_device[begin : begin + mask_words].view(torch.float32)[: owners * bucket]
                out[mask_name] = flat.view(owners, bucket)
            out[HISTORY_KEYS] = keys[rows * width :].view(owners, len(self.sequences) * bucket)
        out[ALL_KEYS] = keys
        return out

    def _histories(
        self, inputs: Mapping[str, np.ndarray], lengths: list[np.ndarray], owners: int
    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        """Each sequence's window ``[owners, bucket]`` (aligned to its padding side), its mask; the bucket."""
        spec = self.spec
        longest = max(int(np.max(n, initial=0)) for n in lengths)
        bucket = spec.sequence_bucket(min(max(longest, 1), spec.serving.sequence_buckets[-1]))
        positions = np.arange(bucket)[None, :]
        out = []
        for (attention, _), group_lengths in zip(self.groups, lengths, strict=True):
            for sequence in attention.sequences:
                items = require(inputs, sequence.name, "INT64", owners, None)
                check_history(items, group_lengths, sequence, attention.length_input)
                width = min(bucket, items.shape[1])
                window = np.zeros((owners, bucket), np.int64)
                window[:, :width] = items[:, :width]
                mask = positions < group_lengths[:, None]
                if sequence.padding == "left":
                    window, mask = right_align(window, group_lengths), right_align(mask, group_lengths)
                out.append((window, mask))
        return out, bucket
