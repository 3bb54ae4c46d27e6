"""``recserve learn``'s process: train on the joined examples as they are committed, publish, watch.

:class:`LearnLoop` holds what the process runs on: the served store and network, the
:class:`~recserve.loop.learner.Learner` (the rows) and, with ``dense_learning_rate``, its
:class:`~recserve.loop.dense.DenseTrainer`, where they publish (the update log; dense versions
loaded by the servers) and what a restart takes back (beside the examples, under ``.state``).
Each round trains on the segments committed since the last, judges the published versions it
watches, and publishes the dense weights and the touched rows when their intervals are due. Every
step prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.store.served import ServedStore
from recserve.build.repository import load_served_net
from recserve.commands.spec_source import command_spec
from recserve.core.files import write_text_atomically
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.loop import learner_state
from recserve.loop.dense import DenseTrainer
from recserve.loop.joiner import committed_segments
from recserve.loop.learner import Learner

#: the command's flags that override ``[loop]`` when given
OVERRIDES = (
    "learning_rate",
    "max_loss_increase",
    "max_auc_drop",
    "watch_examples",
    "train_tables",
    "dense_learning_rate",
    "dense_publish_seconds",
)


def say(line: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed (what a supervisor or the bench reads)."""
    print(json.dumps(line), flush=True)


def checked(trainer: Learner | DenseTrainer) -> dict[str, float]:
    """A publish decision's figures (the learner's or its dense trainer's) for its JSON line."""
    (loss, served_loss), (auc, served_auc) = trainer.last_check, trainer.last_auc
    return {
        "log_loss": round(loss, 5),
        "served_log_loss": round(served_loss, 5),
        "auc": round(auc, 4),
        "served_auc": round(served_auc, 4),
    }


