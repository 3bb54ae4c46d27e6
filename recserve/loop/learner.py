"""``recserve learn``: the served rows trained on joined examples, the touched ones published.

The learner starts from what is served: the store's rows as the update log has them (every
published version applied) and the newest dense version's network. For each batch of examples it
scores the batch (progressive validation: the loss *before* the batch trains,
:attr:`Learner.progressive_loss`), then takes one row-wise Adagrad step on the rows the batch
touched, each example weighted by ``1 / sample_rate`` (a negative kept at rate w stands for 1/w, so
the served score needs no ln w correction; :attr:`Learner.accumulators` hold each row's sum of
squared gradients). Only ``[loop] train_tables`` move. :meth:`Learner.publish` writes **only the rows
touched** since the last publish, one delta per table through the update log, unless their
progressive log loss or AUC is worse than the served scores' by more than a margin (then they go
back); after it, :meth:`Learner.watch` judges each version on the examples it served against the
rows it replaced and rolls it back if worse (:mod:`recserve.loop.watch`). With a
:class:`~recserve.loop.dense.DenseTrainer` the dense weights train too; the rows always train through
the weights as served.

What it trains: the bundled ``ctr`` spec; attention groups, several of them with lengths of their own,
their sequences summed or side by side as the lookup step combines them; multi-hot features, each
value's row through its pooling weight, read back from the logged keys; an imported DeepFM with its
1-wide first-order tables, through its ONNX graph. Rows are held at the store's widest width; each
slot reads its table's width of them, and a row's accumulator is the mean square of its table's
columns alone. See docs/design/loop.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.dense.onnx_torch import OnnxNet
from recserve.backends.store.tiered import TieredStore
from recserve.core.names import DENSE_NORMALIZED
from recserve.core.spec.model import ModelSpec
from recserve.loop.batch import BatchFigures, BatchLayout, distinct_rows, trainable
from recserve.loop.dense import DenseTrainer, weighted_log_loss
from recserve.loop.watch import (
    Key,
    Watch,
    positive_share,
    progressive_auc,
    progressive_check,
    watched_auc,
    worse,
)

LOGGER = logging.getLogger(__name__)
#: Adagrad's epsilon, under the square root of a row's accumulated squared gradient
EPSILON = 1e-10
#: a dense network the learner scores through: the bundled one, or an imported one's ONNX graph
Network = CTRNet | OnnxNet
#: rows that stand in for the store's (None: the store's row)
Overlay = Mapping[Key, "np.ndarray | None"]
#: publishes one table's delta: (table, keys, vectors) -> the version published
Publish = Callable[[str, np.ndarray, np.ndarray], int]
#: serves again what a published version replaced: (table, version) -> the new (revert) version
Rollback = Callable[[str, int], int]


class Learner:
    """Trains the rows of ``store`` through ``net`` as served, its weights frozen (see the module).

    Args:
        spec: the served spec.
        store: the served rows (read for rows the learner has not trained yet).
        net: the served dense network, its weights frozen (an imported model's: its ONNX graph
            under PyTorch, :class:`~recserve.backends.dense.onnx_torch.OnnxNet`).
        learning_rate: Adagrad's step on the rows (None: ``[loop] learning_rate``).
        train_tables: the tables whose rows it trains, empty: all (None: ``[loop] train_tables``).
        dense: trains a copy of ``net``'s weights on the same batches and loads each version it
            publishes into ``net`` (None: the weights stay as served); its ``served`` is ``net``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        store: TieredStore,
        net: Network,
        learning_rate: float | None = None,
        train_tables: tuple[str, ...] | None = None,
        dense: DenseTrainer | None = None,
    ) -> None:
        reason = trainable(spec)
        if reason:
            raise ValueError(f"recserve learn does not train specs with {reason} yet")
        if dense is not None and dense.served is not net:
            raise ValueError("the dense trainer must serve the learner's network")
        self.spec = spec
        self.store = store
        self.dense = dense
        self.net = net.eval()
        for parameter in self.net.parameters():
            parameter.requires_grad_(False)
        self.learning_rate = spec.loop.learning_rate if learning_rate is None else learning_rate
        names = (spec.loop.train_tables if train_tables is None else train_tables) or spec.table_names
        #: the ids of the tables whose rows it trains
        self.trained_tables = np.array(sorted(store.table_id(name) for name in names), np.int16)
        #: each table's width, by table id: a row's columns past it are padding
        self.widths = np.array([spec.tables[name].dim for name in store.table_names], np.int64)
        self.layout = BatchLayout(spec, store.table_id)
        self.rows: dict[Key, np.ndarray] = {}  # (table id, key) -> the row as trained
        #: each trained row's accumulated squared gradient (Adagrad), kept and reverted with its row
        self.accumulators: dict[Key, float] = {}
        self.touched: set[Key] = set()  # trained since the last publish
        self.progressive_loss: list[float] = []
        self.examples_trained = 0
        self.rows_published = 0
        self.versions_published = 0
        # when the examples trained since the last publish were labelled (their click or window end)
        self._labelled: list[float] = []
        #: seconds from an example's label to the publish of the rows trained on it: (p50, p99) of the last
        self.freshness: tuple[float, float] = (0.0, 0.0)
        self.published: dict[Key, np.ndarray] = {}  # the rows as last published
        self.published_accumulators: dict[Key, float] = {}  # their accumulators then
        self.restored: dict[Key, float] = {}  # accumulators a restart kept (:mod:`.learner_state`)
        self.refused_publishes = 0
        #: the last publish decision's log losses on the examples with a served score: (learner, served)
        self.last_check: tuple[float, float] = (0.0, 0.0)
        #: and its AUCs on them (NaN: one label alone)
        self.last_auc: tuple[float, float] = (0.0, 0.0)
        # per batch: progressive p, label, weight, served score (NaN: none)
        self._scored: list[np.ndarray] = []
        self.watching: list[Watch] = []  # in the order published
        self.rollbacks = 0
        #: the last watch judged: the log losses (its own, the replaced rows') on the examples it served
        self.last_watch: tuple[float, float] = (0.0, 0.0)
        self.last_watch_auc: tuple[float, float] = (0.0, 0.0)  # and its AUCs (NaN: one label alone)
        self.table_columns = {name: i for i, name in enumerate(spec.table_names)}  # embedding_version's order

    # ---- one batch ---------------------------------------------------------------------------
    def _vectors(
        self, keys: np.ndarray, tables: np.ndarray, *overlays: Overlay
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct rows of ``keys`` (structured: table, key), their vectors, and where each key is.

        A row comes from the first of ``overlays`` holding it (None there: the store's), else from
        the store. Without overlays: the rows as trained (:attr:`rows`).
        """
        overlays = overlays or (self.rows,)
        unique, inverse = distinct_rows(keys, tables)
        found = self.store.lookup(unique["key"], unique["table"], record=False).vectors
        vectors = np.array(found, np.float32)  # the store's widest width: each slot reads its own
        for i, key in enumerate(zip(unique["table"].tolist(), unique["key"].tolist(), strict=True)):
            for overlay in overlays:
                if key in overlay:
                    row = overlay[key]
                    if row is not None:
                        vectors[i] = row
                    break
        return unique, vectors, inverse

    def _probability(
        self,
        examples: pa.Table,
        vectors: torch.Tensor,
        mask: np.ndarray,
        weights: np.ndarray,
        net: Network | None = None,
    ) -> torch.Tensor:
        """The network's probabilities of a batch whose rows are ``vectors`` (``net``: another's).

        ``mask`` and ``weights``: each group's history mask and the multi-hot positions' pooling weights
        (:meth:`BatchLayout.of`).
        """
        named = self.layout.named(vectors, mask, weights)
        if self.net.has_dense:
            dense = pc.list_flatten(examples["dense"]).to_numpy().astype(np.float32)
            named[DENSE_NORMALIZED] = torch.tensor(dense.reshape(examples.num_rows, -1))
        return (net or self.net).score(named).reshape(-1).clamp(1e-7, 1 - 1e-7)

    def score(self, examples: pa.Table, *overlays: Overlay, net: Network | None = None) -> np.ndarray:
        """Probabilities of ``examples`` with the rows of ``overlays`` (see :meth:`_vectors`).

        ``score(batch)`` scores with the rows as trained, ``score(batch, learner.published)`` as
        published, ``score(batch, {})`` with the store's rows alone; ``net``: through another network.
        """
        keys, tables, mask, pooling = self.layout.of(examples)
        _, vectors, where = self._vectors(keys, tables, *overlays)
        with torch.no_grad():
            batch = torch.tensor(vectors[where].reshape(*keys.shape, -1))
            return self._probability(examples, batch, mask, pooling, net).numpy().astype(np.float64)

    def train(self, examples: pa.Table) -> BatchFigures:
        """Score the batch (its progressive log loss), then one Adagrad step on the rows it touched."""
        keys, tables, mask, pooling = self.layout.of(examples)
        unique, rows, where = self._vectors(keys, tables)
        vectors = torch.tensor(rows[where].reshape(*keys.shape, -1), requires_grad=True)
        probability = self._probability(examples, vectors, mask, pooling)
        labels = torch.tensor(np.asarray(examples["label"], np.float32))
        weights = 1.0 / torch.tensor(np.asarray(examples["sample_rate"], np.float32))
        loss = weighted_log_loss(probability, labels, weights)
        loss.backward()
        assert vectors.grad is not None
        grads = vectors.grad.numpy().reshape(len(where), -1)
        valid = self.layout.trained(mask, pooling)
        summed = np.zeros(rows.shape, np.float32)
        np.add.at(summed, where[valid], grads[valid])
        touched = np.zeros(len(unique), bool)
        touched[where[valid]] = True
        touched &= np.isin(unique["table"], self.trained_tables)  # the other tables' rows stay as served
        unique = unique[touched]
        pairs = list(zip(unique["table"].tolist(), unique["key"].tolist(), strict=True))
        self._step(pairs, rows[touched], summed[touched])
        figures = BatchFigures(examples.num_rows, float(loss.detach()), len(unique))
        self.progressive_loss.append(figures.log_loss)
        self.examples_trained += examples.num_rows
        self._labelled += (pc.cast(examples["labelled_at"], pa.int64()).to_numpy() / 1e6).tolist()
        served = np.array([np.nan if v is None else v for v in examples["score"].to_pylist()], np.float64)
        progressive = probability.detach().numpy().astype(np.float64)
        scored = np.stack([progressive, labels.numpy(), weights.numpy(), served], axis=1)
        self._scored.append(scored)
        if self.dense is not None:
            rows_now = vectors.detach()
            self.dense.train(
                lambda net: self._probability(examples, rows_now, mask, pooling, net), labels, weights, served
            )
            self.dense.observe(examples, scored, lambda part, net: self.score(part, self.published, net=net))
        self._observe(examples, served)
        return figures

    def _observe(self, examples: pa.Table, served: np.ndarray) -> None:
        """Hand each watch the examples its versions served (their ``embedding_version``), scored."""
        versions = np.array(examples["embedding_version"].to_pylist(), np.int64).reshape(
            examples.num_rows, -1
        )
        if not self.watching or versions.shape[1] != len(self.table_columns):
            return
        for watch in self.watching:
            columns = [self.table_columns[t] for t in watch.versions]
            wanted = np.array(list(watch.versions.values()), np.int64)
            mine = np.flatnonzero((versions[:, columns] >= wanted).any(axis=1))
            if len(mine):
                watch.scored.append(self._watched(watch, examples.take(mine), served[mine]))

    def _watched(self, watch: Watch, examples: pa.Table, served: np.ndarray) -> np.ndarray:
        """Label, weight, the new version's score and the replaced rows' of examples ``watch`` served.

        The new version's is the score served (scored again with its rows where the example carries
        none); the replaced rows' is scored with them in its rows' place, the rows served now elsewhere.
        """
        new = served.copy()
        missing = np.isnan(new)
        if missing.any():
            new[missing] = self.score(examples.filter(pa.array(missing)), watch.rows, self.published)
        before = self.score(examples, watch.previous, self.published)
        labels = np.asarray(examples["label"], np.float64)
        weights = 1.0 / np.asarray(examples["sample_rate"], np.float64)
        return np.stack([labels, weights, new, before], axis=1)

    def _step(self, keys: list[Key], rows: np.ndarray, gradients: np.ndarray) -> None:
        """Row-wise Adagrad: each row's accumulator grows by its gradient's mean square, its step shrinks."""
        accumulated = np.array([self.accumulators.get(k, 0.0) for k in keys], np.float64)
        widths = self.widths[[table for table, _ in keys]] if keys else np.ones(0, np.int64)
        # the mean over the row's table's columns (those past it are padding: their gradient is 0)
        accumulated += np.sum(np.square(gradients, dtype=np.float64), axis=1) / widths
        steps = (self.learning_rate / np.sqrt(accumulated + EPSILON)).astype(np.float32)
        moved = rows - steps[:, None] * gradients
        for key, row, total in zip(keys, moved, accumulated.tolist(), strict=True):
            self.rows[key] = row
            self.accumulators[key] = total
        self.touched.update(keys)

    def watch(
        self,
        rollback: Rollback,
        watch_examples: int,
        max_loss_increase: float,
        max_auc_drop: float | None = None,
    ) -> dict[str, int]:
        """Roll back a watched publish that scored worse than the rows it replaced; table -> revert.

        A publish is judged once ``watch_examples`` examples served by its versions came (see
        :mod:`recserve.loop.watch`): it is kept, or rolled back when its log loss on them is above
        the replaced rows' by more than ``max_loss_increase``, or its AUC below theirs by more than
        ``max_auc_drop`` (None: not checked). A rollback serves again what the
        version replaced, which undoes the versions published after it on the same tables too: the
        watches of those go with it, and the learner's rows of all of them go back (with what it
        trained on them since).
        """
        reverted: dict[str, int] = {}
        for watch in list(self.watching):
            if watch not in self.watching:
                continue  # undone with an earlier one
            judged = watch.judge(watch_examples)
            if judged is None:
                continue
            self.last_watch, self.last_watch_auc = judged, watched_auc(watch.scored)
            reason = worse(judged, self.last_watch_auc, max_loss_increase, max_auc_drop)
            if not reason:
                self.watching.remove(watch)
                continue
            LOGGER.warning("rolling back %s: against the rows it replaced, %s", watch.versions, reason)
            reverted.update(self._roll_back(watch, rollback))
        return reverted

    def _roll_back(self, watch: Watch, rollback: Rollback) -> dict[str, int]:
        """Serve again what ``watch``'s versions replaced; the later watches on its tables go with it."""
        later = self.watching[self.watching.index(watch) + 1 :]
        undone = [watch] + [w for w in later if set(w.versions) & set(watch.versions)]
        first: dict[str, int] = {}  # per table, the earliest version undone
        for each in undone:
            self.watching.remove(each)
            for table, version in each.versions.items():
                first.setdefault(table, version)
        reverted = {table: rollback(table, version) for table, version in first.items()}
        for each in reversed(undone):  # the newest first: each row ends as it was before the first
            for key, value in each.replaced.items():
                self.touched.discard(key)  # what it trained since, on the rolled-back row, goes too
                self._revert(key, value, published=True)
        self.rollbacks += 1
        return reverted

    # ---- publishing ----------------------------------------------------------------------
    def publish(
        self,
        publish: Publish,
        now: float | None = None,
        max_loss_increase: float | None = None,
        max_auc_drop: float | None = None,
    ) -> dict[str, int]:
        """Publish the rows touched since the last publish, one delta per table; table -> version.

        First the decision, on the examples since the last publish that carry their served score
        (:func:`~recserve.loop.watch.progressive_check`): when the learner's log loss exceeds
        the served one by more than ``max_loss_increase``, or its AUC falls below the served one by
        more than ``max_auc_drop`` (None: not checked), nothing is published (``refused_publishes``)
        and the touched rows go back to what is served. Also measures the freshness of what it
        published (``now``: seconds since the epoch).
        """
        self.last_check = progressive_check(self._scored)
        self.last_auc = progressive_auc(self._scored)
        share = positive_share(self._scored)
        self._scored = []
        reason = worse(self.last_check, self.last_auc, max_loss_increase, max_auc_drop)
        if reason:
            LOGGER.warning(
                "not published: %s, the learner's against the served scores'; the rows go back", reason
            )
            self.refused_publishes += 1
            for row in self.touched:
                self._revert(row, self._published_state(row))
            self.touched.clear()
            self._labelled = []
            return {}
        versions: dict[str, int] = {}
        replaced = {key: self._published_state(key) for key in self.touched}
        by_table: dict[int, list[int]] = {}
        for table, key in sorted(self.touched):
            by_table.setdefault(table, []).append(key)
        for table, keys in by_table.items():
            name = self.store.table_names[table]
            width = self.store.table_dim(name)  # rows are held at the store's widest: the table's part
            vectors = np.stack([self.rows[(table, k)][:width] for k in keys]).astype(np.float32)
            versions[name] = publish(name, np.array(keys, np.int64), vectors)
            self.rows_published += len(keys)
            self.published.update({(table, k): self.rows[(table, k)] for k in keys})
            self.published_accumulators.update({(table, k): self.accumulators[(table, k)] for k in keys})
        self.versions_published += len(versions)
        if versions:
            rows = {key: self.published[key] for key in replaced}
            self.watching.append(Watch(versions, rows, replaced, share))
        if versions and self._labelled:
            ages = (time.time() if now is None else now) - np.array(self._labelled)
            self.freshness = (float(np.percentile(ages, 50)), float(np.percentile(ages, 99)))
        self.touched.clear()
        self._labelled = []
        return versions

    def _published_state(self, key: Key) -> tuple[np.ndarray, float] | None:
        """A row as last published, with its accumulator then (None: never published, the store's)."""
        row = self.published.get(key)
        return None if row is None else (row, self.published_accumulators[key])

    def _revert(self, key: Key, state: tuple[np.ndarray, float] | None, published: bool = False) -> None:
        """Put a row and its accumulator back to ``state`` (None: the store's row, a new accumulator).

        With ``published``, what the learner holds as published goes back too (a rollback).
        """
        held: list[tuple[dict, dict]] = [(self.rows, self.accumulators)]
        if published:
            held.append((self.published, self.published_accumulators))
            if state is None:  # back to before its first publish (a watch kept over a restart)
                self.restored.pop(key, None)
        for rows, accumulators in held:
            if state is None:
                rows.pop(key, None)
                accumulators.pop(key, None)
                if key in self.restored:  # published before a restart: its accumulator then
                    accumulators[key] = self.restored[key]
            else:
                rows[key], accumulators[key] = state
