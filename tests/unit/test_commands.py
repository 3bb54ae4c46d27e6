"""The command line's shape: user commands and lab commands apart, old lab names kept, ``--spec`` anywhere."""

import json
import re
import subprocess
import sys

import pytest

from recserve.cli import main, parser
from recserve.commands.lab import FLAT_NAMES
from recserve.commands.main import resolve_flat_name
from recserve.core.spec.types import DEFAULT_SPEC

USER_COMMANDS = (
    "build", "import", "contract", "sample", "serve", "predict", "verify", "update", "rollback", "explain",
    "redis-load", "access", "canary", "observe", "k8s", "perf", "bench", "lab",
)  # fmt: skip
# the lab commands that never had a top-level name too
LAB_COMMANDS = (*FLAT_NAMES.values(), "fuzz", "chaos", "device-ops", "degrade", "versions", "stages")


def help_text(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr()


def listed(section: str) -> set[str]:
    """The command names of a help section (wrapped help text is indented deeper)."""
    names = set()
    for line in section.splitlines():
        indent = len(line) - len(line.lstrip())
        if 2 <= indent <= 4 and line.strip():
            names.add(line.split()[0])
    return names


def test_the_help_lists_the_user_commands_and_the_lab_commands_apart(capsys):
    text = help_text(["--help"], capsys).out
    user, lab = text.split("user commands:")[1].split("lab commands (recserve lab NAME ...):")
    assert set(USER_COMMANDS) <= listed(user) and not listed(user) & set(LAB_COMMANDS)
    assert listed(lab) == set(LAB_COMMANDS)
    assert not listed(text) & (set(FLAT_NAMES) - set(LAB_COMMANDS))  # the old names are hidden


@pytest.mark.parametrize("name", LAB_COMMANDS)
def test_every_lab_command_runs_under_lab(name, capsys):
    flat = next((old for old, new in FLAT_NAMES.items() if new == name), None)
    args = parser().parse_args(["lab", name])
    assert args.command == "lab" and args.lab_command == name
    if flat is not None:
        assert args.func is parser().parse_args(resolve_flat_name([flat])).func
    assert help_text(["lab", name, "--help"], capsys).out.startswith(f"usage: recserve lab {name} ")


@pytest.mark.parametrize(("old", "new"), FLAT_NAMES.items())
def test_the_old_flat_lab_names_still_work_with_a_notice(old, new, capsys):
    assert resolve_flat_name(["--spec", "tiny", old, "--json", "x"]) == [
        "--spec",
        "tiny",
        "lab",
        new,
        "--json",
        "x",
    ]
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and f"'recserve lab {new}'" in notice
    shown = help_text([old, "--help"], capsys)
    assert shown.out.startswith(f"usage: recserve lab {new} ") and f"'{old}' is now" in shown.err


def test_an_old_lab_name_runs_the_command(tiny_repository, tmp_path, capsys):
    out = tmp_path / "buckets.csv"
    argv = ["--repository", str(tiny_repository), "--rounds", "1", "--budget-ms", "0", "--output", str(out)]
    assert main(["--spec", "tiny", "bench-dense", *argv]) == 0
    assert "'bench-dense' is now 'recserve lab dense-bench'" in capsys.readouterr().err
    assert out.read_text().startswith("rows,length,dynamic_rows_per_s")


def test_other_words_are_left_alone():
    for argv in (["serve"], ["--spec", "soak", "contract"], ["--spec=x", "bench"], ["-h", "soak"], []):
        assert resolve_flat_name(argv) == argv


def test_spec_goes_before_or_after_the_command_and_after_wins():
    assert parser().parse_args(["contract"]).spec is None  # not given: the default, or a carried one
    imported = parser().parse_args(["import", "--spec", "s.toml", "--tables", "t", "--dense", "d.onnx"])
    assert imported.spec == "s.toml" and imported.command == "import"  # the form import.md writes
    assert parser().parse_args(["--spec", "a", "contract"]).spec == "a"
    assert parser().parse_args(["contract", "--spec", "b"]).spec == "b"
    assert parser().parse_args(["--spec", "a", "contract", "--spec", "b"]).spec == "b"
    assert parser().parse_args(["--spec", "a", "lab", "soak", "--spec", "b"]).spec == "b"
    assert parser().parse_args(["--spec", "a", "lab", "soak"]).spec == "a"


def test_spec_after_the_command_is_the_one_used(capsys):
    assert main(["--spec", "tiny", "contract", "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["contract", "--json", "--spec", "tiny"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert main([*["--spec", DEFAULT_SPEC], "contract", "--spec", "tiny", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert main(["contract", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert before == after == both != default


def test_the_docs_index_lists_every_command():
    """docs/README.md's command tables name every user and lab command the parser has."""
    import argparse
    from pathlib import Path

    def commands(command_parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        (sub,) = [a for a in command_parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(sub.choices)

    top = commands(parser())
    expected = {name for name in top if name != "lab"} | {f"lab {name}" for name in commands(top["lab"])}
    text = (Path(__file__).resolve().parents[2] / "docs" / "README.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    named = {m for row in rows for m in re.findall(r"`recserve ((?:lab )?[a-z0-9-]+)", row)}
    assert expected - named == set()
    assert {"user-state", "bench-longseq", "lab fuzz"} <= expected


def test_the_command_line_starts_without_the_heavy_libraries():
    """Building the parser imports no torch nor onnxruntime: every command (``recserve predict``) starts in
    well under a second, and a command that needs them imports them when it runs."""
    script = (
        "import sys\nfrom recserve.cli import parser\nparser()\n"
        "print(sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert loaded.stdout.split("\n")[-2] == "[]", loaded.stdout
