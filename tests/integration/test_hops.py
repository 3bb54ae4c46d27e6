"""``recserve lab hops`` on a real tritonserver: the echo ensembles serve, and cost less than the model."""

from recserve.perf.bench.hops import PACKED, format_report, run_hops


def test_the_echo_ensembles_serve_and_the_report_splits_the_time(spec, repository, tmp_path):
    summary = run_hops(spec, repository, tmp_path, requests=40, rounds=1, cpu_seconds=1.0)
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
    cpu = summary["cpu_per_request"]
    for system, steps in ((spec.name, ("embedding_lookup", "dense")), ("echo_2_hops", floor["steps"])):
        for figures in cpu[system].values():  # every process of the system did some work per request
            assert figures["requests_per_s"] > 0 and set(figures["cpu_us"]) == {"tritonserver", *steps}
            assert all(us > 0 for us in figures["cpu_us"].values()), cpu
    # the served steps compute: each costs more CPU per request than its echo, one in flight
    assert cpu[spec.name]["1"]["cpu_us"]["dense"] > cpu["echo_2_hops"]["1"]["cpu_us"]["echo_2_hops_dense"]
    print(format_report(summary))
