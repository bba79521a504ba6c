"""Every shell command of the course (README.md and the pages in docs/) is checked, in the order
a learner runs them: the pages in the order of the README's table, in one working folder.

Each command of a ```bash block is classified by the first rule below that matches it:
commands that can run here are run with a small override (few steps, small data, a
temporary output folder shared by every command of the course, as one clone is) and must succeed,
and a training command must train (a command that lands in the folder of an earlier one and
finds nothing to do fails); paths under logs/ are taken inside that folder. Slurm, GPU-only
and long-running commands are checked statically
(the script, configuration, flags and files they name must exist and parse). A command that
no rule matches fails the test: a new command on a page must be classified here. Links and
images between the pages, and the code ranges a page points to, are checked too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from scripts.code_ranges import CODE_RANGE, refresh, span
from scripts.page_figures import FIGURES, Figure
from scripts.page_figures import check as figure_check
from scripts.page_stats import Command, readme_commands
from tests.conftest import REPO, subprocess_env
from utils.config import DEFAULT_YAML, available_configs, load_config
from utils.synthetic_era5 import generate

README = REPO / "README.md"
DOCS = REPO / "docs"


def course_pages() -> list[Path]:
    """README.md, then the pages its table links, in the table's order, then any other page."""
    linked = []
    for name in re.findall(r"\]\((docs/[\w.-]+\.md)\)", README.read_text()):
        if REPO / name not in linked:
            linked.append(REPO / name)
    rest = [p for p in sorted(DOCS.glob("*.md")) if p not in linked]
    return [README, *linked, *rest]


PAGES = course_pages()
TRAIN_SCRIPTS = {"train.py", "train_graph.py", "train_mp.py"}
OUTPUT_FLAGS = ("--out", "--out_dir", "--output_dir", "--expdir")
SUBMIT_SCRIPTS = {"submit_pm.sh": "train.py", "submit_pm_dp.sh": "train.py",
                  "submit_pm_mp.sh": "train_mp.py"}
SBATCH_OPTIONS_WITH_VALUE = {"-N", "--nodes", "-n", "--ntasks", "-t", "--time", "-A", "--account",
                             "-q", "--qos", "-C", "--constraint", "-J", "--job-name",
                             "--gpus-per-node", "--gpus-per-task", "--cpus-per-task", "-c",
                             "--ntasks-per-node", "--signal", "--reservation", "-o", "--output"}
SBATCH_FLAGS = {"--requeue", "--exclusive"}


def course_commands() -> list[Command]:
    return [cmd for page in PAGES
            for cmd in readme_commands(page.read_text(), page.relative_to(REPO).as_posix())]


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
        self.seconds: list[tuple[float, str]] = []  # each command's run time (shown with -s)
        self.outputs: list[str] = []  # what the commands printed since the last clear()
        self.slurm_conf: str | None = None  # the configuration of the local Slurm a page started

    def data_for(self, config: str) -> Path:
        size = load_config(DEFAULT_YAML, config).img_size
        if size not in self.data:
            out = self.tmp / f"data_{size[0]}x{size[1]}"
            generate(out, size, 24, {"train": [2016], "valid": [2017], "test": [2018]}, seed=0)
            self.data[size] = out
        return self.data[size]

    def in_logs(self, words: list[str]) -> list[str]:
        """Paths under logs/ (run folders, plots, reports) inside this test's folder."""
        return [str(self.tmp / w) if w.startswith("logs/") else w for w in words]

    def run(self, words: list[str], env: dict[str, str], timeout: float = 240) -> str:
        """The command, in a new process (`python SCRIPT`, torchrun and its ranks forked from a
        server that has imported torch: tests/fast_start/server.py)."""
        start = time.monotonic()
        result = subprocess.run(words, cwd=REPO, env=subprocess_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=timeout)
        self.seconds.append((time.monotonic() - start, " ".join(words)))
        self.outputs.append(result.stdout)
        assert result.returncode == 0, (words, result.stdout[-5000:])
        return result.stdout

    def train_overrides(self, config: str) -> list[str]:
        """One step (an epoch) of 16 samples: the command trains, validates and checkpoints."""
        return ["--num_iters", "1", "--limit_nsamples", "16", "--limit_nsamples_val", "8",
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


HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
DRY_RUN_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)  # scripts/dry_run.py


