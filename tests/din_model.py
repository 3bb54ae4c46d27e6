"""The hand-written DIN of the import tests: its spec, vocabularies, PyTorch model, rows and reference.

A DIN (Deep Interest Network, Zhou et al. 2018) as a user brings it from a model zoo: per-table
vocabularies, user-profile embeddings, each behaviour and the candidate ad as its item's embedding
next to its category's (``combine = "concat"``), DIN's attention unit over ``[h, t, h - t, h * t]``
whose scores weight a sum over the real positions, and an MLP. ``test_import_din`` exports its
network over the dense contract; ``test_import_in_model`` exports it as written.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from recserve.core.rows import Rows

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


def din_rows(rng: np.random.Generator, count: int) -> Rows:
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


def din_reference(model: DIN, rows: Rows) -> np.ndarray:
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


def export_din_tables(model: DIN, folder) -> None:
    """Each table as ``<table>.npy`` and ``<table>.vocab.json`` (tokens as clients send them)."""
    folder.mkdir()
    for table, tokens in VOCABULARIES.items():
        np.save(folder / f"{table}.npy", model.embeddings[table].weight.detach().numpy())
        (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))
