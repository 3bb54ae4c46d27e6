"""``[degrade]`` on a real tritonserver: a request's value reaches the steps, and its level serves it.

One server over a variant of the default repository whose spec has ``[degrade]`` with lambda held
(``fixed_lambda``), so each tier lands on a known level: premium in full, standard with its list
capped, basic capped with a short history, low refused. The value travels as the SDK's header and
as a plain request parameter; both reach the steps through the ensemble, and through the access
layer. A priority set on the ensemble request reaches the steps' batchers too. Last, the quick form
of ``recserve lab degrade`` (its own two servers, under a minute).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from recserve.access import AccessLayer, ProxyPorts
from recserve.backends.steps.pipeline import InProcessPipeline
from recserve.backends.store.tiered import TieredStore
from recserve.build.configs import write_variant
from recserve.build.repository import dense_runner, version_dir
from recserve.build.synthetic import generate
from recserve.clients import AsyncCTRClient, CTRClient, read_rows
from recserve.clients.errors import InvalidRequestError, ServerUnavailableError
from recserve.clients.writers import write_tsv
from recserve.core.degrade_capacity import FILE_NAME
from recserve.core.files import write_text_atomically
from recserve.core.names import DENSE, EMBEDDING_LOOKUP, SMALL_DENSE_DIR
from recserve.core.sections.degrade import DEGRADE_LEVEL, LAMBDA_HEADER, VALUE_HEADER
from recserve.core.spec.parse import parse_spec, small_dense_spec
from recserve.perf.lab.degrade_costs import with_small_dense
from recserve.server import Ports, TritonServer
from tests.integration.helpers import http_client, infer_inputs, metrics_text, recserve, wait_for

#: lambda 0.1: v >= 2.5 full, >= 0.375 capped, >= 0.08 short, >= 0.019 lean (every candidate, by the
#: smaller network), below refused (v x q - lambda x c)
DEGRADE = {
    "enabled": True,
    "tiers": {"low": 0.01, "thrifty": 0.05, "basic": 0.1, "standard": 1.0, "premium": 5.0},
    "default": "premium",
    "levels": [
        {"name": "capped", "cost": 0.5, "quality": 0.98, "max_candidates": 4},
        {"name": "short", "cost": 0.2, "quality": 0.9, "max_candidates": 2, "history_length": 8},
        {"name": "lean", "cost": 0.16, "quality": 0.85, "small_dense": True},
    ],
    "small_dense": {"bottom_mlp": [16], "top_mlp": [32], "attention_heads": 1},
    "fallback_score": 0.0,
    "fixed_lambda": 0.1,
    "priority_value": 2.5,  # premium is sent at priority 1: the steps' batchers have two levels
}


#: a line of the steps' requests per level and tier: (level, tier, count)
COUNTED = r'^recserve_degrade_requests_total\{level="(\w+)",tier="(\w+)"\} (\S+)$'


@pytest.fixture(scope="module")
def degraded(spec, repository, tmp_path_factory):
    """A server of the default model with [degrade] on, and the rows to send."""
    folder = tmp_path_factory.mktemp("degrade")
    degrade_spec = parse_spec({**spec.source, "degrade": DEGRADE})
    distilled = with_small_dense(degrade_spec, repository, folder / "distilled", lambda _: None)
    variant = write_variant(degrade_spec, distilled, folder / "repository")
    rows = read_rows(write_tsv(folder / "rows.tsv", generate(spec, 40, seed=47), spec), spec)
    with TritonServer(variant, Ports.free(), log_path=folder / "server.log") as server:
        yield server, degrade_spec, rows


def test_each_tier_is_served_at_its_level_and_a_list_cut_short_is_answered_in_full(degraded):
    server, spec, rows = degraded
    longest = int(np.argmax(rows.lengths))
    user = {"history_items": rows.history[longest, : rows.lengths[longest]].tolist()}
    assert len(user["history_items"]) > 8  # the short level cuts it
    candidates = rows.take(slice(0, 10))
    scores, levels = {}, {}
    with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
        for tier in ("premium", "standard", "basic"):
            client.value = tier
            scores[tier] = client.score_candidates(user, candidates)
            levels[tier] = client.last_level
        client.value = None  # the default: premium
        assert np.array_equal(client.score_candidates(user, candidates), scores["premium"])
        assert client.last_level == 0
        client.value = "low"
        with pytest.raises(ServerUnavailableError, match="refused under load"):
            client.score_candidates(user, candidates)
        client.value = "gold"  # a tier-like name the spec does not have
        with pytest.raises(InvalidRequestError, match=f"parameter '{VALUE_HEADER}'.*one of the tiers"):
            client.score_candidates(user, candidates)
    assert levels == {"premium": 0, "standard": 1, "basic": 2}
    full, capped, short = scores["premium"], scores["standard"], scores["basic"]
    assert full.shape == capped.shape == short.shape == (10,) and (full > 0).all()
    np.testing.assert_allclose(capped[:4], full[:4], rtol=1e-5)
    assert (capped[4:] == 0.0).all() and (short[2:] == 0.0).all()
    assert not np.allclose(short[:2], full[:2], rtol=1e-5)  # scored over the newest 8 items only


def test_a_level_of_the_smaller_network_is_scored_by_it_rows_and_lists_alike(degraded):
    server, spec, rows = degraded
    part = rows.take(slice(0, 5))
    root = server.repository
    small = dense_runner(small_dense_spec(spec), version_dir(root, DENSE, spec) / SMALL_DENSE_DIR, "torch")
    store = TieredStore.load(version_dir(root, EMBEDDING_LOOKUP, spec), spec)
    expected = InProcessPipeline(spec, store, small).predict(part.to_wire(spec))
    user = {"history_items": rows.history[0, : rows.lengths[0]].tolist()}
    with CTRClient(server.grpc_url, timeout_s=30, spec=spec) as client:
        client.value = "thrifty"
        served = client.predict(part)
        assert client.last_level == 3
        listed = client.score_candidates(user, rows.take(slice(0, 10)))
        assert client.last_level == 3
        client.value = "premium"
        full = client.predict(part)
        full_list = client.score_candidates(user, rows.take(slice(0, 10)))
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(served, full, rtol=1e-3)  # not the full network's scores
    assert listed.shape == (10,) and (listed > 0).all() and not np.allclose(listed, full_list, rtol=1e-3)


def test_a_request_parameter_reaches_the_steps_through_the_ensemble(degraded):
    server, spec, rows = degraded
    inputs = rows.take(slice(0, 3)).to_inputs(spec)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for value, level in (("premium", 0), ("standard", 1), (0.2, 2)):
            result = client.infer(
                spec.name,
                infer_inputs(grpcclient, inputs),
                outputs=[grpcclient.InferRequestedOutput(n) for n in ("probability", DEGRADE_LEVEL)],
                parameters={VALUE_HEADER: value},
            )
            assert result.as_numpy(DEGRADE_LEVEL).reshape(-1).tolist() == [level] * 3


def test_the_levels_served_are_counted_per_tier_on_the_metrics_endpoint(degraded):
    server, _, _ = degraded
    capped = 'recserve_degrade_requests_total{level="capped",tier="standard"}'

    def counted() -> bool:
        lines = [line for line in metrics_text(server).splitlines() if line.startswith(capped)]
        return bool(lines) and float(lines[0].split()[-1]) >= 1

    wait_for(counted, 10.0, "the capped level counted")
    text = metrics_text(server)
    assert 'recserve_degrade_requests_total{level="refused",tier="low"}' in text
    assert "recserve_degrade_lambda 0.1" in text


def test_the_quick_lab_puts_shedding_and_degradation_side_by_side(tmp_path):
    """``recserve lab degrade --quick``: both policies through a 2x and a 4x spike, bounded in time."""
    out, picture = tmp_path / "degrade.json", tmp_path / "degrade.png"
    work = tmp_path / "work"  # the servers' logs, for a failure
    done = recserve(
        "lab", "degrade", "--quick", "--json", str(out), "--plot", str(picture), "--workdir", str(work)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    for policy in ("degrade", "shed"):
        for suffix in ("", "_4x"):
            assert summary[f"{policy}_p99_ratio{suffix}"] > 0, done.stderr[-3000:]
            assert 0.0 <= summary[f"{policy}_value_retained{suffix}"] <= 1.0
        names = [phase["name"] for phase in summary["phases"][policy]]
        assert names == ["normal", "spike_2x", "after_2x", "spike_4x", "after_4x"]
    assert summary["failed"] == 0, (work / "degrade.log").read_text()[-4000:]
    # at normal load nothing is degraded (a little slack: CI machines are shared)
    assert summary["degrade_normal_degraded_share"] < 0.1
    assert summary["lambda_timeline"] and summary["windows"]["degrade"] and summary["windows"]["shed"]
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_the_value_header_passes_the_access_layer(degraded, tmp_path):
    """Through Envoy (``recserve access``), the SDK's value header reaches the steps as it does directly."""
    server, spec, rows = degraded
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0)
    variant = server.repository
    with AccessLayer(access, {"stable": variant}, tmp_path / "access", ProxyPorts.free()) as layer:
        with CTRClient(layer.grpc_url, timeout_s=30, spec=spec, model_name=spec.name) as client:
            for tier, level in (("premium", 0), ("standard", 1), ("basic", 2)):
                client.value = tier
                client.predict_inputs(rows.take(slice(0, 2)).to_inputs(spec))
                assert client.last_level == level
            client.value = "low"
            with pytest.raises(ServerUnavailableError, match="refused under load"):
                client.predict_inputs(rows.take(slice(0, 2)).to_inputs(spec))
        # only the access layer's door sets the lambda a level is chosen at: the proxy drops a caller's
        inputs = infer_inputs(grpcclient, rows.take(slice(0, 2)).to_wire(spec))
        forged = {VALUE_HEADER: "standard", LAMBDA_HEADER: "1e9"}
        with grpcclient.InferenceServerClient(layer.grpc_url) as proxied:
            served = proxied.infer(spec.name, inputs, headers=forged)
            assert served.as_numpy(DEGRADE_LEVEL).reshape(-1).tolist() == [1, 1]
        with grpcclient.InferenceServerClient(server.grpc_url) as direct:  # the step serves at it
            with pytest.raises(InferenceServerException, match="refused under load"):
                direct.infer(spec.name, inputs, headers=forged)


