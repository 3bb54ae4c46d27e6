"""The history columns of the features records: the compiled loop gives what the numpy path gives."""

import numpy as np
import pytest

from recserve.backends.request_log import histories
from recserve.backends.request_log.histories import history_columns, numpy_history_columns

pytestmark = pytest.mark.skipif(histories._loop() is None, reason="the _histories extension was not built")


def requests(rng, count, sequences):
    """``count`` requests: row-layout ones (an owner per row) and lists (one owner), with repeats."""
    keys, splits, counts = [], [], []
    for _ in range(count):
        rows = int(rng.integers(1, 9))
        owners = rows if rng.random() < 0.5 else 1
        pool = [
            (rng.integers(0, 4, sequences).astype(np.int32), rng.integers(0, 5, 8))
            for _ in range(int(rng.integers(1, 4)))
        ]
        picked = [pool[int(rng.integers(len(pool)))] for _ in range(owners)]
        splits.append(np.array([split for split, _ in picked], np.int32).reshape(owners, sequences))
        keys.append(np.concatenate([values[: int(split.sum())] for split, values in picked]).astype(np.int64))
        counts.append(rows)
    return keys, splits, np.array(counts)


def numpy_of(keys, splits, counts):
    owners = np.array([s.shape[0] for s in splits])
    return numpy_history_columns(np.concatenate(keys), np.concatenate(splits), counts, owners)


@pytest.mark.parametrize("sequences", [1, 2])
@pytest.mark.parametrize("seed", range(20))
def test_the_compiled_columns_are_the_numpy_columns(seed, sequences):
    keys, splits, counts = requests(np.random.default_rng(seed), 6, sequences)
    compiled, expected = history_columns(keys, splits, counts), numpy_of(keys, splits, counts)
    np.testing.assert_array_equal(compiled[0], expected[0])
    assert compiled[1].to_pylist() == expected[1].to_pylist()
    assert compiled[2].to_pylist() == expected[2].to_pylist()


def test_equal_digests_of_unequal_histories_are_written_apart():
    """The digest is a sum (order-blind): [1, 2] and [2, 1] share it; the check keeps them apart."""
    keys = [np.array([1, 2, 2, 1, 1, 2, 2, 1], np.int64)]
    splits = [np.array([[2], [2], [2], [2]], np.int32)]
    row, column, lengths = history_columns(keys, splits, np.array([4]))
    assert row.tolist() == [0, 1, 0, 3]  # the last matches only the first of its digest, as numpy's
    assert row.tolist() == numpy_of(keys, splits, np.array([4]))[0].tolist()
    assert column.to_pylist() == [[1, 2], [2, 1], None, [2, 1]]
    assert lengths.to_pylist() == [[2], [2], None, [2]]


def test_a_list_writes_its_users_history_on_its_first_candidate_only():
    keys, splits = [np.array([7, 8], np.int64), np.array([5], np.int64)], [np.array([[2]], np.int32)] * 2
    splits[1] = np.array([[1]], np.int32)
    row, column, _ = history_columns(keys, splits, np.array([3, 2]))
    assert row.tolist() == [0, 0, 0, 0, 0]
    assert column.to_pylist() == [[7, 8], None, None, [5], None]


@pytest.mark.parametrize(
    ("keys", "split", "counts"),
    [
        ([1, 2, 3], [[2]], [1]),  # the lengths do not cover the keys
        ([1, 2], [[-1], [3]], [2]),
        ([], np.zeros((0, 1)), [2]),  # rows without an owner
    ],
)
def test_columns_that_do_not_fit_together_are_refused_before_the_loop_reads_them(keys, split, counts):
    with pytest.raises(ValueError, match="history"):
        history_columns([np.array(keys, np.int64)], [np.array(split, np.int32)], np.array(counts))
