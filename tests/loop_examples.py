"""Joined examples for the learner's tests: rows of the spec's tables with labels, rates and served scores."""

import numpy as np

from recserve.backends.features.hashing import missing_key
from recserve.loop.tables import examples_table


def examples(spec, tables, labels, rates=None, seed=0, served=None, versions=None, dense_version=None):
    versions = versions or {}
    rng = np.random.default_rng(seed)
    rows = []
    for i, label in enumerate(labels):
        keys = [int(rng.choice(tables[f.table].keys)) for f in spec.categorical.features]
        for feature in spec.categorical.multi_hot:  # i % (max_length + 1) values, then padding
            count = i % (feature.max_length + 1)
            keys += [int(k) for k in rng.choice(tables[feature.table].keys, count)]
            keys += [int(missing_key(spec.hashing.namespace, feature.name))] * (feature.max_length - count)
        keys += [int(rng.choice(tables[t.table].keys)) for t in spec.targets]
        history = lengths = None
        if (
            spec.sequences and i % 2
        ):  # each sequence's positions in turn: 3 of the first group's, 4 of the next...
            lengths = [3 + g for g, group in enumerate(spec.attention_groups) for _ in group.sequences]
            sequences = [s for group in spec.attention_groups for s in group.sequences]
            history = [
                int(k)
                for s, n in zip(sequences, lengths, strict=True)
                for k in rng.choice(tables[s.table].keys, n)
            ]
        rows.append(
            {
                "request_id": f"r{i}", "row": 0, "time": 1.0, "variant": "", "label": label, "late": False,
                "sample_rate": 1.0 if rates is None else rates[i], "labelled_at": 2.0, "keys": keys,
                "dense": [0.1] * len(spec.normalized_columns), "history": history, "history_lengths": lengths,
                "embedding_version": [versions.get(t, 1) for t in spec.table_names],
                "score": served[i] if isinstance(served, list) else served, "dense_version": dense_version,
            }
        )  # fmt: skip
    return examples_table(rows)
