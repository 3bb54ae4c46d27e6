"""The store's compiled loops give the numpy path's results bit for bit, on every tier."""

import numpy as np
import pytest

from recserve.backends.store import kernels, user_tokens
from recserve.backends.store.keyindex import KeyIndex
from recserve.backends.store.rows import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, DELTA, L1, L2, TIERS, TieredStore
from recserve.core.sections_serving import StoreSection

KERNELS = kernels.load()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="the compiled store kernels are not built (no C compiler at install)"
)

DIM = 8


def random_keys(rng, count):
    keys = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=count, dtype=np.int64))
    return rng.permutation(np.concatenate([keys, [0, -1, np.iinfo(np.int64).min]]))  # edge keys included


def tables_for(rng, keys, splits=(0.5, 0.8)):
    cut = (np.array(splits) * len(keys)).astype(int)
    parts = np.split(keys, cut)
    return {
        f"t{n}": TableArrays(
            f"t{n}",
            part,
            rng.normal(size=(len(part), DIM)).astype(np.float32),
            np.full(DIM, 100 + n, np.float32),
        )
        for n, part in enumerate(parts)
    }


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_index_probe_matches_find_including_overflow_and_absent_keys():
    rng = np.random.default_rng(3)
    keys = random_keys(rng, 20_000)
    index = KeyIndex.build(keys, buckets=1 << 10)  # 8,192 slots for 20,000 keys: most keys overflow
    assert index.overflow_keys.size > len(keys) // 2
    vectors = rng.normal(size=(len(keys), DIM)).astype(np.float32)
    probe = KERNELS.index_probe(index.buckets, index.overflow_keys, index.overflow_rows, vectors)
    queries = np.concatenate([keys, rng.integers(1, 1 << 62, size=2000, dtype=np.int64)])
    positions = rng.permutation(len(queries)).astype(np.int64)
    out = np.full((len(queries), DIM), np.nan, np.float32)
    tiers = np.full(len(queries), 99, np.int8)
    misses = np.empty(len(queries), np.int64)
    missed = probe.take(queries, positions, out, tiers, L2, misses)

    rows = index.find(queries)
    assert sorted(misses[:missed]) == sorted(np.flatnonzero(rows < 0))
    found = rows >= 0
    assert same_bits(out[found], vectors[rows[found]])
    assert (tiers[found] == L2).all() and (tiers[~found] == 99).all()
    assert np.isnan(out[~found]).all()  # rows not found are left alone


def test_float16_rows_widen_exactly_for_every_half_value():
    every_half = (
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(-1, 64)
    )  # subnormals, inf, nan, -0
    keys = np.arange(1, len(every_half) + 1, dtype=np.int64) * 7919
    index = KeyIndex.build(keys)
    probe = KERNELS.index_probe(index.buckets, index.overflow_keys, index.overflow_rows, every_half)
    out = np.empty((len(keys), 64), np.float32)
    tiers = np.empty(len(keys), np.int8)
    assert probe.take(keys, np.arange(len(keys)), out, tiers, L2, np.empty(len(keys), np.int64)) == 0
    assert same_bits(out, every_half.astype(np.float32))


def test_cache_probe_matches_the_numpy_slot_rule():
    rng = np.random.default_rng(4)
    store = TieredStore.from_tables(
        tables_for(rng, random_keys(rng, 5000)),
        options=StoreSection(cache_mib=(40 * (DIM * 4 + 16)) / (1 << 20)),
    )
    hot = np.concatenate([t.keys[:30] for t in store_tables(store)])
    store.refresh_cache(seed=hot)
    cache = store.snapshot.cache
    assert 0 < len(cache.keys) < len(hot)  # 40 slots for 90 hot keys: conflicts leave some out
    queries = np.concatenate([hot, rng.integers(1, 1 << 62, size=500, dtype=np.int64)])
    out = np.zeros((len(queries), DIM), np.float32)
    tiers = np.full(len(queries), DEFAULT, np.int8)
    misses = np.empty(len(queries), np.int64)
    missed = cache.probe.take(queries, out, tiers, L1, misses)
    hit = cache.slot_keys[store.snapshot.cache.slot_of(queries, len(cache.slot_keys))] == queries
    assert np.array_equal(misses[:missed], np.flatnonzero(~hit))
    assert hit.sum() == len(cache.keys) and (tiers[hit] == L1).all()


def store_tables(store):
    return [store.table_arrays(name) for name in store.table_names]


