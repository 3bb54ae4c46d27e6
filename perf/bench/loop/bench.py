"""``recserve bench-loop``: the loop served beside a frozen copy of the same model, on the same requests.

Two tritonservers serve copies of one built repository under a bench-local spec: the **loop** one
logs every request (``[logging]`` at rate 1.0, Parquet segments of one second) and follows the
update log that ``recserve learn`` publishes to; the **frozen** one has logging off and an update
log of its own that nothing writes. ``recserve join`` and ``recserve learn`` run as separate
processes, as a user runs them. In rounds, one client sends each request of the drifting stream
(:mod:`.stream`) to both servers (which one goes first alternates) and reports the rows'
impressions and clicks as feedback, as the SDK does; the joiner is killed with SIGKILL a third of
the way and started again, the learner two thirds (``LoopGrid.kill``). Then both stop and, closed
loop, the servers are driven alone by turns (loop, frozen, frozen, loop, ...) for the throughput
with and without logging, then paced, with a third server (the **control**, another frozen copy)
for the latency and its A/A (:mod:`.phases`). :mod:`.figures` reads what this module recorded.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from recserve.build import configs
from recserve.build.repository import reference_pipeline
from recserve.clients import CTRClient
from recserve.clients.feedback import FeedbackFile
from recserve.core.rows import Rows
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import parse_spec
from recserve.perf.bench.loop import phases
from recserve.perf.bench.loop.phases import LATENCY_SIDES
from recserve.perf.bench.loop.processes import ADMIN_KEY, kill, start_joiner, start_learner
from recserve.perf.bench.loop.stream import DriftingStream, StreamSettings
from recserve.server import Ports, Security, TritonServer

#: The bench-local spec of the loop side, written beside its repository (``recserve --spec FILE``).
SPEC_FILE = "loop_spec.json"


@dataclass(frozen=True)
class LoopGrid:
    """How long and how hard the bench runs, and the loop's settings."""

    rounds: int = 12
    round_seconds: float = 20.0
    rate: float = 8.0  # requests per second to each server during the rounds
    rows: int = 32  # rows per request
    window_seconds: float = 4.0  # [loop] W: clicks are reported at once; W covers the log segments' delay
    commit_seconds: float = 1.0  # the joiner's
    segment_seconds: float = 1.0  # [logging]: a log segment closes this old
    publish_seconds: float = 5.0  # the learner's
    # The stream drifts its items' clicks, so the bench trains the item rows, at the rate the replay
    # chose for them (docs/design/loop.md): a user's [loop] names the tables that move for them.
    learning_rate: float | None = 0.03  # the learner's step (None: [loop] learning_rate)
    train_tables: tuple[str, ...] | None = None  # None: the drifting items' table; (): every table
    batch_size: int = 128
    # the learner trains the dense network too (0: frozen), publishing a dense version this often: the
    # loop server runs with model control explicit and loads each one (a hot swap during the rounds)
    dense_learning_rate: float = 0.0
    dense_publish_seconds: float = 20.0
    throughput_seconds: float = 4.0  # one turn of the throughput phase
    # per server, in the order loop, frozen, frozen, loop, ...: a pair of turns moves by about 10% on
    # two shared cores, so eight of them put a run's ratio within about 0.035 (four: 0.05)
    throughput_turns: int = 8
    throughput_clients: int = 2  # requests in flight during a turn
    # the latency phase: per server, turns of one client sending this many requests a second; at 40 a
    # second, eight turns of 3 s give each server 960 requests, a p99 over its ten slowest
    latency_rate: float = 40.0
    latency_seconds: float = 3.0
    latency_turns: int = 8
    kill: bool = True  # kill -9 the joiner a third of the way and the learner two thirds; each starts again
    stream: StreamSettings = field(default_factory=StreamSettings)

    @classmethod
    def quick(cls) -> LoopGrid:
        """Six 8-second rounds, then eight turns of 3 s per server in each phase (about 3.5 min here)."""
        return cls(rounds=6, round_seconds=8.0, throughput_seconds=3.0)


@dataclass
class Served:
    """One request as both servers answered it."""

    round: int
    request_id: str
    sent: float  # seconds since the epoch
    clicks: np.ndarray
    loop_scores: np.ndarray
    frozen_scores: np.ndarray
    loop_latency_s: float
    frozen_latency_s: float
    loop_first: bool
    item_version: int  # the target table's version that the loop server answered with


