"""The Envoy configuration of the access layer, built as a plain dict from the spec's ``[access]``.

One listener per protocol (gRPC, HTTP) on the public ports; behind each, one cluster per variant
and protocol (``stable_grpc``, ``canary_http``, ...) holding that variant's tritonservers, and one
shadow cluster per protocol for the mirrored copies. The parts:

* **Admission** (``circuit_breakers``): a cluster admits at most ``max_requests`` requests per
  replica in flight; the next one is refused at once (HTTP 503, gRPC UNAVAILABLE), never queued.
  HTTP/2 pools multiplex, so a gRPC request over the cap has nowhere to wait; for HTTP/1.1 the pool
  may open as many connections as it likes, so a request only waits for its connection to open.
* **Weighted split with sticky users** (``weighted_clusters`` + ``hash_policy``): the variant is
  picked from a hash of the :data:`~recserve.core.names.USER_HEADER` header, so a user stays on one variant
  while the weights stand; requests without the header are split at random. Each weight is read
  from the runtime key :func:`weight_key` first, so ``POST /runtime_modify`` changes the split
  without a reload.
* **Shadow traffic** (``request_mirror_policies``): a share of live requests (runtime key
  :data:`SHADOW_KEY`) is copied to the shadow cluster; Envoy discards the copy's response and does
  not wait for it. The shadow cluster has its own, small in-flight cap: a slow shadow drops copies
  instead of holding live requests or their admission budget.
* **Health** (``grpc_health_check``, ``/v2/health/ready``): Triton's ``grpc.health.v1`` and readiness
  endpoints. With every replica of a variant failing, Envoy's panic mode still sends to them.
* **Replicas** (``outlier_detection``, ``retry_policy``): with several tritonservers in a cluster, one
  whose connection is refused or reset is ejected at its first such failure, for a few seconds at a
  time and never more than half of them; a request that could not be sent to it (refused connection
  or stream, reset before the request went out) is retried once on another replica. A request
  already sent is never retried: inference work is not repeated, and at most the requests in flight
  on a dying replica fail. A cluster of one replica allows no retries.
* **Front door** (:mod:`recserve.access.front_door`): headers over Triton's limit answered 431, bodies
  over what the served models take 413, inference bodies (JSON or gRPC) whose shapes or names Triton
  would allocate or echo unchecked 400, models that are not public 404, all by Envoy before any
  tritonserver sees them; only a refused or reset connection (a dead process) ejects a replica,
  never a request's answer. With ``[degrade]`` on and the capacity known, its value door refuses the
  lowest values under a spike before they queue (:mod:`recserve.access.value_door`).
* **Admin** on 127.0.0.1 only, with an admin runtime layer (what ``/runtime_modify`` writes).
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recserve.access.front_door import GRPC_STREAM_PATH, FrontDoor, buffer_off
from recserve.core.names import TRAFFIC_HEADER, USER_HEADER, VARIANT_HEADER
from recserve.core.sections.serving import AccessSection
from recserve.server import Ports

LOOPBACK = "127.0.0.1"
PROTOCOLS = ("grpc", "http")
#: Runtime key of the mirrored share, in millionths of the live requests.
SHADOW_KEY = "access.shadow_per_million"
#: Prefix of the weight keys: ``access.weights.<protocol>.<cluster>``.
WEIGHT_PREFIX = "access.weights"
HEALTH_INTERVAL_S = 2.0
#: Bucket edges (ms) of the per-cluster request-time histograms: fine enough for the canary's p99
#: comparison at millisecond latencies (Envoy records whole milliseconds).
# fmt: off
LATENCY_BUCKETS_MS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 65, 80, 100, 130, 160, 200,
                      250, 300, 400, 500, 650, 800, 1000, 1500, 2000, 3000, 5000, 10000, 30000, 60000)
# fmt: on
#: Idle HTTP/1.1 upstream connections are closed after this (a stopping tritonserver waits for them).
IDLE_S = 1.0
#: How often Envoy merges its histograms for the admin API (what the canary reads each period).
STATS_FLUSH_S = 0.25
EJECTION_S = 2.0  # a replica ejected for a refused or reset connection stays out this long (times ejections)
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"


class AccessError(RuntimeError):
    """The access layer cannot be configured, validated, started or driven."""


@dataclass(frozen=True)
class Upstream:
    """One tritonserver of a variant: where its gRPC and HTTP endpoints listen.

    ``host`` may be a DNS name standing for ``replicas`` servers (a Kubernetes headless Service):
    Envoy then resolves it and balances over every address it gets.
    """

    grpc_port: int
    http_port: int
    host: str = LOOPBACK
    replicas: int = 1


@dataclass(frozen=True)
class ProxyPorts:
    """The proxy's public ports and its admin port."""

    grpc: int
    http: int
    admin: int

    @classmethod
    def from_section(cls, access: AccessSection) -> ProxyPorts:
        """The ports written in ``[access]``."""
        return cls(access.grpc_port, access.http_port, access.admin_port)

    @classmethod
    def free(cls) -> ProxyPorts:
        """Three loopback ports free now (tests and benchmarks, beside other servers)."""
        free = Ports.free()
        return cls(free.grpc, free.http, free.metrics)


