"""The spec a repository carries: ``recserve build`` and ``import`` write it into every step's config.

Each step's ``config.pbtxt`` holds the spec it serves as the ``spec`` parameter (JSON of the spec's
document, what the steps read at load). So a command pointed at a repository needs no ``--spec``:
it reads the spec there, the one the repository was built or imported with (an imported table's
cardinality included).
"""

from __future__ import annotations

from pathlib import Path

from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import spec_from_json
from recserve.errors import ArtifactError

#: The config parameter holding the served spec (see :func:`recserve.build.configs.step_config`).
SPEC_PARAMETER = "spec"


def spec_json_of_config(text: str, where: str) -> str:
    """The spec JSON of a step's ``config.pbtxt`` text.

    Raises:
        ArtifactError: the text is no model config, or it carries no spec.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ArtifactError(f"{where} is not a model config: {exc}") from None
    parameters = config.parameters
    if SPEC_PARAMETER not in parameters:
        raise ArtifactError(f"{where} carries no spec (built before repositories carried theirs)")
    return str(parameters[SPEC_PARAMETER].string_value)


def repository_spec(repository: Path) -> ModelSpec:
    """The spec ``repository`` was built or imported with.

    Raises:
        ArtifactError: the repository has no ``embedding_lookup`` config, or it carries no spec.
    """
    path = repository / EMBEDDING_LOOKUP / "config.pbtxt"
    if not path.is_file():
        raise ArtifactError(f"{repository} holds no built model (no {EMBEDDING_LOOKUP}/config.pbtxt)")
    return spec_from_json(spec_json_of_config(path.read_text(), str(path)))
