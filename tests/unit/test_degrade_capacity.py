"""The capacity a ``[degrade]`` door learned, kept for the next run: written while it moves, read back."""

import json

from recserve.core.degrade_capacity import KEEP_EVERY_S, MAX_BYTES, CapacityFile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_learned_capacity_is_read_back_by_the_next_run(tmp_path):
    path = tmp_path / "degrade-capacity.json"
    assert CapacityFile(path).load() is None  # a first run: nothing kept
    assert CapacityFile(path).keep(512.5)
    assert CapacityFile(path).load() == 512.5
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written whole, no temporary left


def test_a_moving_capacity_is_written_at_most_every_few_seconds_and_only_once_it_moved(tmp_path):
    clock = Clock()
    kept = CapacityFile(tmp_path / "c.json", clock)
    assert not kept.keep(float("inf"))  # not known yet: nothing to keep
    assert kept.keep(400.0)
    clock.now += 1.0
    assert not kept.keep(500.0)  # too soon
    clock.now += KEEP_EVERY_S
    assert not kept.keep(410.0)  # moved too little
    assert kept.keep(500.0)
    assert not kept.keep(520.0) and kept.keep(520.0, force=True)  # the step stopping writes it at once
    assert CapacityFile(tmp_path / "c.json").load() == 520.0


def test_a_damaged_or_foreign_file_is_not_trusted(tmp_path):
    path = tmp_path / "c.json"
    for text in ("not json", "[1, 2]", '{"capacity_per_s": -3}', '{"capacity_per_s": true}',
                 '{"capacity_per_s": "fast"}', '{"capacity_per_s": 1e300}', "{}"):  # fmt: skip
        path.write_text(text)
        assert CapacityFile(path).load() is None, text
    path.write_text(json.dumps({"capacity_per_s": 300.0, "pad": "x" * MAX_BYTES}))
    assert CapacityFile(path).load() is None  # too large to read


def test_a_folder_that_cannot_be_written_costs_the_kept_capacity_only(tmp_path):
    kept = CapacityFile(tmp_path / "missing" / "c.json")
    assert not kept.keep(300.0)  # logged; the step goes on
    assert kept.keep(300.0, force=True) is False and list(tmp_path.iterdir()) == []
