"""The parts of one candidate list over the served limit, sent together by the blocking client.

A list longer than the server takes (:attr:`~recserve.clients.base.ClientBase.max_batch_size`) goes
in several requests; :class:`ListParts` sends them from a few threads at once, the answers in the
parts' order. Over gRPC the threads share the client's transport (it is thread-safe); over HTTP the
transport is gevent based and serves one thread, so each part goes on one of its own, made in the
worker thread and closed after the part.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

LOGGER = logging.getLogger(__name__)

#: the most parts of one candidate list in flight at once
PARTS_IN_FLIGHT = 8

#: sends one part (its arrays, its request id) and returns its probabilities
SendPart = Callable[[dict[str, np.ndarray], str], np.ndarray]


class ListParts:
    """Sends a list's parts together; :meth:`transport` is the calling thread's own, where it has one.

    Args:
        shared: True when the client's transport may serve several threads (gRPC).
        new_transport: makes a transport like the client's (for a worker thread, over HTTP).
    """

    def __init__(self, shared: bool, new_transport: Callable[[], Any]) -> None:
        self.shared = shared
        self.new_transport = new_transport
        self._local = threading.local()

    def transport(self) -> Any:
        """The calling worker thread's own transport, or None (the client's serves it)."""
        return getattr(self._local, "client", None)

    def send(self, send: SendPart, requests: Sequence[dict[str, np.ndarray]], ids: Sequence[str]) -> list:
        """Each request's answer, in order: one request alone, several from up to 8 threads at once."""
        if len(requests) == 1:
            return [send(requests[0], ids[0])]
        LOGGER.info("a candidate list over the served limit goes in %d requests, sent together", len(ids))
        with ThreadPoolExecutor(min(len(requests), PARTS_IN_FLIGHT), "recserve-parts") as pool:
            return list(pool.map(lambda arrays, rid: self._one(send, arrays, rid), requests, ids))

    def _one(self, send: SendPart, arrays: dict[str, np.ndarray], rid: str) -> np.ndarray:
        if self.shared:
            return send(arrays, rid)
        self._local.client = self.new_transport()
        try:
            return send(arrays, rid)
        finally:
            self._local.client.close()
            self._local.client = None
