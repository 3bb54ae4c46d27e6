"""User states served through Triton: a miss is today's answer, exact mode is the full-length attention.

The tiny spec with ``[user_state]`` on, written to a test-local spec file: its repository is built
here (seconds), its states put in the local store under the served repository's folder.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import tritonclient.grpc as grpcclient

from recserve.backends.features.hashing import keys_for, table_salt
from recserve.backends.store.user_state.state import EXACT, UserState
from recserve.backends.store.user_state.states import LocalUserStates
from recserve.backends.store.user_state.tokens import dedup
from recserve.build.repository import build_repository, load_reference_net, reference_pipeline
from recserve.build.synthetic import generate
from recserve.clients import CTRClient
from recserve.core.contract import attention_inputs
from recserve.core.names import HISTORY_LOG_WEIGHTS, USER_ID, USER_SEQ
from recserve.core.spec.parse import load_spec, spec_path

from .helpers import grpc_client, infer_raw, metrics_text, wait_for
from .private_server import private_server

EVENTS, TAIL, DISTINCT = 4096, 32, 80
SECTION = f"""
[user_state]
enabled = true
tokens = 96
exact_tokens = 64
tail = {TAIL}
cache_ttl_ms = 0

[inputs]
user = "C1"
"""


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    """The test-local spec and its built repository."""
    folder = tmp_path_factory.mktemp("user_state")
    text = spec_path("tiny").read_text()
    assert "[user_state]" not in text and tomllib.loads(text + SECTION)["user_state"]["enabled"]
    path = folder / "tiny_user_state.toml"
    path.write_text(text + SECTION)
    spec = load_spec(path)
    repository = folder / "repository"
    build_repository(spec, repository)
    return spec, repository


def _users(spec, rows, seed):
    """Wire rows whose history is each user's newest ``TAIL`` of ``EVENTS`` events, and those events."""
    rng = np.random.default_rng(seed)
    wire = generate(spec, rows, seed).to_wire(spec)
    cardinality = spec.tables[spec.sequences[0].table].cardinality
    events = np.stack([rng.choice(np.arange(1, cardinality), DISTINCT, replace=False)[
        np.minimum(rng.zipf(1.3, EVENTS) - 1, DISTINCT - 1)] for _ in range(rows)])  # fmt: skip
    wire[spec.sequences[0].name] = events[:, -TAIL:]
    wire[spec.attention_groups[0].length_input] = np.full((rows, 1), TAIL, np.int32)
    wire[USER_ID] = np.arange(100, 100 + rows, dtype=np.int64)[:, None]
    wire[USER_SEQ] = np.full((rows, 1), EVENTS, np.int64)
    return wire, events


def _metric(server, outcome):
    found = re.findall(
        rf'recserve_user_state_total\{{[^}}]*outcome="{outcome}"[^}}]*\}} (\S+)', metrics_text(server)
    )
    return sum(float(v) for v in found)


def _full_history_reference(spec, repository, wire, events):
    """PyTorch on each row's whole ``EVENTS``-event history (no state, no truncation)."""
    pipeline = reference_pipeline(spec, repository, runtime="torch")
    plain = {k: v for k, v in wire.items() if k not in (USER_ID, USER_SEQ)}
    named = {k: torch.from_numpy(np.asarray(v)) for k, v in pipeline.embeddings(plain).items()}
    group, store = attention_inputs(spec)[0], pipeline.lookup.store
    table = spec.sequences[0].table
    keys = keys_for(events.reshape(-1).astype(np.uint64), table_salt(spec.hashing.namespace, table))
    ids = np.full(keys.size, store.table_id(table), np.int16)
    vectors = store.lookup(keys, ids, record=False).vectors[:, : spec.model.embedding_dim]
    named[group.history] = torch.from_numpy(np.ascontiguousarray(vectors.reshape(*events.shape, -1)))
    named[group.mask] = torch.ones(events.shape)
    named.pop(HISTORY_LOG_WEIGHTS, None)
    with torch.no_grad():
        return load_reference_net(spec, repository).score(named).numpy().reshape(-1)


