"""The DIN of docs/design/import.md, end to end: a user's own model over rows as they are, with a user state.

A Deep Interest Network (Zhou et al. 2018) written in plain PyTorch: string user ids, a real-valued
price that is sometimes missing (its missing flag a column of the network's own), each behaviour's
item beside its category (two aligned sequences), DIN's activation unit over ``[h, t, h - t, h * t]``
whose scores weight a sum over the real positions. It is exported with ``torch.onnx.export``'s
current exporter, imported with its vocabularies and served through Triton. The served scores must
equal the model's own PyTorch scores on rows, on a candidate list, and with a near-line user state:
its builder runs over an event log of string users whose events carry their category, and a
request's real-time tail is merged into the user's state, so the served score is the model's on the
user's whole history (longer than the largest sequence bucket).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from recserve.clients import CTRClient
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS, USER_ID, USER_SEQ
from recserve.core.rows import Rows
from recserve.core.spec.parse import load_spec
from tests.integration.helpers import recserve
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

[inputs]
user = "user"                     # the user's id: a profile feature, and whose state a row merges

[user_state]
enabled = true
tokens = 8                        # up to 8 distinct (item, category) tokens per user, kept exactly
exact_tokens = 6
tail = 8                          # the newest events a request carries
bucket_margin = 0
debounce_ms = 0

[[features]]
name = "user"
kind = "categorical"
value_type = "string"

[[features]]
name = "price"
kind = "numeric"
value_type = "real"
clip = [0, 1e9]
log1p = true
missing_flag = true               # "price_missing", 1.0 where the row has no price

[[features]]
name = "hist_item_ids"
kind = "sequence"
table = "item"
max_length = 16
combine = "concat"

[[features]]
name = "hist_cate_ids"            # each behaviour's category, at its item's position
kind = "sequence"
table = "cate"
positions = "hist_item_ids"

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
item = { dim = 8, cardinality = 30 }
cate = { dim = 4, cardinality = 6 }
"""

#: The user's vocabularies (row 0 is the out-of-vocabulary row).
VOCABULARIES: dict[str, list[str | int]] = {
    "user": [f"u-{i}" for i in range(40)],
    "item": list(range(1, 31)),
    "cate": list(range(6)),
}
WIDTHS = {"user": 8, "item": 8, "cate": 4}
ITEM_WIDTH = WIDTHS["item"] + WIDTHS["cate"]
NAMES = ["dense_normalized", "sparse_embeddings", "target_embedding", "history_embeddings"]
NAMES += ["history_mask", "history_log_weights"]


class DIN(nn.Module):
    """DIN as a user writes it: row ids and the price in, a logit out."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {table: nn.Embedding(len(VOCABULARIES[table]) + 1, width) for table, width in WIDTHS.items()}
        )
        for table in self.embeddings.values():
            nn.init.normal_(table.weight, std=0.5)
        self.unit = nn.Sequential(nn.Linear(4 * ITEM_WIDTH, 16), nn.PReLU(), nn.Linear(16, 1))
        self.mlp = nn.Sequential(nn.Linear(2 + 8 + 2 * ITEM_WIDTH, 32), nn.PReLU(), nn.Linear(32, 1))
        for layer in (*self.unit, *self.mlp):
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.3)

    def forward(self, ids: dict[str, torch.Tensor], price: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1]``: user and ad ids ``[B]``, history ids ``[B, L]``, price ``[B]`` (NaN: none)."""
        missing = torch.isnan(price)
        numeric = torch.stack([torch.log1p(torch.where(missing, 0.0, price)), missing.float()], dim=1)
        profile = self.embeddings["user"](ids["user"])[:, None, :]
        target = torch.cat(
            [self.embeddings["item"](ids["item_id"]), self.embeddings["cate"](ids["cate_id"])], -1
        )
        history = torch.cat(
            [self.embeddings["item"](ids["hist_item_ids"]), self.embeddings["cate"](ids["hist_cate_ids"])], -1
        )
        return self.head(numeric, profile, target, history, mask, torch.zeros_like(mask))

    def head(self, numeric, profile, target, history, mask, log_weights) -> torch.Tensor:
        """The network over the embeddings (what is exported, in the dense contract's order).

        DIN pools with unnormalised weights, so ``c`` equal behaviours weigh ``c`` times one: a user
        state's token of count ``c`` (``log_weights`` = ln c) is weighed by ``exp(log_weights)``.
        """
        query = target[:, None, :].expand_as(history)
        unit_in = torch.cat([history, query, history - query, history * query], dim=-1)
        scores = self.unit(unit_in).squeeze(-1) * mask * torch.exp(log_weights)
        pooled = (scores[:, :, None] * history).sum(dim=1)
        return self.mlp(torch.cat([numeric, profile.flatten(1), pooled, target], dim=1))


