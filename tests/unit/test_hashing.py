import numpy as np

from recserve.backends.features.hashing import fnv1a64, keys_for, missing_key, splitmix64, table_salt


def test_known_values_do_not_change():
    # Changing these breaks every published table: keys are part of the artifact format.
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF


def test_keys_are_deterministic_and_separate_tables():
    values = np.arange(1000, dtype=np.uint64)
    a = keys_for(values, table_salt("recserve", "C1"))
    assert a.dtype == np.int64
    assert np.array_equal(a, keys_for(values, table_salt("recserve", "C1")))
    b = keys_for(values, table_salt("recserve", "C2"))
    assert len(np.intersect1d(a, b)) == 0
    assert len(np.unique(a)) == 1000


def test_missing_keys_differ_per_feature():
    assert missing_key("recserve", "C1") != missing_key("recserve", "C2")


def test_splitmix64_of_an_array_matches_it_value_by_value_and_leaves_the_input_alone():
    import warnings

    values = np.array([[0, 1, 2**63, 2**64 - 1], [12345, 7, 99, 2**40]], dtype=np.uint64)
    before = values.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wrap-around is the hash, never a warning
        hashed = splitmix64(values)
        one_by_one = [int(splitmix64(np.uint64(v))) for v in values.reshape(-1).tolist()]
        zero_dim = splitmix64(np.array(values[0, 3]))
    assert np.array_equal(values, before)
    assert hashed.shape == values.shape and hashed.reshape(-1).tolist() == one_by_one
    assert int(zero_dim) == one_by_one[3]
