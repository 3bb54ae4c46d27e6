"""Typed sections of how the model is served: model, network, serving, store, canary, access, inputs."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from recserve.core.names import STEPS
from recserve.core.sections.base import ENV_NAME, SpecError

#: Where an imported ONNX's embedding lookups are (``[model] lookups``): ``store``, the network takes
#: the looked-up embeddings (the dense contract); ``in_model``, it takes each feature's vocabulary rows
#: and holds its tables (:mod:`recserve.core.in_model`).
MODEL_LOOKUPS = ("store", "in_model")


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: the served model's name, version and limits."""

    name: str
    max_batch_size: int = 256  # rows per request (and per candidate list)
    # every interacting embedding has this width (DLRM dot interaction); 0: the widest table's
    embedding_dim: int = 0
    version: int = 1
    output: str = "probability"  # what the dense ONNX returns: "probability", or "logit" (served as sigmoid)
    # where an imported ONNX looks its embeddings up: "store" (it takes them), "in_model" (it takes rows)
    lookups: str = "store"

    def __post_init__(self) -> None:
        if self.lookups not in MODEL_LOOKUPS:
            raise SpecError(f"model.lookups must be one of {', '.join(MODEL_LOOKUPS)}, got {self.lookups!r}")


@dataclass(frozen=True)
class DenseNetSection:
    """``[dense_net]``: sizes of the built-in network; each has a default that fits any table widths.

    An imported ONNX uses none of them, so an import's spec may leave the section out.
    """

    bottom_mlp: tuple[int, ...] = ()  # (): [64, embedding_dim]; it ends at embedding_dim
    top_mlp: tuple[int, ...] = (64, 32)
    attention_heads: int = 0  # 0: 2 where embedding_dim is even, else 1
    # FM-style first-order terms: the values of the 1-wide tables summed into the logit (they
    # leave the interaction); needs at least one table of dim = 1
    first_order: bool = False


@dataclass(frozen=True)
class QueuePolicy:
    """How the steps' queues shed load (Triton's ``default_queue_policy`` of each step).

    The first step is the admission gate: at most ``entry_max_queue_size`` requests wait there and
    a request that waited ``entry_timeout_microseconds`` without starting is refused (UNAVAILABLE),
    before any work is spent on it. Later steps hold up to ``max_queue_size`` requests for up to
    ``default_timeout_microseconds``. 0 means no limit, and a step without any limit gets no policy
    at all: the default. With any policy tritonserver's batcher forms a batch only once an instance
    waits for one, and may miss that instance's return and idle up to 500 ms
    (docs/design/serving.md#queue-policies), so shedding is opt-in, a ``[serving.queue_policies]``
    entry, and the access layer admits in front of policy-free servers.
    """

    entry_max_queue_size: int = 0
    max_queue_size: int = 0
    default_timeout_microseconds: int = 0
    entry_timeout_microseconds: int | None = None  # None: default_timeout_microseconds
    timeout_action: str = "REJECT"

    @property
    def entry_timeout(self) -> int:
        """The first step's queue timeout in microseconds (0: none)."""
        if self.entry_timeout_microseconds is None:
            return self.default_timeout_microseconds
        return self.entry_timeout_microseconds

    def check(self, name: str) -> None:
        """Raise :class:`SpecError` on negative limits or an unknown action."""
        limits = (
            self.entry_max_queue_size,
            self.max_queue_size,
            self.default_timeout_microseconds,
            self.entry_timeout,
        )
        if min(limits) < 0 or self.timeout_action not in ("REJECT", "DELAY"):
            raise SpecError(
                f"{name} needs limits >= 0 (0: none) and timeout_action REJECT or DELAY, got {self}"
            )


@dataclass(frozen=True)
class ServingSection:
    """``[serving]``: shape buckets, dynamic batching, instances and queue policies."""

    # (): 1, 8, 32, ... (times 4) and max_batch_size; sequences: 8, 16, ... and the longest max_length
    batch_buckets: tuple[int, ...] = ()
    sequence_buckets: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 100
    instances: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEPS, 1))
    preferred_batch_size: tuple[int, ...] = ()
    # the gpu and cuda profiles' largest batch and candidate list (buckets doubling up to it);
    # 0: [model] max_batch_size, as the cpu profile (recserve.core.gpu_batches)
    gpu_max_batch_size: int = 0
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    queue_policies: dict[str, QueuePolicy] = field(default_factory=dict)

    def check(self) -> None:
        """Raise :class:`SpecError` unless ``instances`` names each step once, with a count >= 1."""
        if set(self.instances) != set(STEPS) or min(self.instances.values()) < 1:
            raise SpecError(
                f"[serving.instances] needs a count >= 1 for each step {list(STEPS)}, "
                f"got {dict(self.instances)}"
            )


