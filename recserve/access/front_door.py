"""The front door: what the public listeners refuse before a request reaches a tritonserver.

tritonserver 2.51 allocates a JSON input's declared shape before it reads ``data``: one HTTP body
declaring ``"shape": [1099511627776, 13]`` aborts the process (``std::bad_alloc``). So the proxy
proves every request safe first, with what Envoy ships:

* **Headers** (``max_request_headers_kb``): Triton drops the connection on a header line of 8 KiB or
  more, which Envoy would read as a dead replica. Envoy answers 431 itself above
  :data:`MAX_HEADERS_KB` in all, so such a request never leaves the proxy.
* **Body size** (``envoy.filters.http.buffer``, ``max_request_bytes``): the largest body a client can
  legitimately send, derived from the served configs (:meth:`FrontDoor.from_repositories`); over it,
  413, on both listeners (one gRPC message per unary call; the stream call is refused).
* **What Triton will read** (``envoy.filters.http.lua``, :mod:`recserve.access.lua`):
  a strict JSON parse of the inference body (or of the binary form's JSON header) with escapes decoded
  and duplicate or unknown keys refused, and a protobuf walk of the gRPC message. Refused with 400
  (gRPC ``INVALID_ARGUMENT``): a shape holding more elements than the model takes (max batch ×
  per-row elements from its config), ``data`` whose element count differs from the shape's, a name
  the model does not have, a name over :data:`MAX_NAME_BYTES`. Compressed bodies (which Triton would
  inflate) are refused with 415.
* **Public models** (:attr:`FrontDoor.public`): the served ensembles; a path or call naming any other
  model (an ensemble's steps) is answered 404 (gRPC ``NOT_FOUND``), so clients cannot call a step
  directly (nor steer a canary's figures through it).

Every refusal is a JSON ``{"error": "..."}`` (or a ``grpc-message``) naming the input and the
offending value (truncated), as Triton's own errors look.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.access.lua.frame import ENTRY, PRELUDE
from recserve.access.lua.grpc_message import GRPC_MESSAGE
from recserve.access.lua.json_body import JSON_BODY
from recserve.access.lua.value_door import VALUE_DOOR
from recserve.core.sections.degrade import LAMBDA_HEADER, ORDERED_HEADER, REFUSED_HEADER, VALUE_HEADER
from recserve.core.spec.model import ModelSpec

if TYPE_CHECKING:
    from recserve.access.value_door import ValueDoor

#: Request headers Envoy accepts, in KiB in all; Triton drops a connection on one line of 8 KiB.
MAX_HEADERS_KB = 7
#: Deepest JSON nesting the scanner reads (a request's ``data`` is at most a few levels deep).
MAX_DEPTH = 16
#: Most dimensions of one input's shape.
MAX_DIMS = 8
#: Bytes one element may take in a JSON body: a number with its separator and indentation ...
JSON_NUMBER_BYTES = 40
#: ... and a string (the categorical inputs' hex or multi-hot text, quoted and escaped).
JSON_STRING_BYTES = 160
#: Added to a derived body size: the JSON around the tensors (names, shapes, parameters).
BODY_MARGIN_BYTES = 64 * 1024
#: Echoed values are cut to this many characters, with their length.
SHOWN_CHARS = 64
#: Longest name (input, output, parameter, version) the proxy passes for a model it does not know.
MAX_NAME_BYTES = 256

_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_BUFFER_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
#: The gRPC streaming call: never buffered (its request body does not end).
GRPC_STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


class FrontDoorError(ValueError):
    """The front door's limits cannot be derived from a repository."""