def needs_deepspeed(words: list[str]) -> bool:
    """A command of DeepSpeed's lesson (the optional install, `make deepspeed`)."""
    static = words[0] in ("make", "sbatch", "srun")  # checked without running: kept
    return ("deepspeed" in words or "--engine=deepspeed" in words
            or script_of(words) == "deepspeed_compare.py") and not static


def launched_ranks(words: list[str]) -> int:
    """Ranks a command starts: torchrun's --nproc_per_node, DeepSpeed's --num_gpus, else one."""
    for flag, value in zip(words, words[1:]):
        if flag in ("--nproc_per_node", "--nproc-per-node", "--num_gpus"):
            return int(value)
    for word in words:
        if word.startswith(("--nproc_per_node=", "--nproc-per-node=", "--num_gpus=")):
            return int(word.split("=", 1)[1])
    return 1


def planned_run_dir(words: list[str]) -> str | None:
    """The run folder a training command writes, as the page names it ('logs/tiny/2GPU_ds2/00'),
    resolved as the launcher resolves it; None for other commands."""
    script = script_of(words)
    if script not in TRAIN_SCRIPTS:
        return None
    from distributed.mesh import ParallelMesh, check_sizes, requested_sizes
    from training.launcher import DEFAULT_RUN_NUM, resolve_config, run_dir_for

    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    args = train_parser(script).parse_args(words[index + 1:])
    cfg = resolve_config(args)
    sizes = check_sizes(launched_ranks(words), requested_sizes(cfg.layout), cfg.parallel_order)
    mesh = ParallelMesh(sizes=sizes)
    folder = run_dir_for(cfg, args.config, args.run_num or DEFAULT_RUN_NUM, mesh, script == "train_mp.py")
    return folder.relative_to(cfg.exp_path.parent).as_posix() if not Path(cfg.expdir).is_absolute() \
        else folder.as_posix()


def outputs_of(words: list[str]) -> list[str]:
    """What a command writes that a later one may read: its run folder, its --out folder or file."""
    run = planned_run_dir(words)
    named = [value for flag, value in zip(words, words[1:]) if flag in OUTPUT_FLAGS]
    return ([run] if run else []) + named


def course_plan(commands: list[Command], have_deepspeed: bool = HAVE_DEEPSPEED,
                dry_run_torch: bool = DRY_RUN_TORCH) -> dict[Command, str]:
    """The commands the course check leaves out here, each with the reason: those of an optional
    part that is not installed, and every later command that reads what a left-out one writes
    (page 10 compares the DeepSpeed runs it starts: without DeepSpeed the comparison goes too)."""
    skipped: dict[Command, str] = {}
    missing: dict[str, Command] = {}  # output path -> the left-out command that writes it
    for cmd in commands:
        words = cmd.env_and_words[1]
        reason = None
        if needs_deepspeed(words) and not have_deepspeed:
            reason = "DeepSpeed is not installed (make deepspeed installs it)"
        elif script_of(words) == "dry_run.py" and not dry_run_torch:
            reason = "the dry run needs torch 2.11 or newer (tests/test_dry_run.py checks its refusal)"
        else:
            for word in words:
                source = next((c for out, c in missing.items() if word == out or word.startswith(out + "/")),
                              None)
                if source is not None:
                    reason = f"reads {word}, which the left-out command at {source.where} writes"
                    break
        if reason:
            skipped[cmd] = reason
            missing.update({out: cmd for out in outputs_of(words)})
    return skipped


