"""The Kubernetes manifests of the stack, checked offline against the Kubernetes schemas."""

from __future__ import annotations

import dataclasses
import json

import pytest

from recserve.access import kubernetes, validate
from recserve.cli import main
from recserve.core.spec.parse import load_spec

kubernetes_validate = pytest.importorskip("kubernetes_validate")
VERSION = "1.33"


def _spec(redis: bool = False):
    spec = load_spec("ctr")
    access = dataclasses.replace(
        spec.access, weights={"stable": 90, "canary": 10}, replicas=3, shadow_fraction=0.1
    )
    store = dataclasses.replace(
        spec.store, redis_nodes=("recserve-redis-0.recserve-redis:6379",) if redis else ()
    )
    return dataclasses.replace(spec, access=access, store=store)


@pytest.mark.parametrize("redis", [False, True])
def test_every_manifest_fits_the_kubernetes_schema(redis):
    documents = kubernetes.manifests(_spec(redis), "registry.example/recserve:1", namespace="ads")
    kinds = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert ("Deployment", "recserve-canary") in kinds and ("Service", "recserve") in kinds
    assert (("StatefulSet", "recserve-redis") in kinds) == redis
    for document in documents:
        kubernetes_validate.validate(document, VERSION, strict=True)


def test_a_manifest_off_the_schema_is_caught():
    deployment = kubernetes.manifests(_spec(), "registry.example/recserve:1")[0]
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)
    deployment["spec"]["replicas"] = 3
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def test_the_servers_are_ready_on_triton_health_and_the_proxy_resolves_them(tmp_path):
    spec = _spec()
    documents = {
        (d["kind"], d["metadata"]["name"]): d for d in kubernetes.manifests(spec, "img", namespace="ads")
    }
    stable = documents[("Deployment", "recserve-stable")]["spec"]
    container = stable["template"]["spec"]["containers"][0]
    assert stable["replicas"] == 3 and container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["args"][:4] == ["recserve", "--spec", "ctr", "serve"]
    assert documents[("Service", "recserve-stable")]["spec"]["clusterIP"] == "None"
    entry = documents[("Service", "recserve")]["spec"]["ports"]
    assert sorted(p["port"] for p in entry) == sorted([spec.access.grpc_port, spec.access.http_port])
    config = json.loads(documents[("ConfigMap", "recserve-envoy")]["data"]["envoy.json"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    grpc = clusters["stable_grpc"]
    assert grpc["type"] == "STRICT_DNS" and "outlier_detection" in grpc
    assert grpc["circuit_breakers"]["thresholds"][0]["max_requests"] == spec.access.max_requests * 3
    address = grpc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["address"] == "recserve-stable.ads.svc.cluster.local"
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    validate(path)  # envoy --mode validate


def test_the_k8s_command_writes_one_yaml_file(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    assert main(["--spec", "avazu", "k8s", "--output", str(tmp_path), "--image", "img:1"]) == 0
    path = tmp_path / "recserve-avazu.yaml"
    assert capsys.readouterr().out.strip() == str(path)
    documents = list(yaml.safe_load_all(path.read_text()))
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "ConfigMap", "Deployment", "Service"]


def test_a_redis_password_comes_from_a_secret_into_every_node_and_server():
    spec = _spec(redis=True)
    spec = dataclasses.replace(spec, store=dataclasses.replace(spec.store, redis_password_env="L3_PASS"))
    documents = kubernetes.manifests(spec, "img", namespace="ads")
    for document in documents:
        kubernetes_validate.validate(document, VERSION, strict=True)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    secret = {"secretKeyRef": {"name": kubernetes.REDIS_SECRET, "key": "password"}}
    server = by_name[("Deployment", "recserve-stable")]["spec"]["template"]["spec"]["containers"][0]
    assert server["env"] == [{"name": "L3_PASS", "valueFrom": secret}]
    node = by_name[("StatefulSet", "recserve-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["valueFrom"] for e in node["env"]} == {
        "REDIS_PASSWORD": secret,
        "REDISCLI_AUTH": secret,
    }
    assert node["args"][-4:] == ["--requirepass", "$(REDIS_PASSWORD)", "--masterauth", "$(REDIS_PASSWORD)"]
    create = by_name[("Job", "recserve-redis-create")]["spec"]["template"]["spec"]["containers"][0]
    assert create["env"] == [{"name": "REDISCLI_AUTH", "valueFrom": secret}]
    assert not any(d["kind"] == "Secret" for d in documents)  # the operator creates it; no password here
    without = kubernetes.manifests(_spec(redis=True), "img", namespace="ads")
    assert not any(
        "env" in c
        for d in without
        if "template" in d.get("spec", {})
        for c in d["spec"]["template"]["spec"]["containers"]
    )
