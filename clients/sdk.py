"""CTR client over tritonclient: gRPC or HTTP, blocking or asyncio.

:class:`CTRClient` blocks, :class:`AsyncCTRClient` is its asyncio twin.

Example::

    from recserve.clients import CTRClient, read_rows
    from recserve.spec import load_spec

    spec = load_spec()
    with CTRClient("127.0.0.1:8001", protocol="grpc", spec=spec) as client:
        probabilities = client.predict(read_rows("rows.tsv", spec), batch_size=64)

Inputs are the request tensors of the spec's ensemble (see :meth:`CriteoRows.to_inputs`); the output
is the click probability per row. :meth:`CTRClient.score_inputs` also returns, per row, the versions
that served it (:class:`Scores`: the dense model's version and every embedding table's version).
Every transport error is raised as a :class:`~recserve.clients.errors.RecserveClientError` subclass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from recserve.clients.errors import (
    InvalidRequestError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    map_exception,
)
from recserve.clients.rows import CriteoRows
from recserve.clients.shared_memory import SharedMemoryIO
from recserve.errors import cap_message, shorten, shorten_all
from recserve.spec import NUMPY_DTYPES, ModelSpec, load_spec
from recserve.wire import DENSE_VERSION, EMBEDDING_VERSION, PROBABILITY, USER_HEADER, candidate_list_inputs

LOGGER = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http")
DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}


def _normalise_url(url: str | None, protocol: str) -> tuple[str, bool]:
    """``(host:port[/path], ssl)`` with any ``scheme://`` prefix removed."""
    if url is None or not url.strip():
        return DEFAULT_URLS[protocol], False
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rstrip("/"), False
    return rest.rstrip("/"), scheme.lower() in ("https", "grpcs")


@dataclass(frozen=True)
class Scores:
    """One response with the versions that served it.

    Attributes:
        probabilities: float32 ``[B]`` click probabilities.
        dense_version: int64 ``[B]``: the ``dense`` model version that scored each row.
        embedding_version: int64 ``[B, T]``: per row, the version of each embedding table in the
            store snapshot that served it, in the order of :attr:`tables`. A request is served by one
            snapshot, so its rows agree.
        tables: table names, the columns of ``embedding_version`` (the spec's ``table_names``).
    """

    probabilities: np.ndarray
    dense_version: np.ndarray
    embedding_version: np.ndarray
    tables: tuple[str, ...]

    def table_versions(self, row: int = 0) -> dict[str, int]:
        """Table name -> version that served ``row``."""
        return dict(zip(self.tables, (int(v) for v in self.embedding_version[row]), strict=True))


def _check_protocol(protocol: str) -> str:
    name = protocol.lower()
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return name


