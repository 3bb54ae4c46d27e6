"""A DIN written by hand in plain PyTorch, exported with torch.onnx.export, imported and served.

The model is what a user brings from a model zoo (Deep Interest Network, Zhou et al. 2018): per-table
vocabularies, user-profile embeddings, each behaviour and the candidate ad as its item's embedding
next to its category's (``combine = "concat"``: 8 + 4 wide), DIN's attention unit (an MLP over
``[h, t, h - t, h * t]``) whose scores weight a sum over the real positions, and an MLP over the
profile, the pooled history and the target. The served scores must equal the model's own PyTorch
scores on rows with unseen and empty values and short or empty histories.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from recserve.clients import CTRClient
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS
from recserve.core.spec.parse import load_spec
from tests.din_model import DIN, ITEM_WIDTH, PROFILE, SPEC, Head, din_reference, din_rows, export_din_tables
from tests.integration.helpers import import_torch_model, recserve
from tests.integration.private_server import private_server


def test_a_hand_written_din_over_concatenated_items_and_categories_serves_its_own_pytorch_scores(tmp_path):
    spec_file = tmp_path / "din.toml"
    spec_file.write_text(SPEC)
    spec = load_spec(spec_file)
    contract = json.loads(recserve("--spec", str(spec_file), "contract", "--json").stdout)
    shapes = {t["name"]: t["shape"] for t in contract["inputs"]}
    assert shapes == {
        "sparse_embeddings": [-1, 3, 8],
        "target_embedding": [-1, ITEM_WIDTH],
        "history_embeddings": [-1, -1, ITEM_WIDTH],
        "history_mask": [-1, -1],
    }
    assert list(spec.categorical.slot_names) == list(PROFILE)  # the profile stacked as the model stacks it
    names = list(shapes)

    torch.manual_seed(11)
    model = DIN().eval()
    export_din_tables(model, tmp_path / "tables")
    example = (
        torch.randn(2, 3, 8),
        torch.randn(2, ITEM_WIDTH),
        torch.randn(2, 5, ITEM_WIDTH),
        torch.ones(2, 5),
    )
    axes = {name: {0: BATCH_AXIS} for name in [*names, "logit"]}
    axes["history_embeddings"] = axes["history_mask"] = {0: BATCH_AXIS, 1: SEQUENCE_AXIS}
    import_torch_model(Head(model), example, names, axes, spec_file, tmp_path)

    rows = din_rows(np.random.default_rng(5), 200)
    want = din_reference(model, rows)
    assert want.std() > 0.05  # the rows reach different rows of every table: the comparison can fail
    # requests of 1 to 13 rows: the dynamic batcher merges histories of different sequence buckets
    chunks = [slice(s, s + 1 + s % 13) for s in range(0, len(rows), 14)] + [slice(0, 64), slice(64, 128)]
    with private_server(tmp_path / "repository", tmp_path / "serve", model_control="none") as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            served = [client.predict_inputs(rows.take(part).to_wire(spec)) for part in chunks]
    deltas = [np.abs(got - want[part]).max() for part, got in zip(chunks, served, strict=True)]
    print(f"DIN served vs its PyTorch scores: max |delta| = {max(deltas):.2e} over {len(want)} rows")
    for part, got in zip(chunks, served, strict=True):
        np.testing.assert_allclose(got, want[part], atol=1e-5)
    # the categories' columns count: the same model without them scores the rows differently
    blind = DIN().eval()
    blind.load_state_dict(model.state_dict())
    with torch.no_grad():
        blind.embeddings["cate"].weight.zero_()
    assert np.abs(din_reference(blind, rows) - want).max() > 0.01