def test_a_miss_serves_todays_answer_and_exact_states_serve_the_full_history(stateful, tmp_path):
    spec, repository = stateful
    wire, events = _users(spec, 6, seed=5)
    stored = 3  # users 100..102 have a state built up to event EVENTS - 10; 103..105 have none

    def prepare(root: Path) -> None:
        states = LocalUserStates(root / spec.user_state.local_path, ttl_s=600, max_tokens=96)
        for r in range(stored):
            tokens = dedup(events[r, : EVENTS - 10])
            assert len(tokens) <= 96
            states.put(100 + r, UserState(EVENTS - 10, EXACT, tokens))
        states.close()

    today = {k: v for k, v in wire.items() if k not in (USER_ID, USER_SEQ)}
    with private_server(repository, tmp_path, model_control="none", prepare=prepare) as server:
        with grpc_client(server) as client:
            served = infer_raw(grpcclient, client, spec, wire)
            without = infer_raw(grpcclient, client, spec, today)
            misses = infer_raw(grpcclient, client, spec, {k: v[stored:] for k, v in wire.items()})
            alone = infer_raw(grpcclient, client, spec, {k: v[stored:] for k, v in today.items()})
        assert np.array_equal(misses, alone)  # a miss: today's answer for the tail, bit for bit
        assert np.array_equal(served[stored:], without[stored:])
        expected = _full_history_reference(spec, repository, wire, events)
        assert np.abs(served[:stored] - expected[:stored]).max() <= 1e-5
        assert np.abs(without[:stored] - expected[:stored]).max() > 1e-5  # the tail alone differs
        wait_for(  # published once a second, by the metrics thread
            lambda: (
                infer_raw(grpcclient, grpc_client(server), spec, today) is not None
                and _metric(server, "hit") == stored
                and _metric(server, "miss") == 2 * (6 - stored)
            ),
            15,
            "hits and misses on the metrics endpoint",
        )
        queued = tmp_path / "repository" / (spec.user_state.event_path + ".rebuild")
        wait_for(lambda: queued.exists() and "105" in queued.read_text(), 15, "the misses queued")
        assert {int(line.split(":")[1].strip(" }")) for line in queued.read_text().splitlines()} == {
            103,
            104,
            105,
        }
        assert "Traceback" not in server.log_tail(200)


def test_a_candidate_list_with_its_user_scores_as_its_rows_do(stateful, tmp_path):
    """The list's user's state is merged once for all its candidates, through the candidates ensemble."""
    spec, repository = stateful
    _, events = _users(spec, 1, seed=9)
    tail, count, user = events[0, -TAIL:], 12, 100
    rows = generate(spec, count, 10)
    rows = replace(rows, history=np.tile(tail, (count, 1)), lengths=np.full(count, TAIL, np.int32))
    rows = rows.with_user_state(spec, np.full(count, user), np.full(count, EVENTS))

    def prepare(root: Path) -> None:
        states = LocalUserStates(root / spec.user_state.local_path, ttl_s=600, max_tokens=96)
        states.put(user, UserState(EVENTS - 10, EXACT, dedup(events[0, : EVENTS - 10])))
        states.close()

    context = {spec.sequences[0].name: tail, USER_ID: user, USER_SEQ: EVENTS}
    with private_server(repository, tmp_path, model_control="none", prepare=prepare) as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            as_rows = client.predict(rows)
            as_list = client.score_candidates(context, rows)
            by_user = client.predict_by_user(rows)  # one run of one user: sent as that list
            today = client.score_candidates({spec.sequences[0].name: tail}, rows)
        wait_for(lambda: _metric(server, "hit") == count + 2, 15, "a hit per row, then one per list")
        assert "Traceback" not in server.log_tail(200)
    assert np.abs(as_list - as_rows).max() <= 1e-6  # the list graph against the row graph
    np.testing.assert_array_equal(by_user, as_list)
    full = _full_history_reference(spec, repository, rows.to_wire(spec), np.tile(events[0], (count, 1)))
    assert np.abs(as_list - full).max() <= 1e-5  # exact: the whole 4,096-event history
    assert np.abs(today - full).max() > 1e-5  # the tail alone differs


def _set_aside(server) -> float:
    found = re.findall(
        r"^recserve_user_state_set_aside_total(?:\{[^}]*\})? (\S+)$", metrics_text(server), re.M
    )
    return sum(float(v) for v in found)


def test_a_corrupt_state_database_is_set_aside_once_and_the_server_serves(stateful, tmp_path):
    """Before: ``file is not a database`` in the lookup step's initialize: the server never went READY."""
    spec, repository = stateful
    wire, _ = _users(spec, 4, seed=11)
    today = {k: v for k, v in wire.items() if k not in (USER_ID, USER_SEQ)}

    def prepare(root: Path) -> None:
        (root / spec.user_state.local_path).write_bytes(b"\x00 not a database " * 512)

    with private_server(repository, tmp_path, model_control="none", prepare=prepare) as server:
        with grpc_client(server) as client:
            served = infer_raw(grpcclient, client, spec, wire)
            alone = infer_raw(grpcclient, client, spec, today)
        assert np.array_equal(served, alone)  # every user a miss on the fresh file: today's answer
        # every lookup instance opened the file at load; one set it aside, the others found the new one
        wait_for(lambda: _set_aside(server) == 1 and _metric(server, "miss") == 4, 15, "one set-aside")
        assert "set aside as" in server.log_tail(400) and "Traceback" not in server.log_tail(400)
    root = tmp_path / "repository"
    (aside,) = root.glob(Path(spec.user_state.local_path).name + ".corrupt-*[0-9]")
    assert aside.read_bytes().startswith(b"\x00 not a database")