@pytest.mark.parametrize("float16", [False, True])
def test_lookup_is_identical_on_both_paths_across_every_tier(float16):
    rng = np.random.default_rng(5)
    tables = tables_for(rng, random_keys(rng, 30_000))
    dtypes = {"t1": "float16"} if float16 else {}  # two shards: one float32, one float16
    options = StoreSection(cache_mib=(2000 * (DIM * 4 + 16)) / (1 << 20))
    compiled = TieredStore.from_tables(tables, dtypes, options=options)
    numpy_path = TieredStore(list(compiled.tables.values()), compiled.shards, 1, options, compiled=False)
    assert compiled.compiled and not numpy_path.compiled

    names = sorted(tables)
    table_ids = rng.integers(0, len(names), size=40_000).astype(np.int16)
    known = np.array([rng.choice(tables[names[t]].keys) for t in table_ids[:30_000]])
    unknown = rng.integers(1, 1 << 62, size=10_000, dtype=np.int64)
    keys = np.concatenate([known, unknown])
    delta_keys = known[:3000:3]  # rows that an update rewrote
    delta = RowBlock.of(
        np.unique(delta_keys), rng.normal(size=(len(np.unique(delta_keys)), DIM)).astype(np.float32)
    )
    compiled.install({}, delta)
    compiled.refresh_cache(seed=keys[:5000])
    numpy_path.snapshot = compiled.snapshot  # the same L1 and delta rows

    got = compiled.lookup(keys, table_ids)
    want = numpy_path.lookup(keys, table_ids)
    assert same_bits(got.vectors, want.vectors)
    assert np.array_equal(got.tiers, want.tiers)
    assert {TIERS[t] for t in np.unique(got.tiers)} == {"l1", "delta", "l2", "default"}
    assert np.array_equal(compiled.stats.by_table_tier, numpy_path.stats.by_table_tier)
    assert (got.vectors[got.tiers == DEFAULT] >= 100).all() and (got.tiers[:30_000] != DEFAULT).all()
    assert (got.tiers[np.isin(keys, delta_keys)] != L2).all() and DELTA in got.tiers


def test_non_contiguous_or_wrong_dtype_buffers_are_refused():
    index = KeyIndex.build(np.arange(1, 100, dtype=np.int64))
    probe = KERNELS.index_probe(
        index.buckets, index.overflow_keys, index.overflow_rows, np.zeros((99, DIM), np.float32)
    )
    keys = np.arange(1, 200, dtype=np.int64)
    out, tiers, misses = np.empty((199, DIM), np.float32), np.empty(199, np.int8), np.empty(199, np.int64)
    with pytest.raises(ValueError, match="C-contiguous int64"):
        probe.take(keys[::2], np.arange(100), out, tiers, L2, misses)
    with pytest.raises(ValueError, match="C-contiguous int64"):
        probe.take(keys, np.arange(199, dtype=np.int32), out, tiers, L2, misses)


def test_the_numpy_path_can_be_forced(monkeypatch):
    monkeypatch.setenv("RECSERVE_STORE_KERNELS", "numpy")
    assert kernels.load.__wrapped__() is None
    monkeypatch.delenv("RECSERVE_STORE_KERNELS")
    assert isinstance(kernels.load.__wrapped__(), kernels.Kernels)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_user_state_merge_gives_the_numpy_merge(seed):
    """Any 64-bit item ids (edge values included), states of any size, tails with or without newer events."""
    rng = np.random.default_rng(seed)
    vocabulary = random_keys(rng, int(rng.integers(1, 400)))
    rows, width = int(rng.integers(1, 40)), int(rng.integers(1, 130))
    states = [np.unique(rng.choice(vocabulary, int(rng.integers(0, 300)))) for _ in range(rows)]
    sizes = np.array([s.size for s in states], np.int64)
    items = np.concatenate([rng.permutation(s) for s in states]).astype(np.int64)
    counts = rng.integers(1, 1000, items.size).astype(np.int64)
    tails = rng.choice(vocabulary, (rows, width)).astype(np.int64)
    ends = rng.integers(0, width + 1, rows).astype(np.int64)
    first = np.minimum(rng.integers(0, width + 1, rows), ends).astype(np.int64)
    arguments = (items, counts, np.cumsum(sizes) - sizes, sizes, tails, first, ends)
    compiled = KERNELS.merge_rows(*arguments)
    for got, expected in zip(compiled, user_tokens.merge_numpy(*arguments), strict=True):
        assert np.array_equal(got, expected)


def test_the_compiled_merge_refuses_spans_outside_their_arrays():
    items, counts = np.arange(4, dtype=np.int64), np.ones(4, np.int64)
    tails = np.zeros((1, 3), np.int64)
    one = np.array([1], np.int64)
    for starts, sizes, first, ends in [(one * 2, one * 3, one * 0, one), (one * 0, one, one * 0, one * 4)]:
        with pytest.raises(ValueError, match="outside its array"):
            KERNELS.merge_rows(items, counts, starts, sizes, tails, first, ends)


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_placement_of_merged_tokens_writes_what_numpy_writes(seed, left):
    rng = np.random.default_rng(50 + seed)
    history_rows, width = int(rng.integers(1, 20)), int(rng.integers(1, 70))
    rows = np.sort(rng.choice(history_rows, int(rng.integers(1, history_rows + 1)), replace=False))
    lengths = rng.integers(0, width + 1, rows.size).astype(np.int64)
    items = random_keys(rng, int(lengths.sum()))[: int(lengths.sum())]
    counts = rng.integers(1, 2**32, items.size).astype(np.int64)
    merged = user_tokens.MergedRows(lengths, items, counts, *(np.zeros(rows.size),) * 3)
    written = []
    for place in (
        lambda *a: KERNELS.place_tokens(items, counts, lengths, rows, left, *a),
        lambda *a: user_tokens.place_numpy(merged, rows, left, *a),
    ):
        shape = (history_rows, width)
        out = (np.full(shape, 7, np.int64), np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        place(*out)
        written.append(out)
    for got, expected in zip(*written, strict=True):
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="a row outside it"):
        KERNELS.place_tokens(items, counts, lengths, rows + history_rows, left, *written[0])
