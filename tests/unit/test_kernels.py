"""The store's compiled loops give the numpy path's results bit for bit, on every tier."""

import numpy as np
import pytest

from recserve.backends.store import kernels
from recserve.backends.store.keyindex import KeyIndex
from recserve.backends.store.table_data import RowBlock, TableArrays
from recserve.backends.store.tiered import DEFAULT, DELTA, L1, L2, TIERS, TieredStore
from recserve.backends.store.user_state import merge as history_merge
from recserve.backends.store.user_state import tokens as user_tokens
from recserve.core.sections.serving import StoreSection

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


def _histories_batch(rng):
    """Rows with or without a state (any 64-bit ids, edge values included), tails of any length and
    sequence numbers that overlap, leave gaps or are older than the state."""
    vocabulary = random_keys(rng, int(rng.integers(1, 400)))
    rows, width = int(rng.integers(1, 40)), int(rng.integers(1, 130))
    states = []
    for _ in range(rows):
        if rng.random() < 0.2:
            states.append(None)
            continue
        items = rng.permutation(np.unique(rng.choice(vocabulary, int(rng.integers(0, 300))))).astype(np.int64)
        counts = rng.integers(1, 4, items.size) * rng.integers(1, 2**20, items.size) ** (rng.random() < 0.3)
        states.append(
            user_tokens.StoredTokens(
                user_tokens.Tokens(items, counts.astype(np.int64)), int(rng.integers(0, 200))
            )
        )
    keys = rng.choice(vocabulary, (rows, width)).astype(np.int64)
    mask = rng.integers(0, 2, (rows, width)).astype(np.float32)
    lengths = rng.integers(0, width + 1, rows).astype(np.int64)
    newest = lengths + rng.integers(0, 250, rows)
    return states, keys, mask, lengths, newest


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_merge_into_the_history_gives_the_numpy_one(seed, left):
    """Tokens, mask and log-weights of merged rows, the kept rows of rows without a state, the padding."""
    rng = np.random.default_rng(seed)
    states, keys, mask, lengths, newest = _histories_batch(rng)
    buckets = np.cumsum(rng.integers(1, 60, 30)) + int(rng.integers(-40, 10))  # some below the tails' width
    arguments = (
        states,
        keys,
        mask,
        lengths.tolist(),
        newest.tolist(),
        left,
        -5,
        history_merge.Buckets.of(buckets),
    )
    compiled = history_merge.merge_histories(*arguments)
    expected = history_merge.merge_numpy_histories(*arguments)
    for field in ("keys", "mask", "weights", "lengths", "gaps", "lag_events"):
        np.testing.assert_array_equal(getattr(compiled, field), getattr(expected, field), err_msg=field)


def test_the_compiled_merge_refuses_rows_outside_its_arrays():
    tokens = user_tokens.Tokens(np.arange(4, dtype=np.int64), np.ones(4, np.int64))
    table = np.array([[*user_tokens.StoredTokens(tokens, 0).entry, 3, 3]], np.int64)
    tails, mask = np.zeros((1, 3), np.int64), np.zeros((1, 3), np.float32)

    def merge(table, out_width=7, widths=(2, 5, 7)):
        return KERNELS.merge_histories(table, tails, mask, False, 0, np.array(widths, np.int64), out_width)

    merged = merge(table)
    assert merged[3].tolist() == [[4, 0, 3]]  # the tail's item 0 joins the state's: 4 tokens
    assert merged[0].shape == (1, 5) and merge(table, widths=(4, 9))[0].shape == (1, 4)
    for bad in (
        {"table": table + [0, 0, 0, 0, 1, 0]},
        {"table": table, "out_width": 6},
        {"table": table, "widths": (2, 3)},  # no width holds 4 tokens
    ):
        with pytest.raises(ValueError, match="wider than 3 or"):
            merge(**bad)
    with pytest.raises(ValueError, match="a table"):
        merge(table[:, :5].copy())


def test_an_arrays_address_is_its_data_pointer_writable_or_not():
    array = np.arange(12, dtype=np.int64)
    frozen = array.copy()
    frozen.flags.writeable = False
    for a in (array, array[3:], frozen, array[::2], np.zeros(0, np.int64), array.reshape(3, 4).T):
        assert kernels.address(a) == a.ctypes.data


def test_the_default_fill_refuses_rows_of_another_width_or_type():
    out, tiers = np.zeros((4, DIM), np.float32), np.zeros(4, np.int8)
    positions, table_ids = np.array([0, 2]), np.zeros(4, np.int16)
    KERNELS.fill_rows(positions, table_ids, np.ones((1, DIM), np.float32), out, tiers, DEFAULT)
    assert out[[0, 2]].min() == 1.0 and not out[[1, 3]].any() and tiers.tolist() == [DEFAULT, 0, DEFAULT, 0]
    with pytest.raises(ValueError):
        KERNELS.fill_rows(positions, table_ids, np.ones((1, DIM + 1), np.float32), out, tiers, DEFAULT)
    with pytest.raises(ValueError):
        KERNELS.fill_rows(positions, table_ids.astype(np.int32), np.ones((1, DIM), np.float32), out, tiers, 4)
    with pytest.raises(ValueError):  # a position past the output, or a table without a default row
        KERNELS.fill_rows(np.array([4]), table_ids, np.ones((1, DIM), np.float32), out, tiers, DEFAULT)
    with pytest.raises(ValueError):
        KERNELS.fill_rows(positions, table_ids + 1, np.ones((1, DIM), np.float32), out, tiers, DEFAULT)
    assert tiers.tolist() == [DEFAULT, 0, DEFAULT, 0]  # nothing written by a refused call
