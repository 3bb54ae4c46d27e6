"""The model access layer: a real Envoy proxy in front of the variants' tritonservers.

:mod:`~recserve.access.config` builds the Envoy config from the spec's ``[access]``,
:mod:`~recserve.access.process` starts and stops the proxy and the servers behind it,
:mod:`~recserve.access.admin` drives the running proxy (weights, shadow share, stats),
:mod:`~recserve.access.canary.controller` rolls a canary out and back through it, and
:mod:`~recserve.access.observe` writes a Prometheus scrape config and a Grafana dashboard for it.
"""

from recserve.access import observe
from recserve.access.admin import AdminClient
from recserve.access.config import (
    PROTOCOLS,
    SHADOW_KEY,
    AccessError,
    ProxyPorts,
    Upstream,
    cluster_name,
    envoy_config,
    weight_key,
    write_config,
)
from recserve.access.process import AccessLayer, EnvoyProxy, envoy_binary, run_foreground, validate
from recserve.access.repository import UNBOUNDED, behind_proxy, unbounded_view

__all__ = [
    "PROTOCOLS",
    "SHADOW_KEY",
    "UNBOUNDED",
    "observe",
    "AccessError",
    "AccessLayer",
    "AdminClient",
    "EnvoyProxy",
    "ProxyPorts",
    "Upstream",
    "behind_proxy",
    "cluster_name",
    "envoy_binary",
    "envoy_config",
    "run_foreground",
    "unbounded_view",
    "validate",
    "weight_key",
    "write_config",
]
