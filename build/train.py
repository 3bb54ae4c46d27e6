"""Train the CTR model on the user's rows or synthetic ones; turn its embeddings into keyed tables.

Training uses row indices into per-table vocabularies built from the training keys (values seen
fewer than ``min_count`` times share the out-of-vocabulary row); the exported tables are keyed by
the same 64-bit keys the serving feature transform computes.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.transform import FeatureTransform
from recserve.backends.store.table_data import TableArrays
from recserve.build.evaluation import figure, logloss
from recserve.build.progress import Progress, stderr_progress
from recserve.build.synthetic import generate
from recserve.core.contract import attention_inputs, sparse_inputs
from recserve.core.names import DENSE_NORMALIZED, HISTORY_KEYS, HISTORY_MASK
from recserve.core.ranking import roc_auc
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.values import categorical_values

LOGGER = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.1  # of the user's rows, held out to report AUC and logloss


@dataclass
class KeyedRows:
    """Serving keys of a set of rows (what the feature transform of ``embedding_lookup`` produces)."""

    dense: np.ndarray
    sparse: np.ndarray  # [N, F]
    multi: np.ndarray  # [N, M]: the multi-hot features' keys side by side
    weights: np.ndarray  # [N, M]: their pooling weights
    target: np.ndarray  # [N, T]
    history: np.ndarray  # [N, S, positions]: every sequence, group by group
    mask: np.ndarray  # [N, G, positions]: each attention group's
    labels: np.ndarray


def keyed(spec: ModelSpec, rows: Rows) -> KeyedRows:
    """Run the serving feature transform's numeric steps over raw rows (parts the spec lacks: empty)."""
    transform = FeatureTransform(spec)
    n = len(rows)
    target, history, mask = (
        np.zeros((n, 0), np.int64),
        np.zeros((n, 0, 1), np.int64),
        np.zeros((n, 0, 1), np.float32),
    )
    if spec.sequences:
        target = np.concatenate(
            [transform.target_keys(rows.target_ids(t.name)[:, None], t) for t in spec.targets], axis=1
        )
        groups = spec.attention_groups
        lengths = [rows.lengths_of(group.length_input).astype(np.int32) for group in groups]
        bucket = spec.sequence_bucket(max(max(int(n.max(initial=0)) for n in lengths), 1))
        histories, masks = [], []
        for group, group_lengths in zip(groups, lengths, strict=True):
            for s in group.sequences:
                keyed_history = transform.history(rows.sequence(s.name), group_lengths, s, bucket)
                histories.append(keyed_history[HISTORY_KEYS])
            masks.append(keyed_history[HISTORY_MASK])
        history, mask = np.stack(histories, axis=1), np.stack(masks, axis=1)
    dense, numeric = np.zeros((n, 0), np.float32), None
    parsed = categorical_values(rows.categorical, spec.categorical)
    if spec.dense is not None:
        dense, numeric = (
            transform.dense_values(rows.dense, rows.dense_missing, parsed),
            (rows.dense, rows.dense_missing),
        )
    multi, weights = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
    if spec.categorical.multi_hot:
        multi, weights = transform.multi_hot_keys(rows.categorical)
    return KeyedRows(
        dense=dense,
        sparse=transform.categorical_keys(*parsed, numeric),
        multi=multi,
        weights=weights,
        target=target,
        history=history,
        mask=mask,
        labels=rows.label_values(),
    )


def _multi_hot_spans(spec: ModelSpec) -> list[slice]:
    """Each multi-hot feature's columns in :attr:`KeyedRows.multi`."""
    ends = np.cumsum([f.max_length for f in spec.categorical.multi_hot])
    return [
        slice(int(end) - f.max_length, int(end))
        for f, end in zip(spec.categorical.multi_hot, ends, strict=True)
    ]


class Vocabulary:
    """Keys seen at least ``min_count`` times, mapped to rows; everything else to the OOV row."""

    def __init__(self, keys: np.ndarray, min_count: int) -> None:
        unique, counts = np.unique(keys, return_counts=True)
        self.keys = unique[counts >= min_count]

    @property
    def oov(self) -> int:
        """Row index shared by unknown keys."""
        return len(self.keys)

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """Row index of each key."""
        pos = np.minimum(np.searchsorted(self.keys, keys), max(len(self.keys) - 1, 0))
        return np.where(self.keys[pos] == keys, pos, self.oov)


