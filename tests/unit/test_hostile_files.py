"""Hostile and broken files given to ``recserve import``: each refused with one ``error:`` line.

Sizes and shapes are checked before anything is inflated or allocated, so a small file that claims
gigabytes (a compressed ``.npz`` of zeros, a sparse ONNX over 2 GiB) is refused under a memory
limit far below what it claims; malformed headers, deep JSON and external data outside the model's
folder are refused naming the file, never with a traceback.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from recserve import verify
from recserve.backends.base.artifacts import map_safetensors
from recserve.backends.base.bounded_files import load_npz, map_npy
from recserve.build.repository import version_dir
from recserve.cli import main
from recserve.core.names import DENSE
from recserve.errors import ArtifactError
from tests.hostile_files import npy_header, write_zero_member
from tests.model_exports import export_tables

#: Address space the import subprocess may use: far below what the hostile files claim.
MEMORY_LIMIT = 2 << 30  # the import's code and libraries take about 0.7 GiB of it before any table


@pytest.fixture(scope="module")
def exported(tiny_spec, tiny_repository, tmp_path_factory) -> Path:
    """The tiny model's tables (keyed safetensors, then vocabulary .npy) and its ONNX beside them."""
    folder = tmp_path_factory.mktemp("hostile")
    formats = {name: ("keyed", "vocabulary")[i % 2] for i, name in enumerate(tiny_spec.table_names)}
    export_tables(tiny_spec, tiny_repository, folder / "tables", formats)
    shutil.copy(version_dir(tiny_repository, DENSE, tiny_spec) / "model.onnx", folder / "model.onnx")
    return folder


@pytest.fixture()
def inputs(exported, tmp_path) -> Path:
    shutil.copytree(exported, tmp_path / "in")
    return tmp_path / "in"


def keyed_table(folder: Path) -> str:
    return sorted(p.stem for p in folder.glob("*.safetensors"))[0]


def vocabulary_table(folder: Path) -> str:
    return sorted(p.name[: -len(".vocab.json")] for p in folder.glob("*.vocab.json"))[0]


def import_args(inputs: Path) -> list[str]:
    """``recserve import`` of the tables and dense model in ``inputs`` (exported from the tiny spec)."""
    return [
        "--spec",
        "tiny",
        "import",
        "--tables",
        str(inputs / "tables"),
        "--dense",
        str(inputs / "model.onnx"),
    ]


