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
from torch import nn

from recserve.clients import CTRClient
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS
from recserve.core.rows import Rows
from recserve.core.spec.parse import load_spec
from tests.integration.helpers import import_torch_model, recserve
from tests.integration.private_server import private_server

SPEC = """
[model]
name = "din"
max_batch_size = 64
embedding_dim = 8
output = "logit"

[dense_net]                       # the built-in network's sizes (an imported model uses none of them)
bottom_mlp = [8]
top_mlp = [16]
attention_heads = 2

[serving]
batch_buckets = [1, 8, 64]
sequence_buckets = [4, 16]
max_queue_delay_microseconds = 100
instances = { embedding_lookup = 1, dense = 1 }

[[features]]
name = "user"
kind = "categorical"
value_type = "int64"

[[features]]
name = "gender"
kind = "categorical"
value_type = "string"

[[features]]
name = "age_level"
kind = "categorical"
value_type = "int64"

# the clicked items, newest last, and their categories at the same positions, side by side
[[features]]
name = "hist_item_ids"
kind = "sequence"
table = "item"
max_length = 16
combine = "concat"

[[features]]
name = "hist_cate_ids"
kind = "sequence"
table = "cate"
positions = "hist_item_ids"

# the ad: its item and its category, the query of the attention (built the same way)
[[features]]
name = "item_id"
kind = "categorical"
value_type = "int64"
table = "item"
attends = "hist_item_ids"

[[features]]
name = "cate_id"
kind = "categorical"
value_type = "int64"
table = "cate"
attends = "hist_cate_ids"

[tables]
user = { dim = 8, cardinality = 40 }
gender = { dim = 8, cardinality = 2 }
age_level = { dim = 8, cardinality = 7 }
item = { dim = 8, cardinality = 30 }
cate = { dim = 4, cardinality = 6 }
"""

#: The user's vocabularies (the raw values of rows 1..; row 0 is the out-of-vocabulary row).
VOCABULARIES: dict[str, list[str | int]] = {
    "user": list(range(100, 140)),
    "gender": ["M", "F"],
    "age_level": list(range(7)),
    "item": list(range(1, 31)),
    "cate": list(range(6)),
}
WIDTHS = {"user": 8, "gender": 8, "age_level": 8, "item": 8, "cate": 4}
PROFILE = ("user", "gender", "age_level")
ITEM_WIDTH = WIDTHS["item"] + WIDTHS["cate"]


def category(items: np.ndarray) -> np.ndarray:
    """Each item's category (ids 0..7: 6 and 7 unseen by the vocabulary)."""
    return items % 8