def check_local_python(cmd: Command, runner: Runner) -> None:
    env, words = cmd.env_and_words
    words = runner.in_logs(python_words(words))
    script = script_of(words)
    assert script and (REPO / next(w for w in words if w.endswith(".py"))).is_file(), cmd.text
    if script in TRAIN_SCRIPTS:
        index = next(i for i, w in enumerate(words) if w.endswith(".py"))
        check_train_flags(script, words[index + 1:])
        overrides = runner.train_overrides(config_of(words))
        if "--profile_epoch" in words:  # its window is in the second epoch: two steps
            overrides[1] = "2"
        out = runner.run(words + overrides, env)
        assert "Avg train loss=" in out, (f"trained nothing (an earlier command of the course used the "
                                          f"same run folder?): {cmd.text}\n{out[-1500:]}")
    elif script == "convert_checkpoint.py":  # the runs' folders: under this test's --expdir
        runner.run(words, env)
    elif script == "make_synthetic_era5.py":
        runner.run(words + ["--output_dir", str(runner.tmp / "generated"), "--samples_per_year", "3",
                            "--quiet"], env)
    elif script in SCRIPT_OVERRIDES:
        runner.run(words + SCRIPT_OVERRIDES[script](runner), env)
    else:
        raise AssertionError(f"no rule to run {script}: add one to SCRIPT_OVERRIDES in {__file__}")


SCRIPT_OVERRIDES = {  # extra flags that make a script quick here; paths under logs/ are rewritten
    "plot_training.py": lambda runner: [],  # reads example_logs
    "plot_prediction.py": lambda runner: [],  # the run folder of the page's first training command
    "plot_model_sizes.py": lambda runner: [],  # the runs of the commands just before it
    "plot_profile.py": lambda runner: [],  # the trace of the profiling command before it
    "mp_memory.py": lambda runner: [],  # no data, no output files: runs as written
    "dry_run.py": lambda runner: [],  # fake tensors: no data, no output files, a few seconds
    "plot_memory.py": lambda runner: [],  # the two --memory_snapshot runs before it
    "sharding_report.py": lambda runner: [  # fsdp on 2 ranks, one step (ddp and zero1 are the same
        "--ranks", "2", "--modes", "fsdp", "--steps", "1", "--checkpointing", "full",  # code with other
        # flags; "none" is the ranks' code again; test_sharded.py measures what each mode holds)
        "--", "--data_dir", str(runner.data_for("tiny_large"))],
    "pipeline_report.py": lambda runner: [  # zero bubble (F, B and W parts) on 2 stages, 2 steps
        "--schedules", "zero_bubble", "--stages", "2", "--microbatches", "4", "--steps", "2",
        "--batch", "8", "--", "--data_dir", str(runner.data_for("tiny_deep"))],
    "comm_overlap.py": lambda runner: [  # one step of each variant, one DDP bucket size
        "--steps", "1", "--warmup", "0", "--bucket_mb", "1"],
    "compare_runs.py": lambda runner: [],  # the runs of the commands before it
    "plot_experts.py": lambda runner: [],  # the mixture-of-experts run before it
    "lr_range_test.py": lambda runner: [  # 6 steps from 1e-6 to 1 (diverged or not, it suggests)
        "--steps", "6", "--data_dir", str(runner.data_for("tiny")), "--expdir", str(runner.tmp / "logs")],
    "batch_scaling.py": lambda runner: [  # one run: batch 16 as 2 micro-batches of 8, LAMB
        "--batches", "16", "--micro_batch", "8", "--optimizers", "LAMB", "--samples", "16",
        "--data_dir", str(runner.data_for("tiny")), "--expdir", str(runner.tmp / "logs")],
    "deepspeed_compare.py": lambda runner: [  # one row, one step (the other rows are the same code
        "--layouts", "deepspeed 2", "--steps", "1", "--batch", "4",  # with other flags)
        "--", "--data_dir", str(runner.data_for("tiny"))],
    "cost_model.py": lambda runner: [  # calibrated on 2 ranks, briefly; the check of dp2 alone (4
        # steps); flags a command's mode does not use are ignored (test_cost_model.py checks layouts)
        "--calibrate_ranks", "2", "--calibrate_calls", "4", "--calibrate_seconds", "0.05",
        "--only", "dp2", "--steps", "4",
        "--data_dir", str(runner.data_for("tiny"))],
    "async_sgd.py": lambda runner: [  # 4 updates of batches of 16 samples
        "--num_iters", "4", "--limit_nsamples", "32", "--limit_nsamples_val", "8", "--log_every", "2",
        "--data_dir", str(runner.data_for("tiny")), "--expdir", str(runner.tmp / "logs")],
    "async_report.py": lambda runner: [  # every part, each run 2 steps or 4 updates on 2 ranks
        "--stages", "2", "--timeline_stages", "2", "--microbatches", "2", "--batch", "8",
        "--pipeline_steps", "2", "--throughput_steps", "2", "--lrs", "0.001",
        "--sgd_updates", "4", "--slow_ms", "20", "--val_samples", "8",
        "--", "--limit_nsamples", "32", "--data_dir", str(runner.data_for("tiny"))],
    "hang_demo.py": lambda runner: ["--timeout", "1"],  # both cases; it fails if no rank is named
    "freeze_report.py": lambda runner: [  # 2 steps per number of frozen blocks of `tiny` (its 4
        # blocks), 4 of fine-tuning, the pipeline shrinking within 4 steps
        "--config", "tiny", "--epoch_steps", "1", "--finetune_steps", "4", "--freeze_every", "2",
        "--pipeline_steps", "4", "--pipeline_freeze_steps", "1", "2", "3", "--batch", "8",
        "--data_dir", str(runner.data_for("tiny"))],
    "benchmark.py": lambda runner: [  # one rung, one step of batch 2 (the full ladder: test_ladder.py)
        "--data_dir", str(runner.data_for("small")), "--rungs", "baseline", "--steps", "1", "--batch", "2",
        "--warmup", "0", "--profile_steps", "1", "--loader_batches", "1", "--matmul_size", "64",
        "--shape_seconds", "0.01", "--no_bare", "--out_dir", str(runner.tmp / "logs" / "benchmark")],
}


