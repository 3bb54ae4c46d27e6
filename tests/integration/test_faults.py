"""Faults under load: a stub killed with SIGKILL, and a SIGTERM that drains and leaves nothing behind."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate

from .helpers import infer_inputs, infer_raw
from .private_server import private_server

RECOVERY_S = 10.0


@pytest.fixture(scope="module")
def fault_server(repository, tmp_path_factory):
    with private_server(repository, tmp_path_factory.mktemp("faults"), model_control="none", exit_timeout_s=20) as server:
        yield server


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _shared_memory_regions(pids) -> set[str]:
    """The shared-memory regions the stubs were started with (named on their command lines)."""
    regions = set()
    for pid in pids:
        for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            if arg.startswith(b"triton_python_backend_shm"):
                regions.add(arg.decode())
    return regions


def _closed_loop(server, spec, stop, log, seed):
    request = generate(spec, 8, seed=seed).to_wire(spec)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                infer_raw(grpcclient, client, spec, request, client_timeout=30)
                log.append((started, time.monotonic(), None))
            except InferenceServerException as exc:
                log.append((started, time.monotonic(), exc.message()))
            time.sleep(0.002)


@pytest.mark.parametrize("model", ["embedding_lookup", "feature_transform"])
def test_a_killed_stub_fails_only_requests_in_flight_and_service_returns(fault_server, spec, model):
    stop, log, threads = threading.Event(), [], []
    for i in range(3):
        threads.append(threading.Thread(target=_closed_loop, args=(fault_server, spec, stop, log, 40 + i), daemon=True))
        threads[-1].start()
    time.sleep(3)
    (victim,) = [pid for pid, name in fault_server.stubs().items() if name == model]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    time.sleep(RECOVERY_S + 2)
    stop.set()
    for thread in threads:
        thread.join(60)
    failures = [entry for entry in log if entry[2] is not None]
    in_flight = [entry for entry in log if entry[0] <= killed_at <= entry[1]]
    after = [entry for entry in log if entry[0] > killed_at]
    assert len(failures) <= len(threads), f"{len(failures)} failures: {[f[2] for f in failures[:5]]}"
    assert all(entry in in_flight for entry in failures), "a request sent after the kill failed"
    assert all("/" not in entry[2] for entry in failures), failures
    recovered = [entry for entry in after if entry[2] is None]
    assert recovered and recovered[0][1] - killed_at < RECOVERY_S, "service did not come back within 10 s"
    assert [pid for pid, name in fault_server.stubs().items() if name == model] not in ([], [victim])


def test_sigterm_completes_accepted_requests_and_leaves_no_process_or_shared_memory(fault_server, spec):
    stubs = list(fault_server.stubs())
    regions = _shared_memory_regions(stubs)
    assert stubs and regions
    requests = [generate(spec, 64, seed=200 + i).to_wire(spec) for i in range(24)]
    results, done = [None] * len(requests), threading.Semaphore(0)

    def record(index):
        def callback(result, error):
            results[index] = error if error is not None else result
            done.release()

        return callback

    with grpcclient.InferenceServerClient(fault_server.grpc_url) as client:
        for i, inputs in enumerate(requests):
            client.async_infer(spec.name, infer_inputs(grpcclient, inputs), record(i))
        time.sleep(0.05)
        signalled = time.monotonic()
        fault_server.process.send_signal(signal.SIGTERM)
        for _ in requests:
            assert done.acquire(timeout=60)
    assert all(not isinstance(r, Exception) for r in results), [r for r in results if isinstance(r, Exception)][:3]
    returncode = fault_server.process.wait(fault_server.exit_timeout_s + 10)
    exited_after = time.monotonic() - signalled
    assert exited_after <= fault_server.exit_timeout_s + 5, exited_after
    assert returncode == 0
    assert not [pid for pid in stubs if _alive(pid)], "stub processes outlived the server"
    assert not [r for r in regions if Path("/dev/shm", r).exists()], "shared-memory regions left behind"
