"""``recserve join``: the closed loop's joiner of logged rows and feedback, a long-running process."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
from pathlib import Path

from recserve.core.spec.parse import load_spec


def _join(args: argparse.Namespace) -> int:
    from recserve.backends.request_log.streams import cluster_client
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
    join = Join(loop.window_seconds, loop.late_seconds, loop.negative_rate, loop.require_impression)
    joiner = Joiner(
        join, log, feedback, args.examples_dir or Path(loop.examples_directory), loop.commit_seconds
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    joiner.run(stop, args.for_seconds)
    print(json.dumps({"examples": joiner.examples_written, "checkpoint": joiner.seq, **join.counts}))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``join``."""
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
        "--for-seconds", type=float, default=None, help="stop after this long (default: run on)"
    )
    join.set_defaults(func=_join)