@dataclass
class Recorded:
    """What a run recorded, for :mod:`.figures`."""

    grid: LoopGrid
    folder: Path
    log_dir: Path
    examples_dir: Path
    loop_repository: Path
    item_table: str
    served: list[Served] = field(default_factory=list)
    learner_lines: list[tuple[float, dict]] = field(default_factory=list)  # (seen at, the line)
    loop_rows_sent: int = 0
    throughput_rows: dict[str, float] = field(default_factory=lambda: {"loop": 0.0, "frozen": 0.0})
    throughput_seconds: dict[str, float] = field(default_factory=lambda: {"loop": 0.0, "frozen": 0.0})
    #: each request's latency in the latency phase, per server (:data:`.phases.LATENCY_SIDES`)
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in LATENCY_SIDES})
    joiner_summary: dict = field(default_factory=dict)
    exits: dict[str, int | None] = field(default_factory=dict)  # the joiner's and the learner's exit status
    kills: list[dict] = field(default_factory=list)  # each kill -9: the process, the round, its time
    joiner_stopped: float = 0.0  # when the last joiner was told to stop (seconds since the epoch)
    negative_rate: float = 1.0  # the loop's w: the share of negatives the joiner keeps
    seconds: float = 0.0


def bench_specs(spec: ModelSpec, folder: Path, grid: LoopGrid) -> tuple[ModelSpec, ModelSpec]:
    """The loop side's spec (logging on, ``[loop]`` settings) and the frozen side's (logging off)."""
    doc = copy.deepcopy(spec.source)
    doc["loop"] = {
        **doc.get("loop", {}),
        "window_seconds": grid.window_seconds,
        "late_seconds": 10.0,
        "commit_seconds": grid.commit_seconds,
        "feedback": "files",
        "feedback_directory": str(folder / "feedback"),
        "examples_directory": str(folder / "examples"),
    }
    tables = grid.train_tables
    if tables is None and spec.targets:
        tables = (spec.targets[0].table,)  # the items the stream drifts
    if tables is not None:
        doc["loop"]["train_tables"] = list(tables)
    frozen = {**doc, "logging": {"enabled": False}}
    doc["logging"] = {
        "enabled": True,
        "sample_rate": 1.0,
        "sink": "parquet",
        "directory": str(folder / "log"),
        "segment_seconds": grid.segment_seconds,
    }
    return parse_spec(doc), parse_spec(frozen)


def copy_served(source: Path, target: Path, spec: ModelSpec) -> Path:
    """``source``'s model (without its update log) at ``target``, its configs written for ``spec``."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("updates", "__pycache__"))
    configs.write_configs(spec, target)
    return target


def starting_logits(spec: ModelSpec, repository: Path) -> Callable[[Rows], np.ndarray]:
    """The logits that ``repository``'s model gives rows, in process (ONNX Runtime, as served)."""
    pipeline = reference_pipeline(spec, repository, runtime="onnx")

    def logits(rows: Rows) -> np.ndarray:
        parts = []
        for start in range(0, len(rows), spec.model.max_batch_size):
            part = rows.take(slice(start, start + spec.model.max_batch_size))
            parts.append(np.asarray(pipeline.predict(part.to_inputs(spec)), np.float64).reshape(-1))
        p = np.clip(np.concatenate(parts), 1e-6, 1 - 1e-6)
        return np.log(p / (1 - p))

    return logits


