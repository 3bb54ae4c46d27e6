"""``recserve import`` and ``recserve contract``: trained tables and a dense ONNX in, a served repository out.

The served side of the same imports is in tests/integration/test_import.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tomllib
import torch
from safetensors.numpy import save_file

from recserve.backends.base.artifacts import map_safetensors
from recserve.backends.dense.compatibility import check_onnx_contract
from recserve.backends.steps.pipeline import InProcessPipeline
from recserve.backends.store.tiered import TieredStore
from recserve.build.importer import TableImportError, import_repository
from recserve.build.repository import is_built, reference_pipeline, version_dir
from recserve.build.synthetic import generate
from recserve.cli import main
from recserve.clients.writers import write_csv
from recserve.core.contract import dense_contract
from recserve.core.names import (
    BATCH_AXIS,
    DENSE,
    DENSE_NET_INPUTS,
    DENSE_NORMALIZED,
    EMBEDDING_LOOKUP,
    HISTORY_EMBEDDINGS,
    HISTORY_MASK,
    LOGIT,
    PROBABILITY,
    SEQUENCE_AXIS,
    SPARSE_EMBEDDINGS,
    TARGET_EMBEDDING,
)
from recserve.core.spec.parse import parse_spec, spec_path
from recserve.errors import ArtifactError
from tests.model_exports import HandWrittenModel, export_tables

FORMATS = ("vocabulary", "keyed", "hugectr")


def quiet(message: str) -> None:
    """Progress lines are not asserted on."""


@pytest.fixture(scope="module")
def logit_spec(tiny_spec):
    """The tiny spec for a dense model that returns logits."""
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["output"] = "logit"
    return parse_spec(doc)


@pytest.fixture(scope="module")
def exported(tiny_spec, tiny_repository, tmp_path_factory) -> Path:
    """The tiny model's tables, each format used at least once, and its ONNX beside them."""
    folder = tmp_path_factory.mktemp("exported")
    formats = {name: FORMATS[i % 3] for i, name in enumerate(tiny_spec.table_names)}
    export_tables(tiny_spec, tiny_repository, folder / "tables", formats)
    shutil.copy(version_dir(tiny_repository, DENSE, tiny_spec) / "model.onnx", folder / "model.onnx")
    return folder


def copy_of(exported: Path, tmp_path: Path) -> Path:
    shutil.copytree(exported, tmp_path / "in")
    return tmp_path / "in"


def test_an_import_round_trip_in_every_table_format_scores_as_the_built_model(
    tiny_spec, tiny_repository, exported, tmp_path
):
    report = import_repository(
        tiny_spec, exported / "tables", exported / "model.onnx", tmp_path / "repo", quiet
    )
    assert set(report.formats.values()) == set(FORMATS)
    assert is_built(tiny_spec, tmp_path / "repo")
    rows = generate(tiny_spec, 256, seed=11).to_wire(tiny_spec)
    built = reference_pipeline(tiny_spec, tiny_repository, "onnx").predict(rows)
    imported = reference_pipeline(tiny_spec, tmp_path / "repo", "onnx").predict(rows)
    np.testing.assert_array_equal(imported, built)


def test_a_hand_written_onnx_with_random_vocabulary_tables_scores_as_its_numpy_reference(
    logit_spec, tmp_path
):
    model = HandWrittenModel(logit_spec)
    model.write(tmp_path / "hand.onnx")
    tables = model.random_tables(logit_spec, tmp_path / "tables")
    import_repository(logit_spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "repo", quiet)
    rows = generate(logit_spec, 200, seed=12)
    served = reference_pipeline(logit_spec, tmp_path / "repo", "onnx").predict(rows.to_wire(logit_spec))
    np.testing.assert_allclose(served, model.reference(logit_spec, tables, rows), atol=1e-5)