def check_deepspeed_launcher(cmd: Command, runner: Runner) -> None:
    """`deepspeed --num_gpus N train.py ...`: DeepSpeed's launcher (as a module of this
    interpreter), which starts the ranks with --local_rank."""
    env, words = cmd.env_and_words
    words = runner.in_logs(words)
    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    check_train_flags(Path(words[index]).name, words[index + 1:])
    out = runner.run([sys.executable, "-m", "deepspeed.launcher.runner", *words[1:]]
                     + runner.train_overrides(config_of(words)), env)
    assert "--local_rank=1" in out, out[-1500:]


def check_srun(cmd: Command, runner: Runner) -> None:
    """`srun python X.py ...` or `bash srun_pm.sh X.py ...` in an allocation on a GPU node: the
    script exists and a training script's flags parse (tests/test_perlmutter_commands.py checks
    the rest: layout, memory, container, paths)."""
    _, words = cmd.env_and_words
    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    script = Path(words[index]).name
    assert (REPO / words[index]).is_file(), cmd.text
    if script in TRAIN_SCRIPTS:
        check_train_flags(script, words[index + 1:])
    else:
        assert config_of(words) in available_configs(), cmd.text


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


def check_slurm_harness(cmd: Command, runner: Runner) -> None:
    """`python3 tests/slurm_harness.py start --nodes 2 DIR` (and `stop DIR`): a local Slurm cluster,
    which needs root, starts daemons and edits /etc/hosts, so it is not started here
    (tests/test_slurm_nodes.py starts one); the arguments parse with the harness's own parser."""
    from tests.slurm_harness import SlurmCluster, arg_parser

    _, words = cmd.env_and_words
    try:
        args = arg_parser().parse_args(words[2:])
    except SystemExit as err:
        raise AssertionError(f"tests/slurm_harness.py rejects {words[2:]}") from err
    if args.action == "start":
        runner.slurm_conf = str(SlurmCluster(args.folder).conf)