def run_loop(
    spec: ModelSpec, source: Path, folder: Path, grid: LoopGrid, progress: Callable[[str], None]
) -> Recorded:
    """Serve the drifting stream through the loop and the frozen copy; what was recorded.

    ``source`` is a repository built from ``spec``; ``folder`` (new or empty) receives the two
    repositories, the log, the feedback, the examples and the processes' logs.
    """
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    loop_spec, frozen_spec = bench_specs(spec, folder.resolve(), grid)
    loop_repository = copy_served(source, folder / "loop_repository", loop_spec)
    frozen_repository = copy_served(source, folder / "frozen_repository", frozen_spec)
    control_repository = copy_served(source, folder / "control_repository", frozen_spec)
    spec_file = folder / SPEC_FILE
    spec_file.write_text(json.dumps(loop_spec.source, indent=1))
    stream = DriftingStream(spec, grid.rounds, grid.stream, row_logits=starting_logits(spec, source))
    item_table = loop_spec.targets[0].table  # DriftingStream checked there is one
    recorded = Recorded(grid, folder, folder / "log", folder / "examples", loop_repository, item_table)
    recorded.negative_rate = loop_spec.loop.negative_rate
    loop_security = (
        Security(model_control="explicit", admin_key=ADMIN_KEY) if grid.dense_learning_rate else None
    )
    servers = {
        "loop": TritonServer(
            loop_repository, Ports.free(), log_path=folder / "loop_server.log", security=loop_security
        ),
        "frozen": TritonServer(frozen_repository, Ports.free(), log_path=folder / "frozen_server.log"),
        "control": TritonServer(control_repository, Ports.free(), log_path=folder / "control_server.log"),
    }
    with ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.stop)
        progress("[bench-loop] starting the loop, the frozen and the control tritonservers")
        _start_all(list(servers.values()))
        joiner = start_joiner(spec_file, recorded, stack)
        learner, reader = start_learner(spec_file, recorded, stack, servers["loop"].grpc_url)
        feedback = FeedbackFile(folder / "feedback" / "bench.jsonl")
        with (
            CTRClient(servers["loop"].grpc_url, timeout_s=30, spec=spec, feedback=feedback) as loop_client,
            CTRClient(servers["frozen"].grpc_url, timeout_s=30, spec=spec) as frozen_client,
        ):
            for round_ in range(grid.rounds):
                if grid.kill and round_ == max(grid.rounds // 3, 1):
                    kill(joiner, "joiner", round_, recorded, progress)
                    joiner = start_joiner(spec_file, recorded, stack)
                if grid.kill and round_ == max(2 * grid.rounds // 3, 2):
                    kill(learner, "learner", round_, recorded, progress)
                    reader.join(10)
                    learner, reader = start_learner(spec_file, recorded, stack, servers["loop"].grpc_url)
                _serve_round(spec, stream, round_, loop_client, frozen_client, recorded)
                published = [line for _, line in recorded.learner_lines if line.get("published")]
                progress(
                    f"[bench-loop] round {round_ + 1}/{grid.rounds}: {len(recorded.served)} requests, "
                    f"{len(published)} versions published"
                )
            recorded.joiner_stopped = time.time()
            for process in (learner, joiner):  # they commit and stop
                process.send_signal(signal.SIGTERM)
            learner.wait(60)
            reader.join(10)
            out = joiner.communicate(timeout=60)[0].strip().splitlines()
            recorded.exits = {"joiner": joiner.returncode, "learner": learner.returncode}
            recorded.joiner_summary = json.loads(out[-1]) if out else {}
            time.sleep(2 * loop_spec.store.update_poll_s + 0.5)  # the last publish served
            requests = [stream.request(grid.rounds, grid.rows)[0].to_inputs(spec) for _ in range(16)]
            progress("[bench-loop] throughput: each server alone by turns, logging on and off")
            phases.throughput(spec, requests, servers, recorded)
            progress("[bench-loop] latency: each server alone by turns, logging on, off and off again")
            phases.latency(spec, requests, servers, recorded)
        for server in servers.values():
            server.stop()  # the loop server's steps write what they hold
    recorded.seconds = time.monotonic() - started
    (folder / "grid.json").write_text(json.dumps(asdict(grid), indent=1))
    return recorded


def _start_all(servers: list[TritonServer]) -> None:
    errors: list[BaseException] = []

    def start(server: TritonServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # reported below, with the server it came from
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _serve_round(
    spec: ModelSpec,
    stream: DriftingStream,
    round_: int,
    loop_client: CTRClient,
    frozen_client: CTRClient,
    recorded: Recorded,
) -> None:
    """One round at the grid's rate: each request to both servers, then its feedback."""
    grid = recorded.grid
    count = max(1, round(grid.rate * grid.round_seconds))
    start = time.monotonic()
    for k in range(count):
        wait = start + k / grid.rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        rows, _, clicks = stream.request(round_ + k / count, grid.rows)
        inputs = rows.to_inputs(spec)
        request_id = f"r{round_}-{k}"
        loop_first = len(recorded.served) % 2 == 0
        answers = {}
        for side in ("loop", "frozen") if loop_first else ("frozen", "loop"):
            client = loop_client if side == "loop" else frozen_client
            sent = time.perf_counter()
            scores = client.score_inputs(inputs, request_id)
            answers[side] = (scores, time.perf_counter() - sent)
        now = time.time()
        recorded.loop_rows_sent += grid.rows
        events: list[tuple[str, int, str, float]] = [
            (request_id, r, "impression", now) for r in range(grid.rows)
        ]
        events += [(request_id, int(r), "click", now) for r in np.flatnonzero(clicks)]
        loop_client.report_feedback(events)
        loop_scores, loop_latency = answers["loop"]
        recorded.served.append(
            Served(
                round=round_,
                request_id=request_id,
                sent=now,
                clicks=clicks,
                loop_scores=np.asarray(loop_scores.probabilities, np.float64).reshape(-1),
                frozen_scores=np.asarray(answers["frozen"][0].probabilities, np.float64).reshape(-1),
                loop_latency_s=loop_latency,
                frozen_latency_s=answers["frozen"][1],
                loop_first=loop_first,
                item_version=loop_scores.table_versions()[recorded.item_table],
            )
        )
