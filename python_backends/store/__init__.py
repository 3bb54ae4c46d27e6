"""The sparse parameter store: L1 hot cache, delta rows, memory-mapped L2 shards, Redis L3, defaults."""