def check_export(cmd: Command, runner: Runner) -> None:
    """`export SLURM_CONF=...` names the configuration of the cluster the page started just before;
    `export OMP_NUM_THREADS=N` a number of threads."""
    _, words = cmd.env_and_words
    assert len(words) == 2, cmd.text
    name, _, value = words[1].partition("=")
    if name == "SLURM_CONF":
        assert value == runner.slurm_conf, f"{value} is not the slurm.conf of the cluster started before " \
                                           f"({runner.slurm_conf})"
    else:
        assert name == "OMP_NUM_THREADS" and value.isdigit(), f"no rule for {cmd.text}"


def check_make(cmd: Command, runner: Runner) -> None:
    """`make train` runs what it stands for, `python train.py --config tiny`, in the course's
    folder (a later command that lands in its run folder must not find it done). Other targets
    are dry runs: the target exists. `make test` is what CI runs, the others set up or check."""
    _, words = cmd.env_and_words
    if words[1:] == ["train"]:
        check_local_python(Command(cmd.line, "python train.py --config tiny", cmd.page), runner)
        return
    result = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, (cmd.text, result.stderr)


def check_activate(cmd: Command, runner: Runner) -> None:
    """`source .venv/bin/activate`: the environment `make venv` makes (the suite runs in one)."""
    _, words = cmd.env_and_words
    assert words == ["source", ".venv/bin/activate"], cmd.text
    assert "-m venv $(VENV)" in (REPO / "Makefile").read_text()


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
    (r"^python3? tests/slurm_harness\.py\b", check_slurm_harness),
    (r"^export [A-Z_]+=", check_export),
    (r"^([A-Z_]+=\S+ )*(python3?|\.venv/bin/python|torchrun)\b", check_local_python),
    (r"^([A-Z_]+=\S+ )*sbatch\b", check_sbatch),
    (r"^make\b", check_make),
    (r"^srun\b|^bash srun_pm\.sh ", check_srun),
    (r"^deepspeed\b", check_deepspeed_launcher),
    (r"^\.venv/bin/tensorboard\b|^tensorboard\b", check_tensorboard),
    (r"^source \.venv/bin/activate$", check_activate),
]


def classify(cmd: Command):
    for pattern, check in RULES:
        if re.search(pattern, cmd.text):
            return check
    return None


COMMANDS = course_commands()
COURSE_PLAN = course_plan(COMMANDS)  # what this machine leaves out, and why


def test_the_course_has_its_pages_and_commands():
    assert [p.name for p in PAGES[:2]] == ["README.md", "01-single-device.md"] and len(PAGES) >= 7
    assert len(COMMANDS) > 40


def test_without_deepspeed_what_reads_its_runs_is_left_out_too():
    """As if DeepSpeed were missing: its commands are left out, and so is every command that reads
    what they write (the comparison of page 10's runs failed a fresh clone's `make test`)."""
    plan = course_plan(COMMANDS, have_deepspeed=False)
    compare = [c for c in COMMANDS if "compare_runs.py" in c.text and "2GPU_ds2" in c.text]
    assert compare and all("reads logs/tiny/2GPU_ds2/00" in plan[c] for c in compare)
    assert any(needs_deepspeed(c.env_and_words[1]) for c in plan)
    missing = {out for c in plan for out in outputs_of(c.env_and_words[1])}
    for cmd in COMMANDS:
        if cmd not in plan:
            assert not any(w == out or w.startswith(out + "/") for w in cmd.env_and_words[1]
                           for out in missing), f"{cmd.where} reads what a left-out command writes"
    assert course_plan(COMMANDS, have_deepspeed=True, dry_run_torch=True) == {}
    old_torch = course_plan(COMMANDS, have_deepspeed=True, dry_run_torch=False)  # 2.8: the dry run out
    assert [script_of(c.env_and_words[1]) for c in old_torch] == ["dry_run.py"]