class DIN(nn.Module):
    """DIN as a model zoo writes it: row ids in, a logit out."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {table: nn.Embedding(len(VOCABULARIES[table]) + 1, width) for table, width in WIDTHS.items()}
        )
        for table in self.embeddings.values():
            nn.init.normal_(table.weight, std=0.5)
        self.unit = nn.Sequential(nn.Linear(4 * ITEM_WIDTH, 16), nn.PReLU(), nn.Linear(16, 1))
        width = len(PROFILE) * 8 + 2 * ITEM_WIDTH
        self.mlp = nn.Sequential(nn.Linear(width, 32), nn.PReLU(), nn.Linear(32, 1))
        for layer in (*self.unit, *self.mlp):  # a trained model's spread of scores
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.3)

    def forward(self, ids: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1]`` from row ids (profile and target ``[B]``, histories ``[B, L]``) and the mask."""
        profile = torch.stack([self.embeddings[f](ids[f]) for f in PROFILE], dim=1)
        target = torch.cat(
            [self.embeddings["item"](ids["item_id"]), self.embeddings["cate"](ids["cate_id"])], -1
        )
        history = torch.cat(
            [self.embeddings["item"](ids["hist_item_ids"]), self.embeddings["cate"](ids["hist_cate_ids"])], -1
        )
        return self.head(profile, target, history, mask)

    def head(
        self, profile: torch.Tensor, target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The network over the embeddings (what is exported): attention unit, weighted sum, MLP."""
        query = target[:, None, :].expand_as(history)
        unit_in = torch.cat([history, query, history - query, history * query], dim=-1)
        scores = self.unit(unit_in).squeeze(-1) * mask  # DIN: no softmax, padding weighs nothing
        pooled = (scores[:, :, None] * history).sum(dim=1)
        return self.mlp(torch.cat([profile.flatten(1), pooled, target], dim=1))


class Head(nn.Module):
    """The few lines of the export: the dense contract's inputs, in its order, into ``head``."""

    def __init__(self, model: DIN) -> None:
        super().__init__()
        self.model = model

    def forward(self, profile, target, history, mask) -> torch.Tensor:  # noqa: D102
        return self.model.head(profile, target, history, mask)


def _rows(rng: np.random.Generator, count: int) -> Rows:
    """Raw rows: known, unseen and empty values in every column; absent and unseen ads; histories
    of 0 to 16 items, some unseen, each behaviour's category its item's."""
    pools = {
        "user": [*(str(v) for v in VOCABULARIES["user"]), "7", "99999", ""],
        "gender": ["M", "F", "X", ""],
        "age_level": ["0", "3", "6", "9", ""],
    }
    categorical = np.array(
        [[p[i].encode() for i in rng.integers(0, len(p), count)] for p in pools.values()], dtype=object
    ).T
    items = rng.integers(1, 36, size=(count, 16))  # 31..35: not in the item vocabulary
    lengths = rng.choice([0, 0, 1, 2, 3, 5, 9, 16], size=count).astype(np.int32)
    items[np.arange(16)[None, :] >= lengths[:, None]] = 0
    target = rng.integers(1, 36, size=count)
    target[rng.random(count) < 0.1] = -1  # no ad item
    return Rows(
        dense=np.zeros((count, 0), np.float32),
        dense_missing=np.zeros((count, 0), bool),
        categorical=categorical,
        target=target,
        history=items,
        lengths=lengths,
        side={"hist_cate_ids": category(items), "cate_id": np.where(target >= 0, category(target), -1)},
    )


def _reference(model: DIN, rows: Rows) -> np.ndarray:
    """The user's own scores: their vocabularies over the raw values, their mask, their model."""

    def ids(table: str, values) -> torch.Tensor:
        index = {str(token): r + 1 for r, token in enumerate(VOCABULARIES[table])}  # 0: out of vocabulary
        return torch.tensor([[index.get(str(v), 0) for v in row] for row in np.atleast_2d(values)])

    columns = [[v.decode() for v in column] for column in rows.categorical.T]
    named = {field: ids(field, [column])[0] for field, column in zip(PROFILE, columns, strict=True)}
    named["item_id"] = ids("item", [rows.target])[0]
    named["cate_id"] = ids("cate", [rows.side["cate_id"]])[0]
    named["hist_item_ids"] = ids("item", rows.history)
    named["hist_cate_ids"] = ids("cate", rows.side["hist_cate_ids"])
    mask = torch.from_numpy((np.arange(16)[None, :] < rows.lengths[:, None]).astype(np.float32))
    with torch.no_grad():
        return torch.sigmoid(model(named, mask)).numpy()[:, 0]


def _export_tables(model: DIN, folder) -> None:
    """Each table as ``<table>.npy`` and ``<table>.vocab.json`` (tokens as clients send them)."""
    folder.mkdir()
    for table, tokens in VOCABULARIES.items():
        np.save(folder / f"{table}.npy", model.embeddings[table].weight.detach().numpy())
        (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))


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
    _export_tables(model, tmp_path / "tables")
    example = (
        torch.randn(2, 3, 8),
        torch.randn(2, ITEM_WIDTH),
        torch.randn(2, 5, ITEM_WIDTH),
        torch.ones(2, 5),
    )
    axes = {name: {0: BATCH_AXIS} for name in [*names, "logit"]}
    axes["history_embeddings"] = axes["history_mask"] = {0: BATCH_AXIS, 1: SEQUENCE_AXIS}
    import_torch_model(Head(model), example, names, axes, spec_file, tmp_path)

    rows = _rows(np.random.default_rng(5), 200)
    want = _reference(model, rows)
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
    assert np.abs(_reference(blind, rows) - want).max() > 0.01
