"""The layers of the code are visible from the folder names: imports only go down.

entry scripts (train*.py) -> training/ -> distributed/ -> networks/ -> utils/
Nothing imports an entry script; utils/ imports nothing of the project above it.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

LAYERS = ["utils", "networks", "distributed", "training"]  # lowest first
ENTRY_SCRIPTS = {"train", "train_graph", "train_mp"}
# a guide, not a rule: a concept that reads better whole may stay whole up to this
MAX_LINES = 450
# the spine: page 1 promises the single-device step and the epoch loop in one file; every config
# key is declared once, in its group, with its help text and the group's own checks (trainer.py's
# 5 lines more: a run that changes its layout as blocks freeze, part 12, asks the step variant
# before each step; 15 more: run_steps, the loop the benchmark, the range test and the
# batch-scaling study drive; config_groups.py's 85: part 12's freezing group, part 13's pipeline
# keys, 1-bit Adam, whether a resumed run may change each key, data_parallel's modes as properties)
LONGER = {"training/trainer.py": 590, "utils/config_groups.py": 585}
# the one module allowed to use torch's private names (each use guarded and explained there)
COMPAT_MODULE = "utils/compat.py"
# private-looking names of the standard library that are documented public API
PUBLIC_UNDERSCORED = {"os._exit"}


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
    for name in ("backbone.py", "vit.py", "moe.py"):
        assert project_imports(REPO / "networks" / name) <= {"utils", "networks"}, name


def tracked_python_files() -> list[Path]:
    """The project's own Python files: git's list, so that a virtual environment of any name
    inside the clone (torch's files included) is not walked."""
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout
        return [REPO / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: skip environments
        environments = {p.parent for p in REPO.rglob("pyvenv.cfg")}
        return [p for p in sorted(REPO.rglob("*.py"))
                if not any(part.startswith(".") for part in p.relative_to(REPO).parts[:-1])
                and not any(env in p.parents for env in environments)]


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules ``path`` imports, anywhere in it: at the top, inside a function, or
    for type checking only (each of them ties the two files together for a reader)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names))
                         if m in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found


def test_no_two_files_import_each_other():
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in tracked_python_files()}
    imports = {name: module_imports(path, set(paths)) - {name} for name, path in paths.items()}
    circles = sorted({tuple(sorted((a, b))) for a, deps in imports.items() for b in deps if a in imports[b]})
    assert not circles, f"files that import each other: {circles}"


def test_the_trainer_is_composed_not_subclassed():
    """A lesson changes the step with a part the Trainer holds (training/trainer.py EagerStep and
    its variants), a script or a test with callbacks: no subclass of Trainer, no class made at
    run time with type(name, bases, namespace)."""
    found = []
    for path in tracked_python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [getattr(b, "id", getattr(b, "attr", None)) for b in getattr(node, "bases", ())]
            if isinstance(node, ast.ClassDef) and "Trainer" in bases:
                found.append(f"{path.relative_to(REPO)}: class {node.name}(Trainer)")
            made = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type"
            if made and len(node.args) == 3:
                found.append(f"{path.relative_to(REPO)} line {node.lineno}: type(...) makes a class")
    assert not found, found


TRAINER_NAMES = {"t", "trainer"}  # how the step variants, state classes and scripts name a Trainer