def test_planned_run_folders_are_the_launchers():
    assert planned_run_dir(shlex.split("torchrun --standalone --nproc_per_node 2 train.py --config tiny "
                                       "--engine deepspeed --zero_stage 3 --cpu_offload")) == \
        "logs/tiny/2GPU_ds3_offload/00"
    assert planned_run_dir(shlex.split("torchrun --nproc_per_node=4 train_mp.py --config tiny "
                                       "--tensor_parallel 2 --run_num x")) == "logs/tiny/4GPU_tp2_cp1_dp2/x"
    assert planned_run_dir(["python", "scripts/plot_training.py"]) is None


def test_every_command_is_classified():
    unclassified = [f"{c.where}: {c.text}" for c in COMMANDS if classify(c) is None]
    assert not unclassified, "add a rule for:\n" + "\n".join(unclassified)


COMMAND_WORDS = ("python", "python3", "torchrun", "sbatch", "srun", "make", "pip", "tensorboard", "nsys",
                 ".venv/", "bash", "export", "cd ", "source ", "deepspeed ")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shell_commands_are_only_in_bash_blocks(page):
    """A command in a block not marked ```bash would escape the checks: mark the block."""
    block, offenders = None, []  # block: the open code block's language, None outside blocks
    for number, line in enumerate(page.read_text().splitlines(), 1):
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


def test_commands_write_only_under_logs_or_data():
    """A command of the course never writes over the repository's own files (a plot into
    docs/img, a report into the root): its outputs go under logs/ (or data/ for data)."""
    offenders = []
    for cmd in COMMANDS:
        words = cmd.env_and_words[1]
        for flag, value in zip(words, words[1:]):
            if flag in OUTPUT_FLAGS and not value.startswith(("logs/", "data/", "$")):
                offenders.append(f"{cmd.where}: {flag} {value}")
    assert not offenders, "\n".join(offenders)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_images_resolve(page):
    """Relative links and images work on GitHub: the file exists (from the page's folder) and
    an anchor names a heading of the page it points to."""
    text, problems = page.read_text(), []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            if anchor not in headings:
                problems.append(f"{target}: no heading with that anchor")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_a_range_that_moved_is_rewritten_across_a_line_break():
    start, end = span(REPO / "distributed" / "parallelize.py", ["materialize"])
    text, moved = refresh("`distributed/parallelize.py` lines\n  1-2 (`materialize`): built")
    assert text == f"`distributed/parallelize.py` lines\n  {start}-{end} (`materialize`): built" and moved


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_ranges_point_at_their_code(page):
    """"`training/trainer.py` lines 118-180 (`train_step`, `train_epoch`)": the file has those
    lines, and the names given span exactly them (scripts/code_ranges.py --fix updates them)."""
    problems = []
    for path, start, end, names in CODE_RANGE.findall(page.read_text()):
        wanted = re.findall(r"`(\w+)`", names)
        now = span(REPO / path, wanted) if (REPO / path).is_file() else None
        if not wanted or now != (int(start), int(end)):
            problems.append(f"{path} lines {start}-{end} ({', '.join(wanted) or 'no names'}): the "
                            f"code is at {now}")
    assert not problems, (f"{page.name}:\n" + "\n".join(problems)
                          + "\nrun python scripts/code_ranges.py --fix")


def test_code_range_references_are_found_across_line_breaks():
    text = "see `a/b.py`\n  lines 3-9 (`f`,\n  `g`) and `c.py` lines 1-2 (`h`)"
    assert CODE_RANGE.findall(text) == [("a/b.py", "3", "9", "`f`,\n  `g`"), ("c.py", "1", "2", "`h`")]