def run_import(inputs: Path, capsys) -> str:
    """``recserve import`` in this process: its exit status must be 1 and stderr one ``error:`` line."""
    code = main([*import_args(inputs), "--repository", str(inputs.parent / "repo")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, err
    assert not (inputs.parent / "repo").exists()
    return errors[0]


def start_import_limited(inputs: Path, limit: int = MEMORY_LIMIT) -> subprocess.Popen:
    """``recserve import`` started in a subprocess whose address space is capped at ``limit`` bytes."""
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
        "from recserve.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script, *import_args(inputs), "--repository", str(inputs.parent / "repo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def assert_one_error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    return errors[0]


def huge_onnx(inputs: Path, spec) -> str:
    with open(inputs / "model.onnx", "r+b") as fh:
        fh.truncate((2 << 30) + 1)  # sparse: nothing is written
    return "model.onnx"


def huge_hugectr_default(inputs: Path, spec) -> str:
    tables = inputs / "tables"
    table = keyed_table(tables)
    arrays = map_safetensors(tables / f"{table}.safetensors")
    (tables / table).mkdir()
    np.asarray(arrays["keys"], "<i8").tofile(tables / table / "key")
    np.asarray(arrays["vectors"], "<f4").tofile(tables / table / "emb_vector")
    with open(tables / table / "default", "wb") as fh:
        fh.truncate(16 << 30)  # sparse: nothing is written
    (tables / f"{table}.safetensors").unlink()
    return table


def decompression_bomb(inputs: Path, spec) -> str:
    tables = inputs / "tables"
    table = keyed_table(tables)
    (tables / f"{table}.safetensors").unlink()
    rows, dim = 1 << 26, spec.tables[table].dim  # 512 MiB of keys and 1 GiB of vectors, all zeros
    with zipfile.ZipFile(tables / f"{table}.npz", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        write_zero_member(archive, "keys.npy", (rows,), "<i8")
        write_zero_member(archive, "vectors.npy", (rows, dim), "<f2")
    assert (tables / f"{table}.npz").stat().st_size < 8 << 20
    return table


#: the files each import under the memory limit is given (the bomb last: it takes longest to make)
LIMITED = {
    "honest": lambda inputs, spec: "",
    "onnx": huge_onnx,
    "default": huge_hugectr_default,
    "bomb": decompression_bomb,
}


@pytest.fixture(scope="module")
def limited(
    exported, tiny_spec, tmp_path_factory
) -> dict[str, tuple[Path, str, subprocess.CompletedProcess]]:
    """Each of :data:`LIMITED` imported under the memory limit: its inputs, the table it names, the result.

    The imports run side by side, each in its own process with its own limit.
    """
    started, done = {}, {}
    try:
        for name, damage in LIMITED.items():
            inputs = tmp_path_factory.mktemp(f"limited-{name}") / "in"
            shutil.copytree(exported, inputs)
            table = damage(inputs, tiny_spec)
            started[name] = (inputs, table, start_import_limited(inputs))
        for name, (inputs, table, process) in started.items():
            out, err = process.communicate(timeout=300)
            done[name] = (
                inputs,
                table,
                subprocess.CompletedProcess(process.args, process.returncode, out, err),
            )
    finally:  # none is left running when one fails or hangs (as subprocess.run kills on its timeout)
        for _, _, process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return done


def test_a_decompression_bomb_npz_is_refused_before_inflating_under_a_memory_limit(limited):
    _, table, result = limited["bomb"]
    error = assert_one_error_line(result)
    assert f"{table}.npz inflates to 1.5 GiB" in error and f"table {table!r}" in error


def test_an_onnx_over_two_gib_is_refused_up_front_under_a_memory_limit(limited):
    error = assert_one_error_line(limited["onnx"][2])
    assert "dense model model.onnx has 2.0 GiB, over the 2 GiB" in error


def test_a_huge_sparse_hugectr_default_file_is_refused_before_reading_under_a_memory_limit(limited):
    _, table, result = limited["default"]
    error = assert_one_error_line(result)
    assert f"table {table!r}: {table}/default has 17,179,869,184 bytes, not 8 float32s" in error


def test_the_memory_limit_leaves_room_for_an_honest_import(limited):
    inputs, _, result = limited["honest"]
    assert result.returncode == 0, result.stderr
    assert (inputs.parent / "repo").is_dir()


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def _keyed_npz(tables: Path, content) -> str:
    """Replace the first keyed table's safetensors by an ``.npz`` holding ``content(arrays)`` bytes."""
    table = keyed_table(tables)
    arrays = {k: np.array(v) for k, v in map_safetensors(tables / f"{table}.safetensors").items()}
    (tables / f"{table}.safetensors").unlink()
    (tables / f"{table}.npz").write_bytes(content(arrays))
    return f"{table}.npz"


def _vectors_npy(tables: Path, content) -> str:
    table = vocabulary_table(tables)
    path = tables / f"{table}.npy"
    path.write_bytes(content(path.read_bytes()))
    return path.name


def _safetensors(tables: Path, header: object, data: bytes = b"") -> str:
    table = keyed_table(tables)
    raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    (tables / f"{table}.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return f"{table}.safetensors"


def _keys_and_vectors(keys_offsets: list, vectors_offsets: list) -> dict:
    return {
        "keys": {"dtype": "I64", "shape": [4], "data_offsets": keys_offsets},
        "vectors": {"dtype": "F32", "shape": [4, 8], "data_offsets": vectors_offsets},
    }


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _vocabulary(tables: Path, text: str) -> str:
    table = vocabulary_table(tables)
    (tables / f"{table}.vocab.json").write_text(text)
    return f"{table}.vocab.json"


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda t: _keyed_npz(t, lambda a: b""), "is not a numpy file"),
        (lambda t: _keyed_npz(t, lambda a: _npz_bytes(a)[:200]), "is not a numpy file"),
        (lambda t: _keyed_npz(t, lambda a: os.urandom(4096)), "is not a numpy file"),
        (
            lambda t: _keyed_npz(t, lambda a: _npz_bytes({**a, "vectors": a["vectors"][:, :3]})),
            r"vectors is float32\[\d+, 3\], expected float32 or float16 \[rows, 8\] \(refused before",
        ),
        (lambda t: _vectors_npy(t, lambda b: os.urandom(4096)), "is not a numpy file"),
        (lambda t: _vectors_npy(t, lambda b: b[:-40]), "truncated or padded"),
        (lambda t: _vectors_npy(t, lambda b: b[:60]), "no readable .npy header|truncated"),
        (lambda t: _safetensors(t, [1, 2, 3]), "its header is a JSON list, not an object"),
        (lambda t: _safetensors(t, {"keys": {"dtype": "F32"}}), "is not an object of"),
        (lambda t: _safetensors(t, '{"keys": ' + _deep(100_000) + "}"), "nested too deeply"),
        (
            lambda t: _safetensors(t, _keys_and_vectors([0, 32], [16, 144]), bytes(144)),
            "tensors 'keys' and 'vectors' share bytes",
        ),
        (
            lambda t: _safetensors(t, _keys_and_vectors([0, 32.0], [32, 160]), bytes(160)),
            r"data_offsets \[0, 32.0\], not two non-negative integers",
        ),
        (
            lambda t: _safetensors(t, _keys_and_vectors([0, 32], [32, 161]), bytes(161)),
            "do not hold its shape",
        ),
        (lambda t: _vocabulary(t, '{"tokens": ' + _deep(100_000) + "}"), "is nested too deeply"),
        (lambda t: _vocabulary(t, '{"tokens": [' + '"a", ' * (1 << 20) + "null]}"), "at most"),
    ],
    ids=[
        "empty-npz",
        "truncated-npz",
        "random-bytes-npz",
        "npz-shape-off-spec",
        "random-bytes-npy",
        "truncated-npy",
        "npy-header-cut",
        "safetensors-header-list",
        "safetensors-entry-not-flat",
        "safetensors-deep-header",
        "safetensors-overlap",
        "safetensors-fractional-offset",
        "safetensors-range-off-shape",
        "vocabulary-deep",
        "vocabulary-too-large",
    ],
)
def test_a_hostile_table_file_is_one_error_line_naming_file_and_table(inputs, capsys, damage, problem):
    name = damage(inputs / "tables")
    error = run_import(inputs, capsys)
    table = name.split(".")[0]
    assert name in error and f"table {table!r}" in error, error
    assert "pickled" not in error
    assert re.search(problem, error), error


def _external(model_path: Path, location: str) -> None:
    """Move the model's largest initializer to external data at ``location``."""
    model = onnx.load(str(model_path))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data) or numpy_helper.to_array(t).size)
    array = numpy_helper.to_array(tensor)
    tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(model_path))


