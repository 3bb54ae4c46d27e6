"""Connecting to the Redis Cluster of ``[store]``: credentials, TLS, and what a refusal says.

Shared by the L3 tier and the request log's stream sink, which both reach the cluster the spec names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


class L3ConnectError(ValueError):
    """The ``[store]`` Redis settings reach no usable cluster (credentials missing or refused, no node up).

    A ValueError, as a wrong setting is: commands print it as one ``error:`` line.
    """


def connection_settings(options: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The credentials and TLS settings of ``[store]`` as ``redis.cluster.RedisCluster`` arguments.

    The password is read from the environment variable named by ``redis_password_env``, never
    from the spec (the spec is copied into every generated ``config.pbtxt``).

    Raises:
        L3ConnectError: ``redis_password_env`` names a variable that is not set (or is empty).
    """
    settings: dict[str, Any] = {}
    if options.redis_username:
        settings["username"] = options.redis_username
    if options.redis_password_env:
        password = (os.environ if environ is None else environ).get(options.redis_password_env, "")
        if not password:
            raise L3ConnectError(
                f"[store] redis_password_env names {options.redis_password_env}, "
                "which is not set in the server's environment"
            )
        settings["password"] = password
    if options.redis_ssl:
        settings["ssl"] = True
        for name in ("ca_certs", "certfile", "keyfile"):
            path = getattr(options, f"redis_ssl_{name}")
            if path:
                settings[f"ssl_{name}"] = path
        settings["ssl_check_hostname"] = options.redis_ssl_check_hostname
    return settings


#: What redis-py's errors say when a node refuses the credentials (no password, a wrong one, no such user).
_AUTH_WORDS = ("NOAUTH", "WRONGPASS", "authenticat", "Authenticat", "username-password", "invalid password")


def refused_error(options: Any, exc: BaseException) -> L3ConnectError:
    """The error for credentials the cluster refused."""
    who = f"user {options.redis_username!r}" if options.redis_username else "the default user"
    how = (
        f"the password in ${options.redis_password_env}"
        if options.redis_password_env
        else "no password ([store] redis_password_env is not set)"
    )
    return L3ConnectError(
        f"the Redis Cluster at {','.join(options.redis_nodes)} refused {who} with {how}: "
        f"{auth_reason(exc)[:200]}"
    )


def timed_out(exc: BaseException) -> bool:
    """Did the cluster answer too late (rather than refuse, or not listen)?"""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def refused_credentials(exc: BaseException) -> bool:
    """Did Redis refuse to authenticate (rather than being unreachable)?"""
    return any(word in str(exc) for word in _AUTH_WORDS)


def auth_reason(exc: BaseException) -> str:
    """The server's answer, without redis-py's "cannot be connected" preamble."""
    return str(exc).rsplit("reachable node: ", 1)[-1].split("\n")[0]


def host_port(node: str) -> tuple[str, int]:
    """``host:port`` split at its last colon."""
    host, _, port = node.rpartition(":")
    return host, int(port)
