"""The DIN of test_import_din exported as written: row ids in, its tables inside, imported and served.

``[model] lookups = "in_model"``: the exported graph is the model's whole ``forward(ids, mask)``, with
no wrapper; ``recserve import`` splits it at its lookups and takes each table from the graph, its keys
from ``<table>.vocab.json``. The served scores must equal the model's own PyTorch scores.
"""

from __future__ import annotations

import json

import numpy as np
import torch

import tests.din_model as din
from recserve.clients import CTRClient
from recserve.core.names import BATCH_AXIS, SEQUENCE_AXIS
from recserve.core.spec.parse import load_spec
from tests.integration.helpers import recserve
from tests.integration.private_server import private_server

SPEC = din.SPEC.replace('output = "logit"', 'output = "logit"\nlookups = "in_model"')
#: The model's row inputs, in the order of its ``ids`` dict, then its mask: the names the export gives them.
NAMES = [
    "user",
    "gender",
    "age_level",
    "item_id",
    "cate_id",
    "hist_item_ids",
    "hist_cate_ids",
    "history_mask",
]


def test_a_din_exported_as_written_with_its_own_tables_serves_its_own_pytorch_scores(tmp_path):
    spec_file = tmp_path / "din.toml"
    spec_file.write_text(SPEC)
    spec = load_spec(spec_file)
    contract = json.loads(recserve("--spec", str(spec_file), "contract", "--json").stdout)
    assert contract["lookups"] == "in_model"
    assert {t["name"]: (t["dtype"], t["shape"]) for t in contract["inputs"]} == {
        **{name: ("INT64", [-1]) for name in NAMES[:5]},
        "hist_item_ids": ("INT64", [-1, -1]),
        "hist_cate_ids": ("INT64", [-1, -1]),
        "history_mask": ("FP32", [-1, -1]),
    }

    torch.manual_seed(11)
    model = din.DIN().eval()
    tables = tmp_path / "tables"
    tables.mkdir()
    for table, tokens in din.VOCABULARIES.items():  # the vocabularies only: the rows are the model's
        (tables / f"{table}.vocab.json").write_text(json.dumps({"tokens": [None, *tokens], "oov": 0}))
    ids = {name: torch.zeros(2, dtype=torch.long) for name in NAMES[:5]}
    ids |= {name: torch.zeros(2, 5, dtype=torch.long) for name in NAMES[5:7]}
    batch, sequence = torch.export.Dim(BATCH_AXIS), torch.export.Dim(SEQUENCE_AXIS)
    shapes = {name: {0: batch} for name in NAMES[:5]} | {name: {0: batch, 1: sequence} for name in NAMES[5:7]}
    torch.onnx.export(  # the current exporter (torch.export), as docs/design/import.md shows it
        model,
        (ids, torch.ones(2, 5)),  # the model's own forward(ids, mask)
        str(tmp_path / "din.onnx"),
        input_names=NAMES,
        output_names=["logit"],
        dynamic_shapes=(shapes, {0: batch, 1: sequence}),
    )
    imported = recserve(
        "--spec", str(spec_file), "import", "--tables", str(tables),
        "--dense", str(tmp_path / "din.onnx"), "--repository", str(tmp_path / "repository"),
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert "split at its 7 lookups" in imported.stderr

    rows = din.din_rows(np.random.default_rng(5), 128)
    want = din.din_reference(model, rows)
    assert want.std() > 0.05
    chunks = [slice(s, s + 1) for s in range(0, 8)] + [slice(0, 64), slice(64, 128)]
    with private_server(tmp_path / "repository", tmp_path / "serve", model_control="none") as server:
        with CTRClient(server.grpc_url, spec=spec) as client:
            served = [client.predict_inputs(rows.take(part).to_wire(spec)) for part in chunks]
    deltas = [np.abs(got - want[part]).max() for part, got in zip(chunks, served, strict=True)]
    print(
        f"DIN as written, served vs its PyTorch scores: max |delta| = {max(deltas):.2e} over {len(want)} rows"
    )
    for part, got in zip(chunks, served, strict=True):
        np.testing.assert_allclose(got, want[part], atol=1e-5)
