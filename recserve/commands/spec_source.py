"""Which spec a command works with when ``--spec`` is not given.

A repository carries the spec it was built or imported with (every step's config), and a server
reports the spec it serves: so ``predict``, ``verify``, ``explain``, ``perf`` and the store commands
need no ``--spec``. In order: ``--spec`` where given; the spec of the repository (``--repository``,
or the default one) where it carries one; for a command that talks to a server, the served spec;
else the bundled default spec.
"""

from __future__ import annotations

import argparse
import logging

from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec

LOGGER = logging.getLogger(__name__)


def command_spec(args: argparse.Namespace, server: bool = False) -> ModelSpec:
    """The spec of ``args``'s command (see the module docstring).

    Args:
        args: the parsed command line (``spec``, ``spec_given``; ``repository``, ``url``,
            ``protocol`` and ``timeout`` where the command has them).
        server: the command scores through a server: without ``--spec`` and without a repository
            named on the command line, ask the server (``--url``) for the spec it serves.

    Raises:
        ArtifactError: the named repository carries no readable spec.
        RecserveClientError: the server cannot be reached or serves no spec.
    """
    if getattr(args, "spec_given", True):
        return load_spec(args.spec)
    repository = getattr(args, "repository", None)
    named = getattr(args, "repository_given", False)
    if repository is not None and (named or not server):
        if (repository / EMBEDDING_LOOKUP / "config.pbtxt").is_file():
            from recserve.build.repository_spec import repository_spec

            spec = repository_spec(repository)
            LOGGER.info("spec %r: the one repository %s carries", spec.name, repository)
            return spec
        if named:
            from recserve.errors import ArtifactError

            raise ArtifactError(f"{repository} holds no built model; pass --spec or build it first")
    if server:
        from recserve.clients.served_spec import served_spec

        spec = served_spec(args.url, args.protocol, getattr(args, "timeout", 10.0))
        LOGGER.info("spec %r: the one the server serves", spec.name)
        return spec
    return load_spec(args.spec)
