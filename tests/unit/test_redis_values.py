"""Redis is untrusted storage: values read back from L3 are checked key by key, settings never leak.

The decoding is pure logic (an MGET reply in, rows and a refused list out); the same garbage written
into a real Redis Cluster is served in ``tests/integration/test_redis_tier.py``.
"""

import copy
import math
import time

import numpy as np
import pytest

from recserve.backends.store.redis_connect import (
    L3ConnectError,
    auth_reason,
    connection_settings,
    refused_credentials,
)
from recserve.backends.store.redis_values import decode_rows, describe_value
from recserve.core.sections.base import SpecError
from recserve.core.sections.serving import StoreSection
from recserve.core.spec.parse import parse_spec
from tests.unit.helpers import ctr_spec_document

DIM = 4


def row(*values: float) -> bytes:
    return np.array(values, np.float32).tobytes()


GOOD = row(1, 2, 3, 4)
#: Every kind of garbage a writer can leave under a key, with what decode_rows must make of it.
GARBAGE = {
    "short": row(1, 2, 3),
    "long": row(1, 2, 3, 4, 5),
    "empty": b"",
    "odd length": GOOD[:-1],
    "nan": row(1, math.nan, 3, 4),
    "inf": row(1, 2, -math.inf, 4),
    "huge": row(1, 2, 3e38, 4),  # finite, but Inf in the first product it enters: the score's NaN
    "over the bound": row(1, -2e6, 3, 4),
    "text": "a string, not bytes",
    "number": 12,
    "list": [GOOD],
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_bad_value_is_refused_for_its_own_key_alone(kind):
    values = [GOOD, GARBAGE[kind], None, row(5, 6, 7, 8)]
    vectors = np.full((4, DIM), -1.0, np.float32)
    found, refused = decode_rows(values, vectors)
    assert found.tolist() == [True, False, False, True]
    assert refused.tolist() == [1]  # the absent key (None) is not a refusal: it is simply not in L3
    assert vectors[0].tolist() == [1, 2, 3, 4] and vectors[3].tolist() == [5, 6, 7, 8]
    assert (vectors[1:3] == -1).all()  # refused and absent rows are left to the store's defaults


def test_every_kind_of_garbage_in_one_batch_leaves_the_good_rows_exact():
    rng = np.random.default_rng(0)
    good = rng.normal(size=(64, DIM)).astype(np.float32)
    values: list = [r.tobytes() for r in good]
    bad_at = list(range(3, 64, 5))[: len(GARBAGE)]
    for at, kind in zip(bad_at, sorted(GARBAGE), strict=True):
        values[at] = GARBAGE[kind]
    vectors = np.zeros((64, DIM), np.float32)
    found, refused = decode_rows(values, vectors)
    assert refused.tolist() == bad_at
    keep = np.setdiff1d(np.arange(64), bad_at)
    assert found[keep].all() and not found[bad_at].any()
    assert np.array_equal(vectors[keep], good[keep]) and not vectors[bad_at].any()


def test_rows_are_checked_against_each_keys_table_width():
    vectors = np.full((5, DIM), -1.0, np.float32)
    values = [row(1, 2), row(1, 2), row(1, 2, 3, 4), row(9, 9, 9), row(1, 2, 3, 4, 5)]
    widths = np.array([2, 4, 2, 0, 0])  # 0: the table is not known (the L1 rebuild): any width up to DIM
    found, refused = decode_rows(values, vectors, widths)
    assert found.tolist() == [True, False, False, True, False]
    assert refused.tolist() == [1, 2, 4]
    assert vectors[0].tolist() == [1, 2, 0, 0] and vectors[3].tolist() == [9, 9, 9, 0]
    assert (vectors[[1, 2, 4]] == -1).all()


def test_a_narrow_row_holding_nan_is_refused_and_its_neighbours_kept():
    vectors = np.zeros((3, DIM), np.float32)
    values = [row(1, 2), row(math.nan, 2), row(3, 4, 5, 6)]
    found, refused = decode_rows(values, vectors, np.array([2, 2, 4]))
    assert found.tolist() == [True, False, True] and refused.tolist() == [1]
    assert vectors.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [3, 4, 5, 6]]


def test_values_at_the_bound_are_served_and_just_over_it_refused():
    vectors = np.zeros((4, DIM), np.float32)
    values = [row(1e6, -1e6, 0, 0), row(0, 0, 0, 1.0001e6), row(1e6, 1e6), row(-1.0001e6, 0)]
    found, refused = decode_rows(values, vectors, np.array([4, 4, 2, 2]))
    assert found.tolist() == [True, False, True, False] and refused.tolist() == [1, 3]
    assert vectors[0].tolist() == [1e6, -1e6, 0, 0] and vectors[2].tolist() == [1e6, 1e6, 0, 0]