def test_the_imported_graph_names_its_axes_and_serves_a_logit_as_a_probability(logit_spec, tmp_path):
    model = HandWrittenModel(logit_spec)
    model.write(tmp_path / "hand.onnx")
    model.random_tables(logit_spec, tmp_path / "tables")
    import_repository(logit_spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "repo", quiet)
    graph = onnx.load(str(version_dir(tmp_path / "repo", DENSE, logit_spec) / "model.onnx")).graph
    assert [o.name for o in graph.output] == [PROBABILITY]
    axes = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert axes[HISTORY_MASK] == [BATCH_AXIS, SEQUENCE_AXIS]
    assert axes[DENSE_NORMALIZED][0] == BATCH_AXIS


def test_a_probability_model_that_returns_logits_is_refused(tiny_spec, tmp_path):
    model = HandWrittenModel(tiny_spec)
    model.write(tmp_path / "hand.onnx", output=LOGIT)
    model.random_tables(tiny_spec, tmp_path / "tables")
    with pytest.raises(ArtifactError, match="no output 'probability'"):
        import_repository(tiny_spec, tmp_path / "tables", tmp_path / "hand.onnx", tmp_path / "repo", quiet)


def _edit_graph(source: Path, target: Path, edit) -> Path:
    model = onnx.load(str(source))
    edit(model.graph)
    onnx.save(model, str(target))
    return target


def _rename_input(graph, old, new):
    next(i for i in graph.input if i.name == old).name = new
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda g: _rename_input(g, TARGET_EMBEDDING, "item_emb"), "no input 'target_embedding'"),
        (
            lambda g: g.input[1].type.tensor_type.shape.dim[1].__setattr__("dim_value", 5),
            "input 'sparse_embeddings' is [?, 5, 8]",
        ),
        (
            lambda g: g.input[0].type.tensor_type.__setattr__("elem_type", onnx.TensorProto.DOUBLE),
            "input 'dense_normalized' is FP64",
        ),
        (
            lambda g: g.input[4].type.tensor_type.shape.dim.pop(),
            "input 'history_mask' has rank 1",
        ),
        (
            lambda g: g.input[0].type.tensor_type.shape.dim[0].__setattr__("dim_value", 1),
            "input 'dense_normalized' is [1, 4]",
        ),
        (lambda g: g.output[0].__setattr__("name", "score"), "no output 'probability'"),
    ],
)
def test_an_onnx_off_the_contract_is_refused_naming_the_difference(
    exported, tiny_spec, tmp_path, edit, named
):
    bad = _edit_graph(exported / "model.onnx", tmp_path / "bad.onnx", edit)
    with pytest.raises(ArtifactError) as err:
        check_onnx_contract(tiny_spec, bad)
    assert named in str(err.value)
    with pytest.raises(ArtifactError):
        import_repository(tiny_spec, exported / "tables", bad, tmp_path / "repo", quiet)
    assert not (tmp_path / "repo").exists()


def _vocabulary_table(folder: Path) -> str:
    return next(p.name[: -len(".vocab.json")] for p in folder.glob("*.vocab.json"))


def _keyed_table(folder: Path) -> str:
    return next(p.stem for p in folder.glob("*.safetensors"))


def _hugectr_table(folder: Path) -> str:
    return next(p.name for p in folder.iterdir() if p.is_dir())


def _vocab_edit(change):
    def edit(folder: Path) -> str:
        name = _vocabulary_table(folder)
        path = folder / f"{name}.vocab.json"
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))
        return name

    return edit


def _npy_edit(change):
    def edit(folder: Path) -> str:
        name = _vocabulary_table(folder)
        np.save(folder / f"{name}.npy", change(np.load(folder / f"{name}.npy")))
        return name

    return edit


def _keyed_edit(change):
    def edit(folder: Path) -> str:
        name = _keyed_table(folder)
        arrays = {k: np.array(v) for k, v in map_safetensors(folder / f"{name}.safetensors").items()}
        save_file(change(arrays), str(folder / f"{name}.safetensors"))
        return name

    return edit


def _with_nan(vectors):
    vectors = vectors.copy()
    vectors[3, 1] = np.nan
    return vectors


def _with_huge(vectors):
    vectors = vectors.copy()
    vectors[3, 1] = 3e38  # finite, but the scores of any row using it overflow: refused as Redis refuses it
    return vectors


