"""One module, one job: no module of the product is over 400 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The folders of the installed package (recserve, its backends, build, clients and perf).
FOLDERS = ("recserve", "python_backends", "build", "clients", "perf")
MAX_LINES = 400
#: Folders a local build writes copies into (``build/lib.*``, ``build/temp.*``): not sources.
BUILD_OUTPUTS = ("lib.", "temp.")


def line_counts() -> dict[str, int]:
    """Lines of every module under :data:`FOLDERS`, by path relative to the repository root."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not any(part == "__pycache__" or part.startswith(BUILD_OUTPUTS) for part in path.parts)
    }


def test_no_module_is_over_400_lines():
    over = {path: lines for path, lines in line_counts().items() if lines > MAX_LINES}
    assert not over, f"split these modules by job (at most {MAX_LINES} lines each): {over}"
