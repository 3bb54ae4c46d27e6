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