class Head(nn.Module):
    """The export: the dense contract's inputs, in its order, into ``head``."""

    def __init__(self, model: DIN) -> None:
        super().__init__()
        self.model = model

    def forward(self, numeric, profile, target, history, mask, log_weights) -> torch.Tensor:  # noqa: D102
        return self.model.head(numeric, profile, target, history, mask, log_weights)


def _ids(table: str, values) -> torch.Tensor:
    index = {str(token): r + 1 for r, token in enumerate(VOCABULARIES[table])}  # 0: out of vocabulary
    return torch.tensor([index.get(str(v), 0) for v in values], dtype=torch.long)


def _reference(model: DIN, users, prices, items, cates, histories) -> np.ndarray:
    """The user's own scores: one row per ad, each with its own whole history ``(items, cates)``."""
    out = []
    for user, price, item, cate, (hist, hist_cates) in zip(
        users, prices, items, cates, histories, strict=True
    ):
        named = {
            "user": _ids("user", [user]),
            "item_id": _ids("item", [item]),
            "cate_id": _ids("cate", [cate]),
            "hist_item_ids": _ids("item", hist)[None, :],
            "hist_cate_ids": _ids("cate", hist_cates)[None, :],
        }
        with torch.no_grad():
            logit = model(named, torch.tensor([price], dtype=torch.float32), torch.ones(1, len(hist)))
        out.append(torch.sigmoid(logit)[0, 0].item())
    return np.array(out, np.float32)


def _rows(users, prices, items, cates, histories) -> Rows:
    """Rows as a file holds them: the user's string id, a price or none, the ad, a history of 0..16."""
    count = len(users)
    width = max(16, *(len(h) for h, _ in histories))
    hist, hist_cates = np.zeros((count, width), np.int64), np.zeros((count, width), np.int64)
    for r, (h, c) in enumerate(histories):
        hist[r, : len(h)], hist_cates[r, : len(c)] = h, c
    prices = np.asarray(prices, np.float32)
    return Rows(
        dense=np.nan_to_num(prices)[:, None],
        dense_missing=np.isnan(prices)[:, None],
        categorical=np.array([[str(u).encode()] for u in users], dtype=object),
        target=np.asarray(items, np.int64),
        history=hist,
        lengths=np.array([len(h) for h, _ in histories], np.int32),
        side={"hist_cate_ids": hist_cates, "cate_id": np.asarray(cates, np.int64)},
    )