def trainer_writes(source: str) -> list[str]:
    """Assignments to an attribute of a Trainer (``t.x = ``, ``trainer.x += ``, ``self.trainer.x =``)
    and ``setattr(trainer, ...)`` calls in ``source``: each as 'line N: trainer.x'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            for sub in ast.walk(target):
                owner = getattr(sub, "value", None) if isinstance(sub, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id in TRAINER_NAMES or \
                        isinstance(owner, ast.Attribute) and owner.attr == "trainer":
                    found.append(f"line {node.lineno}: {ast.unparse(sub)}")
    return found


def test_only_the_trainer_writes_its_attributes():
    """A script asks the Trainer (its methods: set_lr_factor, attention_kernel_as, run_steps); a step
    variant hands back a value (build_model's model, build_optimizer's optimizer, its n_params and
    engine): no module but training/trainer.py assigns a Trainer attribute, so the order of
    building is read in one file."""
    found = [f"{path.relative_to(REPO)} {w}" for path in tracked_python_files()
             if path.parts[len(REPO.parts)] != "tests" and path != REPO / "training" / "trainer.py"
             for w in trainer_writes(path.read_text())]
    assert not found, found


def test_the_step_and_the_checkpoint_are_handed_their_parts():
    """The step variants and the checkpoint's state classes (training/) are handed StepParts
    (training/context.py), never the Trainer: none of training/'s modules but trainer.py and the
    launcher, which builds Trainers, names the Trainer or holds one (``self.trainer``)."""
    found = []
    for path in sorted((REPO / "training").glob("*.py")):
        if path.name in ("trainer.py", "launcher.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            held = isinstance(node, ast.Attribute) and ast.unparse(node) == "self.trainer"
            if held or isinstance(node, ast.Name) and node.id == "Trainer":
                found.append(f"training/{path.name} line {node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.alias) and node.name == "Trainer":
                found.append(f"training/{path.name}: imports Trainer")
    assert not found, found


def test_a_trainer_write_is_found():
    source = ("t.model = m\ntrainer.step += 1\nself.trainer.scheduler = s\nsetattr(trainer, 'x', 1)\n"
              "t.loss.fill_(0)\n")
    assert trainer_writes(source) == ["line 1: t.model", "line 2: trainer.step",
                                      "line 3: self.trainer.scheduler", "line 4: trainer.?"]


CONFIG_NAMES = {"cfg", "config", "base"}  # how the library names a whole configuration (Config)


def flat_config_reads(source: str) -> list[str]:
    """Reads of a key through the whole configuration (``cfg.lr``, ``self.cfg.depth``) instead of
    its group (``cfg.optim.lr``): each as 'line N: cfg.lr'. A ``cfg`` annotated as a group
    (``cfg: ModelConfig``) reads its own keys."""
    from utils.config_groups import GROUPS, KEY_GROUP

    groups = {g.__name__ for g in GROUPS.values()}
    found = []

    def visit(node: ast.AST, group_names: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            named = {a.arg: a.annotation is not None and ast.unparse(a.annotation) in groups for a in args
                     if a.arg in CONFIG_NAMES}
            group_names = frozenset({n for n in group_names if n not in named}
                                    | {n for n, g in named.items() if g})
        if isinstance(node, ast.Attribute) and node.attr in KEY_GROUP:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in CONFIG_NAMES - group_names or \
                    isinstance(owner, ast.Attribute) and owner.attr == "cfg":
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, group_names)

    visit(ast.parse(source), frozenset())
    return found


def test_the_library_reads_the_configuration_by_its_groups():
    """Code reads a key where it is declared (``cfg.optim.lr``, ``cfg.layout.pipeline_parallel``),
    so a reader sees which part of the run it belongs to; the flags and YAML keys stay flat."""
    found = [f"{path.relative_to(REPO)} {r}" for path in tracked_python_files()
             if path.parts[len(REPO.parts)] != "tests" for r in flat_config_reads(path.read_text())]
    assert not found, found


def test_a_flat_config_read_is_found():
    source = ("a = cfg.lr + cfg.optim.lr\nb = self.cfg.depth\n"
              "def f(cfg: ModelConfig):\n    return cfg.depth\n"
              "def g(cfg: Config):\n    return cfg.depth\n")
    assert flat_config_reads(source) == ["line 1: cfg.lr", "line 2: self.cfg.depth", "line 6: cfg.depth"]


VIT_LAYERS = {"blocks", "attn", "mlp", "fc1", "fc2", "patch_embed", "pos_embed", "head"}
VIT_CODE = {"ViT", "build_vit"}
# a path through one of them: "blocks.0.", "head.weight"
VIT_PATH = re.compile(r"(?:^|\.)(" + "|".join(sorted(VIT_LAYERS)) + r")(?:\.|$)")
STILL_THE_VITS = {  # files outside networks/ written for the ViT, each with the reason
    "scripts/cost_model.py": "its FLOP, activation and collective formulas are the ViT's (docs/11)",
    "scripts/compile_bf16_check.py": "checks a CPU for a fault of torch.compile on the ViT's block (docs/02)",
}


def vit_names(source: str) -> list[str]:
    """Where ``source`` names the ViT: an attribute that is one of its layers (``m.blocks``), its
    class or build function, an import from networks/vit.py, or a string that is a parameter or
    module path through one of its layers ("blocks.0.", "head.weight"): each as 'line N: name'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in VIT_LAYERS | VIT_CODE:
            name = node.attr
        elif isinstance(node, ast.Name) and node.id in VIT_CODE:
            name = node.id
        elif isinstance(node, ast.alias) and node.name in VIT_CODE:
            name = node.name
        elif isinstance(node, ast.ImportFrom) and node.module == "networks.vit":
            name = "networks.vit"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and not re.search(r"\s", node.value) and VIT_PATH.search(node.value):
            name = repr(node.value)
        if name:
            found.append((node.lineno, name))
    return [f"line {n}: {name}" for n, name in sorted(found)]


def test_only_networks_name_the_vits_layers():
    """Every layout reads the model through networks/backbone.py (its units, stem, tail and
    tensor-parallel plan), so that another backbone goes through all of them unchanged."""
    found = [f"{path.relative_to(REPO)} {w}" for path in tracked_python_files()
             if path.parts[len(REPO.parts)] not in ("networks", "tests")
             and str(path.relative_to(REPO)) not in STILL_THE_VITS for w in vit_names(path.read_text())]
    assert not found, found


