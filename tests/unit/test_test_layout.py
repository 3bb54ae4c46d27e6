"""Test modules import no other test module: shared helpers live in helper modules, fixtures in conftest.py.

Importing a ``test_*`` module runs its module-level code in another module's session and ties two test
files together; what they share goes to ``tests/*.py`` (both folders), ``tests/unit/helpers.py``,
``tests/integration/helpers.py``, or the ``conftest.py`` of their folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

TESTS = ROOT / "tests"


def imported_modules(path: Path, source: str) -> list[str]:
    """Dotted names of the modules (and of the names imported from them) that ``source`` imports.

    Relative imports are resolved against ``path``'s package under the project root.
    """
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return found


def imported_test_modules(path: Path, source: str) -> list[str]:
    """The ``test_*`` modules under ``tests`` that ``source`` imports."""
    return sorted(
        {
            name
            for name in imported_modules(path, source)
            if name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_")
        }
    )


def test_no_test_module_imports_another_test_module():
    offenders = {
        str(path.relative_to(ROOT)): imports
        for path in sorted(TESTS.rglob("*.py"))
        if (imports := imported_test_modules(path, path.read_text()))
    }
    assert not offenders, f"test modules importing test modules (move the shared helper out): {offenders}"


def test_relative_and_absolute_imports_of_test_modules_are_both_found():
    path = TESTS / "integration" / "test_example.py"
    source = (
        "from .test_store_serving import recserve\n"
        "from . import test_bench\n"
        "from tests.unit.test_store import DIM\n"
        "import tests.unit.test_spec\n"
        "from .helpers import wait_for\n"
        "from tests.store_tables import make_tables\n"
    )
    assert imported_test_modules(path, source) == [
        "tests.integration.test_bench",
        "tests.integration.test_store_serving",
        "tests.unit.test_spec",
        "tests.unit.test_store",
    ]