class TrainingModel(nn.Module):
    """Embedding bags in front of :class:`CTRNet`, used for training only."""

    def __init__(self, spec: ModelSpec, vocab: dict[str, Vocabulary]) -> None:
        super().__init__()
        self.spec = spec
        tables = {name: nn.Embedding(v.oov + 1, spec.tables[name].dim) for name, v in vocab.items()}
        for table in tables.values():
            nn.init.normal_(table.weight, std=0.05)
        self.embeddings = nn.ModuleDict(tables)
        self.net = CTRNet(spec)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Probabilities from row indices (see :func:`train`'s ``index``).

        ``sparse`` [B, F], ``multi`` [B, M] with ``weights``, ``target`` [B, T], ``history`` [B, S, L].
        """
        spec = self.spec
        columns = [
            self.embeddings[f.table](batch["sparse"][:, i]) for i, f in enumerate(spec.categorical.features)
        ]
        start = 0
        for feature in spec.categorical.multi_hot:
            span = slice(start, start + feature.max_length)
            vectors = self.embeddings[feature.table](batch["multi"][:, span])
            columns.append((vectors * batch["weights"][:, span, None]).sum(dim=1))
            start += feature.max_length
        named = {DENSE_NORMALIZED: batch["dense"]}
        for name, _, slots in sparse_inputs(spec):  # the embeddings of each width, as served
            named[name] = torch.stack([columns[i] for i in slots], dim=1)
        first = 0
        groups = zip(spec.attention_groups, attention_inputs(spec), strict=True)
        for g, (group, names) in enumerate(groups):
            members = range(first, first + len(group.sequences))
            first += len(group.sequences)
            targets = [self.embeddings[spec.targets[i].table](batch["target"][:, i]) for i in members]
            histories = [self.embeddings[spec.sequences[i].table](batch["history"][:, i]) for i in members]
            # the sequences of a group summed (or concatenated) per position, as the lookup step serves them
            if group.combine == "concat":
                named[names.target], named[names.history] = torch.cat(targets, -1), torch.cat(histories, -1)
            else:
                named[names.target] = functools.reduce(operator.add, targets)
                named[names.history] = functools.reduce(operator.add, histories)
            named[names.mask] = batch["mask"][:, g]
        return self.net.score(named)  # no user state in training: no log-weights (today's attention)


def _real_positions(
    spec: ModelSpec, history: torch.Tensor, mask: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``history`` [B, S, L] and ``mask`` [B, G, L] cut to ``width`` positions on each group's real side."""
    if not spec.sequences:
        return history, mask
    kept_history, kept_mask, first = [], [], 0
    for g, group in enumerate(spec.attention_groups):
        kept = slice(-width, None) if group.primary.padding == "left" else slice(0, width)
        kept_history += [history[:, first + i, kept] for i in range(len(group.sequences))]
        kept_mask.append(mask[:, g, kept])
        first += len(group.sequences)
    return torch.stack(kept_history, dim=1), torch.stack(kept_mask, dim=1)


@dataclass
class TrainedModel:
    """The outcome of training: the dense net, keyed tables and the held-out AUC."""

    net: CTRNet
    tables: dict[str, TableArrays]
    holdout_auc: float | None  # None when the held-out rows hold one class only


def split_holdout(rows: Rows, seed: int, fraction: float = HOLDOUT_FRACTION) -> tuple[Rows, Rows]:
    """Shuffle ``rows`` (the same way for the same seed) and hold ``fraction`` of them out.

    Raises:
        ValueError: fewer than 2 rows.
    """
    if len(rows) < 2:
        raise ValueError(f"training needs at least 2 labelled rows, got {len(rows)}")
    order = np.random.default_rng(seed).permutation(len(rows))
    held = min(max(1, round(len(rows) * fraction)), len(rows) - 1)
    return rows.take(order[held:]), rows.take(order[:held])


def train(spec: ModelSpec, progress: Progress = stderr_progress, rows: Rows | None = None) -> TrainedModel:
    """Train on ``rows`` (else on the spec's synthetic rows), evaluate on held-out rows, export tables.

    Args:
        spec: the model spec; ``[training]`` gives the seed, sizes and optimiser settings.
        progress: where progress lines go.
        rows: the user's labelled rows; ``HOLDOUT_FRACTION`` of them is held out for the AUC.
    """
    cfg = spec.training
    seed = cfg.seed
    torch.manual_seed(seed)
    started = time.perf_counter()
    if rows is None:
        progress(f"[train] generating {cfg.rows} training + {cfg.holdout_rows} held-out rows")
        train_rows, holdout_rows = generate(spec, cfg.rows, seed), generate(spec, cfg.holdout_rows, seed + 1)
    else:
        train_rows, holdout_rows = split_holdout(rows, seed)
        progress(f"[train] your rows: {len(train_rows)} to train on, {len(holdout_rows)} held out")
    data, holdout = keyed(spec, train_rows), keyed(spec, holdout_rows)

    keys_by_table: dict[str, list[np.ndarray]] = {}
    for i, feature in enumerate(spec.categorical.features):
        keys_by_table.setdefault(feature.table, []).append(data.sparse[:, i])
    spans = _multi_hot_spans(spec)
    for multi, span in zip(spec.categorical.multi_hot, spans, strict=True):
        keys_by_table.setdefault(multi.table, []).append(data.multi[:, span][data.weights[:, span] > 0])
    group_of = [g for g, group in enumerate(spec.attention_groups) for _ in group.sequences]
    for i, sequence in enumerate(spec.sequences):  # each target shares its sequence's table
        table = keys_by_table.setdefault(sequence.table, [])
        table += [data.target[:, i], data.history[:, i][data.mask[:, group_of[i]] > 0]]
    vocab = {name: Vocabulary(np.concatenate(keys), cfg.min_count) for name, keys in keys_by_table.items()}

    def index(rows: KeyedRows) -> dict[str, torch.Tensor]:
        sparse = np.stack(
            [vocab[f.table].rows(rows.sparse[:, i]) for i, f in enumerate(spec.categorical.features)], axis=1
        )
        multi = np.zeros(rows.multi.shape, np.int64)
        for feature, span in zip(spec.categorical.multi_hot, spans, strict=True):
            multi[:, span] = vocab[feature.table].rows(rows.multi[:, span])
        target = np.zeros(rows.target.shape, np.int64)
        history = np.zeros(rows.history.shape, np.int64)
        for i, sequence in enumerate(spec.sequences):
            target[:, i] = vocab[sequence.table].rows(rows.target[:, i])
            history[:, i] = vocab[sequence.table].rows(rows.history[:, i])
        return {
            "dense": torch.from_numpy(rows.dense),
            "sparse": torch.from_numpy(sparse),
            "multi": torch.from_numpy(multi),
            "weights": torch.from_numpy(rows.weights),
            "target": torch.from_numpy(target),
            "history": torch.from_numpy(history),
            "mask": torch.from_numpy(rows.mask),
            "lengths": torch.from_numpy(rows.mask.sum(2).max(1, initial=0).astype(np.int64)),
        }

    train_t, hold_t = index(data), index(holdout)
    model = TrainingModel(spec, vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
    loss_fn = nn.BCELoss()
    labels = torch.from_numpy(data.labels)
    batch = cfg.batch_size
    n = len(labels)
    for epoch in range(cfg.epochs):
        model.train()
        order = torch.randperm(n)
        total = 0.0
        for step, start in enumerate(range(0, n, batch)):
            idx = order[start : start + batch]
            width = spec.sequence_bucket(max(int(train_t["lengths"][idx].max()), 1)) if spec.sequence else 1
            step_batch = {name: tensor[idx] for name, tensor in train_t.items()}
            step_batch["history"], step_batch["mask"] = _real_positions(
                spec, step_batch["history"], step_batch["mask"], width
            )
            pred = model(step_batch)[:, 0]
            loss = loss_fn(pred, labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            if step % 50 == 0:
                progress(
                    f"[train] epoch {epoch + 1} {min(start + batch, n)}/{n} rows, loss {loss.item():.4f}"
                )
        progress(
            f"[train] epoch {epoch + 1} done, mean loss {total / n:.4f}, {time.perf_counter() - started:.1f}s"
        )

    model.eval()
    with torch.no_grad():
        scores = torch.cat(
            [
                model({name: tensor[s : s + 4096] for name, tensor in hold_t.items()})[:, 0]
                for s in range(0, len(holdout.labels), 4096)
            ]
        ).numpy()
    auc = roc_auc(holdout.labels, scores)
    progress(
        f"[train] held-out AUC {figure(auc)}, logloss {figure(logloss(holdout.labels, scores))} "
        f"on {len(holdout.labels)} rows after {time.perf_counter() - started:.1f}s"
    )

    tables = {}
    for name, v in vocab.items():
        embedding = model.embeddings[name]
        assert isinstance(embedding, nn.Embedding)  # the ModuleDict holds one nn.Embedding per table
        weight = embedding.weight.detach().numpy()
        tables[name] = TableArrays(name, np.asarray(v.keys, np.int64), weight[: v.oov], weight[v.oov])
    return TrainedModel(model.net, tables, auc)
