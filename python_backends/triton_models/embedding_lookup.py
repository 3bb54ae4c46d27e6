"""Triton model ``embedding_lookup``: keys to vectors (see recserve.backends.lookup)."""

import time

import triton_python_backend_utils as pb_utils

from recserve.backends import tensors
from recserve.backends.lookup import EmbeddingLookup
from recserve.backends.store import EmbeddingStore
from recserve.backends.triton_adapter import ModelContext, execute_merged

INPUTS = (tensors.SPARSE_KEYS, tensors.TARGET_KEY, tensors.HISTORY_KEYS)
METRICS_INTERVAL_S = 1.0  # each increment is a message to the server: publish at most this often


class TritonPythonModel:
    """Looks up the keys of a whole dynamic batch at once; counts unknown keys per table."""

    def initialize(self, args: dict) -> None:
        """Load and verify the tables of this model version."""
        context = ModelContext.from_args(args)
        self.lookup = EmbeddingLookup(context.spec, EmbeddingStore.load(context.version_dir, context.spec))
        self.metric_family = pb_utils.MetricFamily(
            name="recserve_embedding_keys_total",
            description="Keys looked up per table and outcome (hit, or unknown: served the default vector)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.metrics = {
            (name, outcome): self.metric_family.Metric(labels={"table": name, "outcome": outcome})
            for name in self.lookup.store.tables
            for outcome in ("hit", "unknown")
        }
        self.reported = {name: (0, 0) for name in self.lookup.store.tables}
        self.published_at = 0.0

    def execute(self, requests: list) -> list:
        """Vectors for every valid request; per-table counters published at most once a second."""
        responses = execute_merged(
            requests,
            INPUTS,
            self.lookup.check,
            self.lookup.lookup,
            ragged_outputs={tensors.HISTORY_EMBEDDINGS: tensors.HISTORY_KEYS},
        )
        if time.monotonic() - self.published_at >= METRICS_INTERVAL_S:
            self.publish_metrics()
        return responses

    def publish_metrics(self) -> None:
        """Add the counts since the last publication to the Triton counters."""
        self.published_at = time.monotonic()
        for name, table in self.lookup.store.tables.items():
            lookups, unknown = self.reported[name]
            self.metrics[(name, "hit")].increment((table.stats.lookups - table.stats.unknown) - (lookups - unknown))
            self.metrics[(name, "unknown")].increment(table.stats.unknown - unknown)
            self.reported[name] = (table.stats.lookups, table.stats.unknown)

    def finalize(self) -> None:
        """Publish the last counts before the model unloads."""
        self.publish_metrics()
