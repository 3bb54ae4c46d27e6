"""The in-process bound: recserve's own transform, lookup and dense network in one process on the device.

The served steps' objects, called directly on one user's candidate lists in the id form of the
wire (as the SDK sends them), ``history`` long: the feature transform and the lookup
(:class:`~recserve.backends.steps.lookup.FeaturesToEmbeddings`, the tables resident on the device
as a ``cuda`` instance holds them: ``EmbeddingLookup.for_instance``), then the trained
:class:`~recserve.backends.dense.network.CTRNet` in fp32 on the same device, fed the lookup's
device tensors directly and scoring each user's history once for all of its candidates. One
batch is ``users`` lists of ``candidates`` rows; each call ends with the scores on the host. No
server, no copies between processes: what the served path could reach on this card.

Per batch: candidate rows/s (= user-item pairs/s) and per-call p50/p99 over ``seconds`` of
back-to-back calls, and, on a CUDA device, the host-to-device and device-to-host bytes of one call
per row, read from the CUDA memcpy records of a torch profiler trace. Parity: the bound's scores
against the in-process PyTorch reference on the host (the same rows in the row layout).
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.served import ServedStore
from recserve.build.repository import load_reference_net, reference_pipeline, version_dir
from recserve.core.candidate_lists import candidate_step_inputs
from recserve.core.names import CANDIDATE_PREFIX, EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec, parse_spec
from recserve.perf.bench.candidates import LIST, ROWS, requests_of
from recserve.perf.harness.inprocess import time_calls

from ..common import BenchSizes

LOGGER = logging.getLogger(__name__)

Inputs = Mapping[str, np.ndarray]


def widened(spec: ModelSpec, rows: int) -> ModelSpec:
    """``spec`` taking batches of up to ``rows`` rows in one call (one more batch bucket, ``rows``)."""
    if rows <= spec.model.max_batch_size:
        return spec
    doc = copy.deepcopy(spec.source)
    doc.setdefault("model", {})["max_batch_size"] = rows
    serving = doc.setdefault("serving", {})
    serving.pop("gpu_max_batch_size", None)
    serving["batch_buckets"] = [*spec.serving.batch_buckets, rows]
    serving["sequence_buckets"] = list(spec.serving.sequence_buckets)
    return parse_spec(doc)


def user_lists(
    spec: ModelSpec, users: int, candidates: int, history: int
) -> tuple[dict[str, np.ndarray], Inputs]:
    """``users`` candidate lists of ``candidates`` each (id form, one request) and the same rows as rows."""
    made = [requests_of(spec, candidates, history, seed=11 + 7 * user) for user in range(users)]
    # named as the candidates ensemble hands them to the lookup step
    step_names = {t.name for t in candidate_step_inputs(spec)}
    as_list = {
        CANDIDATE_PREFIX + name if CANDIDATE_PREFIX + name in step_names else name: np.concatenate(
            [m[LIST][name] for m in made]
        )
        for name in made[0][LIST]
    }
    as_rows = {name: np.concatenate([m[ROWS][name] for m in made]) for name in made[0][ROWS]}
    return as_list, as_rows


class Bound:
    """The served steps' objects in one process: candidate-list inputs in, probabilities on the host out.

    Args:
        spec: the spec (widened to the largest batch).
        repository: the built repository.
        device: ``cuda`` (tables resident on the GPU as a ``cuda`` instance holds them) or ``cpu``.
    """

    def __init__(self, spec: ModelSpec, repository: Path, device: str) -> None:
        self.device = torch.device(device)
        instance = "cuda:0" if self.device.type == "cuda" else "cpu"
        self.served = ServedStore.open(spec, version_dir(repository, EMBEDDING_LOOKUP, spec), start=False)
        lookup = EmbeddingLookup.for_instance(spec, self.served, self.device.type, instance)
        self.lookup = lookup
        self.step = FeaturesToEmbeddings(spec, lookup)
        self.net = load_reference_net(spec, repository).to(self.device).eval()

    def tensor(self, value: Any) -> torch.Tensor:
        """A lookup output as a float32 tensor on the device (numpy ones are copied there)."""
        if isinstance(value, torch.Tensor):
            return value.to(self.device, torch.float32)
        return torch.from_numpy(np.ascontiguousarray(value, np.float32)).to(self.device)

    @torch.inference_mode()
    def __call__(self, inputs: Inputs) -> np.ndarray:
        """Probabilities ``[users * candidates]`` of one request of candidate lists."""
        out = self.step.candidates(inputs)
        named, users = {}, None
        for name in self.net.input_names:
            per_candidate = out.get(CANDIDATE_PREFIX + name)
            if per_candidate is None:  # the histories and their masks: one row per user
                named[name] = self.tensor(out[name])
                continue
            users, count = per_candidate.shape[:2]
            named[name] = self.tensor(per_candidate).reshape(users * count, *per_candidate.shape[2:])
        assert users is not None  # a spec with a sequence has per-candidate inputs
        owner = torch.arange(users, device=self.device).repeat_interleave(count)
        return self.net.score(named, owner).reshape(-1).cpu().numpy()

    def close(self) -> None:
        """Let the store go."""
        self.served.close()


def copied_bytes(bound: Bound, inputs: Inputs) -> dict[str, int] | None:
    """Host-to-device and device-to-host bytes of one call (CUDA memcpy records); None off CUDA."""
    if bound.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            bound(inputs)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "trace.json"
            trace.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
    except (RuntimeError, OSError, ValueError) as exc:  # a profiler that cannot trace here: no figure
        LOGGER.warning("no copy figures: the profiler failed: %s", exc)
        return None
    totals = {"h2d": 0, "d2h": 0, "copies": 0}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") != "gpu_memcpy" and not name.startswith("Memcpy"):
            continue
        moved = int(event.get("args", {}).get("bytes", 0))
        totals["copies"] += 1
        if "HtoD" in name:
            totals["h2d"] += moved
        elif "DtoH" in name:
            totals["d2h"] += moved
    return totals


def measure_bound(spec_path: Path, repository: Path, device: str, sizes: BenchSizes) -> dict[str, Any]:
    """The bound at each of ``sizes.bound``'s batches, with parity; the best batch's rows/s."""
    spec = load_spec(spec_path)
    largest = max(users * candidates for users, candidates in sizes.bound)
    wide = widened(spec, largest)
    bound = Bound(wide, repository, device)
    reference = reference_pipeline(widened(spec, sizes.bound[0][0] * sizes.bound[0][1]), repository)
    points: list[dict[str, Any]] = []
    parity: dict[str, Any] = {}
    try:
        for users, candidates in sizes.bound:
            rows = users * candidates
            request, as_rows = user_lists(spec, users, candidates, sizes.history)
            if not parity:  # the first batch: the bound's scores against the host's PyTorch reference
                expected = np.asarray(reference.predict(as_rows)).reshape(-1)
                worst = float(np.abs(bound(request) - expected).max())
                parity = {"max_abs_diff": worst, "rows": rows, "against": "PyTorch on the host (row layout)"}
            for _ in range(3):
                bound(request)  # warm-up: kernels, allocator, cuBLAS handles
            latencies, elapsed = time_calls(bound, [request], sizes.bound_seconds)
            p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99]))
            copied = copied_bytes(bound, request)
            point = {
                "users": users,
                "candidates": candidates,
                "rows": rows,
                "calls": len(latencies),
                "rows_per_s": len(latencies) * rows / elapsed,
                "p50_ms": p50,
                "p99_ms": p99,
                "h2d_bytes_per_row": None if copied is None else copied["h2d"] / rows,
                "d2h_bytes_per_row": None if copied is None else copied["d2h"] / rows,
                "copies_per_call": None if copied is None else copied["copies"],
            }
            points.append(point)
            LOGGER.info("bound %s", point)
    finally:
        bound.close()
    best = max(points, key=lambda p: p["rows_per_s"])
    lookup = bound.lookup.device_l1
    return {
        "device": str(bound.device),
        "gpu": torch.cuda.get_device_name(bound.device) if bound.device.type == "cuda" else "",
        "history": sizes.history,
        "points": points,
        "best": best,
        "rows_per_s": best["rows_per_s"],
        "parity": parity,
        "resident_bytes": int(getattr(lookup, "nbytes", 0)),
        "resident_tables": len(getattr(lookup, "tables", ())),
        "lookup": type(lookup).__name__,
    }
