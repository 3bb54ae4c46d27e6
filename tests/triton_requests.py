"""The two calls of a Triton request that the request log makes, for unit tests (served: the real ones)."""


class Request:
    """``request_id()`` and ``parameters()`` of a served request."""

    def __init__(self, request_id: str, parameters: str = "{}") -> None:
        self._id, self._parameters = request_id, parameters

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return self._parameters
