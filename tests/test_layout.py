"""The layers of the code are visible from the folder names: imports only go down.

entry scripts (train*.py) -> training/ -> distributed/ -> networks/ -> utils/
Nothing imports an entry script; utils/ imports nothing of the project above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

LAYERS = ["utils", "networks", "distributed", "training"]  # lowest first
ENTRY_SCRIPTS = {"train", "train_graph", "train_mp"}
MAX_LINES = 300


def project_imports(path: Path) -> set[str]:
    """Top-level names of the project's packages and scripts that ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names & (set(LAYERS) | ENTRY_SCRIPTS | {"scripts", "tests"})


def package_files(layer: str) -> list[Path]:
    return sorted((REPO / layer).glob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_only_go_down(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    for path in package_files(layer):
        wrong = project_imports(path) - allowed
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)}, above or beside its layer"


def test_the_serial_model_knows_nothing_of_parallelism():
    assert project_imports(REPO / "networks" / "vit.py") <= {"utils"}


def test_nothing_imports_an_entry_script():
    for path in sorted(REPO.rglob("*.py")):
        if ".venv" in path.parts or path.stem in ENTRY_SCRIPTS:
            continue
        assert not project_imports(path) & ENTRY_SCRIPTS, f"{path.relative_to(REPO)} imports an entry script"


def test_package_files_stay_small():
    for layer in LAYERS:
        for path in package_files(layer):
            n = len(path.read_text().splitlines())
            assert n <= MAX_LINES, f"{path.relative_to(REPO)} has {n} lines; split it"
