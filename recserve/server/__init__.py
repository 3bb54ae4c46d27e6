"""Run the real tritonserver over a repository: runtime, security, process, MPS, stub watchdog, supervisor."""

from recserve.server.child import ChildProcess, Started, stop_process
from recserve.server.mps import MpsDaemon, require_gpu, visible_gpus
from recserve.server.process import (
    LOOPBACK,
    Ports,
    TritonServer,
    config_arguments,
    metrics_env,
    port_in_use,
    run_child,
    server_command,
)
from recserve.server.runtime import (
    ServerProcessError,
    prepare_runtime,
    runtime_dir,
    server_env,
)
from recserve.server.security import ADMIN_HEADER, GRPC_HEADER_PREFIX, Security
from recserve.server.supervisor import Backoff, Supervisor, run_foreground
from recserve.server.watchdog import StubWatchdog, ensemble_names, expected_stubs, stub_processes

__all__ = [
    "ADMIN_HEADER",
    "Backoff",
    "ChildProcess",
    "GRPC_HEADER_PREFIX",
    "LOOPBACK",
    "MpsDaemon",
    "Ports",
    "Security",
    "ServerProcessError",
    "Started",
    "StubWatchdog",
    "Supervisor",
    "TritonServer",
    "config_arguments",
    "ensemble_names",
    "expected_stubs",
    "metrics_env",
    "port_in_use",
    "prepare_runtime",
    "require_gpu",
    "run_child",
    "run_foreground",
    "runtime_dir",
    "server_command",
    "server_env",
    "stop_process",
    "stub_processes",
    "visible_gpus",
]
