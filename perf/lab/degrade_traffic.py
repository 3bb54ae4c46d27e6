"""The traffic of ``recserve lab degrade``: candidate lists with labels, values, and open-loop sending.

Each request is one user's candidate list (generated rows with their click labels, the caller's
order as the generator made it) carrying a value drawn from a lognormal distribution in the
``recserve-value`` header. :func:`send_phases` sends them on a fixed schedule whatever the server
does; each :class:`Sent` keeps the value, the list, the level that served it (0 without
``[degrade]``) and the scores it got, so that :mod:`recserve.perf.lab.degrade_report` can weigh
what each policy served against what full compute would have served.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from recserve.build.synthetic import generate
from recserve.core.candidate_lists import candidate_list_inputs, with_profiles_of
from recserve.core.names import IDS_WIRE, PROBABILITY
from recserve.core.sections.degrade import DEGRADE_LEVEL, REFUSED, VALUE_HEADER
from recserve.core.spec.model import ModelSpec
from recserve.perf.harness.traffic import infer_request

LOGGER = logging.getLogger(__name__)
#: How a request ended: served (at some level), refused (UNAVAILABLE: shed, or the refusal level), failed.
SERVED, FAILED = "served", "failed"
__all__ = ["FAILED", "REFUSED", "SERVED", "ListPool", "Sent", "send_phases"]


@dataclass(frozen=True)
class ListPool:
    """Candidate lists as requests of the candidates ensemble, with each candidate's click label."""

    requests: list[dict[str, np.ndarray]]
    labels: list[np.ndarray]

    @classmethod
    def generate(cls, spec: ModelSpec, lists: int, candidates: int, length: int, seed: int) -> ListPool:
        """``lists`` users' lists of ``candidates`` generated rows, each user a ``length``-long history."""
        if spec.candidates_model is None:
            raise ValueError(f"spec {spec.name!r} has no sequence: it has no candidate lists to degrade")
        requests, labels = [], []
        for i in range(lists):
            raw = generate(spec, candidates, seed + 2 * i)
            pool = generate(spec, 2 * length, seed + 2 * i + 1)
            user: dict[str, np.ndarray] = {}
            for group in spec.attention_groups:
                lengths = pool.lengths_of(group.length_input)
                for sequence in group.sequences:
                    ids = pool.sequence(sequence.name)
                    items = np.concatenate([ids[r, : lengths[r]] for r in range(len(pool))])
                    user[sequence.name] = np.resize(items, length)[None, :]
                user[group.length_input] = np.array([[length]], np.int32)
            rows = with_profiles_of(
                spec, raw.to_wire(spec, IDS_WIRE), np.zeros(candidates, np.int64), IDS_WIRE
            )
            requests.append({**user, **candidate_list_inputs(spec, rows, IDS_WIRE)})
            labels.append(np.asarray(raw.label_values(), dtype=np.float32))
        return cls(requests, labels)

    def ordered(
        self, spec: ModelSpec, full: list[np.ndarray], noise: float, seed: int
    ) -> tuple[ListPool, list[np.ndarray]]:
        """The lists in a caller's order, and their full scores so ordered.

        The caller ranks its candidates by a prior: here each candidate's full-compute logit plus
        normal noise of ``noise`` standard deviations (a first stage that roughly agrees with the
        model), best first; a level's cap keeps the head of that order.
        """
        rng = np.random.default_rng(seed)
        names = {t.name for t in spec.wire_form(IDS_WIRE).candidate_inputs}
        requests, labels, scores = [], [], []
        for request, label, score in zip(self.requests, self.labels, full, strict=True):
            logit = np.log(score / np.maximum(1.0 - score, 1e-7) + 1e-7)
            order = np.argsort(-(logit + rng.normal(0.0, noise, score.shape)), kind="stable")
            requests.append({n: a[:, order] if n in names else a for n, a in request.items()})
            labels.append(label[order])
            scores.append(score[order])
        return ListPool(requests, labels), scores


@dataclass(frozen=True)
class Sent:
    """One request: phase, when it left (s since the start), latency, outcome, value, list, level, scores."""

    phase: int
    sent_s: float
    latency_ms: float
    result: str
    value: float
    list_index: int
    level: int = 0
    scores: np.ndarray | None = None