def walk_figures(page: Path, cmd: Command) -> list[Figure]:
    """The figures of the page, independent of the run's length, that this command prints."""
    return [f for f in FIGURES if f.walk and f.page == page.stem and f.command == cmd.text]


def test_figures_are_on_their_pages_and_the_walk_runs_their_commands():
    """Each figure of scripts/page_figures.py is in its page's "What you should see"; one the walk
    checks is printed by a command of the page's bash blocks."""
    for fig in FIGURES:
        page = DOCS / f"{fig.page}.md"
        seen = page.read_text().split("## What you should see", 1)[1].split("\n## ", 1)[0]
        assert " ".join(fig.text.split()) in " ".join(seen.split()), f"{page.name} does not show {fig.text!r}"
        if fig.walk:
            assert fig.command in [c.text for c in readme_commands(page.read_text(), page.name)], \
                f"{fig.command!r} is not a command of {page.name}: the walk would not check {fig.text!r}"


def test_a_figure_the_command_no_longer_prints_fails():
    fig = Figure("05-model-parallel", "python x.py", r'"saved_MiB": ([\d.]+)', "| tp = 4 | 1.14 | [9.07] |")
    assert figure_check(fig, '{"saved_MiB": 9.0712}') is None
    assert "says 9.07" in figure_check(fig, '{"saved_MiB": 9.0812}')
    assert "printed nothing" in figure_check(fig, "other output")
    millions = Figure("01", "c", r"(\d+) parameters", "([0.89]M", scale=1e-6)
    assert figure_check(millions, "892096 parameters") is None
    study = Figure("08", "c", r"loss ([\d.]+)", "| 16 | [0.515] |")  # 0.5145 may be 0.51452
    assert figure_check(study, "loss 0.5145") is None and "says 0.515" in figure_check(study, "loss 0.5144")
    assert "says 0.408277" in figure_check(Figure("03", "c", r"loss ([\d.]+)", "[0.408277]"), "loss 0.408278")
    rate = Figure("02", "c", r"([\d.]+) samples/s", "about [140] samples/s", within=0.3)
    assert figure_check(rate, "170.2 samples/s") is None
    assert "more than 30% off" in figure_check(rate, "190.0 samples/s")


def test_figures_are_read_from_a_learners_day(tmp_path):
    """page_figures.py --day: what scripts/course_day.py's commands printed, by command; a folder
    without its day.json is refused in one line."""
    from scripts.page_figures import day_outputs

    (tmp_path / "01.log").write_text("Avg val loss=0.0137\n")
    (tmp_path / "day.json").write_text('{"commands": [{"command": "python train.py --config tiny", '
                                       '"log": "01.log"}]}')
    assert day_outputs([tmp_path]) == {"python train.py --config tiny": "Avg val loss=0.0137\n"}
    with pytest.raises(SystemExit, match=r"^error: .*no day.json of scripts/course_day.py$"):
        day_outputs([tmp_path / "missing"])


def page_id(page: Path) -> str:
    return page.stem


@pytest.fixture(scope="module")
def course_runner(tmp_path_factory) -> Runner:
    """One folder for the whole course, as one learner's clone: pages share their runs."""
    return Runner(tmp_path_factory.mktemp("course"))


