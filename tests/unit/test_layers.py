"""The dependency direction of the packages, checked on every import (lazy ones included).

Bottom, the ground: ``recserve/core/`` and the domain errors (no other module re-exports them).
Above them the backends that run inside tritonserver, in floors of their own (one rule per
folder): ``base/`` on the bottom alone; the subsystems ``features/``, ``store/`` and ``dense/``
on the base, never on each other; ``steps/`` composed from the subsystems; ``triton/`` (the
adapters) on anything in the backends. Then the build. The server processes stand on the bottom
alone, the access layer (the proxy in front of the servers) on them; ``verify`` on the backends,
the build and the clients; perf in floors of its own; the command line on top of everything. The
client SDK depends only on the bottom layer, so a client installs without the server's code paths.
"""

import ast
from pathlib import Path

import pytest

from tests.unit.helpers import python_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {  # import name -> folder, as pyproject.toml maps them
    "recserve": "recserve",
    "recserve.backends": "python_backends",
    "recserve.build": "build",
    "recserve.clients": "clients",
    "recserve.perf": "perf",
}
#: The ground: ``core/`` and the errors.
BOTTOM = ("recserve.core", "recserve.errors")
BACKEND_BASE = ("recserve.backends.base",)
BACKEND_SUBSYSTEMS = ("recserve.backends.features", "recserve.backends.store", "recserve.backends.dense")
USER_STATE = "recserve.backends.store.user_state"
#: what every part of perf may import: what it measures and the tools that start it
PERF_BASE = (*BOTTOM, "recserve.backends", "recserve.build", "recserve.clients", "recserve.server")
PERF_FLOORS = ("recserve.perf.harness", "recserve.perf.peers", "recserve.perf.bench")
#: module prefix -> the prefixes it may import (besides itself); the first matching prefix rules
ALLOWED = {
    "recserve.core": ("recserve.errors",),  # the ground imports nothing of the project above it
    "recserve.errors": (),
    "recserve.backends.base": BOTTOM,
    **{subsystem: (*BOTTOM, *BACKEND_BASE) for subsystem in BACKEND_SUBSYSTEMS},
    # the near-line user state: a room of the store, on the store's shared parts (kernels, Redis tier)
    USER_STATE: (*BOTTOM, *BACKEND_BASE, "recserve.backends.store"),
    # the request log reads requests with the feature transform; its Redis Streams sink reaches the
    # cluster with the store's connection settings; the steps and adapters hook it in
    "recserve.backends.request_log": (
        *BOTTOM,
        *BACKEND_BASE,
        "recserve.backends.features",
        "recserve.backends.store.redis_connect",
    ),
    "recserve.backends.steps": (*BOTTOM, *BACKEND_BASE, *BACKEND_SUBSYSTEMS, "recserve.backends.request_log"),
    "recserve.backends.triton": (*BOTTOM, "recserve.backends"),
    "recserve.backends": (),  # the package alone (the root's contents: a test below)
    "recserve.build": (*BOTTOM, "recserve.backends"),
    "recserve.clients": BOTTOM,
    "recserve.server": BOTTOM,  # the tritonserver processes: started, supervised, stopped
    "recserve.access": (*BOTTOM, "recserve.server"),  # the proxy in front of the servers
    "recserve.loop": (*BOTTOM, "recserve.backends"),  # the joiner: reads what the steps logged
    "recserve.verify": (*BOTTOM, "recserve.backends", "recserve.build", "recserve.clients"),
    "recserve.commands": ("recserve",),  # the top: the command line may import anything
    "recserve.cli": ("recserve.commands",),  # the console script's entry point
    "recserve": (),  # the package alone
    # perf in floors of its own: the shared helpers, the peers, what users run, the lab on top of them
    "recserve.perf": (),  # the package alone (the root's contents: a test below)
    "recserve.perf.harness": PERF_BASE,
    "recserve.perf.gpu_check": (*PERF_BASE, *PERF_FLOORS),  # the GPU kit runs what users run
    "recserve.perf.peers": (*PERF_BASE, "recserve.perf.harness"),
    # the loop's bench replays the joiner and the learner in process (bench-loop --replay)
    "recserve.perf.bench": (*PERF_BASE, "recserve.loop", "recserve.perf.harness", "recserve.perf.peers"),
    "recserve.perf.lab": (*PERF_BASE, "recserve.access", *PERF_FLOORS),
}


