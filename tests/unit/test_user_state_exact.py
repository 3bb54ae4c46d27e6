"""The dense graph's per-token log-weight: zeros change nothing, counts make a state exact.

A user's 4,096 events reduced to their distinct items with counts (a stored state merged with the
request's real-time tail) score what the full-length attention over all 4,096 events scores.
"""

import numpy as np
import pytest
import torch

from recserve.backends.dense.network import CandidateNet, CTRNet
from recserve.backends.store.user_state.tokens import dedup, merge
from recserve.core.contract import attention_inputs
from recserve.core.names import HISTORY_LOG_WEIGHTS, HISTORY_USER
from recserve.core.spec.parse import load_spec

SPEC = load_spec("ctr")
GROUP = attention_inputs(SPEC)[0]
DIM = SPEC.model.embedding_dim


def _net() -> CTRNet:
    torch.manual_seed(0)
    return CTRNet(SPEC).eval()


def _inputs(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Random dense inputs whose history has ``length`` positions, real ones first."""
    rng = np.random.default_rng(seed)
    named = {}
    for name in _net().input_names:
        if name == GROUP.mask:
            lengths = rng.integers(0, length + 1, rows)
            named[name] = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
        elif name == GROUP.history:
            named[name] = rng.normal(0, 0.5, (rows, length, DIM)).astype(np.float32)
        elif name == GROUP.target:
            named[name] = rng.normal(0, 0.5, (rows, DIM)).astype(np.float32)
        else:
            shape = {"dense_normalized": (rows, len(SPEC.normalized_columns))}.get(name)
            named[name] = rng.normal(0, 0.5, shape or (rows, SPEC.num_sparse, DIM)).astype(np.float32)
    return {name: torch.from_numpy(value) for name, value in named.items()}


@pytest.mark.parametrize("length", SPEC.serving.sequence_buckets)
def test_zero_log_weights_reproduce_todays_outputs_bit_for_bit_at_every_bucket(length):
    net = _net()
    named = _inputs(9, length, seed=length)
    with torch.no_grad():
        today = net.score(named)
        zeros = net.score({**named, HISTORY_LOG_WEIGHTS: torch.zeros(9, length)})
        moved = net.score({**named, HISTORY_LOG_WEIGHTS: torch.full((9, length), 0.7)})
        skewed = net.score(
            {**named, HISTORY_LOG_WEIGHTS: torch.rand(9, length, generator=torch.Generator().manual_seed(1))}
        )
    assert torch.equal(zeros, today)
    assert torch.allclose(moved, today, atol=1e-6)  # a constant shift cancels in the softmax
    assert (skewed - today).abs().max() > 1e-5  # the weights reach the attention


def test_zero_log_weights_reproduce_todays_candidate_lists_bit_for_bit():
    net = _net()
    candidates = CandidateNet(net).eval()
    named = _inputs(6, SPEC.serving.sequence_buckets[1], seed=3)
    users = torch.tensor([0, 0, 1, 1, 1, 2])
    per_user = {GROUP.history: named[GROUP.history][:3], GROUP.mask: named[GROUP.mask][:3]}
    with torch.no_grad():
        today = net.score({**named, **per_user}, users)
        length = named[GROUP.mask].shape[1]
        zeros = net.score({**named, **per_user, HISTORY_LOG_WEIGHTS: torch.zeros(3, length)}, users)
        exported = candidates(
            *(named.get(n, per_user.get(n, users)) for n in candidates.input_names[:-1]), users
        )
    assert HISTORY_USER in candidates.input_names
    assert torch.equal(zeros, today) and torch.equal(exported, today)


EVENTS = 4096
TAIL = 64


def _token_inputs(named, table, tokens_per_row, bucket):
    """The dense inputs of the rows' tokens: their items' rows, a mask, ``ln count`` per token."""
    rows = len(tokens_per_row)
    history = torch.zeros(rows, bucket, DIM)
    mask = torch.zeros(rows, bucket)
    weights = torch.zeros(rows, bucket)
    for r, tokens in enumerate(tokens_per_row):
        n = len(tokens)
        history[r, :n] = table[torch.from_numpy(tokens.items)]
        mask[r, :n] = 1.0
        weights[r, :n] = torch.from_numpy(tokens.log_weights())
    return {**named, GROUP.history: history, GROUP.mask: mask, HISTORY_LOG_WEIGHTS: weights}


def test_state_plus_tail_scores_what_the_full_4096_event_history_scores():
    """Exact mode: <= 192 distinct items per user, so the tokens fit the 256 bucket with the tail."""
    net = _net()
    rng = np.random.default_rng(7)
    items = 5000
    table = torch.from_numpy(rng.normal(0, 0.6, (items, DIM)).astype(np.float32))
    rows = 6
    named = _inputs(rows, 8, seed=11)
    full_history = torch.zeros(rows, EVENTS, DIM)
    merged = []
    for r in range(rows):
        catalogue = rng.choice(np.arange(1, items), 150, replace=False)
        ranks = np.minimum(rng.zipf(1.3, EVENTS) - 1, catalogue.size - 1)
        events = catalogue[ranks].astype(np.int64)
        full_history[r] = table[torch.from_numpy(events)]
        built = int(rng.integers(EVENTS - TAIL, EVENTS))  # the state lags the request by 1..64 events
        result = merge(dedup(events[:built]), built, events[-TAIL:], EVENTS)
        assert result.outcome == "hit" and result.tokens.events == EVENTS
        merged.append(result.tokens)
    bucket = SPEC.serving.sequence_buckets[-1]
    assert max(len(t) for t in merged) <= bucket
    with torch.no_grad():
        full = net.score({**named, GROUP.history: full_history, GROUP.mask: torch.ones(rows, EVENTS)})
        served = net.score(_token_inputs(named, table, merged, bucket))
        truncated = net.score(
            {**named, GROUP.history: full_history[:, -bucket:], GROUP.mask: torch.ones(rows, bucket)}
        )
    assert (served - full).abs().max().item() <= 1e-5
    assert (truncated - full).abs().max().item() > 1e-4  # the last 256 events alone are not the same


def test_the_exported_graph_with_zero_log_weights_scores_todays_graph_bit_for_bit(tmp_path):
    import onnxruntime as ort

    from recserve.build.export import example_inputs, export_onnx
    from recserve.core.spec.parse import parse_spec
    from tests.unit.helpers import ctr_spec_document

    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True}
    stateful = parse_spec(doc)
    today, with_weights = _net(), CTRNet(stateful).eval()
    with_weights.load_state_dict(today.state_dict())
    export_onnx(SPEC, today, tmp_path / "today.onnx")
    export_onnx(stateful, with_weights, tmp_path / "state.onnx")
    assert HISTORY_LOG_WEIGHTS in with_weights.input_names
    for length in SPEC.serving.sequence_buckets:
        feeds = example_inputs(stateful, rows=7, length=length, seed=length)
        feeds[HISTORY_LOG_WEIGHTS] = np.zeros_like(feeds[HISTORY_LOG_WEIGHTS])
        plain = {name: feeds[name] for name in today.input_names}
        got = ort.InferenceSession(str(tmp_path / "state.onnx")).run(None, feeds)[0]
        expected = ort.InferenceSession(str(tmp_path / "today.onnx")).run(None, plain)[0]
        assert np.array_equal(got, expected)