def response_arrays(response: object) -> dict[str, np.ndarray]:
    """The outputs of a raw gRPC ``ModelInferResponse`` by name (FP32 and INT32 only)."""
    dtypes = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):  # type: ignore[attr-defined]
        out[tensor.name] = np.frombuffer(raw, dtype=dtypes[tensor.datatype]).reshape(tuple(tensor.shape))
    return out


def send_phases(
    url: str,
    spec: ModelSpec,
    pool: ListPool,
    phases: list[tuple[float, float]],
    values: np.ndarray,
    leveled: bool,
) -> list[Sent]:
    """Send the pool's lists at ``rate`` per second for ``seconds``, phase after phase, open loop.

    Request ``i`` carries ``values[i]`` (cycled) and list ``i mod len(pool)``; ``leveled``: the
    server serves ``[degrade]`` (its responses carry ``degrade_level``). Each request goes at the
    Triton priority the SDK would send its value at (``[degrade] priority_value``).
    """
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    assert spec.candidates_model is not None
    outputs = (PROBABILITY, DEGRADE_LEVEL) if leveled else (PROBABILITY,)
    messages = [infer_request(spec.candidates_model, r, outputs) for r in pool.requests]
    by_priority = {0: messages}
    for priority in (1, 2):
        by_priority[priority] = []
        for message in messages:
            copy = type(message)()
            copy.CopyFrom(message)
            copy.parameters["priority"].uint64_param = priority
            by_priority[priority].append(copy)
    sent: list[Sent] = []
    lock, pending = threading.Lock(), threading.Semaphore(0)
    first_error: list[str] = []
    origin, count = time.monotonic(), 0

    def record(future: grpc.Future, phase: int, sent_at: float, value: float, index: int) -> None:
        latency = (time.monotonic() - sent_at) * 1e3
        timing = (phase, sent_at - origin, latency)
        error = future.exception()
        if error is None:
            arrays = response_arrays(future.result())
            level = int(arrays[DEGRADE_LEVEL].max()) if DEGRADE_LEVEL in arrays else 0
            outcome = Sent(*timing, SERVED, value, index, level, arrays[PROBABILITY].reshape(-1))
        else:
            code = error.code() if isinstance(error, grpc.Call) else None
            result = REFUSED if code == grpc.StatusCode.UNAVAILABLE else FAILED
            outcome = Sent(*timing, result, value, index)
            if not first_error:  # what the first refused or failed request was told, for a reader
                first_error.append(str(error.details() if isinstance(error, grpc.Call) else error)[:300])
                LOGGER.warning("first request not served (phase %d): %s", phase, first_error[0])
        with lock:
            sent.append(outcome)
        pending.release()

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for phase, (rate, seconds) in enumerate(phases):
            start, interval = time.monotonic(), 1.0 / rate
            for i in range(int(rate * seconds)):
                delay = start + i * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                value, index = float(values[count % len(values)]), count % len(messages)
                sent_at = time.monotonic()
                message = by_priority[spec.degrade.priority_of(value)][index]
                future = stub.ModelInfer.future(
                    message, timeout=30, metadata=((VALUE_HEADER, f"{value:.6g}"),)
                )
                future.add_done_callback(
                    lambda f, p=phase, s=sent_at, v=value, x=index: record(f, p, s, v, x)
                )
                count += 1
        for _ in range(count):
            pending.acquire(timeout=60)
    return sorted(sent, key=lambda o: o.sent_s)


@dataclass(frozen=True)
class LabShape:
    """The traffic and schedule: lists, candidates, history length, seconds per phase."""

    lists: int = 32
    candidates: int = 64
    length: int = 64
    normal_s: float = 4.0
    spike_s: float = 4.0
    capacity_s: float = 4.0

    @classmethod
    def quick(cls) -> LabShape:
        """The CI form: a minute at most."""
        return cls(lists=16, candidates=64, length=64, normal_s=1.5, spike_s=2.0, capacity_s=2.0)

    def phases(self, capacity: float) -> list[tuple[str, float, float]]:
        """(name, rate, seconds) of the schedule: normal, 2x, normal, 4x, normal."""
        normal = ("normal", 0.5 * capacity, self.normal_s)
        return [
            normal,
            ("spike_2x", 2.0 * capacity, self.spike_s),
            ("after_2x", 0.5 * capacity, self.normal_s),
            ("spike_4x", 4.0 * capacity, self.spike_s),
            ("after_4x", 0.5 * capacity, self.normal_s),
        ]
