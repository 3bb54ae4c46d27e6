"""The spec as the GPU profiles serve it: batches and candidate lists up to ``[serving] gpu_max_batch_size``.

A GPU pays per launch, not per row: the ``gpu`` and ``cuda`` profiles take batches (and one
user's candidate list) of up to several thousand rows, where the CPU profile keeps
``[model] max_batch_size``. Their configs are generated from :func:`gpu_spec`, the spec with
``max_batch_size`` raised to ``gpu_max_batch_size`` and batch buckets doubling from the CPU's
largest up to it (:func:`gpu_batch_buckets`). The derived spec travels in those configs as every
spec does, so each step checks and buckets by it; nothing else names the GPU sizes.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec


def gpu_batch_buckets(spec: ModelSpec) -> tuple[int, ...]:
    """The CPU profile's batch buckets, then doubling from its largest up to ``gpu_max_batch_size``.

    Without ``gpu_max_batch_size`` (0), or one not above ``max_batch_size``: the CPU's buckets.
    """
    buckets = tuple(spec.serving.batch_buckets)
    largest = spec.serving.gpu_max_batch_size
    size = buckets[-1]
    extra = []
    while size < largest:
        size = min(size * 2, largest)
        extra.append(size)
    return buckets + tuple(extra)


def gpu_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the GPU profiles' largest batch and buckets (itself when they are the CPU's).

    The result's source document states the buckets and ``max_batch_size`` it serves and no
    ``gpu_max_batch_size``, so deriving it again changes nothing.
    """
    buckets = gpu_batch_buckets(spec)
    if buckets[-1] == spec.model.max_batch_size:
        return spec
    doc = copy.deepcopy(spec.source)
    doc.setdefault("model", {})["max_batch_size"] = buckets[-1]
    serving = doc.setdefault("serving", {})
    serving.pop("gpu_max_batch_size", None)
    serving["batch_buckets"] = list(buckets)
    serving["sequence_buckets"] = list(spec.serving.sequence_buckets)
    return replace(parse_spec(doc), access=spec.access)