def module_name(path: Path) -> str:
    """Import name of a source file under one of the package folders."""
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[1])):
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = [*package.split("."), *path.relative_to(base).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(f"{path} is in no package folder")


def sources() -> list[Path]:
    """Every source file of the installed packages."""
    folders = [ROOT / folder for folder in set(PACKAGE_DIRS.values())]
    return [
        p
        for p in python_files()
        if any(p.is_relative_to(folder) for folder in folders) and "specs" not in p.parts
    ]


MODULES = {module_name(p) for p in sources()}


def imported(path: Path) -> set[str]:
    """recserve modules a file imports, at any depth (function-level imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("recserve"):
            for alias in node.names:  # ``from recserve import verify`` imports the module recserve.verify
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("recserve"))
    return names


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rule_for(module: str) -> tuple[str, tuple[str, ...]]:
    prefix = max((p for p in ALLOWED if within(module, p)), key=len)
    return prefix, ALLOWED[prefix]


def violations(module: str, imports: set[str]) -> list[str]:
    """The imports of ``module`` that point up or sideways."""
    own, allowed = rule_for(module)
    return sorted(m for m in imports if not within(m, own) and not any(within(m, a) for a in allowed))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    module = module_name(path)
    wrong = violations(module, imported(path))
    assert not wrong, f"{module} imports {wrong}, against the layers {rule_for(module)}"


def test_upward_and_sideways_imports_are_caught():
    assert violations("recserve.clients.rows", {"recserve.build.synthetic", "recserve.core.spec.model"}) == [
        "recserve.build.synthetic"
    ]
    assert violations("recserve.backends.store.tiered", {"recserve.backends.triton.adapter"}) == [
        "recserve.backends.triton.adapter"
    ]
    assert violations("recserve.backends.dense.runner", {"recserve.build.network"}) == [
        "recserve.build.network"
    ]
    assert violations("recserve.core.spec.model", {"recserve.verify", "recserve.core.sections.base"}) == [
        "recserve.verify"
    ]
    assert violations("recserve.perf.bench.bench", {"recserve.build.configs", "recserve.server"}) == []
    assert violations("recserve.access.config", {"recserve.build.configs", "recserve.server"}) == [
        "recserve.build.configs"
    ]
    assert violations("recserve.server.runtime", {"recserve.build.configs", "recserve.core.spec.model"}) == [
        "recserve.build.configs"
    ]
    assert violations("recserve.verify", {"recserve.commands.model"}) == ["recserve.commands.model"]
    assert not within("recserve.backends.storex", "recserve.backends.store")


def test_the_embedding_store_never_imports_the_user_state_room():
    """store/user_state/ stands on the store's shared parts; the rest of the store stands without it."""
    store = [p for p in sources() if within(module_name(p), "recserve.backends.store")]
    outside = [p for p in store if not within(module_name(p), USER_STATE)]
    inward = {module_name(p): sorted(m for m in imported(p) if within(m, USER_STATE)) for p in outside}
    assert outside and {module: names for module, names in inward.items() if names} == {}
    assert violations(f"{USER_STATE}.states", {"recserve.backends.store.redis_tier"}) == []
    assert violations(f"{USER_STATE}.states", {"recserve.backends.features.hashing"}) == [
        "recserve.backends.features.hashing"
    ]


def test_the_backends_floors_are_kept():
    assert violations(
        "recserve.backends.base.metrics", {"recserve.backends.store.tiered", "recserve.core.spec.model"}
    ) == ["recserve.backends.store.tiered"]
    assert violations("recserve.backends.dense.runner", {"recserve.backends.features.transform"}) == [
        "recserve.backends.features.transform"
    ]
    assert violations("recserve.backends.store.tiered", {"recserve.backends.features.hashing"}) == [
        "recserve.backends.features.hashing"
    ]
    assert violations("recserve.backends.store.served", {"recserve.backends.steps.lookup"}) == [
        "recserve.backends.steps.lookup"
    ]
    assert violations("recserve.backends.steps.lookup", {"recserve.backends.triton.adapter"}) == [
        "recserve.backends.triton.adapter"
    ]
    assert (
        violations(
            "recserve.backends.steps.pipeline",
            {"recserve.backends.base.artifacts", "recserve.backends.store.tiered", "recserve.backends.dense"},
        )
        == []
    )
    assert violations("recserve.backends.triton.models.dense", {"recserve.backends.steps.lookup"}) == []


def test_the_backends_root_holds_only_the_package():
    """Every other module of the backends sits in the folder of its floor."""
    root = ROOT / PACKAGE_DIRS["recserve.backends"]
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]


