"""Who may do what on a served repository: model control and the key-restricted APIs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from recserve.server.runtime import ServerProcessError

#: Request header that unlocks the restricted APIs (HTTP header / gRPC metadata key).
ADMIN_HEADER = "recserve-admin-key"
#: Triton expects restricted-protocol metadata on gRPC under this prefix.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
#: APIs only a caller holding the admin key may use: loading and unloading models, changing log and
#: trace settings. Client shared memory is added unless it is asked for explicitly.
RESTRICTED_APIS = ("model-repository", "logging", "trace")
SHARED_MEMORY_API = "shared-memory"
MODEL_CONTROL_MODES = ("none", "explicit")


@dataclass(frozen=True)
class Security:
    """Who may do what on a served repository.

    Attributes:
        model_control: ``none`` (the repository is fixed at start) or ``explicit`` (models are loaded
            and reloaded through the model-repository API, which needs the admin key).
        admin_key: value of the ``recserve-admin-key`` header that unlocks the restricted APIs; when
            None a random key is made and never shown, so those APIs stay closed to everyone.
        client_shared_memory: leave the shared-memory registration API open to every client.
    """

    model_control: str = "none"
    admin_key: str | None = None
    client_shared_memory: bool = False

    def __post_init__(self) -> None:
        if self.model_control not in MODEL_CONTROL_MODES:
            raise ServerProcessError(
                f"model control must be one of {MODEL_CONTROL_MODES}, got {self.model_control!r}"
            )
        if self.model_control == "explicit" and not self.admin_key:
            raise ServerProcessError(
                "model control 'explicit' needs an admin key (--admin-key or RECSERVE_ADMIN_KEY)"
            )

    @property
    def restricted_apis(self) -> tuple[str, ...]:
        """APIs behind the admin key."""
        return RESTRICTED_APIS if self.client_shared_memory else (*RESTRICTED_APIS, SHARED_MEMORY_API)

    def arguments(self) -> list[str]:
        """Tritonserver flags for model control and the key-restricted APIs (HTTP and gRPC alike)."""
        key = self.admin_key or secrets.token_urlsafe(32)
        restriction = f"{','.join(self.restricted_apis)}:{ADMIN_HEADER}={key}"
        model_control = [f"--model-control-mode={self.model_control}"]
        if self.model_control == "explicit":
            model_control.append("--load-model=*")
        return [
            *model_control,
            f"--http-restricted-api={restriction}",
            f"--grpc-restricted-protocol={restriction}",
        ]

    def headers(self, protocol: str = "grpc") -> dict[str, str]:
        """Headers a client sends to use the restricted APIs (gRPC metadata carries Triton's prefix)."""
        if not self.admin_key:
            return {}
        return {(GRPC_HEADER_PREFIX if protocol == "grpc" else "") + ADMIN_HEADER: self.admin_key}