def cluster_name(variant: str, protocol: str, shadow: bool = False) -> str:
    """``<variant>_<protocol>`` (live) or ``<variant>_<protocol>_shadow`` (mirrored copies)."""
    return f"{variant}_{protocol}" + ("_shadow" if shadow else "")


def weight_key(variant: str, protocol: str) -> str:
    """The runtime key Envoy reads a variant's weight from (one per protocol's route)."""
    return f"{WEIGHT_PREFIX}.{protocol}.{cluster_name(variant, protocol)}"


def shadow_per_million(fraction: float) -> int:
    """A mirrored share as the runtime value of :data:`SHADOW_KEY`."""
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise AccessError(f"a shadow fraction lies in 0..1, got {fraction}")
    return round(fraction * 1_000_000)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def cluster(name: str, protocol: str, upstreams: list[Upstream], max_requests: int) -> dict[str, Any]:
    """One cluster: the upstreams' endpoints of ``protocol``, a cap of ``max_requests`` per replica."""
    servers = sum(u.replicas for u in upstreams)
    cap = max_requests * servers  # Envoy's thresholds are per cluster; ours are per replica
    replicated = servers > 1
    by_name = any(not _is_ip(u.host) for u in upstreams)
    endpoints = [
        {"endpoint": {"address": _address(u.host, u.grpc_port if protocol == "grpc" else u.http_port)}}
        for u in upstreams
    ]
    health: dict[str, Any] = {
        "timeout": _seconds(HEALTH_INTERVAL_S),
        "interval": _seconds(HEALTH_INTERVAL_S),
        "no_traffic_interval": _seconds(HEALTH_INTERVAL_S),
        "unhealthy_threshold": 3,
        "healthy_threshold": 1,
    }
    if protocol == "grpc":
        health["grpc_health_check"] = {}
    else:  # a kept-alive HTTP connection holds a stopping tritonserver until its exit timeout
        health["http_health_check"] = {"path": "/v2/health/ready"}
        health["reuse_connection"] = False
    config: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS" if by_name else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_requests": cap,
                    "max_pending_requests": cap,
                    "max_connections": 1024,  # HTTP/1.1: a new connection rather than a wait for one
                    "max_retries": cap if replicated else 0,
                    "track_remaining": True,
                }
            ]
        },
        "health_checks": [health],
    }
    if replicated:
        config["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,  # refused or reset: the process is gone
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": _seconds(EJECTION_S / 2),
            "base_ejection_time": _seconds(EJECTION_S),
            "max_ejection_time": _seconds(5 * EJECTION_S),  # a restarted replica is back within this
            "max_ejection_percent": 50,
            # only a dead process ejects: 5xx answers and success rates are a request's, often a
            # client's, doing (a malformed JSON body gets Triton's 500)
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "enforcing_failure_percentage": 0,
        }
    http_version = "http2_protocol_options" if protocol == "grpc" else "http_protocol_options"
    config["typed_extension_protocol_options"] = {
        _HTTP_OPTIONS: {
            "@type": f"type.googleapis.com/{_HTTP_OPTIONS}",
            "explicit_http_config": {http_version: {}},
            # idle HTTP/1.1 connections are closed soon, for the same reason as above
            **(
                {"common_http_protocol_options": {"idle_timeout": _seconds(IDLE_S)}}
                if protocol == "http"
                else {}
            ),
        }
    }
    return config


def routed_headers(variant: str, traffic: str) -> list[dict[str, Any]]:
    """The variant and traffic headers (live, shadow) the steps get, over any the client sent."""
    pairs = ((VARIANT_HEADER, variant), (TRAFFIC_HEADER, traffic))
    action = "OVERWRITE_IF_EXISTS_OR_ADD"
    return [{"header": {"key": k, "value": v}, "append_action": action} for k, v in pairs]