def test_the_access_layers_door_refuses_the_lowest_values_before_any_server(spec, repository, tmp_path):
    """With the capacity known, Envoy's door refuses what the first step would, and the step never sees it.

    The spec sets no capacity: the door waits for the one the first step keeps, and reads it while the
    proxy runs. Here it is written as a thousandth of a request per second: every request is then
    over the door's budget, so it refuses all but the values it always serves in full (premium, over
    ``full_value``).
    """
    section = {k: v for k, v in DEGRADE.items() if k not in ("fixed_lambda", "priority_value")}
    door_spec = parse_spec({**spec.source, "degrade": {**section, "full_value": 2.5}})
    variant = write_variant(door_spec, repository, tmp_path / "repository")
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0)
    inputs = generate(spec, 2, seed=3).to_inputs(spec)
    with AccessLayer(access, {"stable": variant}, tmp_path / "access", ProxyPorts.free()) as layer:
        with CTRClient(layer.grpc_url, timeout_s=30, spec=door_spec, model_name=spec.name) as client:
            client.value = "low"
            client.predict_inputs(inputs)  # no capacity kept yet: the door lets it through
            assert client.last_level == 0  # and the idle step serves it in full
            write_text_atomically(variant / EMBEDDING_LOOKUP / FILE_NAME, '{"capacity_per_s": 0.001}')

            def refused() -> bool:
                try:
                    client.predict_inputs(inputs)
                except ServerUnavailableError as exc:
                    assert "refused under load at the access layer" in str(exc)
                    return True
                return False

            wait_for(refused, 10.0, "the door reading the kept capacity")
            for tier in ("standard", "basic"):
                client.value = tier
                with pytest.raises(ServerUnavailableError, match="refused under load at the access layer"):
                    client.predict_inputs(inputs)
            client.value = "premium"
            client.predict_inputs(inputs)
            assert client.last_level == 0
        server = layer.servers["stable"][0]

        def counted() -> dict[tuple[str, str], float]:
            found = re.findall(COUNTED, metrics_text(server), re.MULTILINE)
            return {(level, tier): float(n) for level, tier, n in found if float(n) > 0}

        wait_for(lambda: counted().get(("full", "premium")) == 1.0, 10.0, "the served request counted")
        # the refused never reached the step: the door reported them with the one it let through
        refusals = {tier: n for (level, tier), n in counted().items() if level == "refused"}
        assert refusals.keys() == {"low", "standard", "basic"}
        assert refusals["standard"] == refusals["basic"] == 1
        assert counted()[("full", "low")] >= 1  # served while the door had no capacity
        assert ("full", "standard") not in counted()


