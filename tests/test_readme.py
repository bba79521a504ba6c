"""Every shell command in the README is checked, part by part, in the order a learner runs them.

Each command of a ```bash block is classified by the first rule below that matches it:
commands that can run here are run with a small override (few steps, small data, a
temporary output folder shared by the commands of one part of the README) and must succeed,
and a training command must train (a command that lands in the folder of an earlier one and
finds nothing to do fails); Slurm, GPU-only and long-running commands are checked statically
(the script, configuration, flags and files they name must exist and parse). A command that
no rule matches fails the test: a new README command must be classified here.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.make_synthetic_era5 import generate
from tests.conftest import REPO, subprocess_env
from utils.config import DEFAULT_YAML, available_configs, load_config

README = REPO / "README.md"
TRAIN_SCRIPTS = {"train.py", "train_graph.py", "train_mp.py"}
SUBMIT_SCRIPTS = {"submit_pm.sh": "train.py", "submit_pm_dp.sh": "train.py",
                  "submit_pm_mp.sh": "train_mp.py"}
SBATCH_OPTIONS_WITH_VALUE = {"-N", "--nodes", "-n", "--ntasks", "-t", "--time", "-A", "--account",
                             "-q", "--qos", "-C", "--constraint", "-J", "--job-name",
                             "--gpus-per-node", "--gpus-per-task", "--cpus-per-task", "-c",
                             "--ntasks-per-node", "--signal", "--reservation", "-o", "--output"}
SBATCH_FLAGS = {"--requeue", "--exclusive"}


@dataclass(frozen=True)
class Command:
    line: int  # README line where the command starts
    text: str

    @property
    def env_and_words(self) -> tuple[dict[str, str], list[str]]:
        words = shlex.split(self.text)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        return env, words


def readme_commands(text: str | None = None) -> list[Command]:
    """Commands of the README's ```bash blocks, with continuation lines joined."""
    text = README.read_text() if text is None else text
    commands: list[Command] = []
    in_bash, pending, start = False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            in_bash = not in_bash and stripped in ("```bash", "```sh", "```shell")
            continue
        if not in_bash:
            continue
        line = raw[: _comment_start(raw)].rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = " ".join((pending + line).split())
        pending = ""
        if full:
            commands.append(Command(start, full))
    return commands


def _comment_start(line: str) -> int:
    """Index of a shell comment's '#' outside quotes (len(line) if none)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


# ------------------------------------------------------------------------ checks ---
def config_of(words: list[str]) -> str:
    for i, word in enumerate(words):
        if word.startswith("--config="):
            return word.split("=", 1)[1]
        if word == "--config" and i + 1 < len(words):
            return words[i + 1]
    return "base"


def check_train_flags(script: str, args: list[str]) -> None:
    """The flags parse with the script's own parser and the configuration exists."""
    parser = train_parser(script)
    try:
        parsed = parser.parse_args(args)
    except SystemExit as err:
        raise AssertionError(f"{script} rejects {args}") from err
    assert parsed.config in available_configs(), f"unknown config {parsed.config}"


def train_parser(script: str) -> argparse.ArgumentParser:
    assert script in ("train.py", "train_graph.py", "train_mp.py"), script
    from training.launcher import arg_parser

    return arg_parser("")