def route(access: AccessSection, protocol: str, variants: list[str]) -> dict[str, Any]:
    """The catch-all route of a listener: sticky weighted split, mirror, timeout, safe retries.

    Only a request that never reached a replica is retried, once, on another one. Each variant's
    requests carry its name (:func:`routed_headers`), the mirrored copies ``shadow``.
    """
    action: dict[str, Any] = {
        "timeout": _seconds(access.request_timeout_s),
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": 1,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": _PREVIOUS_HOSTS},
                }
            ],
            "host_selection_retry_max_attempts": 3,
        },
        "hash_policy": [{"header": {"header_name": USER_HEADER}}],
        "weighted_clusters": {
            "use_hash_policy": True,
            "runtime_key_prefix": f"{WEIGHT_PREFIX}.{protocol}",
            "clusters": [  # each variant's requests tell the steps its name (the request log's)
                {"name": cluster_name(v, protocol), "weight": access.weights.get(v, 0)}
                | {"request_headers_to_add": routed_headers(v, "live")}
                for v in variants
            ],
        },
    }
    if access.shadow_variant in variants:
        action["request_mirror_policies"] = [
            {
                "cluster": cluster_name(access.shadow_variant, protocol, shadow=True),
                "runtime_fraction": {
                    "default_value": {
                        "numerator": shadow_per_million(access.shadow_fraction),
                        "denominator": "MILLION",
                    },
                    "runtime_key": SHADOW_KEY,
                },
                "request_headers_mutations": [
                    {"append": header} for header in routed_headers(access.shadow_variant, "shadow")
                ],
            }
        ]
    return {"match": {"prefix": "/"}, "route": action}


def listener(
    access: AccessSection,
    protocol: str,
    port: int,
    variants: list[str],
    front_door: FrontDoor | None = None,
) -> dict[str, Any]:
    """A public listener: one HTTP connection manager (HTTP/1.1 and HTTP/2), the front door, the router.

    Headers over the front door's limit are answered 431 by Envoy itself; the body is bounded and
    what Triton will read of it checked (:mod:`recserve.access.front_door`): JSON on HTTP, one
    protobuf message per unary call on gRPC; the stream call is not buffered, the front door refuses
    it before its body.
    """
    door = front_door or FrontDoor()
    name = f"public_{protocol}"
    routes = [route(access, protocol, variants)]
    if protocol == "grpc":  # the stream call's request never ends: not buffered
        stream = route(access, protocol, variants)
        stream["match"] = {"path": GRPC_STREAM_PATH}
        stream["typed_per_filter_config"] = buffer_off()
        routes.insert(0, stream)
    manager: dict[str, Any] = {
        "@type": _HCM,
        "stat_prefix": name,
        "codec_type": "AUTO",
        # the front door reads the model from the path: one spelling of each path
        "normalize_path": True,
        "merge_slashes": True,
        "max_request_headers_kb": door.max_headers_kb,
        "route_config": {
            "name": name,
            "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            *door.http_filters(),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
        "local_reply_config": door.local_replies(protocol),
    }
    return {
        "name": name,
        "address": _address(access.host, port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def envoy_config(
    access: AccessSection,
    upstreams: Mapping[str, list[Upstream]],
    ports: ProxyPorts,
    front_door: FrontDoor | None = None,
) -> dict[str, Any]:
    """The whole bootstrap config: listeners, clusters, admin and runtime layers.

    Args:
        access: the spec's ``[access]``.
        upstreams: variant -> its tritonservers. Every variant with a weight above 0 (and the shadow
            variant, when mirroring) needs at least one; variants not in ``access.weights`` get 0.
        ports: the proxy's public and admin ports.
        front_door: the limits the public listeners enforce, derived from the served repositories
            (:meth:`FrontDoor.from_repositories`); None: generic limits.

    Raises:
        AccessError: a variant that takes traffic has no upstream.
    """
    variants = [v for v, servers in upstreams.items() if servers]
    needed = {v for v, w in access.weights.items() if w > 0}
    if access.shadow_fraction > 0:
        needed.add(access.shadow_variant)
    missing = sorted(needed - set(variants))
    if missing:
        raise AccessError(f"variants {missing} take traffic in [access] but have no tritonserver")
    if "stable" not in variants:
        raise AccessError("the access layer needs the 'stable' variant")
    clusters = [
        cluster(cluster_name(v, p), p, upstreams[v], access.max_requests) for v in variants for p in PROTOCOLS
    ]
    if access.shadow_variant in variants:
        clusters += [
            cluster(
                cluster_name(access.shadow_variant, p, shadow=True),
                p,
                upstreams[access.shadow_variant],
                access.shadow_max_requests,
            )
            for p in PROTOCOLS
        ]
    return {
        "admin": {"address": _address(LOOPBACK, ports.admin)},
        "stats_flush_interval": _seconds(STATS_FLUSH_S),
        "stats_config": {
            "histogram_bucket_settings": [
                {
                    "match": {"safe_regex": {"regex": r"^cluster\.[^.]+\.upstream_rq_time$"}},
                    "buckets": list(LATENCY_BUCKETS_MS),
                }
            ]
        },
        "layered_runtime": {
            "layers": [
                {"name": "static", "static_layer": {}},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {
            "listeners": [
                listener(access, "grpc", ports.grpc, variants, front_door),
                listener(access, "http", ports.http, variants, front_door),
            ],
            "clusters": clusters,
        },
    }


def write_config(config: Mapping[str, Any], path: Path) -> Path:
    """Write ``config`` as JSON (Envoy reads ``.json`` bootstrap files); returns ``path``."""
    if path.suffix != ".json":
        raise AccessError(f"Envoy picks the format by the file name: {path} must end in .json")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