class ClientBase:
    """Request building and response parsing shared by the blocking and asyncio clients."""

    def __init__(
        self,
        url: str | None,
        protocol: str,
        timeout_s: float,
        spec: ModelSpec | None,
        model_name: str | None,
        user_id: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if user_id is not None and (not user_id or not user_id.isascii() or not user_id.isprintable()):
            raise ValueError(f"user_id must be non-empty printable ASCII, got {shorten(user_id)}")
        self.protocol = _check_protocol(protocol)
        self.url, self._ssl = _normalise_url(url, self.protocol)
        self.timeout_s = float(timeout_s)
        self.spec = spec if spec is not None else load_spec()
        self.model_name = model_name or self.spec.name
        # every request tensor's dtype by name: the row form's and a candidate list's once-per-user ones
        self._dtypes = {t.name: t.dtype for t in (*self.spec.wire_inputs(), *self.spec.user_inputs())}
        # sent with every request: the access layer keeps a user on one model variant by it
        self._headers = {USER_HEADER: user_id} if user_id is not None else None

    def _prepare(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs cast to the wire dtypes, checked for names, rank and a common batch size."""
        wire = self.spec.wire_inputs()
        names = {w.name for w in wire}
        unknown = sorted(set(inputs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown inputs [{shorten_all(unknown)}]; the model takes {sorted(names)}"
            )
        missing = [w.name for w in wire if w.name not in inputs or inputs[w.name] is None]
        if missing:
            raise InvalidRequestError(f"missing inputs {missing}")
        arrays: dict[str, np.ndarray] = {}
        for w in wire:
            try:
                array = np.ascontiguousarray(inputs[w.name], dtype=NUMPY_DTYPES[w.dtype])
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"input '{w.name}' cannot be converted to {w.dtype}: {cap_message(str(exc), 200)}"
                ) from exc
            if array.ndim != 2:
                raise InvalidRequestError(
                    f"input '{w.name}' has shape {list(array.shape)}, expected [batch, ...]"
                )
            arrays[w.name] = array
        rows = {a.shape[0] for a in arrays.values()}
        if len(rows) != 1:
            raise InvalidRequestError(f"inputs disagree on the batch size: {sorted(rows)}")
        batch = rows.pop()
        if batch > self.spec.max_batch_size:
            raise InvalidRequestError(
                f"batch of {batch} rows exceeds max_batch_size {self.spec.max_batch_size}; use predict()"
            )
        return arrays

    def _candidate_requests(
        self, user: Mapping[str, Sequence[int] | np.ndarray], candidates: CriteoRows
    ) -> Iterator[dict[str, np.ndarray]]:
        """The candidates ensemble's requests for one user: at most ``max_batch_size`` candidates each.

        The user's sequences travel once per request (``[1, L]``, the length ``[1, 1]``), each
        per-candidate input as ``[1, N, ...]``.
        """
        spec = self.spec
        if spec.candidates_model is None:
            raise InvalidRequestError(
                f"spec {spec.name!r} has no sequence, so no user context: score the candidates with predict()"
            )
        names = [s.name for s in spec.sequences]
        unknown = sorted(set(user) - set(names))
        if unknown:
            raise InvalidRequestError(f"unknown user inputs [{shorten_all(unknown)}]; a user carries {names}")
        histories = {}
        for name in names:
            try:
                histories[name] = np.asarray(user.get(name, ()), dtype=np.int64).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"user input '{name}' is not a list of item ids: {cap_message(str(exc), 200)}"
                ) from exc
        user_arrays = {}
        for group in spec.attention_groups:
            lengths = {s.name: len(histories[s.name]) for s in group.sequences}
            if len(set(lengths.values())) > 1:
                raise InvalidRequestError(
                    f"the user's sequences share positions but differ in length: {lengths}"
                )
            length = lengths[group.primary.name]
            for sequence in group.sequences:
                user_arrays[sequence.name] = np.zeros((1, max(length, 1)), np.int64)
                user_arrays[sequence.name][0, :length] = histories[sequence.name]
            user_arrays[group.length_input] = np.array([[length]], np.int32)
        for part in candidates.batches(spec.max_batch_size):
            yield {**user_arrays, **candidate_list_inputs(spec, part.to_inputs(spec))}

    def _infer_inputs(self, module: ModuleType, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """``InferInput`` objects of the protocol's module (``tritonclient.grpc`` or ``.http``).

        ``arrays``: the row form's wire inputs, or a candidate list's (its profile tensors among them).
        """
        result = []
        for name, array in arrays.items():
            infer_input = module.InferInput(name, list(array.shape), self._dtypes[name])
            try:
                infer_input.set_data_from_numpy(array)
            except Exception as exc:  # tritonclient raises InferenceServerException on bad data
                raise InvalidRequestError(f"input '{name}': {cap_message(str(exc), 200)}") from exc
            result.append(infer_input)
        return result

    def _outputs(self, module: ModuleType, names: tuple[str, ...]) -> list[Any]:
        if self.protocol == "http":
            return [module.InferRequestedOutput(name, binary_data=True) for name in names]
        return [module.InferRequestedOutput(name) for name in names]

    def _output(self, result: Any, name: str, rows: int, dtype: type) -> np.ndarray:
        output = result.as_numpy(name)
        if output is None:
            raise ServerError(f"the response of model '{self.model_name}' has no output '{name}'")
        values: np.ndarray = np.asarray(output, dtype=dtype)
        if values.ndim == 0 or values.shape[0] != rows:
            raise ServerError(f"expected {rows} rows of '{name}', got output of shape {list(output.shape)}")
        return values

    def _probabilities(self, result: Any, rows: int) -> np.ndarray:
        return self._output(result, PROBABILITY, rows, np.float32).reshape(-1)

    def _scores(self, result: Any, rows: int, probabilities: np.ndarray | None = None) -> Scores:
        return Scores(
            self._probabilities(result, rows) if probabilities is None else probabilities,
            self._output(result, DENSE_VERSION, rows, np.int64).reshape(-1),
            self._output(result, EMBEDDING_VERSION, rows, np.int64).reshape(rows, -1),
            self.spec.table_names,
        )

    def _empty_scores(self) -> Scores:
        tables = self.spec.table_names
        return Scores(
            np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros((0, len(tables)), np.int64), tables
        )

    def _check_batch_size(self, batch_size: int) -> None:
        if not 1 <= batch_size <= self.spec.max_batch_size:
            raise ValueError(f"batch_size must be in 1..{self.spec.max_batch_size}, got {batch_size}")


class CTRClient(ClientBase):
    """Blocking client of the CTR ensemble.

    Not thread-safe: use one client per thread (the HTTP transport is gevent based).

    Args:
        url: ``host:port`` of the server (an ``http://`` or ``https://`` prefix is accepted); None:
            ``127.0.0.1:8001`` for gRPC, ``127.0.0.1:8000`` for HTTP.
        protocol: ``"grpc"`` or ``"http"``.
        timeout_s: deadline of each request (gRPC) or connection and network timeout (HTTP).
        spec: the model spec; None loads the bundled default spec.
        model_name: the served model; None uses ``spec.name``.
        shared_memory: pass tensors through a system shared-memory region instead of the request
            message (opt-in; the server must run on the same host).
        user_id: sent with every request as the ``x-recserve-user`` header (gRPC metadata); the
            access layer keeps a user on one model variant by it. None: no header.
    """

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "grpc",
        timeout_s: float = 10.0,
        spec: ModelSpec | None = None,
        model_name: str | None = None,
        shared_memory: bool = False,
        user_id: str | None = None,
    ) -> None:
        super().__init__(url, protocol, timeout_s, spec, model_name, user_id)
        self._shm: SharedMemoryIO | None = None
        self._module = self._import_module()
        try:
            if self.protocol == "grpc":
                self._client = self._module.InferenceServerClient(self.url, ssl=self._ssl)
            else:
                self._client = self._module.InferenceServerClient(
                    self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s, ssl=self._ssl
                )
            if shared_memory:
                self._shm = SharedMemoryIO(self._client, self.spec)
        except Exception as exc:
            raise map_exception(exc) from exc
        self._closed = False

    def _import_module(self) -> ModuleType:
        if self.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        return module

    def __enter__(self) -> CTRClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection; later calls fail."""
        if not self._closed:
            self._closed = True
            if self._shm is not None:
                self._shm.close()
            self._client.close()

    def is_ready(self) -> bool:
        """Whether the server answers and the model is ready.

        Returns:
            False when the server is unreachable, times out or reports the model not ready.

        Raises:
            RecserveClientError: any other failure.
        """
        try:
            if self.protocol == "grpc":
                return bool(self._client.is_model_ready(self.model_name, client_timeout=self.timeout_s))
            return bool(self._client.is_model_ready(self.model_name))
        except Exception as exc:
            error = map_exception(exc)
            if isinstance(error, (ServerUnavailableError, RequestTimeoutError)):
                LOGGER.debug("model %s not ready: %s", self.model_name, error)
                return False
            raise error from exc

    def predict_inputs(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Send one request.

        Args:
            inputs: one array per wire input of the spec (see :meth:`CriteoRows.to_inputs`), at most
                ``spec.max_batch_size`` rows.

        Returns:
            float32 ``[B]`` click probabilities.

        Raises:
            InvalidRequestError: the inputs are malformed (checked locally or by the server).
            ServerUnavailableError: the server cannot be reached.
            RequestTimeoutError: no answer within ``timeout_s``.
            ServerError: any other failure.
        """
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return np.zeros(0, dtype=np.float32)
        result = self._infer(arrays, rows, ())
        if self._shm is not None:
            return self._shm.probabilities(rows)
        return self._probabilities(result, rows)

    def score_inputs(self, inputs: Mapping[str, np.ndarray]) -> Scores:
        """Send one request; the probabilities with the dense and embedding versions that served each row.

        Args:
            inputs: as for :meth:`predict_inputs`.

        Returns:
            :class:`Scores`.

        Raises:
            RecserveClientError: as :meth:`predict_inputs`; ``ServerError`` also when the served
                model has no version outputs (a TensorRT ``dense`` has no ``dense_version``).
        """
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return self._empty_scores()
        result = self._infer(arrays, rows, (DENSE_VERSION, EMBEDDING_VERSION))
        return self._scores(result, rows, self._shm.probabilities(rows) if self._shm is not None else None)

    def score_candidates(
        self, user: Mapping[str, Sequence[int] | np.ndarray], candidates: CriteoRows
    ) -> np.ndarray:
        """Score one user's candidate list: the user's sequences and profile are sent once.

        Args:
            user: each sequence of the spec by name (e.g. ``{"history_items": [...]}``), its item ids
                oldest first, newest last; sequences sharing positions have the same length.
            candidates: the candidate rows (their own sequence columns are ignored, and the user's
                profile columns, ``[inputs] profile``, are read from the first row). More than
                ``spec.max_batch_size`` candidates go in several requests.

        Returns:
            float32 ``[N]`` click probabilities, in the order of ``candidates``.

        Raises:
            InvalidRequestError: the spec has no sequence, or ``user`` is malformed (checked
                locally), or the server refused the request.
            RecserveClientError: as :meth:`predict_inputs`.
        """
        model = self.spec.candidates_model
        parts = [
            self._probabilities(self._infer(arrays, 0, (), model), arrays[self.spec.target_names[0]].shape[1])
            for arrays in self._candidate_requests(user, candidates)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def predict_by_user(self, rows: CriteoRows, batch_size: int = 64) -> np.ndarray:
        """Score all rows; each user's consecutive rows that share their sequences as one candidate list.

        The user is the spec's ``[inputs] user`` column (see :meth:`CriteoRows.user_runs`). Runs of
        one row are sent as rows, ``batch_size`` at a time. The scores are those of :meth:`predict`.

        Returns:
            float32 ``[N]`` probabilities in the order of ``rows``.

        Raises:
            ValueError: ``batch_size`` is out of range.
            RecserveClientError: as :meth:`predict_inputs`.
        """
        self._check_batch_size(batch_size)
        out = np.zeros(len(rows), dtype=np.float32)
        alone = []
        for run in rows.user_runs(self.spec):
            if run.stop - run.start == 1:
                alone.append(run.start)
            else:
                out[run] = self.score_candidates(rows.user_of(self.spec, run.start), rows.take(run))
        if alone:
            out[alone] = self.predict(rows.take(np.asarray(alone)), batch_size)
        return out

    def _infer(
        self,
        arrays: Mapping[str, np.ndarray],
        rows: int,
        extra_outputs: tuple[str, ...],
        model: str | None = None,
    ) -> Any:
        """One request of prepared arrays; the probabilities through shared memory when it is on.

        ``model``: another model than the client's (the candidates ensemble; never through shared memory).
        """
        if self._shm is not None and model is None:
            infer_inputs = self._shm.place(self._module, self.spec, arrays)
            outputs = [self._shm.output(self._module, rows), *self._outputs(self._module, extra_outputs)]
        else:
            infer_inputs = self._infer_inputs(self._module, arrays)
            outputs = self._outputs(self._module, (PROBABILITY, *extra_outputs))
        model = model or self.model_name
        try:
            if self.protocol == "grpc":
                return self._client.infer(
                    model,
                    infer_inputs,
                    outputs=outputs,
                    client_timeout=self.timeout_s,
                    headers=self._headers,
                )
            return self._client.infer(model, infer_inputs, outputs=outputs, headers=self._headers)
        except Exception as exc:
            raise map_exception(exc) from exc

    def predict(self, rows: CriteoRows, batch_size: int = 64) -> np.ndarray:
        """Score all rows, sending them in batches of ``batch_size``.

        Args:
            rows: the rows, e.g. from :func:`~recserve.clients.rows.read_rows`.
            batch_size: rows per request, ``1..spec.max_batch_size``.

        Returns:
            float32 ``[N]`` probabilities in the order of ``rows``.

        Raises:
            ValueError: ``batch_size`` is out of range.
            RecserveClientError: as :meth:`predict_inputs`; earlier batches' results are discarded.
        """
        self._check_batch_size(batch_size)
        parts = [self.predict_inputs(batch.to_inputs(self.spec)) for batch in rows.batches(batch_size)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


__all__ = ["DEFAULT_URLS", "PROTOCOLS", "CTRClient", "ClientBase", "Scores"]
