from recserve.perf.lab.store_bench import format_report, run


def test_store_bench_measures_every_figure_on_a_small_table():
    report = run(keys=20_000, dim=8, batches=40, cache_mib=0.05, device="cpu")
    assert report.store_keys_per_s > 0 and report.floor_keys_per_s > 0 and report.numpy_keys_per_s > 0
    assert abs(sum(report.hit_rates.values()) - 1) < 1e-9 and report.hit_rates["l1"] > 0.3
    assert report.hit_rates["default"] == 0  # every queried key exists
    assert report.bytes_per_key_fp16 < report.bytes_per_key
    assert report.resident_bytes_two_processes > report.keys * 8 * 4  # both processes touched every row
    assert "ratio to floor" in format_report(report) and "numpy path" in format_report(report)
    assert report.l1_rebuild_ms > 0 and "L1 rebuild" in format_report(report)
    assert (
        report.device.device_keys_per_s > 0
        and report.device.host_keys_per_s > 0
        and report.device.device_median_us > 0
    )
    assert abs(report.device.l1_hit_rate - report.hit_rates["l1"]) < 0.1  # the same L1 serves both paths
    assert "device L1 (cpu)" in format_report(report)
