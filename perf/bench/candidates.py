"""One user's candidate list against the same rows in the row layout: ``candidate_list_gain``.

``recserve lab candidate-lists`` (and ``recserve bench``, on its tuned server) sends the same ``N``
candidate rows of one user with a ``length``-long history two ways, closed loop over gRPC, in
turns: as one candidate list to the candidates ensemble (the history travels and is looked up once
per request) and as one row-layout request of ``N`` rows to the row ensemble (every row carries the
history). Both are encoded once before the clock starts. Per concurrency and round, candidate rows
per second and latency percentiles; ``candidate_list_gain`` is the list layout's best rows/s within
the p99 bound over the row layout's, medians over the rounds. Both travel in the id form of the wire
(categorical values as 64-bit ids, as the SDK sends them); the same list is also sent in the bytes
form (values as text, parsed by the server), and ``ids_vs_bytes`` is the id form's best rows/s over
the bytes form's, measured in the same turns.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from recserve.build.synthetic import generate
from recserve.core.candidate_lists import candidate_list_inputs, with_profiles_of
from recserve.core.names import BYTES_WIRE, IDS_WIRE
from recserve.core.spec.model import ModelSpec
from recserve.perf.bench.report import P99_BOUND_MS
from recserve.perf.harness.timed_loop import timed_closed_loop
from recserve.perf.harness.traffic import infer_inputs
from recserve.server import Ports, TritonServer

TIMEOUT_S = 30.0  # a request unanswered this long counts as failed
LIST, ROWS = "candidate_list", "rows"
LIST_BYTES = "candidate_list_bytes"  # the list in the bytes form of the wire


def requests_of(
    spec: ModelSpec, candidates: int, length: int, seed: int = 11
) -> dict[str, dict[str, np.ndarray]]:
    """One user's ``candidates`` rows with a ``length``-long history (synthetic ids), in three requests.

    As a candidate list and as rows in the id form of the wire, and as a candidate list in the
    bytes form.
    """
    if spec.candidates_model is None:
        raise ValueError(f"spec {spec.name!r} has no sequence: it has no candidate-list layout")
    raw = generate(spec, candidates, seed)
    pool = generate(spec, 4 * length, seed + 1)
    user = {}
    for group in spec.attention_groups:
        lengths = pool.lengths_of(group.length_input)
        for sequence in group.sequences:  # those sharing positions hold ids of their own table
            ids = pool.sequence(sequence.name)
            items = np.concatenate([ids[i, : lengths[i]] for i in range(len(pool))])
            if items.size < length:
                raise ValueError(f"the synthetic histories hold {items.size} ids, fewer than {length}")
            user[sequence.name] = items[None, :length]
        user[group.length_input] = np.array([[length]], np.int32)
    first = np.zeros(candidates, np.int64)  # one user's candidates
    rows = with_profiles_of(spec, raw.to_wire(spec, IDS_WIRE), first, IDS_WIRE)
    as_list = {**user, **candidate_list_inputs(spec, rows, IDS_WIRE)}
    as_rows = {name: array for name, array in rows.items() if name not in user}
    as_rows.update({name: np.repeat(array, candidates, axis=0) for name, array in user.items()})
    text = with_profiles_of(spec, raw.to_wire(spec, BYTES_WIRE), first, BYTES_WIRE)
    as_text = {**user, **candidate_list_inputs(spec, text, BYTES_WIRE)}
    return {LIST: as_list, ROWS: as_rows, LIST_BYTES: as_text}


def closed_loop_rate(
    url: str, model: str, request: dict[str, np.ndarray], rows: int, concurrency: int, seconds: float
) -> dict[str, float]:
    """Candidate rows/s and latency percentiles of ``concurrency`` clients sending ``request`` in a loop.

    Refused requests, and requests unanswered after ``TIMEOUT_S``, are counted (``failures``), not
    timed.
    """

    @contextmanager
    def sender() -> Iterator[Callable[[], bool]]:
        with grpcclient.InferenceServerClient(url) as connection:
            inputs = infer_inputs(grpcclient, request)  # encoded once

            def send() -> bool:
                try:
                    connection.infer(model, inputs, client_timeout=TIMEOUT_S)
                    return True
                except InferenceServerException:  # refused (or lost): counted, not timed
                    return False

            yield send

    return timed_closed_loop(sender, rows, concurrency, seconds, 2 * TIMEOUT_S)


def measure(
    spec: ModelSpec,
    url: str,
    candidates: int = 200,
    length: int = 256,
    concurrencies: Sequence[int] = (1, 2, 4),
    seconds: float = 3.0,
    rounds: int = 3,
) -> dict[str, Any]:
    """The three requests at each concurrency, in turns, ``rounds`` times; medians and the gains."""
    forms = requests_of(spec, candidates, length)
    models = {LIST: spec.candidates_model, ROWS: spec.name, LIST_BYTES: spec.candidates_model}
    runs: dict[str, dict[int, list[dict[str, float]]]] = {f: {c: [] for c in concurrencies} for f in forms}
    for _ in range(rounds):
        for concurrency in concurrencies:
            for form, request in forms.items():
                result = closed_loop_rate(url, str(models[form]), request, candidates, concurrency, seconds)
                runs[form][concurrency].append(result)
    medians = {
        form: {
            str(c): {k: float(np.median([r[k] for r in results])) for k in results[0]}
            for c, results in by_concurrency.items()
        }
        for form, by_concurrency in runs.items()
    }

    def best(form: str) -> dict[str, float] | None:
        within = [m for m in medians[form].values() if m["p99_ms"] <= P99_BOUND_MS and not m["failures"]]
        return max(within, key=lambda m: m["rows_per_s"], default=None)

    best_list, best_rows, best_text = best(LIST), best(ROWS), best(LIST_BYTES)
    gain = best_list["rows_per_s"] / best_rows["rows_per_s"] if best_list and best_rows else None
    ids_vs_bytes = best_list["rows_per_s"] / best_text["rows_per_s"] if best_list and best_text else None
    return {
        "candidate_list_gain": gain,
        "ids_vs_bytes": ids_vs_bytes,
        "candidates": candidates,
        "history_length": length,
        "p99_bound_ms": P99_BOUND_MS,
        "medians": medians,
        "best": {LIST: best_list, ROWS: best_rows, LIST_BYTES: best_text},
        "rounds": rounds,
        "seconds": seconds,
    }


def describe(summary: dict[str, Any]) -> str:
    """A table of both forms per concurrency and the gain."""
    lines = [
        f"1 user x {summary['candidates']} candidates, {summary['history_length']}-long history; "
        f"medians of {summary['rounds']} rounds",
        "| form | in flight | candidate rows/s | p50 ms | p99 ms | refused |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for form, by_concurrency in summary["medians"].items():
        for concurrency, m in by_concurrency.items():
            lines.append(
                f"| {form} | {concurrency} | {m['rows_per_s']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} "
                f"| {m['failures']:.0f} |"
            )
    gain, ids = summary["candidate_list_gain"], summary.get("ids_vs_bytes")
    lines.append(f"candidate_list_gain {'n/a' if gain is None else f'{gain:.2f}'} (target >= 3)")
    lines.append(f"ids_vs_bytes {'n/a' if ids is None else f'{ids:.2f}'} (the list, id form over bytes form)")
    return "\n".join(lines)


def candidates_command(
    spec: ModelSpec, repository: Path, candidates: int, length: int, rounds: int, json_path: Path | None
) -> int:
    """``recserve lab candidate-lists``: serve the repository, measure, print; write the JSON when asked."""
    with tempfile.TemporaryDirectory(prefix="recserve-candidates-") as scratch:
        with TritonServer(repository, Ports.free(), log_path=Path(scratch) / "server.log") as server:
            summary = measure(spec, server.grpc_url, candidates, length, rounds=rounds)
    print(describe(summary))
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=1) + "\n")
    return 0
