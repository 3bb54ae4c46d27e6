"""A DeepFM written by hand in plain PyTorch, exported with torch.onnx.export, imported and served.

The model is what a user brings from a model zoo: per-field vocabularies, an embedding (8 or 16
wide) and a first-order weight per field value, an FM over the embeddings, an MLP, and Avazu's C15
read as a number too. Its spec holds only the schema and the tables (no [dense_net], [serving] or
cardinality); every field feeds two tables (``tables = [x, x_linear]``), the weights a 1-wide one.
The served scores must equal the model's own PyTorch scores on rows with unseen and empty values.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from recserve.clients import CTRClient
from recserve.core.contract import dense_net_inputs, sparse_inputs
from recserve.core.names import BATCH_AXIS, DENSE_NORMALIZED
from recserve.core.spec.parse import load_spec
from tests.integration.helpers import import_torch_model, recserve
from tests.integration.private_server import private_server
from tests.model_exports import DEEPFM_SPEC as SPEC

#: The user's fields, their vocabularies (row 0 is the out-of-vocabulary row) and widths.
FIELDS = {
    "site_id": (["", "85f751fd", "1fbe01fe", "e151e245", "d9750ee7"], 16),
    "app_id": (["ecad2386", "", "92f5800b", "e2fcccd2"], 16),
    "device_type": (["1", "0", "4", "5"], 8),
    "C15": (["320", "300", "216", "728", ""], 8),
}
OOV = "<oov>"


class DeepFM(nn.Module):
    """DeepFM as a model zoo writes it: ids in, a logit out (first order + FM + MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict({f: nn.Embedding(len(v) + 1, d) for f, (v, d) in FIELDS.items()})
        self.weights = nn.ModuleDict({f: nn.Embedding(len(v) + 1, 1) for f, (v, _) in FIELDS.items()})
        for table in [*self.embeddings.values(), *self.weights.values()]:
            nn.init.normal_(table.weight, std=0.3)
        self.bias = nn.Parameter(torch.tensor([0.1]))
        width = 1 + sum(d for _, d in FIELDS.values())
        self.mlp = nn.Sequential(
            nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1)
        )

    def forward(self, ids: dict[str, torch.Tensor], number: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1]`` from each field's row ids ``[B]`` and C15's number ``[B, 1]``."""
        wide = torch.stack([self.embeddings[f](ids[f]) for f in ("site_id", "app_id")], dim=1)
        narrow = torch.stack([self.embeddings[f](ids[f]) for f in ("device_type", "C15")], dim=1)
        linear = torch.stack([self.weights[f](ids[f]) for f in FIELDS], dim=1)
        return self.head(number, wide, linear, narrow)

    def head(
        self, number: torch.Tensor, wide: torch.Tensor, linear: torch.Tensor, narrow: torch.Tensor
    ) -> torch.Tensor:
        """The network over the embeddings: what is exported."""
        first = self.bias + linear.sum(dim=(1, 2))[:, None]
        fm = sum(0.5 * (v.sum(1) ** 2 - (v**2).sum(1)).sum(1, keepdim=True) for v in (wide, narrow))
        deep = self.mlp(torch.cat([number, wide.flatten(1), narrow.flatten(1)], dim=1))
        return first + fm + deep


class Head(nn.Module):
    """The few lines of the export: the dense contract's inputs, in its order, into ``head``."""

    def __init__(self, model: DeepFM) -> None:
        super().__init__()
        self.model = model

    def forward(self, number, wide, linear, narrow) -> torch.Tensor:  # noqa: D102
        return self.model.head(number, wide, linear, narrow)


def _rows(rng: np.random.Generator, count: int) -> dict[str, list[str]]:
    """Raw values: known ones, unseen ones and empty ones, in every field."""
    rows = {}
    for field, (tokens, _) in FIELDS.items():
        known = [t for t in tokens if t]
        unseen = ["999", "12"] if field in ("device_type", "C15") else ["0000beef", "unseen"]
        pool = known + unseen + [""]
        rows[field] = [pool[i] for i in rng.integers(0, len(pool), count)]
    return rows


def _reference(model: DeepFM, rows: dict[str, list[str]]) -> np.ndarray:
    """The user's own scores: their vocabularies, their preprocessing of C15, their model."""
    ids = {}
    for field, (tokens, _) in FIELDS.items():
        index = {t: i + 1 for i, t in enumerate(tokens)}  # row 0: out of vocabulary
        ids[field] = torch.tensor([index.get(v, 0) for v in rows[field]])
    c15 = np.array([float(v) if v else 0.0 for v in rows["C15"]])
    number = torch.from_numpy(np.log1p(np.clip(c15, 0, 2000)).astype(np.float32))[:, None]
    with torch.no_grad():
        return torch.sigmoid(model(ids, number)).numpy()[:, 0]


def _export_tables(model: DeepFM, folder) -> None:
    """Each table as ``<table>.npy`` and ``<table>.vocab.json`` (tokens as clients send them)."""
    folder.mkdir()
    for field, (tokens, _) in FIELDS.items():
        for table, module in ((field, model.embeddings[field]), (f"{field}_linear", model.weights[field])):
            np.save(folder / f"{table}.npy", module.weight.detach().numpy())
            (folder / f"{table}.vocab.json").write_text(json.dumps({"tokens": [OOV, *tokens], "oov": 0}))


def test_a_hand_written_deepfm_serves_its_own_pytorch_scores(tmp_path):
    spec_file = tmp_path / "deepfm.toml"
    spec_file.write_text(SPEC)
    spec = load_spec(spec_file)
    contract = json.loads(recserve("--spec", str(spec_file), "contract", "--json").stdout)
    names = [t["name"] for t in contract["inputs"]]
    assert (
        names
        == list(dense_net_inputs(spec))
        == [
            DENSE_NORMALIZED,
            "sparse_embeddings",
            "sparse_embeddings__1",
            "sparse_embeddings__8",
        ]
    )
    # the slots of each packed input are the fields in the order the model stacks them
    slots = {name: [spec.categorical.slot_names[i] for i in s] for name, _, s in sparse_inputs(spec)}
    assert slots["sparse_embeddings"] == ["site_id", "app_id"]
    assert slots["sparse_embeddings__1"] == list(FIELDS)
    assert slots["sparse_embeddings__8"] == ["device_type", "C15"]

    torch.manual_seed(7)
    model = DeepFM().eval()
    _export_tables(model, tmp_path / "tables")
    example = (torch.rand(2, 1), torch.randn(2, 2, 16), torch.randn(2, 4, 1), torch.randn(2, 2, 8))
    axes = {name: {0: BATCH_AXIS} for name in [*names, "logit"]}
    import_torch_model(Head(model), example, names, axes, spec_file, tmp_path)

    rows = _rows(np.random.default_rng(3), 150)
    want = _reference(model, rows)
    assert want.std() > 0.05  # the rows reach different rows of every table: the comparison can fail
    fields = np.array([[v.encode() for v in rows[f]] for f in FIELDS], dtype=object).T
    with private_server(tmp_path / "repository", tmp_path / "serve", model_control="none") as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            served = np.concatenate(
                [
                    client.predict_inputs({"categorical": fields[s : s + 64]})
                    for s in range(0, len(fields), 64)
                ]
            )
    delta = float(np.abs(served - want).max())
    print(f"DeepFM served vs its PyTorch scores: max |delta| = {delta:.2e} over {len(want)} rows")
    np.testing.assert_allclose(served, want, atol=1e-5)