def test_the_ground_stands_alone():
    """``core/`` imports only itself and the errors."""
    assert violations(
        "recserve.core.rows", {"recserve.core.values", "recserve.errors", "recserve.clients.rows"}
    ) == ["recserve.clients.rows"]
    assert violations("recserve.core.values", {"recserve.backends.features.hashing"}) == [
        "recserve.backends.features.hashing"
    ]


def test_the_former_ground_paths_are_gone():
    """``recserve.spec``, ``.sections`` and ``.wire`` (re-exports of ``core/``) are gone."""
    assert not {"recserve.spec", "recserve.sections", "recserve.wire"} & MODULES


def test_ground_modules_are_short():
    """Every module of the ground does one job in at most 400 lines."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "recserve" / "core").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert (ROOT / "recserve" / "core" / "spec" / "model.py").is_file()
    assert not long, f"over 400 lines: {long}"


def test_perf_floors_point_down():
    """The helpers import no experiment, the benchmarks no lab command; the lab may import both."""
    assert violations("recserve.perf.harness.traffic", {"recserve.perf.bench.report", "recserve.server"}) == [
        "recserve.perf.bench.report"
    ]
    assert violations(
        "recserve.perf.bench.bench", {"recserve.perf.lab.overload", "recserve.perf.peers.monolith"}
    ) == ["recserve.perf.lab.overload"]
    assert violations("recserve.perf.peers.monolith", {"recserve.perf.bench.report"}) == [
        "recserve.perf.bench.report"
    ]
    assert (
        violations("recserve.perf.lab.soak", {"recserve.perf.bench.hops", "recserve.perf.harness.stats"})
        == []
    )
    assert violations("recserve.perf.lab.tune", {"recserve.commands.lab"}) == ["recserve.commands.lab"]


def test_the_perf_root_holds_only_the_package():
    """Every module of perf sits in the folder of its purpose."""
    root = ROOT / PACKAGE_DIRS["recserve.perf"]
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]


def test_the_docs_draw_every_folder_rule():
    """docs/README.md's "Who may import whom" names every folder (or module) that has a rule here."""
    text = (ROOT / "docs" / "README.md").read_text()
    drawing = text.split("### Who may import whom", 1)[1].split("```")[1]
    roots = {"recserve", "recserve.backends", "recserve.perf"}  # the packages alone: no arrow of their own
    missing = []
    for prefix in ALLOWED:
        if prefix in roots:
            continue
        parts = prefix.split(".")[1:]
        if parts[0] == "backends":
            parts = parts[1:]
        name = "/".join(parts)
        is_module = (ROOT / "recserve" / f"{parts[-1]}.py").is_file() and len(parts) == 1
        label = f"{name}.py" if is_module else (name if name.startswith("perf/") else f"{name}/")
        if label not in drawing:
            missing.append(label)
    assert not missing, f"draw these in docs/README.md's import drawing: {missing}"