class Runner:
    """Runs README commands here with small overrides, in a temporary folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.data: dict[tuple[int, int], Path] = {}

    def data_for(self, config: str) -> Path:
        size = load_config(DEFAULT_YAML, config).img_size
        if size not in self.data:
            out = self.tmp / f"data_{size[0]}x{size[1]}"
            generate(out, size, 24, {"train": [2016], "valid": [2017], "test": [2018]}, seed=0, quiet=True)
            self.data[size] = out
        return self.data[size]

    def run(self, words: list[str], env: dict[str, str], timeout: float = 240) -> str:
        result = subprocess.run(words, cwd=REPO, env=subprocess_env(**env), capture_output=True,
                                text=True, timeout=timeout)
        assert result.returncode == 0, (words, result.stdout[-2000:], result.stderr[-3000:])
        return result.stdout

    def train_overrides(self, config: str) -> list[str]:
        return ["--num_iters", "2", "--limit_nsamples", "16", "--limit_nsamples_val", "8",
                "--checkpoint_every", "0", "--expdir", str(self.tmp / "logs"),
                "--data_dir", str(self.data_for(config))]


def python_words(words: list[str]) -> list[str]:
    """`python x.py`, `.venv/bin/python x.py` and `torchrun ...` with this interpreter."""
    if words[0] in ("python", "python3", ".venv/bin/python"):
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return words


def script_of(words: list[str]) -> str | None:
    return next((Path(w).name for w in words if w.endswith(".py")), None)


def check_local_python(cmd: Command, runner: Runner) -> None:
    env, words = cmd.env_and_words
    words = python_words(words)
    script = script_of(words)
    assert script and (REPO / next(w for w in words if w.endswith(".py"))).is_file(), cmd.text
    if script in TRAIN_SCRIPTS:
        index = next(i for i, w in enumerate(words) if w.endswith(".py"))
        check_train_flags(script, words[index + 1:])
        out = runner.run(words + runner.train_overrides(config_of(words)), env)
        assert "Avg train loss=" in out, (f"trained nothing (an earlier command of this part used the "
                                          f"same run folder?): {cmd.text}\n{out[-1500:]}")
    elif script == "convert_checkpoint.py":  # the runs' folders: under this test's --expdir
        runner.run([str(runner.tmp / w) if w.startswith("logs/") else w for w in words], env)
    elif script == "make_synthetic_era5.py":
        runner.run(words + ["--output_dir", str(runner.tmp / "generated"), "--samples_per_year", "3",
                            "--quiet"], env)
    elif script in SCRIPT_OVERRIDES:
        runner.run(words + SCRIPT_OVERRIDES[script](runner), env)
    else:
        raise AssertionError(f"no rule to run {script}: add one to SCRIPT_OVERRIDES in {__file__}")


def trained_tiny_run(runner: Runner) -> Path:
    runner.run([sys.executable, "train.py", "--config", "tiny", "--run_num", "for_plots",
                *runner.train_overrides("tiny")], {})
    return runner.tmp / "logs" / "tiny" / "1GPU" / "for_plots"


SCRIPT_OVERRIDES = {
    "plot_training.py": lambda runner: ["--out", str(runner.tmp / "training.png")],  # reads example_logs
    "plot_prediction.py": lambda runner: [
        "--run_dir", str(trained_tiny_run(runner)), "--out", str(runner.tmp / "prediction.png")],
    "mp_memory.py": lambda runner: [],  # no data, no output files: runs as written
    "sharding_report.py": lambda runner: [  # 1 and 2 ranks, one step each
        "--ranks", "1", "2", "--steps", "1", "--out", str(runner.tmp / "sharding"),
        "--", "--data_dir", str(runner.data_for("tiny_large"))],
    "pipeline_report.py": lambda runner: [  # two schedules on 2 stages, 4 micro-batches, 2 steps
        "--schedules", "1f1b", "zero_bubble", "--stages", "2", "--microbatches", "4", "--steps", "2",
        "--batch", "8",
        "--out", str(runner.tmp / "pipeline"), "--", "--data_dir", str(runner.data_for("tiny_deep"))],
    # the two runs of the README's commands just before it, and the committed example
    "plot_model_sizes.py": lambda runner: [
        "--run_dirs", *(str(runner.tmp / "logs" / c / "1GPU" / "sizes") for c in ("tiny_small",
                                                                                  "tiny_large")),
        "example_logs/tiny/1GPU/demo", "--out", str(runner.tmp / "sizes.png")],
    # reads the trace of the README's profiling command, run earlier in the same part
    "plot_profile.py": lambda runner: [
        "--run_dir", str(runner.tmp / "logs" / "tiny_short" / "1GPU" / "profile"),
        "--out", str(runner.tmp / "profile.png")],
    "benchmark.py": lambda runner: [  # one rung, one step (the full ladder: test_ladder.py)
        "--data_dir", str(runner.data_for("small")), "--rungs", "baseline", "--steps", "1",
        "--warmup", "0", "--profile_steps", "1", "--loader_batches", "1", "--matmul_size", "64",
        "--no_bare", "--out_dir", str(runner.tmp / "benchmark")],
}


def check_srun(cmd: Command, runner: Runner) -> None:
    """`srun python X.py ...` on a GPU node (CUDA Graphs): the script exists and its flags parse."""
    _, words = cmd.env_and_words
    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    script = Path(words[index]).name
    assert script in TRAIN_SCRIPTS and (REPO / words[index]).is_file(), cmd.text
    check_train_flags(script, words[index + 1:])


def check_sbatch(cmd: Command, runner: Runner) -> None:
    """The script exists, its sbatch options are known, its arguments parse as train flags."""
    env, words = cmd.env_and_words
    words = words[1:]
    while words and words[0].startswith("-"):
        option = words.pop(0)
        name = option.split("=", 1)[0]
        if name in SBATCH_FLAGS:
            continue
        assert name in SBATCH_OPTIONS_WITH_VALUE, f"unknown sbatch option {option} in: {cmd.text}"
        if "=" not in option:
            value = words.pop(0)
            if name in ("-N", "--nodes", "-n", "--ntasks"):
                assert value.isdigit(), cmd.text
    script, args = words[0], words[1:]
    assert script in SUBMIT_SCRIPTS and (REPO / script).is_file(), f"no submit script {script}"
    check_train_flags(SUBMIT_SCRIPTS[script], args)
    for key in env:
        assert key in SUBMIT_ENV, f"{key} is not read by the submit scripts"
        assert key in (REPO / "scripts" / "slurm_common.sh").read_text(), key


SUBMIT_ENV = {"DATADIR", "LOGDIR", "IMAGE", "ENABLE_PROFILING", "PROFILE_OUTPUT", "REQUEUE"}


def check_make(cmd: Command, runner: Runner) -> None:
    """`make X`: the target exists (dry run). `make test` is what CI runs; `make train` what
    the end-to-end test exercises; running them here would recurse or duplicate."""
    _, words = cmd.env_and_words
    result = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, (cmd.text, result.stderr)


def check_tensorboard(cmd: Command, runner: Runner) -> None:
    """A server that runs until stopped: the binary exists and the flags are TensorBoard's
    (test_notebook.py starts a real one)."""
    _, words = cmd.env_and_words
    assert Path(sys.executable).with_name("tensorboard").exists()
    assert words[1].startswith("--logdir"), cmd.text


def check_pytest(cmd: Command, runner: Runner) -> None:
    """Running the suite from inside itself would recurse: the files and markers must exist."""
    _, words = cmd.env_and_words
    args = words[words.index("pytest") + 1:]
    markers = (REPO / "pyproject.toml").read_text()
    for i, arg in enumerate(args):
        if arg.startswith("tests/"):
            assert (REPO / arg.split("::")[0]).is_file(), arg
        if arg == "-m":
            for word in re.findall(r"[a-z_]+", args[i + 1]):
                assert word in ("not", "and", "or") or f'"{word}:' in markers, f"unknown marker {word}"


RULES = [
    (r"^(\.venv/bin/)?python3? -m pytest\b", check_pytest),
    (r"^([A-Z_]+=\S+ )*(python3?|\.venv/bin/python|torchrun)\b", check_local_python),
    (r"^([A-Z_]+=\S+ )*sbatch\b", check_sbatch),
    (r"^make\b", check_make),
    (r"^srun\b", check_srun),
    (r"^\.venv/bin/tensorboard\b|^tensorboard\b", check_tensorboard),
]


def classify(cmd: Command):
    for pattern, check in RULES:
        if re.search(pattern, cmd.text):
            return check
    return None


COMMANDS = readme_commands()


def test_readme_has_commands():
    assert len(COMMANDS) > 10


def test_every_command_is_classified():
    unclassified = [f"README line {c.line}: {c.text}" for c in COMMANDS if classify(c) is None]
    assert not unclassified, "add a rule for:\n" + "\n".join(unclassified)


COMMAND_WORDS = ("python", "python3", "torchrun", "sbatch", "srun", "make", "pip", "tensorboard", "nsys",
                 ".venv/", "bash", "export", "cd ")


def test_shell_commands_are_only_in_bash_blocks():
    """A command in a block not marked ```bash would escape the checks: mark the block."""
    block, offenders = None, []  # block: the open code block's language, None outside blocks
    for number, line in enumerate(README.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            block = stripped[3:] if block is None else None
            continue
        if block is not None and block not in ("bash", "sh", "shell") and stripped.startswith(COMMAND_WORDS):
            offenders.append(f"line {number}: {stripped}")
    assert not offenders, "commands outside ```bash blocks:\n" + "\n".join(offenders)


