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
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.server.runtime import MALLOC_SETTINGS

from .helpers import infer_inputs, infer_raw
from .private_server import private_server

RECOVERY_S = 10.0


@pytest.fixture(scope="module")
def fault_server(repository, tmp_path_factory):
    # exit timeout 5 s: the instances replaced after a kill never finish unloading (see the SIGTERM test)
    with private_server(repository, tmp_path_factory.mktemp("faults"), exit_timeout_s=5) as server:
        yield server


def test_tritonserver_and_its_stubs_run_with_mallocs_thresholds(server):
    """Without them, one server start in two took 50-65 page faults a request (runtime.MALLOC_SETTINGS)."""
    pids = [server.process.pid, *server.stubs()]
    assert len(pids) > 1
    for pid in pids:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        environ = dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)
        assert {name: environ.get(name) for name in MALLOC_SETTINGS} == MALLOC_SETTINGS, pid


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
            if arg.startswith((b"triton_python_backend_shm", b"recserve_")):  # the default, or recserve's
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


@pytest.mark.parametrize("model", [EMBEDDING_LOOKUP])
def test_a_killed_stub_fails_only_requests_until_its_model_is_reloaded(fault_server, spec, model):
    stop, log, threads = threading.Event(), [], []
    for i in range(3):
        threads.append(
            threading.Thread(target=_closed_loop, args=(fault_server, spec, stop, log, 40 + i), daemon=True)
        )
        threads[-1].start()
    time.sleep(3)
    (victim,) = [pid for pid, name in fault_server.stubs().items() if name == model]
    reloads_before = len(fault_server.watchdog.reloads)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    time.sleep(RECOVERY_S)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert len(fault_server.watchdog.reloads) == reloads_before + 1, (
        fault_server.watchdog.reloads,
        fault_server.process.poll(),  # None: the server still runs
        fault_server.log_tail(30),
    )
    reloaded_at, reloaded = fault_server.watchdog.reloads[-1]
    assert reloaded == model and reloaded_at - killed_at < RECOVERY_S
    failures = [entry for entry in log if entry[2] is not None]
    print(f"{len(failures)} failed requests, model reloaded {reloaded_at - killed_at:.1f} s after the kill")
    assert failures, "the kill went unnoticed: is the right process killed?"
    assert all(killed_at - 30 < sent <= reloaded_at for sent, _, _ in failures), (
        "a request failed after the reload"
    )
    # caught on the dead instance, or shed by the queue timeout while it was blocked there
    assert all(
        ("is not healthy" in message or "Request timeout expired" in message) and "/" not in message
        for _, _, message in failures
    ), failures[:3]
    recovered = [entry for entry in log if entry[0] > reloaded_at]
    assert len(recovered) > 10 and all(message is None for _, _, message in recovered)
    assert [pid for pid, name in fault_server.stubs().items() if name == model] not in ([], [victim])


def test_sigterm_completes_accepted_requests_and_leaves_no_process_or_shared_memory(
    repository, spec, tmp_path
):
    """What ``recserve serve`` does on SIGTERM: drain (unload the ensemble), then SIGTERM tritonserver.

    A server of its own: after a stub kill, the replaced instance never finishes unloading in this
    Triton, so that server's exit would wait out its exit timeout. The served configs have no queue
    policy, so every request is accepted: admission refusals are not what is tested here.
    """
    with private_server(repository, tmp_path, exit_timeout_s=20) as server:
        _drain_and_stop(server, spec)


def _drain_and_stop(fault_server, spec):
    stubs = list(fault_server.stubs())
    regions = _shared_memory_regions(stubs)
    assert stubs and regions
    # enough that several are still in flight when the stop begins, however fast the steps are
    requests = [generate(spec, 64, seed=200 + i).to_wire(spec) for i in range(64)]
    results, finished, done = [None] * len(requests), [0.0] * len(requests), threading.Semaphore(0)

    def record(index):
        def callback(result, error):
            results[index], finished[index] = (error if error is not None else result), time.monotonic()
            done.release()

        return callback

    with grpcclient.InferenceServerClient(fault_server.grpc_url) as client:
        for inputs in requests[:3]:  # warm: a cold first batch can outwait the queue timeout on 2 cores
            infer_raw(grpcclient, client, spec, inputs)
        for i, inputs in enumerate(requests):
            client.async_infer(spec.name, infer_inputs(grpcclient, inputs), record(i))
        # the stop begins as the first answer comes back: the server has taken the requests, and
        # most are still queued (a fixed pause was too long once, on a fast run: all had finished)
        assert done.acquire(timeout=60)
        done.release()
        signalled = time.monotonic()
        stopper = threading.Thread(target=fault_server.stop, kwargs={"signum": signal.SIGTERM})
        stopper.start()
        for _ in requests:
            assert done.acquire(timeout=60)
        stopper.join(fault_server.exit_timeout_s + 30)
        with pytest.raises(InferenceServerException):  # nothing is accepted any more
            infer_raw(grpcclient, client, spec, requests[0], client_timeout=5)
    refused = [str(r) for r in results if isinstance(r, Exception)]
    assert not refused, refused[:3]  # every request accepted is served
    assert sum(t > signalled for t in finished) >= 4, (
        "too few requests were still in flight when the stop began"
    )
    returncode = fault_server.process.returncode
    exited_after = time.monotonic() - signalled
    assert exited_after <= fault_server.exit_timeout_s + 5, exited_after
    assert returncode == 0
    assert not [pid for pid in stubs if _alive(pid)], "stub processes outlived the server"
    assert not [r for r in regions if Path("/dev/shm", r).exists()], "shared-memory regions left behind"
