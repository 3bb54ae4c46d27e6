"""What the blocking and asyncio clients share: request building and response parsing.

:class:`ClientBase` checks and casts a request's tensors, builds a candidate list's requests, makes
tritonclient's input and output objects and reads a response into probabilities or :class:`Scores`.
The transports are :class:`~recserve.clients.sdk.CTRClient` and
:class:`~recserve.clients.async_sdk.AsyncCTRClient`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType
from typing import Any

import numpy as np

from recserve.clients.errors import InvalidRequestError, ServerError
from recserve.clients.rows import Rows
from recserve.core.candidate_lists import candidate_list_inputs
from recserve.core.names import (
    DENSE_VERSION,
    EMBEDDING_VERSION,
    IDS_WIRE,
    PROBABILITY,
    USER_HEADER,
    USER_ID,
    WIRE_FORMS,
)
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.types import NUMPY_DTYPES
from recserve.core.user_state_wire import user_keys, user_state_inputs
from recserve.core.wire_forms import check_form, ids_from_bytes, request_form
from recserve.errors import InvalidInput, cap_message, shorten, shorten_all

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
    """One response with the versions that served it (once for the request: its rows agree).

    Attributes:
        probabilities: float32 ``[B]`` click probabilities.
        dense_version: the ``dense`` model version that scored the request (0: an empty request).
        embedding_version: int64 ``[T]``: each embedding table's version in the store snapshot that
            served the request, in the order of :attr:`tables` (zeros: an empty request).
        tables: table names, the order of ``embedding_version`` (the spec's ``table_names``).
        request_id: the id the request was sent with (the caller's, or one the client made): the
            server's request log and click events name the request by it.
    """

    probabilities: np.ndarray
    dense_version: int
    embedding_version: np.ndarray
    tables: tuple[str, ...]
    request_id: str = ""

    def table_versions(self) -> dict[str, int]:
        """Table name -> version that served the request."""
        return dict(zip(self.tables, (int(v) for v in self.embedding_version), strict=True))


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
        wire: str = IDS_WIRE,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if user_id is not None and (not user_id or not user_id.isascii() or not user_id.isprintable()):
            raise ValueError(f"user_id must be non-empty printable ASCII, got {shorten(user_id)}")
        self.wire = check_form(wire)
        self.protocol = _check_protocol(protocol)
        self.url, self._ssl = _normalise_url(url, self.protocol)
        self.timeout_s = float(timeout_s)
        self._spec = spec
        self._model_name = model_name
        # sent with every request: the access layer keeps a user on one model variant by it
        self._headers = {USER_HEADER: user_id} if user_id is not None else None
        #: the ids of the requests the latest call sent, in order (one per request it made)
        self.last_request_ids: list[str] = []
        self._limit: int | None = None  # the served max_batch_size, read at first use
        self._collecting: list[str] | None = None

    @contextlib.contextmanager
    def _collect_ids(self) -> Iterator[None]:
        """Gather the ids sent inside the block into :attr:`last_request_ids` (the outermost call's)."""
        if self._collecting is not None:  # a call inside another: the outer one collects
            yield
            return
        self._collecting = []
        try:
            yield
        finally:
            self.last_request_ids, self._collecting = self._collecting, None

    def _sent(self, request_id: str) -> str:
        """Note ``request_id`` as sent by the current call; returns it."""
        if self._collecting is not None:
            self._collecting.append(request_id)
        else:
            self.last_request_ids = [request_id]
        return request_id

    @property
    def spec(self) -> ModelSpec:
        """The model's spec: the one given, else the one the server serves (read once, at first use).

        Without a spec, the client reads it from ``model_name``'s config (from ``embedding_lookup``'s
        when no model is named either: through the access layer, where only the ensembles are
        public, name the model).

        Raises:
            RecserveClientError: no spec was given and the server's cannot be read.
        """
        if self._spec is None:
            from recserve.clients.served_spec import served_spec

            self._spec = served_spec(self._schemed_url, self.protocol, self.timeout_s, self._model_name)
        return self._spec

    @property
    def _schemed_url(self) -> str:
        """The url with its TLS scheme, as :mod:`~recserve.clients.served_spec` reads it."""
        return (("grpcs://" if self.protocol == "grpc" else "https://") if self._ssl else "") + self.url

    @property
    def max_batch_size(self) -> int:
        """The most rows, or one user's candidates, one request may carry: the server's own limit.

        Read from the served spec at first use, also by a client made with a spec (the GPU profiles
        take more than the file's ``max_batch_size``); the spec's while the server cannot be reached
        (asked again next time: :func:`~recserve.clients.served_spec.served_limit`). May be set.
        """
        if self._limit is None:
            from recserve.clients.served_spec import served_limit

            self._limit = served_limit(
                self._schemed_url, self.protocol, self.timeout_s, self.model_name, self._spec
            )
        return self._limit or self.spec.model.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {rows}")
        self._limit = int(rows)

    def limit_for(self, rows: int) -> int:
        """What ``rows`` rows are held to: the given spec's limit while they fit it, else the served one."""
        if self._limit is None and self._spec is not None and rows <= self._spec.model.max_batch_size:
            return self._spec.model.max_batch_size
        return self.max_batch_size

    @property
    def model_name(self) -> str:
        """The ensemble the client calls: the one given, else the spec's row ensemble."""
        return self._model_name or self.spec.name

    @cached_property
    def _dtypes(self) -> dict[str, str]:
        """Every request tensor's dtype by name: both wire forms', a candidate list's user ones too."""
        forms = [self.spec.wire_form(form) for form in WIRE_FORMS]
        dtypes = {t.name: t.dtype for f in forms for t in (*f.inputs, *f.user_inputs)}
        dtypes.update({t.name: t.dtype for t in user_state_inputs(self.spec)})
        return dtypes

    def _prepare(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs cast to the wire dtypes, checked for names, rank and a common batch size.

        ``inputs`` may be of either wire form; those of the bytes form are sent as ids when the
        client's ``wire`` is ``ids`` (parsed and hashed here, by the value codec).
        """
        state = {t.name for t in user_state_inputs(self.spec)}  # none unless [user_state] is on
        given = {n: v for n, v in inputs.items() if n in state and v is not None}
        inputs = {n: v for n, v in inputs.items() if n not in state}
        try:
            form = request_form(self.spec, [n for n, v in inputs.items() if v is not None])
        except InvalidInput as exc:
            raise InvalidRequestError(str(exc)) from None
        wire = self.spec.wire_form(form).inputs
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
        arrays.update(self._user_state_arrays(given, state))
        rows = {a.shape[0] for a in arrays.values()}
        if len(rows) != 1:
            raise InvalidRequestError(f"inputs disagree on the batch size: {sorted(rows)}")
        if form != self.wire == IDS_WIRE:
            try:
                arrays = {**ids_from_bytes(self.spec, arrays), **{n: arrays[n] for n in given}}
            except InvalidInput as exc:
                raise InvalidRequestError(str(exc)) from None
        batch = rows.pop()
        limit = self.limit_for(batch)
        if batch > limit:
            raise InvalidRequestError(f"batch of {batch} rows exceeds max_batch_size {limit}; use predict()")
        return arrays

    @staticmethod
    def _user_state_arrays(given: Mapping[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
        """``user_id`` and ``user_seq`` as INT64 ``[B, 1]``: both or neither (``[user_state]``).

        A user id may be a string: it is sent as its :func:`~recserve.core.user_state_wire.user_key`.
        """
        if given and set(given) != names:
            raise InvalidRequestError(
                f"inputs {sorted(names)} go together (a row's user and its newest event); got {sorted(given)}"
            )
        arrays = {}
        for name, values in given.items():
            try:
                if name == USER_ID:  # string user ids become their int64 (user_key)
                    raw = np.asarray(values, dtype=object)
                    array = user_keys(raw.ravel()).reshape(raw.shape)
                else:
                    array = np.ascontiguousarray(values, dtype=np.int64)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidRequestError(
                    f"input '{name}' cannot be converted to INT64: {cap_message(str(exc), 200)}"
                ) from exc
            arrays[name] = array.reshape(-1, 1) if array.ndim == 1 else array
            if arrays[name].ndim != 2 or arrays[name].shape[1] != 1:
                raise InvalidRequestError(
                    f"input '{name}' has shape {list(array.shape)}, expected [batch, 1]"
                )
        return arrays

    def _candidate_requests(
        self, user: Mapping[str, Sequence[int] | np.ndarray], candidates: Rows
    ) -> Iterator[dict[str, np.ndarray]]:
        """The candidates ensemble's requests for one user: at most :attr:`max_batch_size` candidates each.

        The user's sequences travel once per request (``[1, L]``, the length ``[1, 1]``), each
        per-candidate input as ``[1, N, ...]``; with ``[user_state]``, ``user_id`` and ``user_seq``
        where the user gives them (``[1, 1]``; the sequence is then the real-time tail).
        """
        spec = self.spec
        if spec.candidates_model is None:
            raise InvalidRequestError(
                f"spec {spec.name!r} has no sequence, so no user context: score the candidates with predict()"
            )
        names = [s.name for s in spec.sequences]
        state = {t.name for t in user_state_inputs(spec)}  # the user's state: none unless [user_state]
        unknown = sorted(set(user) - set(names) - state)
        if unknown:
            carried = names + sorted(state)
            raise InvalidRequestError(
                f"unknown user inputs [{shorten_all(unknown)}]; a user carries {carried}"
            )
        given = {n: np.asarray(user[n]).reshape(-1) for n in state if user.get(n) is not None}
        state_arrays = self._user_state_arrays(given, state)
        if any(a.shape[0] != 1 for a in state_arrays.values()):
            raise InvalidRequestError(f"a candidate list has one user: {sorted(state)} take one value each")
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
        for part in candidates.batches(self.limit_for(len(candidates))):
            try:
                rows = replace(part, users=None, user_seqs=None).to_inputs(spec, self.wire)  # no states
            except InvalidInput as exc:
                raise InvalidRequestError(str(exc)) from None
            yield {**user_arrays, **state_arrays, **candidate_list_inputs(spec, rows, self.wire)}

    def _infer_inputs(self, module: ModuleType, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """``InferInput`` objects of the protocol's module (``tritonclient.grpc`` or ``.http``).

        ``arrays``: the row layout's wire inputs, or a candidate list's (its profile tensors among them).
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

    def _scores(
        self, result: Any, rows: int, probabilities: np.ndarray | None = None, request_id: str = ""
    ) -> Scores:
        # the versions leave once per request (one row), not once per row
        return Scores(
            self._probabilities(result, rows) if probabilities is None else probabilities,
            int(self._output(result, DENSE_VERSION, 1, np.int64).reshape(-1)[0]),
            self._output(result, EMBEDDING_VERSION, 1, np.int64).reshape(-1),
            self.spec.table_names,
            request_id,
        )

    def _empty_scores(self, request_id: str = "") -> Scores:
        tables = self.spec.table_names
        return Scores(np.zeros(0, np.float32), 0, np.zeros(len(tables), np.int64), tables, request_id)

    def _check_batch_size(self, batch_size: int) -> None:
        if not 1 <= batch_size <= self.limit_for(batch_size):
            raise ValueError(f"batch_size must be in 1..{self.max_batch_size}, got {batch_size}")