def _duplicate_key(arrays):
    arrays["keys"][1] = arrays["keys"][0]
    return arrays


def _hugectr_truncated(folder: Path) -> str:
    name = _hugectr_table(folder)
    data = (folder / name / "emb_vector").read_bytes()
    (folder / name / "emb_vector").write_bytes(data[:-4])
    return name


def _stray_file(folder: Path) -> str:
    np.save(folder / "C99.npy", np.zeros((2, 8), np.float32))
    (folder / "C99.vocab.json").write_text('{"tokens": ["a", "b"]}')
    return "C99"


def _missing_table(folder: Path) -> str:
    name = _keyed_table(folder)
    (folder / f"{name}.safetensors").unlink()
    return name


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_npy_edit(lambda v: v[:, :4]), r"vectors are \[\d+, 4\], expected \[rows, 8\]"),
        (_npy_edit(lambda v: v.astype(np.float64)), "vectors are float64"),
        (_npy_edit(_with_nan), "row 3 holds NaN or Inf"),
        (_npy_edit(_with_huge), "row 3 holds NaN or Inf, or a value over 1e\\+06 in magnitude"),
        (_npy_edit(lambda v: v[:-1]), r"the vocabulary has \d+ tokens, the vectors \d+ rows"),
        (_vocab_edit(lambda d: d["tokens"].__setitem__(1, d["tokens"][0])), "are the same value"),
        (_vocab_edit(lambda d: d.__setitem__("unk", 0)), "unknown keys"),
        (_vocab_edit(lambda d: d.__setitem__("oov", 10**6)), "oov is 1000000"),
        (_keyed_edit(_duplicate_key), "repeats keys"),
        (_keyed_edit(lambda a: {**a, "vectors": a["vectors"][:, :3]}), "expected \\[\\d+, 8\\]"),
        (_hugectr_truncated, "emb_vector has"),
        (_stray_file, "unknown table"),
        (_missing_table, "missing table"),
    ],
)
def test_a_bad_table_is_refused_naming_it_and_nothing_is_written(
    exported, tiny_spec, tmp_path, damage, problem
):
    folder = copy_of(exported, tmp_path)
    table = damage(folder / "tables")
    with pytest.raises(ArtifactError, match=problem) as err:
        import_repository(tiny_spec, folder / "tables", folder / "model.onnx", tmp_path / "repo", quiet)
    assert repr(table) in str(err.value) or table in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no repository, no staging folder


def test_a_token_that_is_not_a_value_of_its_feature_is_refused_with_its_position(
    exported, tiny_spec, tmp_path
):
    folder = copy_of(exported, tmp_path)
    name = _vocab_edit(lambda d: d["tokens"].__setitem__(2, "xyz"))(folder / "tables")
    with pytest.raises(TableImportError, match=f"table '{name}'.*'xyz'"):
        import_repository(tiny_spec, folder / "tables", folder / "model.onnx", tmp_path / "repo", quiet)


def test_an_existing_repository_is_replaced_only_when_asked(exported, tiny_spec, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "keep").write_text("mine")
    with pytest.raises(TableImportError, match="--replace"):
        import_repository(tiny_spec, exported / "tables", exported / "model.onnx", tmp_path / "repo", quiet)
    assert (tmp_path / "repo" / "keep").read_text() == "mine"
    import_repository(
        tiny_spec, exported / "tables", exported / "model.onnx", tmp_path / "repo", quiet, replace=True
    )
    assert not (tmp_path / "repo" / "keep").exists() and is_built(tiny_spec, tmp_path / "repo")


def test_a_malformed_safetensors_file_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        map_safetensors(path)


