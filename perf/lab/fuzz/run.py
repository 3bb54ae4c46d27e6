"""``recserve lab fuzz``: a seeded differential fuzzer of JSON inference bodies through the real proxy.

The access layer (Envoy with the front door, in front of supervised tritonservers on loopback) is
started over the repository; cases from :class:`~recserve.perf.lab.fuzz.cases.CaseMaker` are sent,
one at a time, to the public HTTP listener. After each answer the fuzzer checks that every
tritonserver is the process it was (same pid, alive, no death in the supervisor's counts) and holds
the answer against what :func:`~recserve.perf.lab.fuzz.bodies.classify` expects:

* ``fuzz_crashes``: a tritonserver died (or was restarted) after the case;
* ``fuzz_failed_valid``: a valid request not answered 200 with outputs;
* ``fuzz_invalid_passed``: a request the front door promises to refuse answered other than 4xx;
* ``fuzz_server_errors``: any other case answered 5xx or not at all.

The same seed, spec and repository give the same cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.access import AccessLayer, ProxyPorts
from recserve.access.front_door import MAX_DEPTH, MAX_DIMS, FrontDoor
from recserve.build.synthetic import generate
from recserve.core.spec.model import ModelSpec
from recserve.errors import shorten
from recserve.perf.lab.fuzz.bodies import ANY, INVALID, VALID, Limits
from recserve.perf.lab.fuzz.cases import Case, CaseMaker

#: Failing cases kept in the report (the counts go on).
KEPT_FAILURES = 20
#: Rows of the valid requests in the pool (the largest batch is added).
POOL_ROWS = (1, 2, 3, 4, 8, 16)


@dataclass
class FuzzReport:
    """What a fuzzing run found."""

    seed: int
    cases: int = 0
    crashes: int = 0
    failed_valid: int = 0
    invalid_passed: int = 0
    server_errors: int = 0
    seconds: float = 0.0
    expected: Counter[str] = field(default_factory=Counter)
    mutations: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, object]] = field(default_factory=list)

    def figures(self) -> dict[str, object]:
        """The headline figures, as printed and written to JSON."""
        return {
            "fuzz_cases": self.cases,
            "fuzz_crashes": self.crashes,
            "fuzz_failed_valid": self.failed_valid,
            "fuzz_invalid_passed": self.invalid_passed,
            "fuzz_server_errors": self.server_errors,
            "fuzz_seconds": round(self.seconds, 1),
            "fuzz_cases_per_s": round(self.cases / self.seconds, 1) if self.seconds else 0.0,
            "fuzz_seed": self.seed,
        }

    def keep(self, what: str, case: Case, status: int, answer: bytes) -> None:
        """Note a failing case (the first :data:`KEPT_FAILURES`), its body and answer shortened."""
        if len(self.failures) < KEPT_FAILURES:
            self.failures.append(
                {
                    "failure": what,
                    "mutation": case.mutation,
                    "expected": case.expect,
                    "status": status,
                    "answer": shorten(answer, 200),
                    "headers": dict(case.headers),
                    "body": shorten(case.body, 300),
                }
            )


def limits_for(repository: Path, model: str) -> Limits:
    """What ``model`` of ``repository`` takes: the front door's limits and the inputs' datatypes."""
    door = FrontDoor.from_repositories([repository])
    config = text_format.Parse((repository / model / "config.pbtxt").read_text(), mc.ModelConfig())
    datatypes = {
        t.name: "BYTES" if t.data_type == mc.TYPE_STRING else mc.DataType.Name(t.data_type)[len("TYPE_") :]
        for t in config.input
    }
    return Limits(model, door.inputs[model], datatypes, door.max_body_bytes, MAX_DEPTH, MAX_DIMS)


def case_maker(spec: ModelSpec, repository: Path, seed: int) -> CaseMaker:
    """Cases for the spec's served ensemble, from valid requests of its synthetic rows."""
    pool = [generate(spec, rows, seed=seed + rows).to_wire(spec) for rows in POOL_ROWS]
    pool.append(generate(spec, spec.model.max_batch_size, seed=seed).to_wire(spec))
    return CaseMaker(pool, limits_for(repository, spec.name), seed)