@dataclass(frozen=True)
class FrontDoor:
    """The limits the public listeners enforce.

    Attributes:
        inputs: model -> input -> the most elements one request may declare for it.
        outputs: model -> its output names (a model not here: any name up to
            :data:`MAX_NAME_BYTES`).
        public: the models clients may reach; every other name is answered 404. Empty: every model.
        max_elements: the bound for a model not in ``inputs`` (the largest a client-facing model
            takes; Triton refuses unknown models, this only keeps their shapes bounded). An input
            name a known model does not have is refused by the proxy: Triton's own refusal echoes
            the whole name.
        max_body_bytes: the largest request body the proxy buffers; over it, 413.
        max_headers_kb: request headers in all, KiB; over it, 431.
        value_door: the ``[degrade]`` door in front of the servers (:mod:`recserve.access.value_door`);
            None: none (the first step decides alone).
    """

    inputs: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    outputs: Mapping[str, frozenset[str]] = field(default_factory=dict)
    public: frozenset[str] = frozenset()
    max_elements: int = 256 * 256 * 16
    max_body_bytes: int = 8 * 1024 * 1024
    max_headers_kb: int = MAX_HEADERS_KB
    value_door: ValueDoor | None = None

    def __post_init__(self) -> None:
        if self.max_elements < 1 or self.max_body_bytes < 1 or self.max_headers_kb < 1:
            raise FrontDoorError(f"front-door limits must be positive: {self}")

    @classmethod
    def from_configs(cls, configs: Iterable[mc.ModelConfig], longest: int) -> FrontDoor:
        """Limits from served model configs; a variable dimension (-1) holds at most ``longest``.

        A batched model (``max_batch_size`` > 0) takes ``max_batch_size`` × the product of its dims
        per input. A model without a batch dimension (the candidate-list ensemble, whose leading
        dims are users and candidates, at most ``max_batch_size`` rows together) takes, per input,
        what a batched model takes under the same name, else the largest batch × its other dims.
        The body size is the largest a client-facing model (an ensemble, or every model where the
        repository has no ensemble) can take as JSON, plus :data:`BODY_MARGIN_BYTES`; only those
        models are :attr:`public`.

        Raises:
            FrontDoorError: no config, or ``longest`` < 1.
        """
        configs = list(configs)
        if not configs or longest < 1:
            raise FrontDoorError(f"no served config to derive the front door from (longest {longest})")
        batch = max(c.max_batch_size for c in configs) or 1
        by_name: dict[str, int] = {}
        for config in configs:
            if config.max_batch_size > 0:
                for tensor in config.input:
                    count = config.max_batch_size * _row_elements(tensor.dims, longest)
                    by_name[tensor.name] = max(by_name.get(tensor.name, 0), count)
        inputs: dict[str, dict[str, int]] = {}
        for config in configs:
            inputs[config.name] = {
                t.name: (
                    config.max_batch_size * _row_elements(t.dims, longest)
                    if config.max_batch_size > 0
                    else by_name.get(t.name) or batch * _row_elements(t.dims[1:], longest)
                )
                for t in config.input
            }
        public = [c for c in configs if c.platform == "ensemble"] or configs
        body = max(sum(inputs[c.name][t.name] * _json_bytes(t.data_type) for t in c.input) for c in public)
        most = max((inputs[c.name][t.name] for c in public for t in c.input), default=batch)
        outputs = {c.name: frozenset(t.name for t in c.output) for c in configs}
        return cls(inputs, outputs, frozenset(c.name for c in public), most, body + BODY_MARGIN_BYTES)

    @classmethod
    def from_repositories(cls, repositories: Iterable[Path]) -> FrontDoor:
        """Limits covering every model of the repositories (each model's ``config.pbtxt``).

        The longest sequence is the served spec's (a Python-backend config's ``spec`` parameter);
        a repository without one bounds a variable dimension by its largest batch.

        Raises:
            FrontDoorError: a repository without any model config.
        """
        repositories = list(repositories)
        configs: dict[str, mc.ModelConfig] = {}
        spec: ModelSpec | None = None
        for repository in repositories:
            for path, config in _configs(repository):
                config.name = config.name or path.parent.name
                known = configs.get(config.name)
                if known is None or config.max_batch_size > known.max_batch_size:
                    configs[config.name] = config
                spec = spec or _spec_of(config)
        longest = max(spec.serving.sequence_buckets) if spec is not None else 0
        if not configs:
            raise FrontDoorError(f"no model config (*/config.pbtxt) in {[str(r) for r in repositories]}")
        return cls.from_configs(
            configs.values(), longest or max(c.max_batch_size for c in configs.values()) or 1
        )

    def http_filters(self) -> list[dict[str, Any]]:
        """A public listener's filters before the router: buffer (size), then Lua (what Triton reads)."""
        return [self.buffer_filter(), lua_filter(lua_source(self))]

    def buffer_filter(self) -> dict[str, Any]:
        """Envoy's buffer filter: a body over :attr:`max_body_bytes` is answered 413."""
        return {
            "name": "envoy.filters.http.buffer",
            "typed_config": {"@type": _BUFFER, "max_request_bytes": self.max_body_bytes},
        }

    def local_replies(self, protocol: str = "http") -> dict[str, Any]:
        """Envoy's own 413 and 431, naming the limit.

        On HTTP a JSON ``{"error": ...}`` body; on gRPC the ``grpc-message`` (Envoy's 413 becomes
        the status ``UNKNOWN``).
        """
        texts = {
            413: f"request body over {self.max_body_bytes} bytes, the most the served models take",
            431: f"request headers over {self.max_headers_kb} KiB",
        }
        json_body = {"json_format": {"error": "%LOCAL_REPLY_BODY%"}, "content_type": "application/json"}
        return {
            "mappers": [
                {
                    "filter": {
                        "status_code_filter": {
                            "comparison": {
                                "op": "EQ",
                                "value": {"default_value": status, "runtime_key": f"access.reply_{status}"},
                            }
                        }
                    },
                    "body": {"inline_string": text},
                    **({"body_format_override": json_body} if protocol == "http" else {}),
                }
                for status, text in texts.items()
            ]
        }


