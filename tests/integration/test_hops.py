"""``recserve lab hops`` on a real tritonserver: the echo ensembles serve, and cost less than the model."""

from recserve.perf.bench.hops import PACKED, format_report, run_hops


def test_the_echo_ensembles_serve_and_the_report_splits_the_time(spec, repository, tmp_path):
    summary = run_hops(spec, repository, tmp_path, requests=40, rounds=1)
    systems = summary["systems"]
    assert set(systems) == {spec.name, "echo_2_hops", "echo_3_hops", PACKED}
    served, floor = systems[spec.name], systems["echo_2_hops"]
    assert floor["p50_ms"] > 0, summary

    def compute_ms(system):  # the steps' own time, without the hops' waits that a busy machine stretches
        return sum(step["compute_ms"] for step in system["steps"].values())

    assert compute_ms(floor) < compute_ms(served), summary  # the echo computes nothing
    assert set(floor["steps"]) == {"echo_2_hops_embedding_lookup", "echo_2_hops_dense"}
    assert len(systems["echo_3_hops"]["steps"]) == 3
    assert summary["packing_saving_ms"] == floor["p50_ms"] - systems[PACKED]["p50_ms"]
    assert all(step["compute_ms"] > 0 for step in served["steps"].values()), summary
    assert summary["inprocess_p50_ms"] > 0 and summary["hop_floor_ratio"] == (
        (served["p50_ms"] - summary["inprocess_p50_ms"]) / floor["p50_ms"]
    )
    print(format_report(summary))
