"""What a variant's tritonserver serves behind the proxy: its repository, with Triton's queues unbounded.

Behind the proxy, admission is Envoy's in-flight cap. A queue policy in Triton would refuse again,
later and after work was spent (a timeout is only noticed at the batcher's next look; a full queue
stalls tritonserver 2.51's batcher for up to 500 ms). :func:`unbounded_view` builds a view of a
built repository whose models are the same folders (linked, not copied) and whose ``config.pbtxt``
files are the repository's own, parsed as ``ModelConfig`` protobufs with the queue policies cleared.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from recserve.access.config import AccessError

CONFIG = "config.pbtxt"
#: ``[access] queue_policy`` value: no queue policy in Triton behind the proxy.
UNBOUNDED = "unbounded"


def without_queue_policy(text: str) -> str | None:
    """``config.pbtxt`` text with the dynamic batcher's queue policies cleared; None when it has none."""
    config = text_format.Parse(text, mc.ModelConfig())
    batching = config.dynamic_batching
    if not config.HasField("dynamic_batching") or not (
        batching.HasField("default_queue_policy") or batching.priority_queue_policy
    ):
        return None
    batching.ClearField("default_queue_policy")
    batching.ClearField("priority_queue_policy")
    return str(text_format.MessageToString(config))


def unbounded_view(source: Path, target: Path) -> Path:
    """A repository at ``target`` serving ``source``'s models with no queue policy.

    Every entry of every model folder (version folders, ``configs/``, update folders) is a link to
    the one in ``source``, so new table versions published there are seen; only the ``config.pbtxt``
    of a model with a queue policy is a file of its own. An existing ``target`` is replaced.

    Raises:
        AccessError: ``source`` holds no model.
    """
    source = source.resolve()
    models = sorted(p for p in source.iterdir() if (p / CONFIG).is_file())
    if not models:
        raise AccessError(f"{source} holds no model (no <model>/{CONFIG}); run 'recserve build'")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for model in models:
        (target / model.name).mkdir()
        for entry in model.iterdir():
            cleared = without_queue_policy(entry.read_text()) if entry.name == CONFIG else None
            if cleared is not None:
                (target / model.name / CONFIG).write_text(cleared)
            else:
                (target / model.name / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return target


def behind_proxy(
    repositories: Mapping[str, Path], queue_policy: str, queue_policies: Iterable[str], workdir: Path
) -> tuple[dict[str, Path], str | None]:
    """What each variant's server serves, and its ``--model-config-name``, for ``[access] queue_policy``.

    ``unbounded``: an :func:`unbounded_view` of each repository under ``workdir``; ``default``: the
    repositories as built; a ``[serving.queue_policies]`` name: the repositories with that profile.

    Raises:
        AccessError: the profile is none of these.
    """
    if queue_policy == UNBOUNDED:
        return {
            name: unbounded_view(path, workdir / f"repository-{name}") for name, path in repositories.items()
        }, None
    if queue_policy == "default":
        return dict(repositories), None
    if queue_policy not in set(queue_policies):
        raise AccessError(
            f"[access] queue_policy {queue_policy!r} is not a [serving.queue_policies] entry, "
            f"{UNBOUNDED!r} or 'default'"
        )
    return dict(repositories), queue_policy
