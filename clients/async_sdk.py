"""The asyncio twin of :class:`recserve.clients.sdk.CTRClient`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from recserve.clients.base import ClientBase, Scores
from recserve.clients.errors import (
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    map_exception,
)
from recserve.clients.feedback import FeedbackLike, FeedbackSink, to_events
from recserve.clients.request_ids import part_ids, request_id_of
from recserve.clients.rows import Rows
from recserve.core.names import DENSE_VERSION, EMBEDDING_VERSION, IDS_WIRE, PROBABILITY
from recserve.core.sections.degrade import VALUE_HEADER, value_text
from recserve.core.spec.model import ModelSpec

LOGGER = logging.getLogger(__name__)


class AsyncCTRClient(ClientBase):
    """asyncio client of the CTR ensemble, same arguments as :class:`CTRClient` (but ``shared_memory``).

    ``value`` is sent as :class:`CTRClient` sends it; there is no ``last_level`` (requests overlap).

    The transport is created on first use inside the running event loop; use ``async with`` or
    ``await client.close()``.
    """

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "grpc",
        timeout_s: float = 10.0,
        spec: ModelSpec | None = None,
        model_name: str | None = None,
        user_id: str | None = None,
        wire: str = IDS_WIRE,
        feedback: FeedbackSink | None = None,
        value: float | str | None = None,
    ) -> None:
        super().__init__(url, protocol, timeout_s, spec, model_name, user_id, wire)
        self.feedback = feedback
        self.value = value  # [degrade]: what the requests are worth (as CTRClient's)
        self._module = self._import_module()
        self._client: Any = None
        self._closed = False

    def _import_module(self) -> ModuleType:
        if self.protocol == "grpc":
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.http.aio as module
        return module

    def _transport(self) -> Any:
        if self._closed:
            raise ServerError("the client is closed")
        if self._client is None:
            try:
                if self.protocol == "grpc":
                    self._client = self._module.InferenceServerClient(self.url, ssl=self._ssl)
                else:
                    self._client = self._module.InferenceServerClient(
                        self.url, conn_timeout=self.timeout_s, ssl=self._ssl
                    )
            except Exception as exc:
                raise map_exception(exc) from exc
        return self._client

    async def __aenter__(self) -> AsyncCTRClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the connection; later calls fail."""
        self._closed = True
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def report_feedback(self, events: Iterable[FeedbackLike]) -> int:
        """Report feedback (see :meth:`CTRClient.report_feedback`); the sink writes on a worker thread."""
        if self.feedback is None:
            raise ValueError("this client has no feedback sink: pass feedback=feedback_sink(spec)")
        return await asyncio.to_thread(self.feedback.write, to_events(events))

    async def is_ready(self) -> bool:
        """Whether the server answers and the model is ready (see :meth:`CTRClient.is_ready`)."""
        client = self._transport()
        try:
            if self.protocol == "grpc":
                return bool(await client.is_model_ready(self.model_name, client_timeout=self.timeout_s))
            return bool(await client.is_model_ready(self.model_name))
        except Exception as exc:
            error = map_exception(exc)
            if isinstance(error, (ServerUnavailableError, RequestTimeoutError)):
                LOGGER.debug("model %s not ready: %s", self._model_name or "(the served one)", error)
                return False
            raise error from exc

    async def predict_inputs(
        self, inputs: Mapping[str, np.ndarray], request_id: str | None = None
    ) -> np.ndarray:
        """Send one request (see :meth:`CTRClient.predict_inputs`).

        Returns:
            float32 ``[B]`` click probabilities.
        """
        request_id = request_id_of(request_id)
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return np.zeros(0, dtype=np.float32)
        return self._probabilities(await self._infer(arrays, (PROBABILITY,), request_id=request_id), rows)

    async def score_inputs(self, inputs: Mapping[str, np.ndarray], request_id: str | None = None) -> Scores:
        """Send one request; probabilities, the versions that served them and the request's id.

        See :meth:`CTRClient.score_inputs`.
        """
        request_id = request_id_of(request_id)
        arrays = self._prepare(inputs)
        rows = next(iter(arrays.values())).shape[0]
        if rows == 0:
            return self._empty_scores(request_id)
        names = (PROBABILITY, DENSE_VERSION, EMBEDDING_VERSION)
        result = await self._infer(arrays, names, request_id=request_id)
        return self._scores(result, rows, request_id=request_id)

    async def score_candidates(
        self,
        user: Mapping[str, Sequence[int] | np.ndarray],
        candidates: Rows,
        request_id: str | None = None,
    ) -> np.ndarray:
        """Score one user's candidate list (see :meth:`CTRClient.score_candidates`, ids too).

        A list over the served limit (:attr:`max_batch_size`) goes in several requests, sent together.

        Returns:
            float32 ``[N]`` click probabilities, in the order of ``candidates``.
        """
        model = self.spec.candidates_model
        requests = list(self._candidate_requests(user, candidates))
        ids = part_ids(request_id, len(requests))

        async def send(arrays: dict[str, np.ndarray], rid: str) -> np.ndarray:
            result = await self._infer(arrays, (PROBABILITY,), model, rid)
            return self._probabilities(result, arrays[self.spec.target_names[0]].shape[1])

        with self._collect_ids():  # the parts of a list over the served limit go out together
            parts = await asyncio.gather(*(send(a, rid) for a, rid in zip(requests, ids, strict=True)))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    async def _infer(
        self,
        arrays: Mapping[str, np.ndarray],
        names: tuple[str, ...],
        model: str | None = None,
        request_id: str | None = None,
    ) -> Any:
        """One request; ``request_id`` None: a new one (noted in :attr:`last_request_ids` either way)."""
        request_id = self._sent(request_id_of(request_id))
        client = self._transport()
        infer_inputs = self._infer_inputs(self._module, arrays)
        outputs = self._outputs(self._module, names)
        model = model or self.model_name
        headers = self._headers
        if self.value is not None:  # [degrade]: what the request is worth
            headers = {**(headers or {}), VALUE_HEADER: value_text(self.value)}
        priority = self.spec.degrade.priority_of(self.value)  # the requests worth most batched first
        try:
            if self.protocol == "grpc":
                return await client.infer(
                    model,
                    infer_inputs,
                    outputs=outputs,
                    client_timeout=self.timeout_s,
                    headers=headers,
                    request_id=request_id,
                    priority=priority,
                )
            return await client.infer(
                model,
                infer_inputs,
                outputs=outputs,
                headers=headers,
                request_id=request_id,
                priority=priority,
            )
        except Exception as exc:
            raise map_exception(exc) from exc

    async def predict(self, rows: Rows, batch_size: int = 64, max_in_flight: int = 4) -> np.ndarray:
        """Score all rows in batches, up to ``max_in_flight`` requests at a time.

        Args:
            rows: the rows, e.g. from :func:`~recserve.clients.rows.read_rows`.
            batch_size: rows per request, ``1..max_batch_size`` (the server's limit).
            max_in_flight: concurrent requests, at least 1.

        Returns:
            float32 ``[N]`` probabilities in the order of ``rows``.

        Raises:
            ValueError: ``batch_size`` or ``max_in_flight`` is out of range.
            RecserveClientError: as :meth:`CTRClient.predict_inputs` (the first failure).
        """
        self._check_batch_size(batch_size)
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        limit = asyncio.Semaphore(max_in_flight)

        async def one(batch: Rows) -> np.ndarray:
            async with limit:
                return await self.predict_inputs(batch.to_inputs(self.spec))

        tasks = [asyncio.ensure_future(one(batch)) for batch in rows.batches(batch_size)]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


__all__ = ["AsyncCTRClient"]
