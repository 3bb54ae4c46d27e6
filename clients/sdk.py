"""CTR client over tritonclient: gRPC or HTTP, blocking or asyncio.

:class:`CTRClient` blocks, :class:`AsyncCTRClient` is its asyncio twin.

Example::

    from recserve.clients import CTRClient, read_rows

    with CTRClient("127.0.0.1:8001", protocol="grpc") as client:  # the spec: the server's own
        probabilities = client.predict(read_rows("rows.tsv", client.spec), batch_size=64)

Inputs are the request tensors of the spec's ensemble (see :meth:`Rows.to_inputs`), sent in
the id form by default (``wire="ids"``: categorical values as 64-bit ids; ``wire="bytes"``: as
text); the output is the click probability per row. :meth:`CTRClient.score_inputs` also returns
the versions that served the request, once for it (:class:`Scores`: the dense model's version and
every embedding table's version). Every transport error is raised as a
:class:`~recserve.clients.errors.RecserveClientError` subclass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from recserve.clients.base import DEFAULT_URLS, PROTOCOLS, ClientBase, Scores
from recserve.clients.errors import (
    RequestTimeoutError,
    ServerUnavailableError,
    map_exception,
)
from recserve.clients.feedback import FeedbackLike, FeedbackSink, to_events
from recserve.clients.list_parts import ListParts
from recserve.clients.request_ids import part_ids, request_id_of
from recserve.clients.rows import Rows
from recserve.clients.shared_memory import SharedMemoryIO
from recserve.core.names import DENSE_VERSION, EMBEDDING_VERSION, IDS_WIRE, PROBABILITY
from recserve.core.sections.degrade import DEGRADE_LEVEL, VALUE_HEADER, value_text
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)


class CTRClient(ClientBase):
    """Blocking client of the CTR ensemble.

    Not thread-safe: use one client per thread (the HTTP transport is gevent based).

    Args:
        url: ``host:port`` of the server (an ``http://`` or ``https://`` prefix is accepted); None:
            ``127.0.0.1:8001`` for gRPC, ``127.0.0.1:8000`` for HTTP.
        protocol: ``"grpc"`` or ``"http"``.
        timeout_s: deadline of each request (gRPC) or connection and network timeout (HTTP).
        spec: the model spec; None: the one the server serves, read from its config at first use
            (through the access layer, name the model too: only the ensembles are public).
        model_name: the served model; None uses ``spec.name``.
        shared_memory: pass tensors through a system shared-memory region instead of the request
            message (opt-in; the server must run on the same host).
        user_id: sent with every request as the ``x-recserve-user`` header (gRPC metadata); the
            access layer keeps a user on one model variant by it. None: no header.
        wire: how categorical values travel: ``"ids"`` (the default), each as its 64-bit id in
            INT64 tensors, parsed and hashed here; ``"bytes"``, as text in BYTES tensors, parsed by
            the server (:mod:`recserve.core.wire_forms`). Both give the same scores.
        feedback: where :meth:`report_feedback` writes (:func:`~recserve.clients.feedback.feedback_sink`
            makes the one ``[loop]`` names); None: reporting is refused.
        value: what the requests are worth, a number or a tier name of the spec's ``[degrade.tiers]``,
            sent with each request as the ``recserve-value`` header (:attr:`value` may be changed
            between calls); None: no header, the spec's default value. With ``[degrade]`` on,
            :attr:`last_level` is the level that served the latest request (0: full), and a
            request worth at least its ``priority_value`` is sent at Triton priority 1.
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
        wire: str = IDS_WIRE,
        feedback: FeedbackSink | None = None,
        value: float | str | None = None,
    ) -> None:
        super().__init__(url, protocol, timeout_s, spec, model_name, user_id, wire)
        self.value = value
        self.last_level: int | None = None
        self.feedback = feedback
        self._shm: SharedMemoryIO | None = None
        self._module = self._import_module()
        self._parts = ListParts(self.protocol == "grpc", self._new_transport)
        try:
            self._client = self._new_transport()
            if shared_memory:  # sized for the largest request the server takes
                self._shm = SharedMemoryIO(self._client, self.spec, self.max_batch_size)
        except Exception as exc:
            raise map_exception(exc) from exc
        self._closed = False

    def _new_transport(self) -> Any:
        """A tritonclient transport of the client's protocol and address."""
        if self.protocol == "grpc":
            return self._module.InferenceServerClient(self.url, ssl=self._ssl)
        return self._module.InferenceServerClient(
            self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s, ssl=self._ssl
        )

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

    def report_feedback(self, events: Iterable[FeedbackLike]) -> int:
        """Report what became of served rows (shown, clicked) to the loop's joiner; how many were written.

        Args:
            events: each a :class:`~recserve.core.feedback.FeedbackEvent`, its fields as a mapping,
                or a tuple ``(request_id, row, event[, time])``: the id the row was served under
                (:attr:`Scores.request_id`, or a part's id from :attr:`last_request_ids`), its row,
                ``"impression"`` or ``"click"``, and seconds since the epoch (default: now).

        Raises:
            FeedbackError: an event does not follow the form (nothing is written then).
            ValueError: the client was made without a ``feedback`` sink.
        """
        if self.feedback is None:
            raise ValueError("this client has no feedback sink: pass feedback=feedback_sink(spec)")
        return self.feedback.write(to_events(events))

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
                LOGGER.debug("model %s not ready: %s", self._model_name or "(the served one)", error)
                return False
            raise error from exc

    def predict_inputs(self, inputs: Mapping[str, np.ndarray], request_id: str | None = None) -> np.ndarray:
        """Send one request.

        Args:
            inputs: one array per wire input of the spec (see :meth:`Rows.to_inputs`), at most
                :attr:`max_batch_size` rows (the server's limit).
            request_id: the request's id (printable ASCII, at most 128 characters); None: a new
                random one. Either way it is in :attr:`last_request_ids` after the call.

        Returns:
            float32 ``[B]`` click probabilities.

        Raises:
            InvalidRequestError: the inputs are malformed (checked locally or by the server).
            ServerUnavailableError: the server cannot be reached.
            RequestTimeoutError: no answer within ``timeout_s``.
            ServerError: any other failure.
        """
        request_id = request_id_of(request_id)
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return np.zeros(0, dtype=np.float32)
        result = self._infer(arrays, rows, (), request_id=request_id)
        if self._shm is not None:
            return self._shm.probabilities(rows)
        return self._probabilities(result, rows)

    def score_inputs(self, inputs: Mapping[str, np.ndarray], request_id: str | None = None) -> Scores:
        """Send one request; the probabilities with the dense and embedding versions that served it.

        Args:
            inputs: as for :meth:`predict_inputs`.
            request_id: as for :meth:`predict_inputs`.

        Returns:
            :class:`Scores`, with the request's id.

        Raises:
            RecserveClientError: as :meth:`predict_inputs`; ``ServerError`` also when the served
                model has no version outputs (a TensorRT ``dense`` has no ``dense_version``).
        """
        request_id = request_id_of(request_id)
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return self._empty_scores(request_id)
        result = self._infer(arrays, rows, (DENSE_VERSION, EMBEDDING_VERSION), request_id=request_id)
        probabilities = self._shm.probabilities(rows) if self._shm is not None else None
        return self._scores(result, rows, probabilities, request_id)

    def score_candidates(
        self,
        user: Mapping[str, Sequence[int] | np.ndarray],
        candidates: Rows,
        request_id: str | None = None,
    ) -> np.ndarray:
        """Score one user's candidate list: the user's sequences and profile are sent once.

        Args:
            user: each sequence of the spec by name (e.g. ``{"history_items": [...]}``), its item ids
                oldest first, newest last; sequences sharing positions have the same length. With
                ``[user_state]`` on, also ``user_id`` and ``user_seq`` (the user's newest event's
                sequence number): the sequence is then the real-time tail, merged into the user's
                state by the server.
            candidates: the candidate rows (their own sequence columns are ignored, and the user's
                profile columns, ``[inputs] profile``, are read from the first row). A list the
                server takes whole (:attr:`max_batch_size`, read from the server) is one request;
                a longer one goes in several, sent together
                (:class:`~recserve.clients.list_parts.ListParts`).
            request_id: the list's id (as for :meth:`predict_inputs`); a list sent as several
                requests sends ``<id>.0``, ``<id>.1``, ... (:attr:`last_request_ids`).

        Returns:
            float32 ``[N]`` click probabilities, in the order of ``candidates``.

        Raises:
            InvalidRequestError: the spec has no sequence, or ``user`` is malformed (checked
                locally), or the server refused the request.
            RecserveClientError: as :meth:`predict_inputs`.
        """
        model = self.spec.candidates_model
        requests = list(self._candidate_requests(user, candidates))
        ids = part_ids(request_id, len(requests))

        def send(arrays: dict[str, np.ndarray], rid: str) -> np.ndarray:
            result = self._infer(arrays, 0, (), model, request_id=rid)
            return self._probabilities(result, arrays[self.spec.target_names[0]].shape[1])

        with self._collect_ids():  # a list over the served limit: its parts sent together
            parts = self._parts.send(send, requests, ids)
            if self._collecting is not None:  # the ids in the order of the parts, not of their sending
                self._collecting[-len(ids) :] = ids
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def predict_by_user(self, rows: Rows, batch_size: int = 64) -> np.ndarray:
        """Score all rows; each user's consecutive rows that share their sequences as one candidate list.

        The user is the spec's ``[inputs] user`` column (see :meth:`Rows.user_runs`). Runs of
        one row are sent as rows, ``batch_size`` at a time. The scores are those of :meth:`predict`.
        Rows that are users' real-time tails (they carry ``users`` and ``user_seqs``, and the spec
        serves user states) go in a list with their user's ``user_id`` and ``user_seq``, whose state
        the server merges; a run whose rows differ in them is sent as rows.

        Returns:
            float32 ``[N]`` probabilities in the order of ``rows``.

        Raises:
            ValueError: ``batch_size`` is out of range.
            RecserveClientError: as :meth:`predict_inputs`.
        """
        self._check_batch_size(batch_size)
        with self._collect_ids():  # every request's id, in the order sent
            return self._predict_by_user(rows, batch_size)

    def _predict_by_user(self, rows: Rows, batch_size: int) -> np.ndarray:
        state = rows.user_state_wire(self.spec)
        out = np.zeros(len(rows), dtype=np.float32)
        alone: list[int] = []
        for run in rows.user_runs(self.spec):
            user: dict[str, Any] = rows.user_of(self.spec, run.start)
            for name, values in state.items():  # one user and newest event per list
                user[name] = values[run.start, 0] if (values[run] == values[run.start]).all() else None
            if run.stop - run.start == 1 or any(user.get(name) is None for name in state):
                alone += range(run.start, run.stop)
            else:
                out[run] = self.score_candidates(user, rows.take(run))
        if alone:
            out[alone] = self.predict(rows.take(np.asarray(alone)), batch_size)
        return out

    def _infer(
        self,
        arrays: Mapping[str, np.ndarray],
        rows: int,
        extra_outputs: tuple[str, ...],
        model: str | None = None,
        request_id: str | None = None,
    ) -> Any:
        """One request of prepared arrays; the probabilities through shared memory when it is on.

        ``model``: another model than the client's (the candidates ensemble; never through shared memory).
        ``request_id``: the request's id (None: a new one); noted in :attr:`last_request_ids`.
        """
        request_id = self._sent(request_id_of(request_id))
        headers = self._headers
        if self.value is not None:  # [degrade]: what the request is worth
            headers = {**(headers or {}), VALUE_HEADER: value_text(self.value)}
        leveled = self.spec.degrade.enabled  # the served level comes back with every response
        priority = self.spec.degrade.priority_of(self.value)  # the requests worth most batched first
        extra_outputs = (*extra_outputs, DEGRADE_LEVEL) if leveled else extra_outputs
        if self._shm is not None and model is None:
            infer_inputs = self._shm.place(self._module, arrays)
            outputs = [self._shm.output(self._module, rows), *self._outputs(self._module, extra_outputs)]
        else:
            infer_inputs = self._infer_inputs(self._module, arrays)
            outputs = self._outputs(self._module, (PROBABILITY, *extra_outputs))
        model = model or self.model_name
        transport = self._parts.transport() or self._client  # a part's own, from a worker thread
        try:
            if self.protocol == "grpc":
                result = transport.infer(
                    model,
                    infer_inputs,
                    outputs=outputs,
                    client_timeout=self.timeout_s,
                    headers=headers,
                    request_id=request_id,
                    priority=priority,
                )
            else:
                result = transport.infer(
                    model,
                    infer_inputs,
                    outputs=outputs,
                    headers=headers,
                    request_id=request_id,
                    priority=priority,
                )
        except Exception as exc:
            raise map_exception(exc) from exc
        if leveled:
            self.last_level = int(np.max(result.as_numpy(DEGRADE_LEVEL), initial=0))
        return result

    def predict(self, rows: Rows, batch_size: int = 64) -> np.ndarray:
        """Score all rows, sending them in batches of ``batch_size``.

        Args:
            rows: the rows, e.g. from :func:`~recserve.clients.rows.read_rows`.
            batch_size: rows per request, ``1..max_batch_size`` (the server's limit).

        Returns:
            float32 ``[N]`` probabilities in the order of ``rows``.

        Raises:
            ValueError: ``batch_size`` is out of range.
            RecserveClientError: as :meth:`predict_inputs`; earlier batches' results are discarded.
        """
        self._check_batch_size(batch_size)
        with self._collect_ids():  # one id per batch, in :attr:`last_request_ids`
            parts = [self.predict_inputs(batch.to_inputs(self.spec)) for batch in rows.batches(batch_size)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


# the shared part (request building, response parsing) is in base; its names stay importable here
__all__ = ["DEFAULT_URLS", "PROTOCOLS", "CTRClient", "ClientBase", "Scores"]
