"""``recserve build``: train, write keyed tables and the ONNX net with manifests, generate configs."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from recserve.backends.base.artifacts import (
    file_entry,
    load_array,
    model_versions,
    read_manifest,
    save_array,
    verified_path,
    write_manifest,
)
from recserve.backends.dense import tensorrt_engine
from recserve.backends.dense.network import CTRNet
from recserve.backends.dense.onnx_torch import OnnxNet
from recserve.backends.dense.runner import OnnxDenseRunner, bucketed_onnx_runner, open_session
from recserve.backends.dense.torch_runners import load_net
from recserve.backends.steps.pipeline import DenseFn, InProcessPipeline
from recserve.backends.store.shards import MANIFEST_FORMAT, write_shards
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.build import configs
from recserve.build.dense_configs import TENSORRT_PLAN
from recserve.build.distill import distill
from recserve.build.evaluation import figure
from recserve.build.export import (
    candidate_inputs,
    example_inputs,
    export_candidates_onnx,
    export_onnx,
    torch_predict,
)
from recserve.build.progress import Progress, stderr_progress
from recserve.build.train import train
from recserve.core.contract import sequence_inputs
from recserve.core.names import DENSE, EMBEDDING_LOOKUP, HISTORY_USER, PROBABILITY, SMALL_DENSE_DIR, STEPS
from recserve.core.rows import Rows
from recserve.core.sections.serving import StoreSection
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import small_dense_spec
from recserve.errors import ArtifactError

DENSE_FORMAT = "recserve-dense/1"
ONNX_FILE = "model.onnx"
CANDIDATES_ONNX_FILE = "candidates.onnx"  # the candidate-list graph of the built-in network
WEIGHTS_FILE = "weights.safetensors"
TIMING_CACHE_FILE = "tensorrt.timing-cache"


@dataclass(frozen=True)
class BuildReport:
    """What a build produced."""

    repository: Path
    holdout_auc: float | None
    onnx_max_abs_diff: float


def spec_digest(spec: ModelSpec) -> str:
    """SHA-256 of the canonical spec; manifests record it so a changed spec forces a rebuild.

    ``[degrade]`` is left out: how requests are served under load changes no artifact.
    """
    built = {key: value for key, value in spec.source.items() if key != "degrade"}
    return hashlib.sha256(json.dumps(built, separators=(",", ":")).encode()).hexdigest()


def version_dir(repository: Path, model: str, spec: ModelSpec) -> Path:
    """Folder of the spec's version of one model."""
    return repository / model / str(spec.version)


def is_built(spec: ModelSpec, repository: Path) -> bool:
    """True when the repository is built for this spec.

    Both artifact manifests exist, were built from this spec and the tables have the current format;
    so was the smaller network where a ``[degrade]`` level is scored by one.
    """
    folders = {version_dir(repository, model, spec): spec for model in (EMBEDDING_LOOKUP, DENSE)}
    small = small_dense_spec(spec)
    if small is not None:
        folders[version_dir(repository, DENSE, spec) / SMALL_DENSE_DIR] = small
    try:
        tables = read_manifest(version_dir(repository, EMBEDDING_LOOKUP, spec))
        return tables.get("format") == MANIFEST_FORMAT and all(
            read_manifest(path).get("spec_sha256") == spec_digest(built) for path, built in folders.items()
        )
    except ArtifactError:
        return False


def write_tables(spec: ModelSpec, tables: dict[str, TableArrays], root: Path) -> None:
    """Write the tables as memory-mappable shards (keys, vectors, hash index) plus the manifest.

    Tables named in ``[store] remote_tables`` keep only their default row locally; their rows are
    written under ``remote/`` for ``recserve redis-load`` to put into the L3 Redis Cluster.
    """
    options = spec.store
    local, remote = dict(tables), {}
    for name in options.remote_tables:
        table = tables[name]
        local[name] = TableArrays(
            name, np.empty(0, np.int64), np.empty((0, table.default.shape[0]), np.float32), table.default
        )
        remote[name] = {
            "keys": save_array(root, f"remote/{name}.keys.npy", table.keys),
            "vectors": save_array(root, f"remote/{name}.vectors.npy", table.block(0, len(table.keys))),
        }
    shards = write_shards(root, local, options.table_dtypes)
    write_manifest(
        root,
        {
            "format": MANIFEST_FORMAT,
            "version": spec.version,
            "spec_sha256": spec_digest(spec),
            **shards,
            "remote": remote,
        },
    )


