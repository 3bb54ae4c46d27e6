"""Files replaced whole (recserve.core.files)."""

from pathlib import Path

import pytest

from recserve.core.files import write_atomically, write_text_atomically


def test_a_replaced_file_is_whole_and_leaves_nothing_beside_it(tmp_path: Path):
    path = tmp_path / "state.json"
    path.write_text("old")
    seen = []

    def write(handle):
        handle.write(b"new, ")
        seen.append(path.read_text())  # mid-write, a reader still sees the old file
        handle.write(b"whole")

    write_atomically(path, write, durable=True)
    assert seen == ["old"] and path.read_text() == "new, whole"
    write_text_atomically(path, "again")
    assert path.read_text() == "again" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_scratch(tmp_path: Path):
    path = tmp_path / "state.json"
    path.write_text("old")

    def write(handle):
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, write)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
