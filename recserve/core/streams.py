"""The loop's Redis stream keys: one name per kind and shard, and the shard of a request id.

A request's records and its events go to the shard of its id (a hash of the id alone), so every
record of a request, and every event about it, lies in one stream of each kind. A key is
``<prefix>:<kind>:{<shard>}``: the braces are a Redis Cluster hash tag, so the shards of a kind
spread over the cluster's slots while the features, scores and events of one shard share a slot.
"""

from __future__ import annotations

import hashlib


def stream_shard(request_id: str, shards: int) -> int:
    """The shard (0 .. ``shards`` - 1) of ``request_id``: the same in every process."""
    if shards <= 1:
        return 0
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"rs-shard").digest()
    return int.from_bytes(digest, "big") % shards


def stream_key(prefix: str, kind: str, shard: int) -> str:
    """The stream holding ``kind`` records (or events) of ``shard``."""
    return f"{prefix}:{kind}:{{{shard}}}"


def stream_keys(prefix: str, kind: str, shards: int) -> list[str]:
    """Every shard's stream of ``kind``, shard by shard."""
    return [stream_key(prefix, kind, shard) for shard in range(shards)]