class LearnLoop:
    """``recserve learn`` on ``args`` (the command's parsed flags); :meth:`run` until stopped."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        spec = command_spec(args)
        self.served = ServedStore.open(
            spec, args.repository / EMBEDDING_LOOKUP / str(spec.version), start=False
        )
        dense_version, net = load_served_net(spec, args.repository)
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
        given = {name: getattr(args, name) for name in OVERRIDES}
        settings = dataclasses.replace(spec.loop, **{k: v for k, v in given.items() if v is not None})
        settings.check(spec.table_names)
        self.settings = settings
        self.margins = (settings.max_loss_increase, settings.max_auc_drop)
        self.examples = args.examples_dir or Path(spec.loop.examples_directory)
        self.progress = self.examples / ".state" / "learner.json"  # what a restart keeps: beside them
        self.dense_kept = self.progress.with_name("learner-dense-optimizer.safetensors")
        self.dense_watches = self.progress.with_name("learner-dense-watches.safetensors")
        self.dense: DenseTrainer | None = None
        if settings.dense_learning_rate > 0:
            if not isinstance(net, CTRNet):
                raise ValueError(
                    "the dense network is an imported ONNX one, kept frozen: leave --dense-learning-rate at 0"
                )
            self.dense = DenseTrainer(net, settings.dense_learning_rate, dense_version)
            learner_state.restore_dense(self.dense, self.dense_kept)
            learner_state.restore_dense_watches(self.dense, self.dense_watches)
            from recserve.commands.dense_versions import dense_publisher

            self.publish_dense = dense_publisher(spec, args.repository, args.servers)
        self.learner = Learner(
            spec, self.served.store, net, settings.learning_rate, settings.train_tables, self.dense
        )
        self.trained = json.loads(self.progress.read_text())["trained"] if self.progress.exists() else 0
        self.kept = self.progress.with_name("learner-accumulators.npz")
        learner_state.restore(self.learner, self.kept)
        self.watches = self.progress.with_name("learner-watches.npz")
        learner_state.restore_watches(self.learner, self.watches)

    def keep(self) -> None:
        """Save what a restart takes back: the published rows' accumulators, the watches."""
        learner_state.save(self.learner, self.kept)
        learner_state.save_watches(self.learner, self.watches)

    def publish(self, table: str, keys: Any, vectors: Any) -> int:
        """Publish rows through the update log, as ``recserve update`` does; their version."""
        served = self.served
        version = served.updater.log.publish(
            table, keys, vectors, served.store.table_dim(table),
            check=lambda: served.updater.check_publishable(table, keys),
        )  # fmt: skip
        if served.maintainer.stream is not None:
            served.maintainer.stream.publish(table, version)
        return version

    def rollback(self, table: str, version: int) -> int:
        """Serve again what ``version`` replaced, as a new version; its number."""
        log = self.served.updater.log
        revert = log.rollback(table, log.record(table, version).parent)
        if self.served.maintainer.stream is not None:
            self.served.maintainer.stream.publish(table, revert)
        return revert

    def run(self) -> int:
        """Train, watch and publish until SIGINT or SIGTERM (``--once``: until nothing is left)."""
        args = self.args
        if args.metrics_port is not None:
            from recserve.loop.metrics import learn_samples, text
            from recserve.server.metrics_endpoint import serve_metrics

            serve_metrics(args.metrics_port, lambda: text(learn_samples(self.learner)), "loop-metrics")
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        started = self.last_publish = self.last_dense = time.monotonic()
        while not stop.is_set():
            segments = committed_segments(self.examples, self.trained)
            for seq, path in segments:
                self.train(seq, path)
            done = args.once and not segments
            self.publish_dense_when_due(done)
            self.publish_rows_when_due(done)
            if done or (args.for_seconds is not None and time.monotonic() - started >= args.for_seconds):
                break
            if not segments:
                stop.wait(1.0)
        return 0

    def train(self, seq: int, path: Path) -> None:
        """Train on the committed segment ``seq``, then judge the versions watched."""
        table = pq.read_table(path)
        for start in range(0, table.num_rows, self.args.batch_size):
            figures = self.learner.train(table.slice(start, self.args.batch_size))
            line = {"segment": seq, "examples": figures.examples, "rows": figures.rows}
            say({**line, "log_loss": round(figures.log_loss, 5)})
        self.trained = seq
        watched = len(self.learner.watching)
        reverted = self.learner.watch(self.rollback, self.settings.watch_examples, *self.margins)
        if reverted:
            say({"rolled_back": reverted})
        if len(self.learner.watching) != watched:  # judged: kept or rolled back
            self.keep()
        if self.dense is not None:
            watched = len(self.dense.watching)
            revert = self.dense.watch(self.publish_dense, self.settings.watch_examples, *self.margins)
            if revert is not None:
                say({"dense_rolled_back": revert})
                learner_state.save_dense(self.dense, self.dense_kept)
            if len(self.dense.watching) != watched:  # judged: kept or rolled back
                learner_state.save_dense_watches(self.dense, self.dense_watches)

    def publish_dense_when_due(self, done: bool) -> None:
        """A new dense version, when the weights trained and their interval passed (or at the end)."""
        due = done or time.monotonic() - self.last_dense >= self.settings.dense_publish_seconds
        if self.dense is None or not self.dense.pending or not due:
            return
        version = self.dense.publish(self.publish_dense, *self.margins)
        self.last_dense = time.monotonic()
        if version is not None:
            learner_state.save_dense(self.dense, self.dense_kept)
            learner_state.save_dense_watches(self.dense, self.dense_watches)
        say({"dense_published": version, **checked(self.dense)})

    def publish_rows_when_due(self, done: bool) -> None:
        """The touched rows, when their interval passed (or at the end); what was trained, kept."""
        due = done or time.monotonic() - self.last_publish >= self.args.publish_seconds
        if not self.learner.touched or not due:
            return
        max_loss_increase, max_auc_drop = self.margins
        published = self.learner.publish(
            self.publish, max_loss_increase=max_loss_increase, max_auc_drop=max_auc_drop
        )
        self.last_publish = time.monotonic()
        self.progress.parent.mkdir(parents=True, exist_ok=True)
        # what was trained up to the rows just published
        write_text_atomically(self.progress, json.dumps({"trained": self.trained, "versions": published}))
        self.keep()
        fresh = [round(f, 3) for f in self.learner.freshness]
        decision: dict[str, object] = {
            "published": published,
            "trained": self.trained,
            **checked(self.learner),
            "freshness_p50_s": fresh[0],
            "freshness_p99_s": fresh[1],
        }
        say(decision)