def remote_table_arrays(
    spec: ModelSpec, root: Path, include_local: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rows meant for L3 (``(keys, vectors)`` by table), checked; with ``include_local``, every table."""
    manifest = read_manifest(root)
    rows = {
        name: (load_array(root, entry["keys"]), load_array(root, entry["vectors"]))
        for name, entry in manifest.get("remote", {}).items()
    }
    if include_local:
        store = TieredStore.load(root, spec)
        for name in store.table_names:
            if name not in rows:
                table = store.table_arrays(name)
                rows[name] = (table.keys, table.vectors)
    return rows


def upload_remote_tables(
    spec: ModelSpec, root: Path, options: StoreSection, include_local: bool = False
) -> int:
    """Write the L3 rows of a built version folder into the Redis Cluster of ``options``; rows written.

    What ``recserve redis-load`` does: the ``[store] remote_tables`` (with ``include_local``, every table).
    """
    from recserve.backends.store.redis_tier import RedisTier

    tier = RedisTier.connect(replace(options, redis_deadline_ms=10_000.0))  # a bulk load, not a lookup
    try:
        return sum(
            tier.upload(keys, vectors)
            for keys, vectors in remote_table_arrays(spec, root, include_local).values()
        )
    finally:
        tier.close()


def write_dense(spec: ModelSpec, net: CTRNet, root: Path, holdout_auc: float | None) -> float:
    """Export ONNX, check it against PyTorch at every sequence bucket, write the manifest."""
    path = root / ONNX_FILE
    export_onnx(spec, net, path)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(root / WEIGHTS_FILE))
    runner = OnnxDenseRunner(spec, path)
    worst = 0.0
    for length in spec.serving.sequence_buckets:
        sample = example_inputs(spec, rows=7, length=length, seed=length)
        worst = max(worst, float(np.abs(runner.predict(sample) - torch_predict(net, sample)).max()))
    files = {"model": file_entry(root, path), "weights": file_entry(root, root / WEIGHTS_FILE)}
    if spec.candidates_model:  # the candidate-list graph: each user's history projected once
        lists = root / CANDIDATES_ONNX_FILE
        export_candidates_onnx(spec, net, lists)
        session = open_session(lists, threads=1)
        for length in spec.serving.sequence_buckets:
            sample = candidate_inputs(spec, users=3, candidates=4, length=length, seed=length)
            rows = dict(sample)
            owner = rows.pop(HISTORY_USER)
            for name in sequence_inputs(spec):  # the same rows, expanded
                rows[name] = sample[name][owner]
            served = session.run([PROBABILITY], sample)[0]
            worst = max(worst, float(np.abs(served - torch_predict(net, rows)).max()))
        files["candidates"] = file_entry(root, lists)
    if worst > 1e-5:
        raise ArtifactError(f"ONNX export differs from PyTorch by {worst:.2e}")
    write_manifest(
        root,
        {
            "format": DENSE_FORMAT,
            "version": spec.version,
            "spec_sha256": spec_digest(spec),
            "holdout_auc": holdout_auc,
            "files": files,
        },
    )
    return worst


def add_tensorrt_engine(
    spec: ModelSpec,
    repository: Path,
    precision: str = "fp32",
    progress: Progress = stderr_progress,
    root: Path | None = None,
) -> Path | None:
    """Build the dense TensorRT engine (one profile per bucket) next to the ONNX file.

    In the spec's dense version folder, or in ``root``. Returns the plan's path, or None (after one
    line saying so) where TensorRT is not installed: the repository keeps its CPU path.
    """
    if not tensorrt_engine.tensorrt_available():
        progress(
            "[build] TensorRT is not installed: no engine built; "
            "the dense step keeps the CPU path (ONNX Runtime)"
        )
        return None
    root = root or version_dir(repository, DENSE, spec)
    manifest = read_manifest(root)
    profiles = tensorrt_engine.spec_profiles(configs.profile_spec(spec, "gpu"))  # the gpu profile's batches
    options = tensorrt_engine.EngineOptions(precision=precision, timing_cache=root / TIMING_CACHE_FILE)
    progress(f"[build] building the TensorRT engine: {len(profiles)} profiles, {precision}")
    plan = tensorrt_engine.build_engine(verified_path(root, manifest["files"]["model"]), profiles, options)
    path = root / TENSORRT_PLAN
    path.write_bytes(plan)
    manifest["files"]["plan"] = file_entry(root, path)
    manifest["tensorrt"] = {
        "precision": precision,
        "profiles": [[p.bucket.rows, p.bucket.length] for p in profiles],
    }
    write_manifest(root, manifest)
    progress(f"[build] TensorRT engine ready: {path} (serve with tritonserver --model-config-name=gpu)")
    return path


def load_reference_net(spec: ModelSpec, repository: Path) -> CTRNet:
    """The trained PyTorch network of a built repository (checked weights, no pickle)."""
    return load_net(spec, _weights(version_dir(repository, DENSE, spec)))


def _weights(root: Path) -> Path:
    """The checked weights file of the dense version folder ``root``."""
    files = read_manifest(root)["files"]
    if "weights" not in files:
        raise ArtifactError(
            f"the dense model in {root} was imported from ONNX and has no PyTorch weights; "
            "use the ONNX runtime (--runtime onnx)"
        )
    return verified_path(root, files["weights"])


def dense_runner(spec: ModelSpec, root: Path, runtime: str = "torch") -> DenseFn:
    """The dense version folder ``root`` in process: its PyTorch net, or ONNX Runtime as served (buckets)."""
    if runtime == "torch":
        net = load_net(spec, _weights(root))
        return lambda inputs: torch_predict(net, inputs)
    if runtime == "onnx":
        path = verified_path(root, read_manifest(root)["files"]["model"])
        return bucketed_onnx_runner(spec, path, threads=1).predict
    raise ValueError(f"unknown runtime {runtime!r}; use 'torch' or 'onnx'")


def dense_versions(repository: Path) -> list[int]:
    """The dense model's version folders in ``repository``, ascending."""
    return model_versions(repository / DENSE)


def load_served_net(spec: ModelSpec, repository: Path) -> tuple[int, CTRNet | OnnxNet]:
    """The newest dense version of a built repository (what the servers serve) and its network.

    An imported model's network (ONNX, no PyTorch weights) comes as its ONNX graph run under
    PyTorch (:class:`~recserve.backends.dense.onnx_torch.OnnxNet`): its weights frozen.
    """
    version = dense_versions(repository)[-1]
    root = repository / DENSE / str(version)
    files = read_manifest(root)["files"]
    if "weights" not in files:
        return version, OnnxNet(verified_path(root, files["model"]))
    return version, load_net(spec, _weights(root))


def new_version_engine(repository: Path) -> dict | None:
    """The TensorRT engine settings a new dense version needs: the newest version's (None: no engine).

    Raises:
        ArtifactError: the newest version has an engine and TensorRT is not installed here.
    """
    newest = dense_versions(repository)[-1]
    engine = read_manifest(repository / DENSE / str(newest)).get("tensorrt")
    if engine is not None and not tensorrt_engine.tensorrt_available():
        raise ArtifactError(
            f"dense version {newest} has a TensorRT engine, which cannot be built for a new version "
            "here: TensorRT is not installed"
        )
    return engine


def add_dense_version(spec: ModelSpec, net: CTRNet, repository: Path) -> int:
    """Write ``net`` as the next dense version folder of ``repository``; returns its version.

    The folder is written under a hidden name, checked (ONNX against PyTorch at every bucket, as
    ``build`` checks), and renamed into place whole: a server loading the model never sees half a
    version. Servers serve it once they load the model again (the model-repository API). Where the
    newest version has a TensorRT engine, the new one gets its own, at the same precision.

    Raises:
        ArtifactError: the newest version has an engine and TensorRT is not installed here.
    """
    engine = new_version_engine(repository)
    version = dense_versions(repository)[-1] + 1
    staging = repository / DENSE / f".{version}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write_dense(spec, net, staging, holdout_auc=None)
        small = repository / DENSE / str(version - 1) / SMALL_DENSE_DIR
        if small.is_dir():  # [degrade]'s smaller network stays served beside the new one
            shutil.copytree(small, staging / SMALL_DENSE_DIR)
        if engine is not None:
            add_tensorrt_engine(spec, repository, engine["precision"], root=staging)
        adapter = resources.files("recserve.backends.triton.models").joinpath(f"{DENSE}.py")
        (staging / "model.py").write_text(adapter.read_text())
        staging.rename(repository / DENSE / str(version))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return version


def install_adapters(spec: ModelSpec, repository: Path) -> None:
    """Copy the thin ``model.py`` adapters into each step's version folder."""
    source = resources.files("recserve.backends.triton.models")
    for step in STEPS:
        target = version_dir(repository, step, spec) / "model.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.joinpath(f"{step}.py").read_text())


def build_repository(
    spec: ModelSpec, repository: Path, progress: Progress = stderr_progress, rows: Rows | None = None
) -> BuildReport:
    """Build every artifact and config of ``spec`` into ``repository``, trained on ``rows`` if given."""
    trained = train(spec, progress, rows)
    tables_dir = version_dir(repository, EMBEDDING_LOOKUP, spec)
    dense_dir = version_dir(repository, DENSE, spec)
    for folder in (tables_dir, dense_dir):
        shutil.rmtree(folder, ignore_errors=True)
    progress(f"[build] writing {len(trained.tables)} tables to {tables_dir}")
    write_tables(spec, trained.tables, tables_dir)
    progress(f"[build] exporting ONNX to {dense_dir}")
    diff = write_dense(spec, trained.net, dense_dir, trained.holdout_auc)
    add_small_dense(spec, repository, progress, rows)
    install_adapters(spec, repository)
    configs.write_configs(spec, repository)
    progress(
        f"[build] repository ready: {repository} "
        f"(held-out AUC {figure(trained.holdout_auc)}, ONNX max diff {diff:.1e})"
    )
    return BuildReport(repository, trained.holdout_auc, diff)


def add_small_dense(
    spec: ModelSpec, repository: Path, progress: Progress = stderr_progress, rows: Rows | None = None
) -> None:
    """Distil ``[degrade.small_dense]``'s network from the built one into its dense version folder.

    Nothing where no level of the spec is scored by a smaller network. ``rows``: the user's (else
    the spec's synthetic rows).
    """
    small = small_dense_spec(spec)
    if small is None:
        return
    root = version_dir(repository, DENSE, spec) / SMALL_DENSE_DIR
    progress(f"[build] distilling the smaller network of [degrade.small_dense] into {root}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    pipeline = reference_pipeline(spec, repository, runtime="onnx")  # the teacher: the network as served
    write_dense(small, distill(spec, small, pipeline, progress, rows).net, root, holdout_auc=None)


def dense_runners(spec: ModelSpec, repository: Path, runtime: str = "torch") -> dict[int, DenseFn]:
    """Every dense version on disk in process, by version: the built one and those recserve learn wrote."""
    return {v: dense_runner(spec, repository / DENSE / str(v), runtime) for v in dense_versions(repository)}


def reference_pipeline(spec: ModelSpec, repository: Path, runtime: str = "torch") -> InProcessPipeline:
    """The in-process path over a built repository: the PyTorch net, or ONNX Runtime as served (buckets)."""
    dense = dense_runner(spec, version_dir(repository, DENSE, spec), runtime)
    return InProcessPipeline(
        spec, TieredStore.load(version_dir(repository, EMBEDDING_LOOKUP, spec), spec), dense
    )