@dataclass(frozen=True)
class TrainingSection:
    """``[training]``: how ``recserve build`` trains the built-in network on synthetic rows."""

    seed: int = 0
    rows: int = 120_000
    holdout_rows: int = 20_000
    epochs: int = 2
    batch_size: int = 512
    learning_rate: float = 0.003
    min_count: int = 2  # values seen fewer times share the table's default (out-of-vocabulary) row


@dataclass(frozen=True)
class HashingSection:
    """``[hashing]``: key = splitmix64(salt(table) XOR value), salt = FNV-1a 64 of ``<namespace>/<table>``."""

    namespace: str = "recserve"


@dataclass(frozen=True)
class TableSection:
    """``[tables.<name>]``: an embedding table (``<name>`` may expand, e.g. ``C{1..26}``)."""

    # rows of the synthetic data (a list when the name expands); 0: not given (an import's rows
    # come from its files; synthetic rows then draw from 1000 values)
    cardinality: int = 0
    dim: int | None = None  # None: the model's embedding_dim
    dtype: str = "fp32"  # storage: fp32 or fp16 (served as float32)
    zipf_exponent: float = 1.05


@dataclass(frozen=True)
class StoreSection:
    """``[store]``: the sparse parameter store's serving settings."""

    cache_mib: float = 8.0  # L1 hot-row cache per model instance
    cache_refresh_s: float = 5.0  # how often L1 is rebuilt from the key frequencies
    update_poll_s: float = 1.0  # how often a server looks for new table versions
    float16_tables: tuple[str, ...] = ()  # tables stored as float16 (served as float32)
    redis_nodes: tuple[str, ...] = ()  # "host:port" seeds of the L3 Redis Cluster; empty: no L3
    redis_deadline_ms: float = 5.0  # every L3 call; on timeout or error the keys get default vectors
    breaker_failures: int = 3  # consecutive L3 failures that open the circuit breaker
    breaker_cooldown_s: float = 2.0  # open breaker: no L3 calls for this long, then one trial call
    remote_tables: tuple[str, ...] = ()  # tables whose rows live only in L3 (not in the local shards)
    redis_username: str = ""  # Redis ACL user; empty: the default user
    redis_password_env: str = ""  # name of the environment variable holding the password; empty: no AUTH
    redis_ssl: bool = False  # TLS to every node
    redis_ssl_ca_certs: str = ""  # CA bundle that signed the nodes' certificates; empty: the system's
    redis_ssl_certfile: str = ""  # client certificate, for nodes with tls-auth-clients
    redis_ssl_keyfile: str = ""  # its private key
    redis_ssl_check_hostname: bool = True  # the node's certificate must name the host it is reached by
    # a device step (profile cuda) holds whole local tables in device memory up to this budget, the
    # rest behind the device L1; 0: the device L1 alone
    device_memory_mib: float = 1024.0

    @property
    def cache_bytes(self) -> int:
        """The L1 budget in bytes."""
        return int(self.cache_mib * (1 << 20))

    @property
    def device_memory_bytes(self) -> int:
        """The device tier's budget in bytes."""
        return int(self.device_memory_mib * (1 << 20))

    @property
    def table_dtypes(self) -> dict[str, str]:
        """Storage dtype of the tables that are not float32."""
        return {name: "float16" for name in self.float16_tables}

    def check(self, tables: typing.Iterable[str]) -> None:
        """Raise :class:`SpecError` when the section names unknown tables or L3 tables without Redis."""
        for setting in ("float16_tables", "remote_tables"):
            unknown = sorted(set(getattr(self, setting)) - set(tables))
            if unknown:
                raise SpecError(f"[store] {setting} names unknown tables {unknown}")
        if self.remote_tables and not self.redis_nodes:
            raise SpecError("[store] remote_tables needs redis_nodes (the L3 Redis Cluster)")
        if not self.device_memory_mib >= 0:
            raise SpecError(
                f"[store] device_memory_mib must be >= 0 (0: no table resident), got {self.device_memory_mib}"
            )
        self._check_redis_access()

    def _check_redis_access(self) -> None:
        """Credentials and TLS settings: well-formed, and the password itself never in the spec."""
        if self.redis_password_env and not ENV_NAME.fullmatch(self.redis_password_env):
            # never echoed: a password typed here by mistake must not reach a log
            raise SpecError(
                "[store] redis_password_env must be the name of an environment variable (letters, "
                f"digits and _, not starting with a digit), got a value of {len(self.redis_password_env)} "
                "characters"
            )
        tls_files = [
            n for n in ("redis_ssl_ca_certs", "redis_ssl_certfile", "redis_ssl_keyfile") if getattr(self, n)
        ]
        if tls_files and not self.redis_ssl:
            raise SpecError(f"[store] {', '.join(tls_files)} needs redis_ssl = true")
        if bool(self.redis_ssl_certfile) != bool(self.redis_ssl_keyfile):
            raise SpecError("[store] redis_ssl_certfile and redis_ssl_keyfile go together")


