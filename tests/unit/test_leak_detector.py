import statistics

from recserve.perf.lab.soak import ResourceSample, detect_leaks


def samples(rss_of, generation_of=lambda at: 1, seconds=60):
    """One sample a second: ``dense`` memory and its newest stub's generation as functions of time."""
    return [
        ResourceSample(at, {"dense": rss_of(at), "tritonserver": 80.0}, {"dense": 7, "tritonserver": 60},
                       generation={"dense": generation_of(at)})
        for at in range(seconds)
    ]  # fmt: skip


def version(at):
    return at // 15  # a new dense version every 15 s: one goes live as the second half starts


def compiling(at):
    """Each version's stub starts at 150 MB and grows to 220 MB as it compiles the shapes it serves."""
    return 150.0 + 5.0 * (at % 15)


def test_a_new_version_still_compiling_is_not_growth():
    run = samples(compiling, version)
    half = [s for s in run if s.at_s >= 29.5]
    assert (
        statistics.median(s.rss_mb["dense"] for s in half[-3:]) - half[0].rss_mb["dense"] > 50
    )  # age, not a leak
    growth, problems = detect_leaks(run)
    assert problems == [] and growth["dense"][0] <= 0


def test_a_new_version_above_the_old_ones_high_water_mark_is_growth():
    growth, problems = detect_leaks(samples(lambda at: compiling(at) + 40.0 * version(at), version))
    assert growth["dense"][0] > 50 and problems[0].startswith("dense: resident memory grew")


def test_steady_growth_of_one_stub_is_a_leak():
    growth, problems = detect_leaks(samples(lambda at: 100.0 + 3.0 * at))
    assert growth["dense"][0] > 50 and problems[0].startswith("dense: resident memory grew")
    assert "tritonserver" not in " ".join(problems)