def test_a_vit_name_is_found():
    source = ("for b in model.blocks.values():\n    b.attn = x\nfrom networks.vit import ViT\n"
              "m = build_vit(cfg)\nn = 'head.weight'\nlog.info('the blocks.')\nunits = model.units()\n")
    assert vit_names(source) == ["line 1: blocks", "line 2: attn", "line 3: ViT", "line 3: networks.vit",
                                 "line 4: build_vit", "line 5: 'head.weight'"]


def test_tracked_files_leave_out_virtual_environments():
    files = {p.relative_to(REPO).as_posix() for p in tracked_python_files()}
    assert "train.py" in files and "training/trainer.py" in files
    assert not any(f.startswith((".venv", "venv")) or "site-packages" in f for f in files)


def test_nothing_imports_an_entry_script():
    for path in tracked_python_files():
        if path.stem in ENTRY_SCRIPTS:
            continue
        assert not project_imports(path) & ENTRY_SCRIPTS, f"{path.relative_to(REPO)} imports an entry script"


def test_a_script_run_by_path_finds_the_packages():
    """`python scripts/x.py` puts scripts/ first on the module path, not the repository: a script
    that imports the project's packages (at any depth) puts the repository there itself. The
    suite's processes have the repository on PYTHONPATH, so only this test sees a missing one."""
    for path in sorted((REPO / "scripts").glob("*.py")):
        text = path.read_text()
        if "__main__" in text and project_imports(path) - ENTRY_SCRIPTS:
            root = r"Path\(__file__\)\.resolve\(\)\.parents\[1\]"
            assert re.search(rf"^(REPO = {root}$(.|\n)*)?^\s*sys\.path\.insert\(0, str\((REPO|{root})\)\)",
                             text, re.M), \
                f"{path.relative_to(REPO)} imports the project's packages but does not put the repository " \
                f"on sys.path"


def test_package_files_stay_small():
    for layer in LAYERS:
        for path in package_files(layer):
            n = len(path.read_text().splitlines())
            limit = LONGER.get(path.relative_to(REPO).as_posix(), MAX_LINES)
            assert n <= limit, f"{path.relative_to(REPO)} has {n} lines; split it"


# a function a learner reads at one sitting (the tests' own helpers are not counted)
MAX_FUNCTION_LINES = 75


def test_functions_stay_short():
    long = []
    for path in tracked_python_files():
        if path.relative_to(REPO).parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"split these functions: {long}"


def private_names(source: str) -> list[str]:
    """Underscored attributes read off anything but ``self``/``cls`` (``torch._C``,
    ``loader._iterator``, ``storage._new_shared``) and underscored names imported."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in PUBLIC_UNDERSCORED:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or ""] + [alias.name for alias in node.names]
            if any(part.startswith("_") and not part.startswith("__")
                   for name in names for part in name.split(".")):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_torch_names_on_the_training_path():
    """Private names change without notice between torch releases: the code that trains uses
    public APIs only, outside the one compatibility module."""
    offenders = []
    for layer in LAYERS:
        for path in package_files(layer):
            if path.relative_to(REPO).as_posix() != COMPAT_MODULE:
                offenders += [f"{path.relative_to(REPO)} {hit}" for hit in private_names(path.read_text())]
    assert not offenders, "private names:\n" + "\n".join(offenders)


def test_the_private_name_check_finds_them():
    source = ("import torch\nfrom torch._C import x\nn = torch._C._storage_Use_Count\n"
              "it._shutdown_workers()\nself._ok = os._exit\n")
    assert [hit.split(": ", 1)[1] for hit in private_names(source)] == [
        "from torch._C import x", "torch._C._storage_Use_Count", "torch._C", "it._shutdown_workers"]


def test_a_lost_xdist_group_stops_the_suite():
    """pytest-xdist groups tests by a suffix it adds to their node ids; where a pytest keeps node ids
    it cannot change (9.2), the suite must stop with a line that says so, not split the groups."""
    from types import SimpleNamespace

    from tests.conftest import check_xdist_groups

    marked = SimpleNamespace(nodeid="tests/test_readme.py::test_page_in_order[README.md]",
                             get_closest_marker=lambda name: name == "xdist_group")
    config = SimpleNamespace(option=SimpleNamespace(loadgroup=True))
    with pytest.raises(pytest.UsageError, match="could not group tests/test_readme.py"):
        check_xdist_groups(config, [marked])
    grouped = SimpleNamespace(nodeid=marked.nodeid + "@course", get_closest_marker=marked.get_closest_marker)
    check_xdist_groups(config, [grouped])
    check_xdist_groups(SimpleNamespace(option=SimpleNamespace(loadgroup=False)), [marked])