def test_a_reply_of_the_wrong_size_refuses_every_key():
    vectors = np.zeros((3, DIM), np.float32)
    found, refused = decode_rows([GOOD, GOOD], vectors)
    assert not found.any() and refused.tolist() == [0, 1, 2] and not vectors.any()


def test_a_well_formed_batch_costs_no_python_per_key():
    """A 4,096-key batch decodes in well under 2 µs a key (a Python loop per key costs more)."""
    rng = np.random.default_rng(1)
    values = [r.tobytes() for r in rng.normal(size=(4096, 64)).astype(np.float32)]
    vectors = np.zeros((4096, 64), np.float32)
    best = min(_timed(lambda: decode_rows(values, vectors)) for _ in range(5))
    assert best / 4096 < 2e-6, f"{best / 4096 * 1e9:.0f} ns a key"


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_the_log_describes_a_refused_value_without_echoing_it():
    assert (
        describe_value(row(1, math.nan)) == "8 bytes holding NaN or Inf, or a value over 1e+06 in magnitude"
    )
    assert describe_value(row(1, 3e38)).startswith("8 bytes holding NaN or Inf, or a value over")
    assert describe_value(b"\x00" * 5).startswith("5 bytes, not the key's row of float32")
    text = describe_value("x" * 100_000)
    assert text.startswith("a str, not bytes") and len(text) < 200 and "(100000 chars)" in text


# ---- [store] credentials and TLS ----------------------------------------------------------------


def store(**settings) -> StoreSection:
    return StoreSection(redis_nodes=("127.0.0.1:7000",), **settings)


def test_the_password_comes_from_the_named_environment_variable():
    settings = connection_settings(
        store(redis_password_env="L3_PASS", redis_username="ranker"), {"L3_PASS": "s3"}
    )
    assert settings == {"username": "ranker", "password": "s3"}
    assert connection_settings(store(), {}) == {}


@pytest.mark.parametrize("environ", [{}, {"L3_PASS": ""}])
def test_an_unset_password_variable_is_a_clear_error_naming_it(environ):
    with pytest.raises(L3ConnectError, match="redis_password_env names L3_PASS, which is not set"):
        connection_settings(store(redis_password_env="L3_PASS"), environ)


def test_tls_settings_map_onto_redis_py_arguments():
    settings = connection_settings(
        store(
            redis_ssl=True,
            redis_ssl_ca_certs="ca.pem",
            redis_ssl_certfile="client.pem",
            redis_ssl_keyfile="client.key",
        ),
        {},
    )
    assert settings == {
        "ssl": True,
        "ssl_ca_certs": "ca.pem",
        "ssl_certfile": "client.pem",
        "ssl_keyfile": "client.key",
        "ssl_check_hostname": True,
    }
    from redis.cluster import REDIS_ALLOWED_KEYS  # what RedisCluster passes on to each node's connection

    assert set(settings) <= set(REDIS_ALLOWED_KEYS)


def test_a_refused_login_is_told_apart_from_an_unreachable_cluster():
    preamble = "Redis Cluster cannot be connected. Please provide at least one reachable node: "
    wrong = Exception(preamble + "invalid username-password pair or user is disabled.")
    missing = Exception(
        preamble + "HELLO must be called with the client already authenticated, otherwise ..."
    )
    down = Exception(preamble + "Error 111 connecting to 127.0.0.1:7000. Connection refused.")
    assert refused_credentials(wrong) and refused_credentials(missing) and not refused_credentials(down)
    assert auth_reason(wrong) == "invalid username-password pair or user is disabled."


def _with_store(**settings):
    doc = copy.deepcopy(ctr_spec_document())
    doc["store"] = {**doc.get("store", {}), "redis_nodes": ["127.0.0.1:7000"], **settings}
    return doc


def test_the_spec_takes_the_redis_access_settings():
    spec = parse_spec(_with_store(redis_password_env="L3_PASS", redis_ssl=True, redis_ssl_ca_certs="ca.pem"))
    assert spec.store.redis_password_env == "L3_PASS" and spec.store.redis_ssl
    assert "L3_PASS" in spec.to_json()  # the variable's name travels to the servers, never a password


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"redis_password": "hunter2"}, "does not hold passwords; .* redis_password_env"),
        ({"redis_password_env": "hunter2!"}, "must be the name of an environment variable"),
        ({"redis_ssl_ca_certs": "ca.pem"}, "redis_ssl_ca_certs needs redis_ssl = true"),
        ({"redis_ssl": True, "redis_ssl_certfile": "c.pem"}, "redis_ssl_certfile and redis_ssl_keyfile go"),
        ({"redis_ssl": "yes"}, "store.redis_ssl must be true or false"),
    ],
)
def test_bad_redis_access_settings_are_refused_without_echoing_a_secret(settings, message):
    with pytest.raises(SpecError, match=message) as refused:
        parse_spec(_with_store(**settings))
    assert "hunter2" not in str(refused.value)
