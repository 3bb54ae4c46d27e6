"""``recserve join`` end to end: a real tritonserver logs what it served, feedback goes to a real Redis
Cluster through the SDK, and the joiner, a real process, is killed with SIGKILL mid-run and started
again: every served row ends as exactly one example (a late click adds its late positive), none twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pyarrow.compute as pc
import pytest

from recserve.backends.request_log.read import read_kind
from recserve.build.synthetic import generate
from recserve.clients import CTRClient, read_rows
from recserve.clients.feedback import feedback_sink, to_events
from recserve.clients.writers import write_tsv
from recserve.core.feedback import FEEDBACK
from recserve.core.sections.logging import LOG_DIR_ENV
from recserve.core.spec.parse import load_spec
from recserve.core.streams import stream_key
from recserve.loop.joiner import read_examples
from recserve.perf.harness.redis_cluster import RedisCluster
from recserve.server import Ports, TritonServer
from tests.integration.helpers import wait_for

WINDOW_S, LATE_S = 15.0, 8.0
REQUESTS, ROWS = 12, 10


def start_joiner(spec_path, folder, *options):
    command = [sys.executable, "-m", "recserve.cli", "--spec", str(spec_path), "join", "--consumer", "j-a",
               "--log-dir", str(folder / "log"), "--examples-dir", str(folder / "examples")]  # fmt: skip
    return subprocess.Popen(
        [*command, *options], stdout=subprocess.PIPE, stderr=open(folder / "joiner.log", "ab"), text=True
    )


def checkpoint(folder):
    path = folder / "examples" / ".state" / "checkpoint.json"
    return json.loads(path.read_text()) if path.exists() else {"seq": 0, "examples": 0, "counts": {}}


def test_a_joiner_killed_mid_run_and_started_again_loses_no_example_and_emits_none_twice(
    spec, repository, tmp_path
):
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", generate(spec, REQUESTS * ROWS, seed=4), spec), spec)
    with RedisCluster(tmp_path / "redis", replicas=0) as cluster:
        doc = {
            **spec.source,
            "store": {"redis_nodes": cluster.nodes, "redis_password_env": cluster.password_env},
        }
        doc["loop"] = {
            "window_seconds": WINDOW_S,
            "late_seconds": LATE_S,
            "feedback": "redis",
            "commit_seconds": 0.5,
        }
        spec_path = tmp_path / "joiner.json"
        spec_path.write_text(json.dumps(doc))
        loop_spec = load_spec(str(spec_path))
        ids = [f"req-{k}" for k in range(REQUESTS)]
        patch = pytest.MonkeyPatch()
        patch.setenv(LOG_DIR_ENV, str(tmp_path / "log"))
        try:
            with TritonServer(repository, Ports.free(), log_path=tmp_path / "server.log") as server:
                with CTRClient(
                    server.grpc_url, timeout_s=30, spec=spec, feedback=feedback_sink(loop_spec)
                ) as client:
                    for k, request_id in enumerate(ids):
                        client.score_inputs(
                            rows.take(slice(k * ROWS, (k + 1) * ROWS)).to_inputs(spec), request_id
                        )
                    served = time.time()
                    client.report_feedback(
                        [(ids[0], 1, "click"), (ids[0], 1, "click"), (ids[1], 2, "impression"),
                         ("never-served", 0, "click")]
                    )  # fmt: skip
                    sink = client.feedback
        finally:
            patch.undo()  # the server stopped: its steps wrote what they held
        cluster_client = sink.client  # type: ignore[attr-defined]
        cluster_client.xadd(
            stream_key("rs:loop", FEEDBACK, 0), {"request_id": "x", "row": "0", "event": "view"}
        )

        items = rows.take(slice(4 * ROWS, 5 * ROWS)).to_inputs(spec)[spec.target.name].reshape(-1).tolist()
        item_of_9 = int(items[9])  # a click naming the item: the joiner finds its row
        row_of_9 = items.index(item_of_9)
        late_row = read_kind(tmp_path / "log", "features").filter(pc.equal(pc.field("request_id"), ids[5]))
        late_at = late_row["time"][0].value / 1e6 + WINDOW_S + 1  # after its window

        joiner = start_joiner(spec_path, tmp_path)
        try:
            wait_for(lambda: checkpoint(tmp_path)["examples"] >= 1, 60, "the first positive committed")
            by_item = {"request_id": ids[4], "item": item_of_9, "event": "click", "time": served}
            sink.write([*_events([(ids[2], 0), (ids[3], 4)], at=served), *to_events([by_item])])
            time.sleep(0.3)
            joiner.send_signal(
                signal.SIGKILL
            )  # mid-run: rows held open, feedback perhaps read, not committed
            joiner.wait(10)
            killed_at = checkpoint(tmp_path)

            port = Ports.free().http
            joiner = start_joiner(spec_path, tmp_path, "--metrics-port", str(port))
            wait_for(lambda: time.time() > late_at, 60, "the late click's time")
            sink.write(_events([(ids[5], 5)], at=late_at))
            wait_for(
                lambda: checkpoint(tmp_path)["counts"].get("late_positives", 0) == 1,
                60,
                "the late positive committed",
            )
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                scraped = response.read().decode()
            joiner.send_signal(signal.SIGTERM)
            summary = json.loads(joiner.communicate(timeout=30)[0].strip().splitlines()[-1])
        finally:
            joiner.kill()

    examples = read_examples(tmp_path / "examples").to_pylist()
    emitted = Counter((e["request_id"], e["row"], e["label"], e["late"]) for e in examples)
    assert max(emitted.values()) == 1, [k for k, n in emitted.items() if n > 1]  # none twice
    positives = {(ids[0], 1), (ids[2], 0), (ids[3], 4), (ids[4], row_of_9)}
    expected = {(rid, r, int((rid, r) in positives), False) for rid in ids for r in range(ROWS)}
    expected.add((ids[5], 5, 1, True))
    assert set(emitted) == expected  # none lost
    assert summary["examples"] == len(expected) and summary["late_positives"] == 1
    assert summary["duplicate_feedback"] == 1
    assert "recserve_join_waiting_feedback 1" in scraped  # the never-served id's click: held, not fatal
    assert checkpoint(tmp_path)["refused"]["feedback"] == 1  # the malformed entry, counted across the restart
    assert killed_at["seq"] >= 1
    assert 'recserve_join_total{count="late_positives"} 1' in scraped
    late = next(e for e in examples if e["late"])
    assert late["score"] is not None and len(late["keys"]) > 0 and late["sample_rate"] == 1.0


def _events(pairs, at):
    return to_events([(rid, row, "click", at) for rid, row in pairs])
