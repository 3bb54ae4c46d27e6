"""``recserve join`` and ``recserve learn``: the closed loop's joiner and learner, long-running processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from recserve.commands.dense_versions import server_list
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec


def item_key(spec: ModelSpec) -> Callable[[int], int] | None:
    """An item id's target key, made by the step's own transform (None: the spec has no target)."""
    if not spec.targets:
        return None
    import numpy as np

    from recserve.backends.features.transform import FeatureTransform

    transform = FeatureTransform(spec)
    return lambda item: int(transform.target_keys(np.array([[item]], np.int64))[0, 0])


def _join(args: argparse.Namespace) -> int:
    from recserve.backends.request_log.streams import cluster_client
    from recserve.loop.batch import record_problem
    from recserve.loop.join import Join
    from recserve.loop.joiner import Joiner
    from recserve.loop.sources import FeedbackFiles, LogSegments, Source, feedback_streams, log_streams

    spec = load_spec(args.spec)
    logging_, loop = spec.logging, spec.loop
    consumer = args.consumer or socket.gethostname()
    client = None
    if logging_.sink == "redis" and args.log_dir is None:
        client = cluster_client(spec.store)
        log: Source = log_streams(client, logging_.stream_prefix, logging_.streams, consumer)
    else:
        log = LogSegments(args.log_dir or Path(logging_.directory))
    if loop.feedback == "redis" and args.feedback_dir is None:
        client = client or cluster_client(spec.store)
        feedback: Source = feedback_streams(client, loop.feedback_prefix, loop.feedback_streams, consumer)
    else:
        feedback = FeedbackFiles(args.feedback_dir or Path(loop.feedback_directory))
    if args.score_wait_seconds is not None:
        loop = dataclasses.replace(loop, score_wait_seconds=args.score_wait_seconds)
        loop.check()
    join = Join(
        loop.window_seconds,
        loop.late_seconds,
        loop.negative_rate,
        loop.require_impression,
        item_key(spec),
        -len(spec.targets),
        loop.score_wait_seconds,
        record_problem(spec),
    )
    joiner = Joiner(
        join, log, feedback, args.examples_dir or Path(loop.examples_directory), loop.commit_seconds
    )
    if args.metrics_port is not None:
        from recserve.loop.metrics import join_samples, text
        from recserve.server.metrics_endpoint import serve_metrics

        serve_metrics(args.metrics_port, lambda: text(join_samples(joiner)), "loop-metrics")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    joiner.run(stop, args.for_seconds)
    print(json.dumps({"examples": joiner.examples_written, "checkpoint": joiner.seq, **join.counts}))
    return 0


def _learn(args: argparse.Namespace) -> int:
    from recserve.commands.learn_loop import LearnLoop

    return LearnLoop(args).run()


def table_names(text: str) -> tuple[str, ...]:
    """``item,C3`` as ``("item", "C3")``; an empty text as no table (``[loop] train_tables``: all)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``join`` and ``learn``."""
    join = sub.add_parser(
        "join",
        help="pair logged rows with their feedback (clicks, impressions) into training examples",
        description=(
            "Join the rows the servers logged ([logging]) with the feedback that follows ([loop]): a click "
            "within [loop] window_seconds makes a positive, a window closing unclicked a negative (kept at "
            "negative_rate), a later click a late positive. Writes Parquet segments of examples; stop it "
            "with SIGINT or SIGTERM (it commits), or kill it: started again, it resumes from its last commit."
        ),
    )
    join.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="read the log's Parquet segments here "
        '(default: [logging] directory, or its Redis streams with sink = "redis")',
    )
    join.add_argument(
        "--feedback-dir",
        type=Path,
        default=None,
        help="read feedback JSON lines (*.jsonl) here "
        '(default: [loop] feedback_directory, or its Redis streams with feedback = "redis")',
    )
    join.add_argument(
        "--examples-dir",
        type=Path,
        default=None,
        help="write examples here (default: [loop] examples_directory)",
    )
    join.add_argument(
        "--consumer",
        default=None,
        help="this joiner's name in the streams' consumer group "
        "(default: the host name); the same name after a restart resumes its entries",
    )
    join.add_argument(
        "--score-wait-seconds",
        type=float,
        default=None,
        help="a click waits at most this long for its row's score record, then its positive goes without "
        "it (default: [loop] score_wait_seconds)",
    )
    join.add_argument(
        "--for-seconds", type=float, default=None, help="stop after this long (default: run on)"
    )
    join.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on 127.0.0.1 here")
    join.set_defaults(func=_join)
    learn = sub.add_parser(
        "learn",
        help="train the served embedding rows on the joiner's examples; publish the touched rows as deltas",
        description=(
            "Follow the examples recserve join commits, train the served embedding rows on them through the "
            "served dense network (an imported model's ONNX graph too) with a per-row adaptive step "
            "(Adagrad), and publish only the rows touched as embedding deltas through the update log every "
            "--publish-seconds (servers apply them within their poll). With --dense-learning-rate, the "
            "bundled network's weights train too and go live as new dense versions that --servers load."
        ),
    )
    learn.add_argument("--repository", type=Path, default=None)
    learn.add_argument(
        "--examples-dir",
        type=Path,
        default=None,
        help="the joiner's examples (default: [loop] examples_directory)",
    )
    learn.add_argument(
        "--publish-seconds", type=float, default=60.0, help="publish the touched rows this often"
    )
    learn.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="the rows' Adagrad step (default: [loop] learning_rate)",
    )
    learn.add_argument(
        "--train-tables",
        type=table_names,
        default=None,
        metavar="TABLES",
        help="train only these tables' rows, e.g. item or item,C3 ('' : all tables; "
        "default: [loop] train_tables)",
    )
    learn.add_argument("--batch-size", type=int, default=256)
    learn.add_argument("--once", action="store_true", help="train on what is committed, publish, and stop")
    learn.add_argument(
        "--for-seconds", type=float, default=None, help="stop after this long (default: run on)"
    )
    learn.add_argument(
        "--max-loss-increase",
        type=float,
        default=None,
        help="publish only when the learner's progressive log loss is at most this much above the served "
        "scores' on the same examples; otherwise the rows go back to what is served "
        "(default: [loop] max_loss_increase)",
    )
    learn.add_argument(
        "--max-auc-drop",
        type=float,
        default=None,
        help="and only when its progressive AUC is at most this much below the served scores' "
        "(default: [loop] max_auc_drop)",
    )
    learn.add_argument(
        "--watch-examples",
        type=int,
        default=None,
        help="after a publish, judge it on this many examples its versions served: when its log loss on them "
        "is above that of the rows it replaced by more than --max-loss-increase, roll the versions back "
        "(default: [loop] watch_examples)",
    )
    learn.add_argument(
        "--dense-learning-rate",
        type=float,
        default=None,
        help="train the dense network's weights too, with this Adagrad step (0: frozen; "
        "default: [loop] dense_learning_rate)",
    )
    learn.add_argument(
        "--dense-publish-seconds",
        type=float,
        default=None,
        help="publish the trained weights as a new dense version this often "
        "(default: [loop] dense_publish_seconds)",
    )
    learn.add_argument(
        "--servers",
        type=server_list,
        default=(),
        metavar="HOST:PORT,...",
        help="gRPC endpoints of the servers (--model-control explicit) that load each new dense version "
        "(the admin key from RECSERVE_ADMIN_KEY)",
    )
    learn.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on 127.0.0.1 here")
    learn.set_defaults(func=_learn)
