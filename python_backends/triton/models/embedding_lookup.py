"""Triton model ``embedding_lookup``: keys to vectors through the tiered store.

See recserve.backends.store.tiered.
"""

import time

from recserve import wire
from recserve.backends.lookup import EmbeddingLookup
from recserve.backends.store.served import ServedStore
from recserve.backends.triton.adapter import (
    MetricsPublisher,
    ModelContext,
    execute_checked_merged,
    instance_device,
)

INPUTS = (wire.SPARSE_KEYS, wire.TARGET_KEY, wire.HISTORY_KEYS)
METRICS_INTERVAL_S = 1.0  # each metric update is a message to the server: publish at most this often


class TritonPythonModel:
    """Looks up the keys of a whole dynamic batch at once; online updates are applied in the background."""

    def initialize(self, args: dict) -> None:
        """Map and verify the shards, apply published updates, warm the hot cache up.

        The hot cache is on the device when the spec sets ``l1_device``.
        """
        context = ModelContext.from_args(args)
        self.served = ServedStore.open(context.spec, context.version_dir)
        self.lookup = EmbeddingLookup.for_instance(
            context.spec,
            self.served,
            context.parameters.get(wire.L1_DEVICE_PARAMETER, ""),
            instance_device(args),
        )
        self.metrics = MetricsPublisher()
        # every declared series exists (at 0) before the first request
        self.metrics.publish(self.served.samples())
        self.published_at = 0.0

    def execute(self, requests: list) -> list:
        """Vectors for every valid request; metrics published at most once a second."""
        responses = execute_checked_merged(
            requests,
            INPUTS,
            self.lookup.check,
            self.lookup.lookup,
            ragged_outputs={wire.HISTORY_EMBEDDINGS: wire.HISTORY_KEYS},
        )
        if time.monotonic() - self.published_at >= METRICS_INTERVAL_S:
            self.published_at = time.monotonic()
            self.metrics.publish(self.served.samples())
        return responses

    def is_ready(self) -> bool:
        """Readiness (Python backends that support it): the local tiers are mapped."""
        return self.served.store.healthy()

    def finalize(self) -> None:
        """Stop the upkeep thread; publish the last counts."""
        self.served.close()
        self.metrics.publish(self.served.samples())
