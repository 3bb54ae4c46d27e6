"""``[user_state]``: a near-line state per user, so long behaviour histories serve at today's latency.

Off by default: without the section (or with ``enabled = false``) requests and models are served
as they are today. See docs/design/user-state.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from recserve.core.sections.base import SpecError

#: Where the builder reads events: a file of JSON lines (the embedded default) or a Redis stream.
EVENT_LOG_KINDS = ("file", "redis")
#: Where states live: a SQLite file (the embedded default) or the Redis Cluster of ``[store]``.
STATE_STORES = ("local", "redis")


@dataclass(frozen=True)
class UserStateSection:
    """``[user_state]``: the per-user state, its builder and the online merge."""

    enabled: bool = False
    tokens: int = 192  # T: the most tokens of a stored state (the dense step gets tokens + tail)
    exact_tokens: int = 160  # clustered mode: the newest distinct items kept exactly; the rest grouped
    group_radius: float = 0.5  # clustered mode: a group's members lie this close to its representative
    max_events: int = 4096  # the builder's window of newest events per user
    tail: int = 64  # the most events a request carries as its real-time tail
    # the sequence buckets gain tokens + bucket_margin (when below the largest), so a state merged
    # with up to this many newer events is served at its own width, not the next bucket's (0: none)
    bucket_margin: int = 16
    ttl_s: float = 7 * 86400.0  # a state lives this long after its last write
    store: str = "local"  # "local" (SQLite file) or "redis" ([store] redis_nodes)
    local_path: str = "user_states.sqlite"  # the local store's file (relative: to the working folder)
    event_log: str = "file"  # "file" (JSON lines) or "redis" (a stream on [store] redis_nodes)
    event_path: str = "user_events.jsonl"  # the file log
    event_stream: str = "recserve:user_events"  # the Redis stream's key
    debounce_ms: float = 200.0  # a user is rebuilt at most once per this long (events batch up)
    deadline_ms: float = 5.0  # the lookup step's batched state read
    cache_users: int = 10_000  # the lookup step's local cache of fetched states (0: none)
    # a cached state is used this long after its fetch; up to twice as long it is still served while
    # a thread of the step reads it again. The merge is exact with any cached state that leaves the
    # row's tail no gap (a gap fetches again), so this bounds only how late an erased, regrouped or
    # rebuilt state reaches the step
    cache_ttl_ms: float = 10_000.0
    # a new item table or dense version regroups the clustered states when it moved their items'
    # keys by more than this (median relative move since their last grouping; 0: on any change)
    regroup_drift: float = 0.05

    def check(self, longest_bucket: int) -> None:
        """Raise :class:`SpecError` on a budget that does not fit the sequence buckets, or bad settings.

        Args:
            longest_bucket: the largest ``[serving] sequence_buckets``: tokens and tail share it.
        """
        if not self.enabled:
            return
        if not 1 <= self.exact_tokens < self.tokens:
            raise SpecError(
                f"[user_state] needs 1 <= exact_tokens < tokens, got {self.exact_tokens} and {self.tokens}"
            )
        if self.tail < 1 or self.tokens + self.tail > longest_bucket:
            raise SpecError(
                f"[user_state] tokens + tail ({self.tokens} + {self.tail}) must fit the largest sequence "
                f"bucket {longest_bucket}, with tail >= 1"
            )
        if self.bucket_margin < 0:
            raise SpecError(f"[user_state] bucket_margin must be >= 0, got {self.bucket_margin}")
        if self.max_events < self.tokens:
            raise SpecError(f"[user_state] max_events {self.max_events} must be >= tokens {self.tokens}")
        if self.store not in STATE_STORES or self.event_log not in EVENT_LOG_KINDS:
            raise SpecError(
                f"[user_state] store must be one of {STATE_STORES} and event_log one of "
                f"{EVENT_LOG_KINDS}, got {self.store!r} and {self.event_log!r}"
            )
        if min(self.ttl_s, self.deadline_ms, self.group_radius) <= 0 or self.debounce_ms < 0:
            raise SpecError("[user_state] ttl_s, deadline_ms and group_radius must be > 0, debounce_ms >= 0")
        if self.cache_users < 0 or self.cache_ttl_ms < 0 or not self.regroup_drift >= 0:
            raise SpecError("[user_state] cache_users, cache_ttl_ms and regroup_drift must be >= 0")

    def state_buckets(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """``buckets`` (sorted) with the states' own bucket, ``tokens + bucket_margin``.

        Added when it is new and below the largest; unchanged when off or with no margin.
        """
        width = self.tokens + self.bucket_margin
        if not self.enabled or not self.bucket_margin or width >= buckets[-1] or width in buckets:
            return buckets
        return tuple(sorted({*buckets, width}))
