"""Triton model ``<ensemble>__caller_order``: the caller's-order level answered beside an ensemble.

See recserve.backends.steps.caller_order; only the access layer's door sends requests here.
"""

from recserve.backends.steps.caller_order import CallerOrder
from recserve.backends.triton.adapter import ModelContext, error_response, respond


class TritonPythonModel:
    """Every row (candidate) of a request answered with ``[degrade] fallback_score``, nothing scored."""

    def initialize(self, args: dict) -> None:
        """The ensemble it stands beside decides the request layout (rows, or candidate lists)."""
        context = ModelContext.from_args(args)
        lists = context.name == context.spec.caller_order_models.get(context.spec.candidates_model or "")
        self.order = CallerOrder(context.spec, lists)

    def execute(self, requests: list) -> list:
        """One response per request, read from its inputs' shapes alone (a bad one fails alone)."""
        responses = []
        for request in requests:
            try:
                shapes = {t.name(): tuple(t.shape()) for t in request.inputs()}
                responses.append(respond(self.order.answer(shapes)))
            except Exception as exc:  # mapped per request
                responses.append(error_response(exc))
        return responses
