"""Where the models speak ``triton_python_backend_utils``: request loops and error mapping.

``model.py`` files stay thin: they build a plain object from :mod:`recserve.backends` in
``initialize`` and hand their requests to one of the request loops: :func:`execute_merged_or_alone`
(one merged call, redone request by request if it fails), :func:`execute_checked_merged` (each
request checked alone, the valid ones computed together), :func:`execute_alone` (each request by
itself), and :func:`execute_by_input` (which sends a batch's two request forms to two of those).
Their counters reach the metrics endpoint through one
:class:`~recserve.backends.triton.publisher.MetricsPublisher` each.

Every request gets exactly one response; a :class:`~recserve.errors.RequestError` fails its own
request with its code; any other exception fails the requests it touched with a generic message
(the details go to the server log, never to the client).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from recserve.backends.base import batching
from recserve.backends.base.request_errors import RequestErrorCounts
from recserve.backends.triton.bytes_codec import decode_bytes_tensor
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import spec_from_json
from recserve.errors import RequestError, cap_message

LOGGER = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
#: Called once per successful request with its inputs and its own outputs, before the response is
#: sent (the request log); whatever it raises is logged, never the request's failure. It takes out
#: of the outputs what the step added for it alone (never sent).
Observer = Callable[[Any, Arrays, dict[str, Any]], None]
#: The errors this stub process (one model instance) answered with, by code; every
#: :class:`~recserve.backends.triton.publisher.MetricsPublisher` of the process publishes them.
REQUEST_ERRORS = RequestErrorCounts()


def install_bytes_decoder() -> None:
    """Let the stub decode BYTES inputs with :func:`decode_bytes_tensor` (same result, faster).

    The stub looks the decoder up on this module by name each time it materialises a BYTES input.
    """
    pb_utils.deserialize_bytes_tensor = decode_bytes_tensor


def _triton_error(message: str, code: str) -> Any:
    # TritonError is bound by the stub after this module is imported: resolve it per call.
    error_type = pb_utils.TritonError
    return error_type(message, getattr(error_type, code, error_type.INTERNAL))


@dataclass(frozen=True)
class ModelContext:
    """What ``initialize`` learns from Triton: the spec, the version folder, the instance."""

    spec: ModelSpec
    version_dir: Path
    name: str
    instance_count: int
    parameters: Mapping[str, str] = field(default_factory=dict)  # the config's string parameters
    # requests Triton sends each instance before it is ready: each ``model_warmup`` sample arrives
    # as ``batch_size`` one-row requests, ``count`` times
    warmup_requests: int = 0

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> ModelContext:
        """Parse the ``args`` of ``TritonPythonModel.initialize``."""
        if int(np.__version__.split(".")[0]) >= 2:
            raise RuntimeError(
                f"numpy {np.__version__} is loaded in the Python backend; this Triton stub needs numpy<2 "
                "(start tritonserver through 'recserve serve')"
            )
        config = json.loads(args["model_config"])
        spec = spec_from_json(config["parameters"]["spec"]["string_value"])
        count = sum(int(group.get("count", 1)) for group in config.get("instance_group", [])) or 1
        version_dir = Path(args["model_repository"]) / args["model_version"]
        install_bytes_decoder()
        parameters = {
            key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()
        }
        warmup = sum(
            max(1, int(sample.get("batch_size", 1))) * max(1, int(sample.get("count", 1)))
            for sample in config.get("model_warmup", [])
        )
        return cls(spec, version_dir, args["model_name"], count, parameters, warmup)

    @property
    def version(self) -> int:
        """The model version being served (the name of its version folder)."""
        return int(self.version_dir.name)


def instance_device(args: Mapping[str, str]) -> str:
    """``cpu``, or ``cuda:N`` for a KIND_GPU instance (from ``initialize``'s ``args``)."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    return "cpu"


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    """Map a domain error to its Triton code; anything else becomes a message without internals."""
    if isinstance(exc, RequestError):
        REQUEST_ERRORS.count(exc.code)
        # cut to MESSAGE_LIMIT behind shorten(): over gRPC the message travels in a trailer, and one
        # over the client's metadata limit (16 KB) turns INVALID_ARG into RESOURCE_EXHAUSTED
        return pb_utils.InferenceResponse(error=_triton_error(cap_message(str(exc)), exc.code))
    REQUEST_ERRORS.count("INTERNAL")
    LOGGER.exception("request failed")
    return pb_utils.InferenceResponse(
        error=_triton_error(f"internal error ({type(exc).__name__}); see the server log", "INTERNAL")
    )


def read_inputs(request: Any, names: Sequence[str], tensors: bool = False) -> Arrays:
    """The named input tensors of a request as numpy arrays (absent ones are left out).

    One pass over ``request.inputs()``: ``get_input_tensor_by_name`` would scan the whole list
    (and wrap every tensor) once per name.

    With ``tensors`` (a device step), each input is a torch tensor where Triton holds it, taken
    through DLPack without a copy: a GPU-resident input stays on the GPU.
    """
    present = {tensor.name(): tensor for tensor in request.inputs()}
    arrays: dict[str, Any] = {}
    for name in names:
        tensor = present.get(name)
        if tensor is None:
            continue
        if tensors:
            import torch

            arrays[name] = torch.from_dlpack(tensor.to_dlpack())
        elif tensor.is_cpu():
            arrays[name] = tensor.as_numpy()
        else:  # a GPU-resident input (gpu profile): one copy to the host through DLPack
            from torch.utils.dlpack import from_dlpack

            arrays[name] = from_dlpack(tensor.to_dlpack()).cpu().numpy()
    return arrays


def output_tensor(name: str, array: Any) -> pb_utils.Tensor:
    """An output tensor from a numpy array, or from a torch tensor (on any device) through DLPack.

    A device tensor stays where it is: the next step of the ensemble receives it there when its
    config accepts GPU inputs (``FORCE_CPU_ONLY_INPUT_TENSORS: no``). The tensor itself is handed
    over, not a capsule, so the stub asks it for the default stream (``__dlpack__(stream=1)``) and
    the work queued on torch's stream is done before Triton reads it.
    """
    if isinstance(array, np.ndarray):
        return pb_utils.Tensor(name, np.ascontiguousarray(array))
    return pb_utils.Tensor.from_dlpack(name, array.contiguous())


def respond(outputs: Mapping[str, Any]) -> pb_utils.InferenceResponse:
    """A successful response carrying ``outputs`` (numpy arrays or torch tensors)."""
    return pb_utils.InferenceResponse(
        output_tensors=[output_tensor(name, array) for name, array in outputs.items()]
    )


def observed(observe: Observer | None, request: Any, inputs: Arrays, outputs: Mapping[str, Any]) -> Any:
    """``outputs`` after ``observe`` saw them (a failing observer is logged, the request unharmed)."""
    if observe is not None:
        outputs = outputs if isinstance(outputs, dict) else dict(outputs)
        try:
            observe(request, inputs, outputs)
        except Exception:  # the observer's failure is never the request's
            LOGGER.exception("observing a served request failed")
    return outputs


def _handle_one(
    handle: Callable[[Arrays], Mapping[str, Any]],
    inputs: Arrays,
    request: Any = None,
    observe: Observer | None = None,
) -> pb_utils.InferenceResponse:
    try:
        return respond(observed(observe, request, inputs, handle(inputs)))
    except Exception as exc:  # mapped per request
        return error_response(exc)


def execute_merged_or_alone(
    requests: Sequence[Any],
    input_names: Sequence[str],
    handle: Callable[[Arrays], Mapping[str, Any]],
    ragged_outputs: Sequence[str] = (),
    ragged_width: Callable[[Arrays], int] | None = None,
    left_padded: Collection[str] = (),
    output_width: Callable[[Mapping[str, Any]], int] | None = None,
    observe: Observer | None = None,
) -> list:
    """Handle the whole dynamic batch in one call; if that call fails, handle each request alone.

    For steps whose validation and computation are one pass (the feature transform): valid batches,
    the common case, cost one vectorised call; a batch holding a bad request (or requests whose
    shapes do not merge) is redone request by request, so only the bad one fails, with its own
    message.

    Args:
        requests: the dynamic batch.
        input_names: tensors to read.
        handle: validates and computes one (merged) set of inputs (numpy arrays or torch tensors out);
            raises ``RequestError``.
        ragged_outputs: outputs whose axis 1 each request gets back at its own width.
        ragged_width: that width, from one request's inputs.
        left_padded: the ragged outputs padded on the left (each request keeps their last columns).
        output_width: instead of ``ragged_width``, the width from a request's own part of the
            outputs (where the step, not the request, decides it: a user state merged in).
        observe: sees each served request (:data:`Observer`).
    """
    inputs = [read_inputs(request, input_names) for request in requests]
    if len(inputs) == 1:
        return [_handle_one(handle, inputs[0], requests[0], observe)]
    try:
        merged, sizes = batching.merge(inputs)
        outputs = handle(merged)
    except Exception:  # redone per request below, where each error is mapped
        LOGGER.debug("merged batch of %d requests refused; handling them one by one", len(inputs))
        return [_handle_one(handle, *pair, observe) for pair in zip(inputs, requests, strict=True)]
    own = None  # each request's width, the same for every ragged output
    if output_width is not None:
        own = [output_width(part) for part in batching.split(outputs, sizes)]
    elif ragged_width is not None:
        own = [ragged_width(item) for item in inputs]
    widths = {name: own for name in ragged_outputs} if own is not None else {}
    parts = batching.split(outputs, sizes, widths, left_padded)
    return [
        respond(observed(observe, request, item, part))
        for request, item, part in zip(requests, inputs, parts, strict=True)
    ]


def execute_alone(
    requests: Sequence[Any],
    input_names: Sequence[str],
    handle: Callable[..., Mapping[str, Any]],
    tensors: bool = False,
    together: Callable[[list[Arrays], list[frozenset]], list | None] | None = None,
    observe: Observer | None = None,
) -> list:
    """Handle each request by itself: one response each, errors mapped per request.

    ``handle(inputs, requested=...)`` also gets the names of the outputs the request asks for (an
    ensemble asks for those its next step takes). ``tensors``: read as in :func:`read_inputs`.
    ``together(inputs, requested)``, when given, first answers every request in one call (None:
    it does not take this batch); if it raises, each request is handled alone and fails alone.
    ``observe`` sees each served request (:data:`Observer`).
    """
    inputs = [read_inputs(request, input_names, tensors) for request in requests]
    requested = [frozenset(request.requested_output_names()) for request in requests]
    if together is not None and len(requests) > 1:
        try:
            outputs = together(inputs, requested)
        except Exception:  # redone per request below, where each error is mapped
            LOGGER.debug("a batch of %d requests refused together; handling them one by one", len(inputs))
            outputs = None
        if outputs is not None:
            return [
                respond(observed(observe, request, item, part))
                for request, item, part in zip(requests, inputs, outputs, strict=True)
            ]
    return [
        _handle_one(functools.partial(handle, requested=wanted), item, request, observe)
        for request, item, wanted in zip(requests, inputs, requested, strict=True)
    ]


def input_names(requests: Sequence[Any]) -> dict[int, frozenset[str]]:
    """The names of each request's inputs, by ``id(request)``: read once for several markers."""
    return {id(request): frozenset([tensor.name() for tensor in request.inputs()]) for request in requests}


def execute_by_input(
    requests: Sequence[Any],
    marker: str,
    rows: Callable[[list], list],
    other: Callable[[list], list],
    names: Mapping[int, frozenset[str]] | None = None,
) -> list:
    """Requests holding the input ``marker`` go to ``other``, the rest to ``rows``; responses in order.

    For a step taking two request layouts (rows, and one user's candidate list), or both wire forms
    (ids, text), in one dynamic batch. ``names``: :func:`input_names` of the requests, when the
    caller splits them by more than one marker.
    """
    if not marker:  # a step with one layout
        return rows(list(requests))
    names = names or input_names(requests)
    return execute_apart(requests, [marker in names[id(request)] for request in requests], other, rows)


def execute_apart(
    requests: Sequence[Any],
    flags: Sequence[bool],
    flagged: Callable[[list], list],
    rest: Callable[[list], list],
) -> list:
    """The requests whose flag is set go to ``flagged``, the others to ``rest``; responses in order."""
    if not any(flags):
        return rest(list(requests))
    marked = iter(flagged([r for r, f in zip(requests, flags, strict=True) if f]))
    plain = [r for r, f in zip(requests, flags, strict=True) if not f]
    unmarked = iter(rest(plain) if plain else [])
    return [next(marked) if f else next(unmarked) for f in flags]


def execute_checked_merged(
    requests: Sequence[Any],
    input_names: Sequence[str],
    check: Callable[[Arrays], Arrays],
    compute: Callable[[Arrays], Mapping[str, Any]],
    ragged_outputs: Mapping[str, str] | None = None,
    accept: Callable[[Mapping[str, Any]], None] | None = None,
    left_padded: Collection[str] = (),
    tensors: bool = False,
    observe: Observer | None = None,
    accept_merged: Callable[[Mapping[str, Any]], bool] | None = None,
) -> list:
    """Check each request alone, then compute all valid ones in one call and split the results.

    Args:
        requests: the dynamic batch.
        input_names: tensors to read.
        check: validates one request's inputs (raises ``RequestError``), returns what to merge.
        compute: runs on the merged arrays of all valid requests (numpy arrays or torch tensors out).
        ragged_outputs: output name -> input name whose width (axis 1) the output keeps per request.
        accept: checks one request's outputs before they are sent (raises ``RequestError``: that
            request alone fails).
        left_padded: ragged inputs padded on the left (merged by padding them on the left).
        tensors: read the inputs as torch tensors where Triton holds them (:func:`read_inputs`); the
            merge then concatenates them on their device.
        observe: sees each served request (:data:`Observer`; its inputs as checked).
        accept_merged: checks the merged outputs at once; True: every request's are accepted
            (``accept`` is skipped), False: ``accept`` checks each request's.
    """
    responses: list = [None] * len(requests)
    valid, checked = [], []
    for i, request in enumerate(requests):
        try:
            checked.append(check(read_inputs(request, input_names, tensors)))
            valid.append(i)
        except Exception as exc:  # mapped per request
            responses[i] = error_response(exc)
    if valid:
        merged, sizes = batching.merge(checked, left_padded)
        widths = {out: [c[src].shape[1] for c in checked] for out, src in (ragged_outputs or {}).items()}
        try:
            outputs = compute(merged)
            if accept_merged is not None and accept_merged(outputs):
                accept = None
            parts = batching.split(outputs, sizes, widths)
        except Exception as exc:  # the merged call failed: each of its requests gets the error
            for i in valid:
                responses[i] = error_response(exc)
            return responses
        for i, item, part in zip(valid, checked, parts, strict=True):
            try:
                if accept is not None:
                    accept(part)
                responses[i] = respond(observed(observe, requests[i], item, part))
            except Exception as exc:  # mapped per request
                responses[i] = error_response(exc)
    return responses