def _export_and_import(model: DIN, spec_file, folder) -> None:
    tables = folder / "tables"
    tables.mkdir()
    for table, tokens in VOCABULARIES.items():
        np.save(tables / f"{table}.npy", model.embeddings[table].weight.detach().numpy())
        (tables / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))
    example = (
        torch.randn(2, 2),
        torch.randn(2, 1, 8),
        torch.randn(2, ITEM_WIDTH),
        torch.randn(2, 5, ITEM_WIDTH),
        torch.ones(2, 5),
        torch.zeros(2, 5),
    )
    batch, sequence = torch.export.Dim(BATCH_AXIS), torch.export.Dim(SEQUENCE_AXIS)
    shapes = ({0: batch}, {0: batch}, {0: batch}, {0: batch, 1: sequence}, {0: batch, 1: sequence})
    torch.onnx.export(  # the current exporter (torch.export), as docs/design/import.md shows it
        Head(model).eval(),
        example,
        str(folder / "model.onnx"),
        input_names=NAMES,
        output_names=["logit"],
        dynamic_shapes=(*shapes, {0: batch, 1: sequence}),
    )
    imported = recserve(
        "--spec", str(spec_file), "import", "--tables", str(tables),
        "--dense", str(folder / "model.onnx"), "--repository", str(folder / "repository"),
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr


def test_a_din_with_string_users_missing_prices_and_a_user_state_serves_its_own_pytorch_scores(tmp_path):
    spec_file = tmp_path / "din.toml"
    spec_file.write_text(SPEC)
    spec = load_spec(spec_file)
    contract = json.loads(recserve("--spec", str(spec_file), "contract", "--json").stdout)
    assert [t["name"] for t in contract["inputs"]] == NAMES
    torch.manual_seed(3)
    model = DIN().eval()
    _export_and_import(model, spec_file, tmp_path)
    rng = np.random.default_rng(7)

    # rows as they are: unknown users and ads, no price, histories of 0 to 16
    count = 60
    users = [f"u-{u}" if u < 40 else f"stranger-{u}" for u in rng.integers(0, 45, count)]
    prices = np.where(rng.random(count) < 0.3, np.nan, rng.lognormal(2.0, 1.0, count)).astype(np.float32)
    items = rng.integers(1, 36, count)  # 31..35: unseen
    cates = items % 8  # 6 and 7: unseen
    lengths = rng.choice([0, 1, 3, 9, 16], count)
    histories = []
    for n in lengths:
        h = rng.integers(1, 36, n)
        histories.append((h, h % 8))
    rows = _rows(users, prices, items, cates, histories)
    want = _reference(model, users, prices, items, cates, histories)
    assert want.std() > 0.05  # the rows reach different rows of every table: the comparison can fail

    # the near-line state: 5 users with 20 to 40 events over 4 items, each item in either of two
    # categories (so 8 (item, category) tokens); the log holds all but the last 3 events of each
    owners = [f"u-{u}" for u in range(5)]
    events, timelines = [], {}
    for user in owners:
        pool = rng.choice(np.arange(1, 31), 4, replace=False)
        n = int(rng.integers(20, 41))
        it = rng.choice(pool, n)
        ca = (it + rng.integers(0, 2, n)) % 6
        timelines[user] = (it, ca)
        events += [
            (user, s + 1, int(i), int(c)) for s, (i, c) in enumerate(zip(it[:-3], ca[:-3], strict=True))
        ]

    def prepare(root) -> None:  # the event log as JSON lines, then the builder over it
        (root / spec.user_state.event_path).write_text(
            "".join(
                json.dumps({"user": user, "seq": seq, "item": item, "ts": 0.0, "hist_cate_ids": cate}) + "\n"
                for user, seq, item, cate in events
            )
        )
        built = recserve(
            "--spec", str(spec_file), "user-state", "run", "--drain", "--repository", str(root),
            "--folder", str(root), "--json", str(root / "builder.json"),
        )  # fmt: skip
        assert built.returncode == 0, built.stderr
        report = json.loads((root / "builder.json").read_text())
        assert report["rebuilds"] == len(owners) and report["modes"] == {"exact": len(owners)}, report

    tail = 5  # each request carries the user's newest 5 events: 3 newer than its state
    stated = _rows(
        owners,
        [4.5, np.nan, 12.0, 0.5, np.nan],
        [int(timelines[u][0][0]) for u in owners],
        [int(timelines[u][1][0]) for u in owners],
        [(timelines[u][0][-tail:], timelines[u][1][-tail:]) for u in owners],
    ).with_user_state(spec, owners, [len(timelines[u][0]) for u in owners])
    want_stated = _reference(
        model,
        owners,
        [4.5, np.nan, 12.0, 0.5, np.nan],
        [int(timelines[u][0][0]) for u in owners],
        [int(timelines[u][1][0]) for u in owners],
        [timelines[u] for u in owners],  # the user's whole history: 20 to 40 events
    )

    # a candidate list of user u-0: 12 ads, scored with the user's state and tail
    ads = rng.integers(1, 31, 12)
    ad_cates = (ads + 1) % 6
    user = owners[0]
    candidates = _rows([user] * 12, np.full(12, 3.0), ads, ad_cates, [(np.zeros(0), np.zeros(0))] * 12)
    context = {
        "hist_item_ids": timelines[user][0][-tail:],
        "hist_cate_ids": timelines[user][1][-tail:],
        USER_ID: user,
        USER_SEQ: len(timelines[user][0]),
    }
    want_list = _reference(model, [user] * 12, np.full(12, 3.0), ads, ad_cates, [timelines[user]] * 12)

    chunks = [slice(s, s + 1 + s % 13) for s in range(0, count, 14)]
    with private_server(
        tmp_path / "repository", tmp_path / "serve", model_control="none", prepare=prepare
    ) as server:
        with CTRClient(server.grpc_url) as client:  # the spec: the one the server serves
            served = [client.predict_inputs(rows.take(part).to_wire(spec)) for part in chunks]
            served_stated = client.predict_inputs(stated.to_wire(spec))
            served_list = client.score_candidates(context, candidates)
            tail_only = client.score_candidates(
                {k: v for k, v in context.items() if k.startswith("hist")}, candidates
            )
        assert "Traceback" not in server.log_tail(200)
    deltas = {
        "rows": max(np.abs(got - want[part]).max() for part, got in zip(chunks, served, strict=True)),
        "user state": np.abs(served_stated - want_stated).max(),
        "list with user state": np.abs(served_list - want_list).max(),
    }
    print(
        "DIN served vs its PyTorch scores, max |delta|: "
        + ", ".join(f"{k} {v:.1e}" for k, v in deltas.items())
    )
    assert max(deltas.values()) <= 1e-5, deltas
    assert np.abs(tail_only - want_list).max() > 1e-3  # the tail alone is another history: the state counts
