from recserve.perf.soak import ResourceSample, detect_leaks


def samples(rss_of, youngest_of=lambda at: 60.0, seconds=60):
    """One sample a second: ``dense`` memory and the age of its youngest stub as functions of time."""
    return [
        ResourceSample(at, {"dense": rss_of(at), "tritonserver": 80.0}, {"dense": 7, "tritonserver": 60},
                       youngest_s={"dense": youngest_of(at)})
        for at in range(seconds)
    ]  # fmt: skip


def reloading(at):
    """A new dense version every 10 s: its stub loads for 3 s (low memory), then holds 210 MB."""
    return 150.0 if at % 10 < 3 else 210.0


def test_a_reload_caught_half_way_is_not_growth():
    caught = samples(reloading, youngest_of=lambda at: float(at % 10))
    assert caught[30].rss_mb["dense"] == 150.0  # the second half starts mid-reload
    growth, problems = detect_leaks(caught)
    assert problems == [] and abs(growth["dense"][0]) < 1.0
    _, unsettled = detect_leaks(caught, settle_s=0.0)  # judged on every sample, it looks like a leak
    assert unsettled and unsettled[0].startswith("dense: resident memory grew 60.0 MB")


def test_steady_growth_of_a_settled_stub_is_a_leak():
    growth, problems = detect_leaks(samples(lambda at: 100.0 + 3.0 * at))
    assert growth["dense"][0] > 50 and problems[0].startswith("dense: resident memory grew")
