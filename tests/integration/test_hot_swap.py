"""Dense versions go live under load with no failed request; misfits and corrupt artifacts are refused."""

import copy
import shutil
import time

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.backends.base.artifacts import file_entry, write_manifest
from recserve.backends.dense.network import CTRNet
from recserve.build.export import export_onnx
from recserve.core.spec.parse import parse_spec
from recserve.perf.harness.traffic import add_version

from .private_server import background_traffic, private_server


@pytest.fixture(scope="module")
def swap_server(repository, tmp_path_factory):
    with private_server(repository, tmp_path_factory.mktemp("hot-swap")) as server:
        yield server


def _wait_for_version(counts, version, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while version not in counts.versions:
        assert time.monotonic() < deadline, f"no response from dense version {version}; saw {counts.versions}"
        time.sleep(0.2)


def _load(server, model="dense"):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(model, headers=server.security.headers())


def _write_misfit_dense(spec, folder, adapter):
    """A dense model exported for embedding_dim 32: it does not fit the 16-wide embedding tables."""
    doc = copy.deepcopy(spec.source)
    doc["model"]["embedding_dim"] = 32
    doc["dense_net"]["bottom_mlp"] = [64, 32]
    for table in doc["tables"].values():
        table.pop("dim", None)
    other = parse_spec(doc)
    folder.mkdir()
    export_onnx(other, CTRNet(other).eval(), folder / "model.onnx")
    (folder / "model.py").write_text(adapter.read_text())
    write_manifest(
        folder,
        {
            "format": "recserve-dense/1",
            "version": int(folder.name),
            "files": {"model": file_entry(folder, folder / "model.onnx")},
        },
    )


def test_restricted_apis_need_the_admin_key(swap_server):
    with grpcclient.InferenceServerClient(swap_server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("dense")
        assert "restricted" in err.value.message().lower() or "PERMISSION" in str(err.value.status())
        with pytest.raises(InferenceServerException):
            client.get_log_settings()
        assert client.is_model_ready("dense", "1")


def test_dense_versions_swap_under_load_and_bad_versions_are_refused(swap_server, spec, tmp_path):
    root = swap_server.repository
    misfit = tmp_path / "3"
    _write_misfit_dense(spec, misfit, root / "dense" / "1" / "model.py")
    with background_traffic(swap_server, spec) as counts:
        _wait_for_version(counts, 1)
        assert add_version(root, "dense") == 2
        _load(swap_server)
        _wait_for_version(counts, 2)

        shutil.move(misfit, root / "dense" / "3")
        with pytest.raises(InferenceServerException) as err:
            _load(swap_server)
        assert (
            "does not fit" in err.value.message() and "'sparse_embeddings' is [26, 32]" in err.value.message()
        )
        with grpcclient.InferenceServerClient(swap_server.grpc_url) as client:
            assert client.is_model_ready("dense", "2") and client.is_model_ready(spec.name)
        served_before = counts.valid_ok
        time.sleep(2)
        assert counts.valid_ok > served_before, "the old pair stopped serving after a refused load"

        shutil.rmtree(root / "dense" / "3")
        add_version(root, "dense", source_version=2)
        onnx = root / "dense" / "3" / "model.onnx"
        data = bytearray(onnx.read_bytes())
        data[len(data) // 2] ^= 0xFF
        onnx.unlink()
        onnx.write_bytes(bytes(data))
        with pytest.raises(InferenceServerException) as err:
            _load(swap_server)
        assert "fails its checksum" in err.value.message()
        with grpcclient.InferenceServerClient(swap_server.grpc_url) as client:
            assert client.is_model_ready("dense", "2")
        served_before = counts.valid_ok
        time.sleep(2)
        assert counts.valid_ok > served_before
    assert counts.valid_failed == 0, counts.failures[:5]
    assert counts.versions == {1, 2}
    assert swap_server.watchdog.reloads == [], "a version swap was taken for a dead stub"