def test_the_door_sends_the_lowest_values_to_the_callers_order_model(degraded, spec, repository, tmp_path):
    """A level with ``caller_order``: Envoy's door renames the request's model, and nothing is scored.

    The kept capacity (10 requests a second) leaves each 50 ms window a budget under one full
    request: a lone low value then costs least in the caller's order, answered by the model beside the
    ensemble (rows and lists, gRPC and HTTP) with ``fallback_score`` for every row; the first step
    counts it when the door reports it on the next request it lets through (each listener's door, gRPC
    and HTTP, on its own).
    """
    _, _, rows = degraded
    section = {k: v for k, v in DEGRADE.items() if k not in ("fixed_lambda", "priority_value", "levels")}
    order = {"name": "order", "cost": 0.02, "quality": 0.8, "caller_order": True}
    levels = [*(level for level in DEGRADE["levels"] if not level.get("small_dense")), order]
    order_spec = parse_spec({**spec.source, "degrade": {**section, "levels": levels, "full_value": 2.5}})
    variant = write_variant(order_spec, repository, tmp_path / "repository")
    write_text_atomically(variant / EMBEDDING_LOOKUP / FILE_NAME, '{"capacity_per_s": 10.0}')
    access = dataclasses.replace(spec.access, weights={"stable": 100}, shadow_fraction=0.0)
    user = {"history_items": rows.history[0, : rows.lengths[0]].tolist()}
    with AccessLayer(access, {"stable": variant}, tmp_path / "access", ProxyPorts.free()) as layer:
        with CTRClient(layer.grpc_url, timeout_s=30, spec=order_spec) as client:
            client.value = "low"
            for _ in range(2):  # each alone in the door's window
                time.sleep(0.06)
                scores = client.score_candidates(user, rows.take(slice(0, 5)))
                assert client.last_level == 3 and scores.tolist() == [0.0] * 5
                time.sleep(0.06)
                assert (
                    client.predict_inputs(rows.take(slice(0, 3)).to_inputs(order_spec)).tolist() == [0.0] * 3
                )
                assert client.last_level == 3
        time.sleep(0.06)
        with http_client(layer) as proxied:
            inputs = infer_inputs(httpclient, rows.take(slice(0, 2)).to_wire(spec))
            answered = proxied.infer(spec.name, inputs, headers={VALUE_HEADER: "low"})
            assert answered.as_numpy(DEGRADE_LEVEL).reshape(-1).tolist() == [3, 3]
            premium = proxied.infer(spec.name, inputs, headers={VALUE_HEADER: "premium"})
            assert premium.as_numpy(DEGRADE_LEVEL).reshape(-1).tolist() == [0, 0]
        with CTRClient(layer.grpc_url, timeout_s=30, spec=order_spec, value="premium") as client:
            client.predict_inputs(rows.take(slice(0, 1)).to_inputs(order_spec))  # each listener reports
        server = layer.servers["stable"][0]

        def ordered() -> float:
            found = re.findall(COUNTED, metrics_text(server), re.MULTILINE)
            return sum(float(n) for level, tier, n in found if (level, tier) == ("order", "low"))

        wait_for(lambda: ordered() == 5.0, 10.0, "the door's caller's-order answers counted")