@dataclass(frozen=True)
class CanarySection:
    """``[access.canary]``: how ``recserve canary`` rolls the ``canary`` variant out, and when it goes back.

    Stages: a shadow stage (``shadow_fraction`` of live requests mirrored to the canary; skipped
    at 0), then the live ``steps`` (the canary's share of live requests, in percent). A stage
    ends after ``dwell_s`` once the canary served ``min_requests`` in it. Every ``period_s`` the
    canary is compared with stable over the stage so far; crossing a threshold rolls it back.
    """

    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)  # the canary's live share, percent
    shadow_fraction: float = 0.1  # mirrored share of the shadow stage; 0: no shadow stage
    dwell_s: float = 60.0  # least time per stage
    min_requests: int = 200  # least canary requests per stage (live or mirrored)
    period_s: float = 1.0  # the controller's period: one comparison and decision each
    min_judged: int = 50  # requests (and scored rows) each variant needs before a comparison counts
    settle_s: float = 5.0  # latency is compared from this far into a stage (a new canary warms up)
    max_error_rate_increase: float = 0.01  # canary's failed share minus stable's
    max_p99_ratio: float = 1.5  # canary's p99 through the proxy over stable's
    p99_slack_ms: float = 5.0  # p99 differences below this never count (timer noise at low latency)
    max_psi: float = 0.2  # population stability index of the served probability vs stable's
    mean_ratio: tuple[float, ...] = (0.8, 1.25)  # [low, high] of canary's mean probability / stable's
    metrics_port: int = 9902  # the controller's /metrics (recserve_access_*), on 127.0.0.1

    def check(self) -> None:
        """Raise :class:`SpecError` on steps that do not rise to 100 or on bad thresholds."""
        steps = self.steps
        if not steps or any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(set(steps)):
            raise SpecError(f"[access.canary] steps must rise within (0, 100], got {list(steps)}")
        if steps[-1] != 100:
            raise SpecError(f"[access.canary] steps must end at 100, got {list(steps)}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise SpecError(f"[access.canary] shadow_fraction must lie in 0..1, got {self.shadow_fraction}")
        if min(self.dwell_s, self.settle_s, self.p99_slack_ms) < 0 or self.period_s <= 0:
            raise SpecError("[access.canary] dwell_s, settle_s and p99_slack_ms must be >= 0, period_s > 0")
        if min(self.min_requests, self.min_judged) < 1:
            raise SpecError("[access.canary] min_requests and min_judged must be >= 1")
        if self.max_error_rate_increase < 0 or self.max_p99_ratio < 1 or self.max_psi <= 0:
            raise SpecError(
                "[access.canary] needs max_error_rate_increase >= 0, max_p99_ratio >= 1, max_psi > 0"
            )
        low_high = self.mean_ratio
        if len(low_high) != 2 or not 0 < low_high[0] <= 1 <= low_high[1]:
            raise SpecError(f"[access.canary] mean_ratio must be [low <= 1, high >= 1], got {list(low_high)}")
        if not 0 < self.metrics_port < 65536:
            raise SpecError(f"[access.canary] metrics_port must lie in 1..65535, got {self.metrics_port}")


#: keys (per section) and the canary variant under their former names, read as their names
FORMER_KEYS = {"serving": {"queue_profiles": "queue_policies"}, "access": {"queue_profile": "queue_policy"}}
FORMER_VARIANT_NAMES = {"candidate": "canary"}


def current_names(where: str, raw: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """Section ``where`` as written, with former key names (and variant names) read as the current ones.

    A key written under both names keeps the current one.
    """
    renamed = FORMER_KEYS.get(where, {})
    out = {renamed.get(k, k): v for k, v in raw.items() if k not in renamed or renamed[k] not in raw}
    if where == "access":
        if isinstance(out.get("weights"), dict):
            out["weights"] = {FORMER_VARIANT_NAMES.get(k, k): v for k, v in out["weights"].items()}
        if isinstance(out.get("shadow_variant"), str):
            out["shadow_variant"] = FORMER_VARIANT_NAMES.get(out["shadow_variant"], out["shadow_variant"])
    return out


@dataclass(frozen=True)
class AccessSection:
    """``[access]``: the Envoy proxy that ``recserve access`` starts in front of the variants' servers.

    A variant is one tritonserver over its own repository (``stable``, ``canary``). The proxy's
    settings are not part of the model: the section is left out of what served models receive, so
    editing it never forces a rebuild.
    """

    host: str = "127.0.0.1"  # address of the public listeners (the admin port is always 127.0.0.1)
    grpc_port: int = 8001  # public gRPC port on the proxy; the tritonservers get free loopback ports
    http_port: int = 8000  # public HTTP port on the proxy
    admin_port: int = 9901  # Envoy's admin API (/runtime_modify, /stats), loopback only
    weights: dict[str, int] = field(default_factory=lambda: {"stable": 100, "canary": 0})
    max_requests: int = 4  # in flight per replica and protocol; over it: UNAVAILABLE / 503 at once
    shadow_variant: str = "canary"  # gets mirrored copies of live requests (responses discarded)
    shadow_fraction: float = 0.0  # share of live requests mirrored, 0..1
    shadow_max_requests: int = 2  # mirrored copies in flight per replica; over it a copy is dropped
    request_timeout_s: float = 30.0  # per request through the proxy
    # Triton's queues behind the proxy: "unbounded" (no queue policy: the proxy is the admission
    # gate), "default" ([serving.queue]) or a [serving.queue_policies] name
    queue_policy: str = "unbounded"
    workers: int = 1  # Envoy worker threads
    # tritonservers per variant; with more than one, a dead one is ejected (outlier detection) and a
    # request that could not reach it is sent to another
    replicas: int = 1
    canary: CanarySection = field(default_factory=CanarySection)  # ``[access.canary]``

    def check(self) -> None:
        """Raise :class:`SpecError` on bad ports, weights, caps or fractions.

        A ``queue_policy`` name is checked by ``recserve access`` when it starts the servers: a spec
        without that profile is fine as long as no proxy is started from it.
        """
        ports = (self.grpc_port, self.http_port, self.admin_port)
        if any(not 0 < port < 65536 for port in ports) or len(set(ports)) != len(ports):
            raise SpecError(f"[access] needs three different ports in 1..65535, got {ports}")
        bad_names = [name for name in self.weights if not name.isidentifier() or name != name.lower()]
        if bad_names:
            raise SpecError(
                f"[access] weights: variant names must be lower-case identifiers, got {bad_names}"
            )
        if "stable" not in self.weights:
            raise SpecError("[access] weights needs the variant 'stable'")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise SpecError(f"[access] weights must be >= 0 with a positive sum, got {self.weights}")
        if min(self.max_requests, self.shadow_max_requests, self.workers, self.replicas) < 1:
            raise SpecError("[access] max_requests, shadow_max_requests, workers and replicas must be >= 1")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise SpecError(f"[access] shadow_fraction must lie in 0..1, got {self.shadow_fraction}")
        if self.shadow_fraction > 0 and self.shadow_variant not in self.weights:
            raise SpecError(
                f"[access] shadow_variant {self.shadow_variant!r} is not one of the weights' variants"
            )
        if self.request_timeout_s <= 0:
            raise SpecError(f"[access] request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.canary.metrics_port in ports:
            raise SpecError(f"[access.canary] metrics_port {self.canary.metrics_port} is a proxy port")
        self.canary.check()


@dataclass(frozen=True)
class InputsSection:
    """``[inputs]``: columns of the user's files that are not features."""

    label: str = "label"  # the click label of training and verify files
    ignore: tuple[str, ...] = ()  # accepted in files and ignored (e.g. a row id)
    # a categorical column naming the user: `recserve predict` sends a user's consecutive rows
    # that share their sequences as one candidate list
    user: str = ""
    # columns describing the user (names may expand): a candidate list carries them once per user
    profile: tuple[str, ...] = ()


#: Value types of a categorical column as clients send it (all travel as strings in one BYTES tensor).