class _Sender:
    """One keep-alive HTTP connection to the proxy, opened again whenever it breaks or closes."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.host, port = url.rsplit(":", 1)
        self.port, self.timeout_s = int(port), timeout_s
        self.connection: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """Status and body of the answer; status 0 when none came."""
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            self.connection.request("POST", path, body, {"Content-Type": "application/json", **headers})
            response = self.connection.getresponse()
            answer = response.read()
            if response.will_close:
                self.close()
            return response.status, answer
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return 0, f"no answer: {type(exc).__name__}: {exc}".encode()

    def close(self) -> None:
        """Close the connection (the next post opens another)."""
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def _served(status: int, answer: bytes) -> bool:
    if status != 200:
        return False
    try:
        return bool(json.loads(answer).get("outputs"))
    except (ValueError, AttributeError):
        return False


def _judge(report: FuzzReport, case: Case, status: int, answer: bytes) -> None:
    if case.expect == VALID and not _served(status, answer):
        report.failed_valid += 1
        report.keep("valid request not served", case, status, answer)
    elif case.expect == INVALID and not 400 <= status < 500:
        report.invalid_passed += 1
        report.keep("invalid request not refused with 4xx", case, status, answer)
    elif case.expect == ANY and not 200 <= status < 500:
        report.server_errors += 1
        report.keep("answered 5xx or not at all", case, status, answer)


def fuzz_layer(
    layer: AccessLayer,
    maker: CaseMaker,
    seconds: float,
    seed: int,
    progress: Callable[[str], None] | None = None,
) -> FuzzReport:
    """Send cases through a running, supervised access layer for ``seconds``; what was found."""
    assert layer.supervisor is not None, "the access layer must be supervised"
    report = FuzzReport(seed)
    path = f"/v2/models/{maker.limits.model}/infer"
    sender = _Sender(layer.http_url)
    pids, deaths = _pids(layer), _deaths(layer)
    start = time.monotonic()
    last_note = start
    try:
        while time.monotonic() - start < seconds:
            case = maker.next()
            status, answer = sender.post(path, case.body, case.headers)
            report.cases += 1
            report.expected[case.expect] += 1
            report.mutations[case.mutation] += 1
            if status == 0 or status >= 500:
                time.sleep(0.3)  # a server killed by the case: let its death show
            dead = [s for s in layer.all_servers() if s.process is None or s.process.poll() is not None]
            if dead or _pids(layer) != pids or _deaths(layer) != deaths:
                report.crashes += 1
                report.keep("a tritonserver died", case, status, answer)
                _wait_restarted(layer)
                pids, deaths = _pids(layer), _deaths(layer)
            else:
                _judge(report, case, status, answer)
            if progress is not None and time.monotonic() - last_note >= 30:
                last_note = report.seconds = time.monotonic()
                report.seconds -= start
                progress(json.dumps(report.figures()))
    finally:
        sender.close()
        report.seconds = time.monotonic() - start
    return report


def _pids(layer: AccessLayer) -> list[int | None]:
    return [s.process.pid if s.process else None for s in layer.all_servers()]


def _deaths(layer: AccessLayer) -> int:
    status = layer.supervisor.status() if layer.supervisor is not None else {}
    return sum(int(str(record.get("crashes", 0))) for record in status.values())


def _wait_restarted(layer: AccessLayer, timeout_s: float = 120.0) -> None:
    """Wait until every server is alive and ready again (the supervisor restarts the dead)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        servers = layer.all_servers()
        if all(s.process is not None and s.process.poll() is None and s.is_ready() for s in servers):
            time.sleep(2.0)  # and the proxy's health check takes it back
            return
        time.sleep(0.5)


def run_fuzz(
    spec: ModelSpec,
    repository: Path,
    seconds: float,
    seed: int = 0,
    workdir: Path | None = None,
    replicas: int = 2,
    progress: Callable[[str], None] | None = None,
) -> FuzzReport:
    """Start the access layer over ``repository`` (``replicas`` supervised servers) and fuzz it."""
    maker = case_maker(spec, repository, seed)
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0, replicas=replicas)
    with tempfile.TemporaryDirectory(prefix="recserve-fuzz-") as scratch:
        root = workdir or Path(scratch)
        with AccessLayer(access, {"stable": repository}, root, ProxyPorts.free()) as layer:
            layer.supervise()
            return fuzz_layer(layer, maker, seconds, seed, progress)


def format_report(report: FuzzReport) -> str:
    """The figures, the cases by mutation and expectation, and the first failing cases."""
    lines = [f"{name} {value}" for name, value in report.figures().items()]
    lines.append("cases by mutation: " + json.dumps(dict(sorted(report.mutations.items()))))
    lines.append("cases by expectation: " + json.dumps(dict(sorted(report.expected.items()))))
    for failure in report.failures[:5]:
        lines.append("failing case: " + json.dumps(failure, ensure_ascii=True))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The fuzzer's options."""
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to send cases")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every case")
    parser.add_argument("--replicas", type=int, default=2, help="supervised tritonservers behind the proxy")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options; exit 1 when a server died or a valid request failed."""
    from recserve.build.repository import is_built
    from recserve.core.spec.parse import load_spec

    spec, repository = load_spec(args.spec), args.repository
    if not is_built(spec, repository):
        print(f"error: {repository} is not built from this spec; run 'recserve build'", file=sys.stderr)
        return 2
    report = run_fuzz(
        spec, repository, args.seconds, args.seed, replicas=args.replicas, progress=lambda m: print(m)
    )
    print(format_report(report))
    if args.json:
        args.json.write_text(
            json.dumps({**report.figures(), "failures": report.failures}, indent=2, ensure_ascii=True) + "\n"
        )
    return 1 if report.crashes or report.failed_valid else 0
