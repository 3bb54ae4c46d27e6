"""No pickle anywhere: every Python file of the repository is scanned for pickle-based loading."""

import re
from pathlib import Path

from tests.conftest import ROOT
from tests.unit.helpers import python_files

FORBIDDEN = (
    (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|joblib)\b", re.M), "a pickle module"),
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
    (re.compile(r"\bpd\.read_pickle\(|\bread_pickle\("), "read_pickle"),
)
TORCH_LOAD = re.compile(r"\btorch\.load\(([^()]|\([^()]*\))*\)", re.S)


def pickle_uses(text: str) -> list[str]:
    """What in ``text`` would unpickle data."""
    found = [label for pattern, label in FORBIDDEN if pattern.search(text)]
    found += [
        f"{m.group(0)!r} without weights_only=True"
        for m in TORCH_LOAD.finditer(text)
        if not re.search(r"weights_only\s*=\s*True", m.group(0))
    ]
    return found


def test_the_scanner_finds_each_kind_of_pickle_use():
    bad = [
        "np.load(path, allow_pickle=True)",
        "import pickle",
        "from cloudpickle import loads",
        "state = torch.load(path)",
        "state = torch.load(open(p), map_location='cpu')",
        "frame = pd.read_pickle(p)",
    ]
    for snippet in bad:
        assert pickle_uses(snippet), snippet
    assert not pickle_uses("state = torch.load(path, weights_only=True)\nnp.load(p, allow_pickle=False)")


def test_no_file_of_the_repository_uses_pickle():
    files = [p for p in python_files() if p.resolve() != Path(__file__).resolve()]
    assert len(files) > 30, "the scan found too few files to be looking at the repository"
    offenders = {
        str(p.relative_to(ROOT)): uses for p in files if (uses := pickle_uses(p.read_text(errors="replace")))
    }
    assert not offenders, offenders