def test_parser_joins_continuations_and_drops_comments():
    text = ("```bash\nsbatch -N 4 x.sh \\\n  --config=a   # note\n# only a comment\n```\n"
            "```\nnot a command\n```\n")
    assert [c.text for c in readme_commands(text)] == ["sbatch -N 4 x.sh --config=a"]


def readme_parts(commands: list[Command], text: str | None = None) -> dict[str, list[Command]]:
    """The commands under each `## ` heading of the README, in README order."""
    text = README.read_text() if text is None else text
    headings = [(n, line[3:].strip()) for n, line in enumerate(text.splitlines(), 1)
                if line.startswith("## ")]
    parts: dict[str, list[Command]] = {}
    for cmd in commands:
        title = next((t for n, t in reversed(headings) if n < cmd.line), "top")
        parts.setdefault(title, []).append(cmd)
    return parts


PARTS = readme_parts(COMMANDS)


def test_parts_group_commands_in_order():
    text = "## A\n```bash\npython a.py\n```\n## B\n```bash\npython b.py\npython c.py\n```\n"
    parts = readme_parts(readme_commands(text), text)
    assert {k: [c.text for c in v] for k, v in parts.items()} == {
        "A": ["python a.py"], "B": ["python b.py", "python c.py"]}


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("part", list(PARTS), ids=[re.sub(r"\W+", "-", p).strip("-") for p in PARTS])
def test_part_in_order(part, tmp_path):
    """One folder for the whole part: a command that collides with an earlier one fails."""
    runner = Runner(tmp_path)
    for cmd in PARTS[part]:
        check = classify(cmd)
        if check is None:
            pytest.fail(f"unclassified README command at line {cmd.line}: {cmd.text}")
        try:
            check(cmd, runner)
        except AssertionError as err:
            raise AssertionError(f"README line {cmd.line}: {cmd.text}\n{err}") from None


@pytest.mark.slow
def test_a_command_that_trains_nothing_fails(tmp_path):
    """Two README commands with the same run folder: the second finds the run finished."""
    runner = Runner(tmp_path)
    cmd = Command(1, "python train.py --config tiny_short")
    check_local_python(cmd, runner)
    with pytest.raises(AssertionError, match="trained nothing"):
        check_local_python(cmd, runner)