@pytest.mark.parametrize("where", ["../outside.bin", "absolute", "link/outside.bin"])
def test_onnx_external_data_outside_the_models_folder_is_refused(inputs, tmp_path, capsys, where):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(1 << 16))
    if where == "absolute":
        where = str(outside)
    elif where.startswith("link"):
        (inputs / "link").symlink_to(tmp_path)
    _external(inputs / "model.onnx", where)
    error = run_import(inputs, capsys)
    assert "dense model model.onnx: tensor" in error and "outside the model's folder" in error, error


def test_onnx_external_data_that_is_short_is_refused(inputs, capsys):
    (inputs / "weights.bin").write_bytes(b"\0" * 4)
    _external(inputs / "model.onnx", "weights.bin")
    error = run_import(inputs, capsys)
    assert "dense model model.onnx: tensor" in error and "'weights.bin', which has 4" in error, error


def test_the_readers_bound_their_work_and_shorten_what_they_echo(tmp_path):
    path = tmp_path / "t.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("keys.npy", npy_header((1 << 40,), "<i8"))  # claims 8 TiB, holds a header
    with pytest.raises(ArtifactError, match="the zip directory says it inflates to 128 bytes"):
        load_npz(path)
    (tmp_path / "o.npy").write_bytes(npy_header((2,), "|O") + bytes(16))
    with pytest.raises(ArtifactError, match="holds Python objects"):
        map_npy(tmp_path / "o.npy")
    header = json.dumps({"k" * 1_000_000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "t.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ArtifactError) as err:
        map_safetensors(tmp_path / "t.safetensors")
    assert len(str(err.value)) < 300 and "(1000000 chars)" in str(err.value)


def test_verify_names_an_unreadable_rows_or_scores_file_in_one_error_line(tmp_path, capsys):
    (tmp_path / "rows.bin").write_bytes(b"\xc4\xff" * 2048)
    (tmp_path / "scores.txt").write_text("0.5\n" + "x" * 1_000_000 + "\n")
    (tmp_path / "scores.gz").write_bytes(os.urandom(512))
    args = ["--spec", "tiny", "verify", "--rows", str(tmp_path / "rows.bin"), "--expected"]
    assert main([*args, str(tmp_path / "scores.txt")]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: rows.bin cannot be read as text")
    with pytest.raises(ValueError) as err:
        verify.read_named(tmp_path / "scores.txt", verify.read_expected)
    assert "scores.txt, line 2: 'xxxx" in str(err.value) and "(1000000 chars)" in str(err.value)
    assert len(str(err.value)) < 300
    with pytest.raises(ValueError, match="scores.gz cannot be read as text"):
        verify.read_named(tmp_path / "scores.gz", verify.read_expected)
