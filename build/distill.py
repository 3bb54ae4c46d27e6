"""A smaller dense network distilled from the served one: the network of ``[degrade.small_dense]``.

A ``[[degrade.levels]]`` entry with ``small_dense = true`` is scored by a smaller network of the same
features (``recserve.core.spec.parse.small_dense_spec``: the spec with ``[degrade.small_dense]``'s
sizes as its ``[dense_net]``), served beside the full one. It takes the same inputs (the embeddings
the lookup step returns), so it is trained on them: rows go through the served feature transform
and lookup in process, the full network scores them, and the smaller one learns those scores
(distillation: the teacher's probabilities as soft labels, the tables as served and not trained).
The full network's own training is not repeated, and an imported network can teach too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from recserve.backends.dense.network import CTRNet
from recserve.backends.steps.pipeline import InProcessPipeline
from recserve.build.evaluation import figure
from recserve.build.progress import Progress
from recserve.build.synthetic import generate
from recserve.core.contract import dense_net_inputs
from recserve.core.ranking import roc_auc
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec

#: At most this many rows teach the smaller network (the spec's training rows, or the user's), a
#: tenth of them held out; passes over them; rows per step (at most the spec's max_batch_size).
DISTILL_ROWS = 40_000
DISTILL_EPOCHS = 4
DISTILL_BATCH = 256


@dataclass(frozen=True)
class Distilled:
    """The smaller network, and how it compares with its teacher on held-out rows."""

    net: CTRNet
    auc: float | None  # against the labels (None: one class only, or no labels)
    teacher_auc: float | None
    mean_abs_diff: float  # of its probabilities from the teacher's


def distill(
    spec: ModelSpec,
    small: ModelSpec,
    pipeline: InProcessPipeline,
    progress: Progress,
    rows: Rows | None = None,
) -> Distilled:
    """Train the network of ``small`` on the scores ``pipeline`` (the served network) gives ``rows``.

    Args:
        spec: the served spec (its features make the inputs).
        small: the smaller network's spec (:func:`~recserve.core.spec.parse.small_dense_spec`).
        pipeline: the served transform, lookup and network, in process.
        progress: where progress lines go.
        rows: the rows to teach on (the user's); None: the spec's synthetic rows.
    """
    started = time.perf_counter()
    seed = spec.training.seed
    torch.manual_seed(seed)
    if rows is None or len(rows) < 2:
        rows = generate(spec, min(spec.training.rows, DISTILL_ROWS), seed + 7)
    else:
        rows = rows.take(np.random.default_rng(seed).permutation(len(rows))[:DISTILL_ROWS])
    held = max(1, len(rows) // 10)
    size = min(DISTILL_BATCH, spec.model.max_batch_size)
    batches = list(_batches(spec, pipeline, rows, size))
    learn, holdout = batches[held // size + 1 :], batches[: held // size + 1]
    if not learn:
        learn = holdout
    net = CTRNet(small)
    optimizer = torch.optim.Adam(net.parameters(), lr=spec.training.learning_rate)
    loss_fn = nn.BCELoss()
    for epoch in range(DISTILL_EPOCHS):
        net.train()
        total = 0.0
        for i in torch.randperm(len(learn)).tolist():
            inputs, teacher, _ = learn[i]
            loss = loss_fn(net(*inputs), teacher)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        progress(f"[distill] epoch {epoch + 1}: loss against the full network {total / len(learn):.4f}")
    net.eval()
    with torch.no_grad():
        student = np.concatenate([net(*inputs).numpy().ravel() for inputs, _, _ in holdout])
    teacher = np.concatenate([t.numpy().ravel() for _, t, _ in holdout])
    labels = np.concatenate([y for _, _, y in holdout])
    found = Distilled(
        net, roc_auc(labels, student), roc_auc(labels, teacher), float(np.abs(student - teacher).mean())
    )
    progress(
        f"[distill] held-out AUC {figure(found.auc)} (the full network's {figure(found.teacher_auc)}), "
        f"mean |diff| {found.mean_abs_diff:.4f} on {len(labels)} rows after "
        f"{time.perf_counter() - started:.1f}s"
    )
    return found


def _batches(
    spec: ModelSpec, pipeline: InProcessPipeline, rows: Rows, size: int
) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor, np.ndarray]]:
    """Per batch of rows: the network's inputs as served, the full network's scores, the labels."""
    names = dense_net_inputs(spec)
    labels = rows.labels if rows.labels is not None else np.zeros(len(rows), np.float32)
    for start in range(0, len(rows), size):
        part = rows.take(slice(start, start + size))
        # no device L1 in process: the lookup answers with numpy arrays
        inputs = cast(dict[str, np.ndarray], pipeline.embeddings(part.to_wire(spec)))
        scores = np.asarray(pipeline.dense(inputs), np.float32).reshape(-1, 1)
        tensors = tuple(torch.from_numpy(np.ascontiguousarray(inputs[n], np.float32)) for n in names)
        yield tensors, torch.from_numpy(scores), labels[start : start + size]
