"""Bounded soak: mixed traffic with 1% malformed requests and dense updates; memory and fds stay flat.

The same detector must catch a stub that leaks on purpose, or it proves nothing.
"""

import os

from recserve.perf.lab.soak import DenseVersionUpdater, EmbeddingDeltaUpdater, alternate, run_soak

from .private_server import private_server

SOAK_S = float(os.environ.get("RECSERVE_SOAK_S", "60"))
LEAKING_S = 30.0

#: Appended to the embedding_lookup adapter: a stub that keeps 8 MB and 8 descriptors per second.
LEAK = '''

import os as _os
import time as _time


class TritonPythonModel(_Served):
    """Leaks on purpose (memory and file descriptors, growing with time, bounded)."""

    def initialize(self, args):
        super().initialize(args)
        self.started, self.kept = _time.monotonic(), []

    def execute(self, requests):
        due = min(400, int(8 * (_time.monotonic() - self.started)))
        while len(self.kept) < due:
            self.kept.append((b"\\x01" * (1 << 20), _os.open(_os.devnull, _os.O_RDONLY)))
        return super().execute(requests)
'''


def _leaking_lookup(root):
    adapter = root / "embedding_lookup" / "1" / "model.py"
    source = adapter.read_text()
    assert "class TritonPythonModel:" in source
    adapter.write_text(source.replace("class TritonPythonModel:", "class _Served:") + LEAK)


def test_soak_keeps_memory_and_descriptors_flat_through_updates(repository, spec, tmp_path):
    with private_server(repository, tmp_path) as server:
        dense = DenseVersionUpdater(server.repository, server.grpc_url, server.security.headers())
        embeddings = EmbeddingDeltaUpdater(spec, server.repository)
        # a dense load compiles every bucket: on 2 shared cores, one update per 10 s (dense and
        # embedding versions in turn) and a lighter load
        report = run_soak(
            server, spec, SOAK_S, alternate(dense, embeddings), update_every_s=SOAK_S / 6, pause_s=0.02
        )
    print(report.table())
    assert report.passed, report.table()
    assert report.counts.bad_refused > 0, "no malformed request was sent"
    assert len(report.updates) >= 4 and len(report.counts.versions) >= 3, report.table()
    assert len(report.counts.embedding_versions) >= 2, report.table()  # responses name the store snapshot too
    assert any("published" in u for u in report.updates) and any("back to base" in u for u in report.updates)
    assert {"tritonserver", "embedding_lookup", "dense"} <= set(report.growth)


def test_the_same_detector_fails_a_leaking_stub(repository, spec, tmp_path):
    with private_server(repository, tmp_path, prepare=_leaking_lookup) as server:
        report = run_soak(server, spec, LEAKING_S)
    print(report.table())
    assert not report.passed
    assert any(p.startswith("embedding_lookup: resident memory grew") for p in report.problems), (
        report.problems
    )
    assert any(p.startswith("embedding_lookup:") and "file descriptors" in p for p in report.problems), (
        report.problems
    )
    assert not any(p.startswith(("tritonserver", "dense")) for p in report.problems), report.problems
