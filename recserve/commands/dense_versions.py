"""Where recserve learn's dense versions go: a version folder written and checked, then loaded by servers."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)


#: dense version folders a learner leaves beside the built one (older ones are deleted as it publishes):
#: the servers serve the newest; the log's records name the version that scored them
KEEP_DENSE_VERSIONS = 4


def dense_publisher(spec: ModelSpec, repository: Path, servers: tuple[str, ...]) -> Callable[..., int]:
    """Publishes dense weights: the next version folder written and checked, then loaded by ``servers``.

    ``servers`` are gRPC ``host:port`` of tritonservers run with ``--model-control explicit`` on this
    repository; the load goes with ``RECSERVE_ADMIN_KEY``. A server that cannot be reached is
    logged and left: it serves the newest version when it loads the model again.
    """
    import tritonclient.grpc as grpcclient

    from recserve.backends.dense.network import CTRNet
    from recserve.build.repository import add_dense_version, dense_versions, new_version_engine
    from recserve.core.names import DENSE
    from recserve.server.security import Security

    key = os.environ.get("RECSERVE_ADMIN_KEY", "")
    if servers and not key:
        raise ValueError("--servers loads dense versions through the admin API: set RECSERVE_ADMIN_KEY")
    headers = Security(admin_key=key or None).headers()
    new_version_engine(repository)  # refused now, not at the first publish, where none can be built

    def publish(weights) -> int:
        net = CTRNet(spec)
        net.load_state_dict(weights)
        version = add_dense_version(spec, net, repository)
        for url in servers:
            try:
                with grpcclient.InferenceServerClient(url) as client:
                    client.load_model(DENSE, headers=headers)
            except Exception as error:  # noqa: BLE001 - one server down must not stop the publishes
                LOGGER.warning("dense version %d not loaded on %s: %s", version, url, error)
        for old in dense_versions(repository)[:-KEEP_DENSE_VERSIONS]:
            if old != spec.version:
                shutil.rmtree(repository / DENSE / str(old), ignore_errors=True)
        return version

    return publish


def server_list(text: str) -> tuple[str, ...]:
    """``host:port,host:port`` as a tuple (empty text: none)."""
    return tuple(url.strip() for url in text.split(",") if url.strip())