@pytest.mark.slow
@pytest.mark.course
@pytest.mark.xdist_group("course")
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_in_order(page, course_runner):
    """The page's commands, after those of the pages before it (the tests run in the pages'
    order on one worker): a command that collides with an earlier one of any page fails."""
    left_out, wrong = COURSE_PLAN, []
    if left_out and os.environ.get("REQUIRE_DEEPSPEED"):
        pytest.fail("REQUIRE_DEEPSPEED is set but DeepSpeed is not installed: run make deepspeed")
    for cmd in [c for c in COMMANDS if c.page == page.relative_to(REPO).as_posix()]:
        check = classify(cmd)
        if check is None:
            pytest.fail(f"unclassified command at {cmd.where}: {cmd.text}")
        if cmd in left_out:  # its flags still parse; shown in the warnings summary
            words = cmd.env_and_words[1]
            if script_of(words) in TRAIN_SCRIPTS:
                index = next(i for i, w in enumerate(words) if w.endswith(".py"))
                check_train_flags(script_of(words), words[index + 1:])
            warnings.warn(f"course check left out {cmd.where}: {cmd.text[:100]}: {left_out[cmd]}",
                          stacklevel=1)
            continue
        course_runner.outputs.clear()
        try:
            check(cmd, course_runner)
        except AssertionError as err:
            raise AssertionError(f"{cmd.where}: {cmd.text}\n{err}") from None
        printed = "\n".join(course_runner.outputs)
        wrong += [problem for fig in walk_figures(page, cmd) if (problem := figure_check(fig, printed))]
    for seconds, words in course_runner.seconds:
        print(f"{seconds:6.1f} s  {words[:160]}")
    course_runner.seconds.clear()
    assert not wrong, "figures of the page that the commands no longer print:\n" + "\n".join(wrong)


@pytest.mark.slow
@pytest.mark.course
def test_a_command_that_trains_nothing_fails(tmp_path):
    """Two commands with the same run folder: the second finds the run finished. `make train`
    stands for `python train.py --config tiny`, so that command after it is such a pair."""
    runner = Runner(tmp_path)
    check_make(Command(1, "make train"), runner)
    with pytest.raises(AssertionError, match="trained nothing"):
        check_local_python(Command(2, "python train.py --config tiny"), runner)


NAMED_IN_FILE = re.compile(r"`(\w+)(?:\.\w+)?` \(`([\w/]+\.py)`")  # "`ShardedSampler` (`utils/era5.py`)"
FILE_AND_NAME = re.compile(r"`([\w/]+\.py):(\w+)`")  # "`utils/device.py:nvtx_range`"


def defines(path: Path, name: str) -> bool:
    return bool(re.search(rf"^\s*(def|class) {name}\b|^{name}\s*[:=]", path.read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_files_and_names_on_a_page_exist(page):
    """Every project file a page names exists, and a name it places in a file is defined there
    (a page once sent readers to utils/data_loader.py for a class then in utils/sampler.py)."""
    text, problems = page.read_text(), []
    for path in set(re.findall(r"`((?:utils|training|distributed|networks|scripts|tests|exercises)/\w+\.py)",
                               text)):
        if not (REPO / path).is_file():
            problems.append(f"{path}: no such file")
    for name, path in NAMED_IN_FILE.findall(text) + [(n, p) for p, n in FILE_AND_NAME.findall(text)]:
        if (REPO / path).is_file() and not defines(REPO / path, name):
            problems.append(f"{name} is not defined in {path}")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_a_name_placed_in_the_wrong_file_is_found():
    wrong = "`ShardedSampler` (`utils/era5.py`) and `utils/device.py:nvtx_range`"
    assert [(n, p) for n, p in NAMED_IN_FILE.findall(wrong)] == [("ShardedSampler", "utils/era5.py")]
    assert not defines(REPO / "utils" / "era5.py", "ShardedSampler")
    assert defines(REPO / "utils" / "data_loader.py", "ShardedSampler")
    assert FILE_AND_NAME.findall(wrong) == [("utils/device.py", "nvtx_range")]


def test_every_test_file_is_described_in_docs_tests_md():
    """docs/tests.md says what each test file checks: a new file brings its row."""
    text = (DOCS / "tests.md").read_text()
    missing = [p.name for p in sorted((REPO / "tests").glob("test_*.py")) if f"`{p.name}`" not in text]
    assert not missing, f"add a row to docs/tests.md for {missing}"