def test_a_priority_set_on_the_ensemble_request_reaches_its_steps(spec, repository, tmp_path):
    """tritonserver 2.51 hands the ensemble request's priority to the steps' dynamic batchers.

    The lookup step gets two priority levels: level 1 refused once it waited 1 us (its batcher
    waits 20 ms for batch-mates), level 2 (the default) unlimited. Sent to the ensemble, a
    priority-1 request is refused by the step's queue and the others are served.
    """
    variant = write_variant(spec, repository, tmp_path / "repository")
    path = variant / "embedding_lookup" / "config.pbtxt"
    config = text_format.Parse(path.read_text(), mc.ModelConfig())
    batching = config.dynamic_batching
    batching.priority_levels, batching.default_priority_level = 2, 2
    batching.max_queue_delay_microseconds = 20_000
    batching.priority_queue_policy[1].CopyFrom(
        mc.ModelQueuePolicy(timeout_action=mc.ModelQueuePolicy.REJECT, default_timeout_microseconds=1)
    )
    path.write_text(text_format.MessageToString(config))
    inputs = generate(spec, 2, seed=3).to_wire(spec)
    with TritonServer(variant, Ports.free(), log_path=tmp_path / "server.log") as server:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for priority in (0, 2):
                client.infer(spec.name, infer_inputs(grpcclient, inputs), priority=priority)
            with pytest.raises(InferenceServerException, match="in ensemble 'ctr', Request timeout expired"):
                client.infer(spec.name, infer_inputs(grpcclient, inputs), priority=1)


def test_the_asyncio_client_sends_the_value_too(degraded):
    server, spec, rows = degraded
    inputs = rows.take(slice(0, 2)).to_inputs(spec)

    async def send(value: str) -> np.ndarray:
        async with AsyncCTRClient(server.grpc_url, timeout_s=30, spec=spec, value=value) as client:
            return await client.predict_inputs(inputs)

    assert asyncio.run(send("premium")).shape == (2,)
    with pytest.raises(ServerUnavailableError, match="refused under load"):
        asyncio.run(send("low"))