def served_spec(repository: Path) -> ModelSpec | None:
    """The spec a built repository serves (a Python-backend config's ``spec`` parameter); None: none."""
    specs = (_spec_of(config) for _, config in _configs(repository))
    return next((spec for spec in specs if spec is not None), None)


def _configs(repository: Path) -> Iterator[tuple[Path, mc.ModelConfig]]:
    """Each model's ``config.pbtxt`` in ``repository``, parsed, in name order."""
    for path in sorted(repository.glob("*/config.pbtxt")):
        yield path, text_format.Parse(path.read_text(), mc.ModelConfig())


def _spec_of(config: mc.ModelConfig) -> ModelSpec | None:
    """The spec a model config carries (the Python backends' ``spec`` parameter), else None."""
    from recserve.core.spec.parse import spec_from_json

    return spec_from_json(config.parameters["spec"].string_value) if "spec" in config.parameters else None


def _row_elements(dims: Iterable[int], longest: int) -> int:
    return math.prod(d if d > 0 else longest for d in dims)


def _json_bytes(data_type: int) -> int:
    return JSON_STRING_BYTES if data_type == mc.TYPE_STRING else JSON_NUMBER_BYTES


def buffer_off() -> dict[str, Any]:
    """Route-level setting that turns the buffer filter off (the gRPC stream call)."""
    return {"envoy.filters.http.buffer": {"@type": _BUFFER_PER_ROUTE, "disabled": True}}


def lua_filter(source: str) -> dict[str, Any]:
    """Envoy's Lua HTTP filter running ``source`` inline."""
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": source}},
    }


def lua_source(door: FrontDoor) -> str:
    """The front door's Lua (:mod:`recserve.access.lua`) with ``door``'s limits written in as literals."""
    outputs = {model: dict.fromkeys(names, "true") for model, names in door.outputs.items()}
    return (
        (PRELUDE + JSON_BODY + GRPC_MESSAGE + VALUE_DOOR + ENTRY)
        .replace("@DOOR@", door.value_door.lua_table() if door.value_door is not None else "nil")
        .replace("@LAMBDA_HEADER@", LAMBDA_HEADER)
        .replace("@REFUSED_HEADER@", REFUSED_HEADER)
        .replace("@ORDERED_HEADER@", ORDERED_HEADER)
        .replace("@VALUE_HEADER@", VALUE_HEADER)
        .replace("@LIMITS@", _lua_table(door.inputs))
        .replace("@OUTPUTS@", _lua_table(outputs))
        .replace("@PUBLIC@", _lua_table(dict.fromkeys(door.public, "true")))
        .replace("@MAX_ELEMENTS@", str(door.max_elements))
        .replace("@MAX_NAME@", str(MAX_NAME_BYTES))
        .replace("@MAX_DEPTH@", str(MAX_DEPTH))
        .replace("@MAX_DIMS@", str(MAX_DIMS))
        .replace("@SHOWN@", str(SHOWN_CHARS))
    )


def _lua_table(table: Mapping[str, Any]) -> str:
    """A Lua table literal of ``table``: string keys, values as they are or (mappings) nested tables."""
    items = (
        f"[{lua_string(key)}] = {_lua_table(item) if isinstance(item, Mapping) else item}"
        for key, item in sorted(table.items())
    )
    return "{" + ", ".join(items) + "}"


def lua_string(text: str) -> str:
    r"""A Lua string literal: letters, digits and ``_-.`` as they are, every other byte as ``\\ddd``."""
    return (
        '"'
        + "".join(
            chr(b) if b < 128 and (chr(b).isalnum() or chr(b) in "_-.") else f"\\{b:03d}"
            for b in text.encode()
        )
        + '"'
    )
