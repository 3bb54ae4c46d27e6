"""Keys of the id form made on the step's device: the ids go there once, the keys never come back.

On a device instance whose tables are resident (:mod:`recserve.backends.store.device_tier`), a
request of the id form is checked on the host as the host transform checks it
(:mod:`.request_checks`, :class:`~recserve.backends.features.id_inputs.IdReader`), then each of its
tensors is copied to the device once, and the keys, masks and normalised dense values are made
there with :mod:`.device_transform`'s ops, bit for bit those of
:class:`~recserve.backends.features.transform.FeatureTransform`::

    host:   ids, missing, dense, targets, histories, lengths ── checks (numpy, whole arrays)
              │ one copy each
    device: ids[:, columns] ─ splitmix64(salt ^ id) ─ missing key where empty ──► sparse keys
            dense ─ fill, clip, log1p, shift, scale ───────────────────────────► dense values
            targets, history windows (bucketed, left padding aligned) ─ keys ──► target / history keys, masks

Specs whose key making needs host-only ops are left to the host transform (:meth:`DeviceKeys.serves`):
multi-hot lists, time parts, bucketized and derived numeric features.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from recserve.backends.base.device_copies import DeviceCopies
from recserve.backends.base.inputs import require
from recserve.backends.features.device_transform import DeviceNormalizer, keys_for, right_align
from recserve.backends.features.hashing import missing_key, table_salt
from recserve.backends.features.id_inputs import IdReader
from recserve.backends.features.request_checks import check_finite, check_history, check_target
from recserve.core.contract import attention_inputs
from recserve.core.names import (
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    HISTORY_KEYS,
    IDS_WIRE,
    SPARSE_KEYS,
    TARGET_KEY,
)
from recserve.core.spec import ModelSpec
from recserve.core.values import ABSENT_ITEM


class DeviceKeys:
    """:meth:`FeatureTransform.transform` of id-form requests, computed on ``device``.

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

        def put(values: list, dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.array(values, dtype=dtype)).to(self.device)

        self.columns = put([single.index(f.column) for f in features], np.int64)
        salts = np.array([table_salt(ns, f.table) for f in features], np.uint64).view(np.int64)
        self.salts = put(list(salts), np.int64)[None, :]
        self.missing = put([missing_key(ns, f.name) for f in features], np.int64)[None, :]
        self.identity = put([f.encoder == "identity" for f in features], bool)[None, :]
        self.normalizer = DeviceNormalizer(spec, self.device) if spec.normalized_columns else None
        self.groups = tuple(
            (group, names.mask)
            for group, names in zip(spec.attention_groups, attention_inputs(spec), strict=True)
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

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A checked host array on the device, its bytes counted."""
        self.copies.to_device(array.nbytes)
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def __call__(self, inputs: Mapping[str, np.ndarray], users: int | None = None) -> dict[str, torch.Tensor]:
        """The transform's outputs for one (merged) request of the id form, as tensors on the device.

        Args:
            inputs: the row-form wire inputs (host arrays).
            users: as :meth:`FeatureTransform.transform`'s: the history owners of a candidate list.

        Raises:
            InvalidInput: the host transform's error for the same request (the same checks, in order).
        """
        spec = self.spec
        ids, empty = self.ids.single_ids(inputs)
        rows = ids.shape[0]
        out: dict[str, torch.Tensor] = {}
        if spec.dense is not None and spec.dense.columns:
            width = len(spec.dense.columns)
            values = require(inputs, spec.dense.name, "FP32", rows, width)
            missing = require(inputs, spec.dense_missing_input, "BOOL", rows, width)
            check_finite(spec.dense.name, spec.dense.columns, values, missing)
            if self.normalizer is not None:
                out[DENSE_NORMALIZED] = self.normalizer(self.to_device(values), self.to_device(missing))
        picked = self.to_device(ids).index_select(1, self.columns)
        keys = torch.where(self.identity, picked, keys_for(picked, self.salts))
        out[SPARSE_KEYS] = torch.where(
            self.to_device(empty).index_select(1, self.columns), self.missing, keys
        )
        if spec.sequences:
            self._sequences(inputs, rows, rows if users is None else users, out)
        return out

    def _sequences(
        self, inputs: Mapping[str, np.ndarray], rows: int, owners: int, out: dict[str, torch.Tensor]
    ) -> None:
        """Target keys, history keys and each group's mask into ``out`` (checked as the host checks)."""
        spec, ns = self.spec, self.spec.hashing.namespace
        lengths = [require(inputs, g.length_input, "INT32", owners, 1)[:, 0] for g, _ in self.groups]
        targets = []
        for feature in spec.targets:
            target = require(inputs, feature.name, "INT64", rows, 1)
            check_target(target, feature)
            on_device = self.to_device(target)
            keys = keys_for(on_device, table_salt(ns, feature.table))
            targets.append(torch.where(on_device == ABSENT_ITEM, int(missing_key(ns, feature.name)), keys))
        out[TARGET_KEY] = torch.cat(targets, dim=1)
        longest = max(int(np.max(n, initial=0)) for n in lengths)
        bucket = spec.sequence_bucket(min(max(longest, 1), spec.serving.sequence_buckets[-1]))
        positions = torch.arange(bucket, device=self.device)[None, :]
        history = []
        for (attention, mask_name), group_lengths in zip(self.groups, lengths, strict=True):
            device_lengths = self.to_device(group_lengths)
            for sequence in attention.sequences:
                items = require(inputs, sequence.name, "INT64", owners, None)
                check_history(items, group_lengths, sequence, attention.length_input)
                width = min(bucket, items.shape[1])
                window = torch.zeros((owners, bucket), dtype=torch.int64, device=self.device)
                window[:, :width] = self.to_device(items[:, :width])
                mask = positions < device_lengths[:, None]
                if sequence.padding == "left":
                    window, mask = right_align(window, device_lengths), right_align(mask, device_lengths)
                salt = table_salt(ns, sequence.table)
                history.append(torch.where(mask, keys_for(window, salt), int(missing_key(ns, sequence.name))))
            out[mask_name] = mask.float()
        out[HISTORY_KEYS] = torch.cat(history, dim=1)
