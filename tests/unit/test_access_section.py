"""The spec's [access] section: defaults, typed parsing, refusals, and that it never touches the model."""

import copy

import pytest
import tomllib

from recserve.build.repository import spec_digest
from recserve.core.sections.base import SpecError, UnknownKeyError
from recserve.core.sections.serving import AccessSection
from recserve.core.spec.parse import load_spec, parse_spec, spec_path


def _doc(access: dict | None = None) -> dict:
    with open(spec_path("tiny"), "rb") as fh:
        doc = tomllib.load(fh)
    if access is not None:
        doc["access"] = copy.deepcopy(access)
    return doc


def test_the_bundled_specs_need_no_access_table():
    for name in ("ctr", "tiny"):
        spec = load_spec(name)
        assert spec.access == AccessSection()
        assert spec.access.weights == {"stable": 100, "canary": 0}
        assert spec.access.queue_policy == "unbounded" and spec.access.shadow_fraction == 0.0


def test_an_access_table_is_parsed_into_typed_fields():
    spec = parse_spec(
        _doc(
            {
                "grpc_port": 9101,
                "http_port": 9100,
                "admin_port": 9199,
                "weights": {"stable": 90, "canary": 10},
                "max_requests": 3,
                "shadow_fraction": 0.25,
                "shadow_max_requests": 1,
                "request_timeout_s": 5,
                "queue_policy": "latency_first",
            }
        )
    )
    access = spec.access
    assert (access.grpc_port, access.http_port, access.admin_port) == (9101, 9100, 9199)
    assert access.weights == {"stable": 90, "canary": 10}
    assert access.max_requests == 3 and access.shadow_max_requests == 1
    assert access.shadow_fraction == 0.25 and access.shadow_variant == "canary"
    assert isinstance(access.request_timeout_s, float) and access.request_timeout_s == 5.0
    assert access.host == "127.0.0.1" and access.workers == 1  # defaults kept


def test_the_canary_variants_former_name_is_read_as_canary():
    former = {"weights": {"stable": 70, "candidate": 30}, "shadow_variant": "candidate"}
    access = parse_spec(_doc(former)).access
    assert access.weights == {"stable": 70, "canary": 30} and access.shadow_variant == "canary"
    other = parse_spec(_doc({"weights": {"stable": 70, "blue": 30}, "shadow_variant": "blue"})).access
    assert other.weights == {"stable": 70, "blue": 30} and other.shadow_variant == "blue"


def test_queue_policies_former_key_names_are_read_as_their_names():
    doc = _doc({"queue_profile": "latency_first"})
    doc["serving"]["queue_profiles"] = doc["serving"].pop("queue_policies")
    spec = parse_spec(doc)
    assert spec.access.queue_policy == "latency_first"
    assert set(spec.serving.queue_policies) == {"throughput_first", "latency_first"}


def test_the_access_table_leaves_the_model_and_its_digest_alone():
    plain = parse_spec(_doc())
    proxied = parse_spec(_doc({"weights": {"stable": 50, "canary": 50}, "max_requests": 2}))
    assert "access" not in proxied.source
    assert proxied.to_json() == plain.to_json()
    assert spec_digest(proxied) == spec_digest(plain)  # editing [access] never forces a rebuild


def test_an_unknown_access_key_is_refused_with_its_name():
    with pytest.raises(UnknownKeyError, match=r"\[access\] has an unknown key 'max_request'") as caught:
        parse_spec(_doc({"max_request": 4}))
    assert "max_requests" in str(caught.value)  # the known keys are listed


def test_an_unknown_access_key_in_a_spec_file_names_its_line(tmp_path):
    text = spec_path("tiny").read_text() + "\n[access]\nmax_requests = 2\nweight = 3\n"
    path = tmp_path / "typo.toml"
    path.write_text(text)
    line = len(text.splitlines())
    with pytest.raises(SpecError, match=rf"typo\.toml, line {line}: \[access\] has an unknown key 'weight'"):
        load_spec(path)


@pytest.mark.parametrize(
    ("access", "message"),
    [
        ({"grpc_port": 8000}, "three different ports"),  # same as the default http_port
        ({"admin_port": 70000}, "three different ports"),
        ({"weights": {"canary": 100}}, "needs the variant 'stable'"),
        ({"weights": {"stable": 0, "canary": 0}}, "positive sum"),
        ({"weights": {"stable": 100, "canary": -1}}, "positive sum"),
        ({"weights": {"stable": 100, "Canary-1": 0}}, "lower-case identifiers"),
        ({"max_requests": 0}, "must be >= 1"),
        ({"shadow_max_requests": 0}, "must be >= 1"),
        ({"replicas": 0}, "must be >= 1"),
        ({"shadow_fraction": 1.5}, "0..1"),
        ({"weights": {"stable": 100}, "shadow_fraction": 0.1}, "shadow_variant 'canary'"),
        ({"request_timeout_s": 0}, "must be positive"),
        ({"max_requests": "4"}, "must be an integer"),
        ({"max_requests": 2.5}, "must be an integer"),
        ({"weights": [100, 0]}, "must be a table"),
        ({"canary": {"steps": [5, 1, 100]}}, "steps must rise"),
        ({"canary": {"steps": [1, 50]}}, "must end at 100"),
        ({"canary": {"steps": [0, 100]}}, "steps must rise"),
        ({"canary": {"shadow_fraction": -0.1}}, "0..1"),
        ({"canary": {"period_s": 0}}, "period_s > 0"),
        ({"canary": {"min_judged": 0}}, "must be >= 1"),
        ({"canary": {"max_p99_ratio": 0.9}}, "max_p99_ratio >= 1"),
        ({"canary": {"mean_ratio": [1.1, 1.2]}}, "mean_ratio"),
        ({"canary": {"metrics_port": 9901}}, "is a proxy port"),
        ({"canary": {"max_psi": "0.2"}}, "must be a number"),
    ],
)
def test_bad_access_values_are_refused(access, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_doc(access))


def test_the_canary_table_is_parsed_and_unknown_keys_are_refused():
    doc = _doc({"canary": {"steps": [0.5, 10, 100], "dwell_s": 5, "max_psi": 0.1}})
    canary = parse_spec(doc).access.canary
    assert canary.steps == (0.5, 10.0, 100.0) and canary.dwell_s == 5.0 and canary.max_psi == 0.1
    assert canary.shadow_fraction == 0.1 and canary.mean_ratio == (0.8, 1.25)  # defaults kept
    with pytest.raises(UnknownKeyError, match=r"\[access\.canary\] has an unknown key 'dwell'"):
        parse_spec(_doc({"canary": {"dwell": 5}}))


def test_a_stable_only_split_without_shadow_is_valid():
    assert parse_spec(_doc({"weights": {"stable": 1}})).access.weights == {"stable": 1}
