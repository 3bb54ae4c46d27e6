"""One user's candidates as rows and as a candidate list, and a store holding every key they look up."""

from __future__ import annotations

import numpy as np

from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.store.table_data import TableArrays
from recserve.backends.store.tiered import TieredStore
from recserve.build.synthetic import generate
from recserve.core.candidate_lists import candidate_list_inputs, with_profiles_of
from recserve.core.names import BYTES_WIRE, CANDIDATE_PREFIX
from tests.store_tables import spec_store


def user_rows(spec, users=2, candidates=3, seed=4, form=BYTES_WIRE):
    """Row-form inputs where each user's candidates carry that user's sequences and profile, and the
    same as lists.
    """
    inputs = generate(spec, users * candidates, seed).to_wire(spec, form)
    first = np.repeat(np.arange(users) * candidates, candidates)  # each row's user's first row
    wire = spec.wire_form(form)
    sequences = [t.name for t in wire.user_inputs if t.name in inputs and t.name not in wire.profile_lists]
    rows = {name: (array[first] if name in sequences else array) for name, array in inputs.items()}
    rows = with_profiles_of(spec, rows, first, form)
    each = [
        candidate_list_inputs(
            spec, {n: a[u * candidates : (u + 1) * candidates] for n, a in rows.items()}, form
        )
        for u in range(users)
    ]
    lists = {name: rows[name][::candidates] for name in sequences}
    names = {t.name for t in wire.candidate_inputs}
    for name in each[0]:
        lists[CANDIDATE_PREFIX + name if name in names else name] = np.concatenate([e[name] for e in each])
    return rows, lists


def served_store(spec, rows):
    """A store holding every key the rows look up, with random vectors (so equality means something)."""
    _, placeholder = spec_store(spec)
    step = FeaturesToEmbeddings(spec, EmbeddingLookup(spec, placeholder))
    keys, table_ids = step.lookup.keys_and_tables(step.transform.transform(rows))
    rng = np.random.default_rng(3)
    tables = {}
    for index, name in enumerate(placeholder.table_names):
        unique = np.unique(keys[table_ids == index])
        vectors = rng.normal(size=(len(unique), spec.model.embedding_dim)).astype(np.float32)
        tables[name] = TableArrays(name, unique, vectors, np.zeros(spec.model.embedding_dim, np.float32))
    return TieredStore.from_tables(tables)