def test_contract_prints_the_dense_inputs_and_output_of_the_spec(capsys, logit_spec):
    assert main(["--spec", "tiny", "contract", "--json"]) == 0
    contract = json.loads(capsys.readouterr().out)
    shapes = {t["name"]: t["shape"] for t in contract["inputs"]}
    assert shapes == {
        DENSE_NORMALIZED: [-1, 4],
        SPARSE_EMBEDDINGS: [-1, 4, 8],
        TARGET_EMBEDDING: [-1, 8],
        HISTORY_EMBEDDINGS: [-1, -1, 8],
        HISTORY_MASK: [-1, -1],
    }
    assert contract["outputs"] == [
        {"name": "probability", "dtype": "FP32", "shape": [-1, 1], "holds": "click probability"}
    ]
    inputs, outputs = dense_contract(logit_spec)
    assert [o.name for o in outputs] == [LOGIT] and all(t.dtype == "FP32" for t in inputs)
    assert main(["--spec", "tiny", "contract"]) == 0
    assert "sparse_embeddings   FP32  [-1, 4, 8]" in capsys.readouterr().out


def test_an_unknown_dense_output_kind_is_refused():
    doc = tomllib.loads(spec_path("tiny").read_text())
    doc["model"]["output"] = "score"
    with pytest.raises(ValueError, match="model.output must be one of probability, logit"):
        parse_spec(doc)


class ForeignDense(torch.nn.Module):
    """A dense part written the way a user of another framework would: not recserve's network."""

    def __init__(self, spec) -> None:
        super().__init__()
        dim, width = (
            spec.model.embedding_dim,
            len(spec.dense.columns) + (spec.num_sparse + 2) * spec.model.embedding_dim,
        )
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.dim = dim

    def forward(self, dense, sparse, target, history, mask):
        pooled = (history * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        return self.mlp(torch.cat([dense, sparse.flatten(1), target, pooled], dim=1))


def test_the_guides_pytorch_example_imports_and_verifies(logit_spec, tmp_path, capsys):
    torch.manual_seed(0)
    dense = ForeignDense(logit_spec).eval()
    names = list(DENSE_NET_INPUTS)
    d, n, f = logit_spec.model.embedding_dim, len(logit_spec.dense.columns), logit_spec.num_sparse
    example = (
        torch.zeros(2, n),
        torch.zeros(2, f, d),
        torch.zeros(2, d),
        torch.zeros(2, 8, d),
        torch.ones(2, 8),
    )
    axes = {name: {0: "batch"} for name in [*names, "logit"]}
    axes["history_embeddings"] = axes["history_mask"] = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        dense,
        example,
        str(tmp_path / "dense.onnx"),
        input_names=names,
        output_names=["logit"],
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
    HandWrittenModel(logit_spec).random_tables(logit_spec, tmp_path / "tables")  # row 0: out of vocabulary
    spec_file = tmp_path / "mine.toml"
    spec_file.write_text(
        spec_path("tiny").read_text().replace("version = 1\n", 'version = 1\noutput = "logit"\n', 1)
    )
    args = ["--spec", str(spec_file)]
    repo = tmp_path / "repo"
    assert (
        main(
            [
                *args,
                "import",
                "--tables",
                str(tmp_path / "tables"),
                "--dense",
                str(tmp_path / "dense.onnx"),
                "--repository",
                str(repo),
            ]
        )
        == 0
    )

    def torch_dense(inputs):
        with torch.no_grad():
            logits = dense(*(torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in names))
        return torch.sigmoid(logits).numpy()

    rows = generate(logit_spec, 120, seed=13)
    store = TieredStore.load(version_dir(repo, EMBEDDING_LOOKUP, logit_spec), logit_spec)
    expected = InProcessPipeline(logit_spec, store, torch_dense).predict(rows.to_wire(logit_spec))
    write_csv(tmp_path / "rows.csv", rows, logit_spec, with_label=True)
    (tmp_path / "scores.txt").write_text("".join(f"{p:.9f}\n" for p in expected))
    verify = ["verify", "--rows", str(tmp_path / "rows.csv"), "--expected", str(tmp_path / "scores.txt")]
    assert main([*args, *verify, "--repository", str(repo)]) == 0
    assert "| in process (onnx) | 120 |" in capsys.readouterr().out
    (tmp_path / "scores.txt").write_text("".join(f"{p + 0.01:.9f}\n" for p in expected))
    assert main([*args, *verify, "--repository", str(repo)]) == 1
