"""The real tritonserver shipped in the nvidia-pytriton wheel, run without a container.

The wheel carries ``tritonserver``, the Python backend and one stub per Python version. The stub
finds packages through the interpreter on ``PATH`` (it ignores ``PYTHONPATH``), so the server is
started with this environment's ``bin/`` first on ``PATH`` and its ``LIBDIR`` on
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path


class ServerProcessError(RuntimeError):
    """tritonserver could not be prepared, did not become ready, or died.

    Not to be confused with :class:`recserve.clients.errors.ServerError`: a failure a running server
    reports to a client.
    """


def _site_packages_of(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ServerProcessError(f"package {package!r} is not installed; run 'make install'")
    return Path(spec.origin).parent.parent


def runtime_dir() -> Path:
    """Where the writable copy of the server lives (inside this environment)."""
    return Path(sys.prefix) / "share" / "recserve" / "tritonserver"


def prepare_runtime(target: Path | None = None) -> Path:
    """Copy the wheel's server into a writable folder with the stub of this Python; idempotent."""
    target = target or runtime_dir()
    source = _site_packages_of("pytriton") / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerProcessError(f"no Python-backend stub for Python {version} in {source}")
    installed_stub = target / "backends" / "python" / "triton_python_backend_stub"
    if not installed_stub.is_file():
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


#: glibc malloc's thresholds for tritonserver and its stubs, unless the environment sets its own.
#: By default an allocation over 128 KiB is mapped afresh and unmapped when freed, and free memory
#: over the heap's top is handed back; the thresholds then move with what was freed last. A
#: server that fell into that cycle took 47-66 page faults and 110-150 µs more CPU a request
#: (32 rows: the history embeddings alone are 512 KiB), one server start in two. Kept on the heap
#: up to these sizes, the buffers are reused (docs/performance.md, "tritonserver's page faults").
MALLOC_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's largest: allocations up to 32 MiB from the heap
    "MALLOC_TRIM_THRESHOLD_": str(128 << 20),  # free memory at a heap's top kept up to 128 MiB
}


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: this venv's interpreter first on PATH, its libs on LD_LIBRARY_PATH.

    And glibc malloc's thresholds (:data:`MALLOC_SETTINGS`), where the environment does not set them.
    """
    env = dict(os.environ if base is None else base)
    for name, value in MALLOC_SETTINGS.items():
        env.setdefault(name, value)
    libs = [
        str(_site_packages_of("pytriton") / "nvidia_pytriton.libs"),
        str(sysconfig.get_config_var("LIBDIR")),
    ]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)
    return env
