#!/usr/bin/env python
"""Check a CUDA machine end to end within ten minutes on one GPU, and write one report.

    make gpu-check                                    # or: python scripts/gpu_check.py
    python scripts/gpu_check.py --skip tests --out /tmp/gpu_check

Checks, each isolated (one that fails is reported and the others still run):

* ``tests``: every ``cuda``-marked test (``pytest -m cuda``, on 2 workers where pytest-xdist is
  installed), reported per *part* of the course (tests/gpu_parts.py: DeepSpeed, expert
  parallelism, compression hooks, the hang diagnosis on NCCL, FSDP offload, HSDP, ZeRO-1, memory
  snapshots, the cost model, context and sequence parallelism, the pipeline schedules, fp16,
  clipping, resuming, sharded checkpoints, stop signals, LAMB, torch.compile, CUDA graphs, the
  benchmark, DALI): pass, fail or skipped with the reason, and each test's numbers (losses against
  one process, memory, rates). Multi-rank tests run over NCCL with a rank per GPU where there are
  GPUs enough; with fewer, their ranks share the GPUs over gloo where gloo does their collectives
  for GPU tensors, and the others are skipped with the reason (pipelines: gloo has no send/recv
  for GPU tensors; the hang diagnosis on NCCL: NCCL refuses two ranks on one GPU);
* ``data``: synthetic data at the real 360 x 720 size, generated into a temporary folder
  (the three checks below train and read it);
* ``train_vs_graph``: train.py and train_graph.py on a ``short``-sized model, same seed,
  same steps, bf16; every epoch's logged training and validation loss must agree within
  ``--loss_rtol``;
* ``dali``: the DALI GPU pipeline's batches against the PyTorch loader's (skipped when DALI
  is not importable);
* ``ladder``: scripts/benchmark.py's rungs on the same model and data, one process per rung:
  samples/s and MFU per rung.

Time: the whole check has ``--budget_s`` (600 s), shared out in SHARES_S: each check must end by
the time its share and those of the checks before it have run out (a check that ends early leaves
its time to the next), and a check (or test) still running then is stopped and reported as not
finished. The shares are estimates (tests/gpu_parts.py says how the tests' was made); no GPU has
run this version yet.

OUT/report.md and OUT/report.json hold the versions (torch, CUDA, cuDNN, NCCL, DALI), the GPU,
every part's and check's result (pass, fail or skipped, with the reason) and their numbers;
OUT/logs holds each subprocess's output (OUT/logs/parts: every test's jobs). Exit code 0 when
nothing failed, 1 otherwise; on a machine without CUDA the script stops with one line and exit
code 2. It runs with whatever python starts it (torch 2.8 to 2.15; pytest for the tests) and
installs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.gpu_parts import NOT_RUN  # noqa: E402 (standard library only, like this script's start)

log = logging.getLogger("gpu_check")

CHECKS = ("tests", "data", "train_vs_graph", "dali", "ladder")
# what each check imports beyond torch (module: the package that brings it). A GPU image may have
# only torch, h5py and tensorboard: a check that lacks one of these is skipped, naming it, and the
# others run (docs/gpu-check.md: `make gpu-wheels` and `make gpu-check-deps` bring the pure-Python
# ones to a machine without a package index). DALI is optional inside its checks (dali_status).
PROJECT = {"ruamel.yaml": "ruamel.yaml", "h5py": "h5py"}  # the configuration and the data
NEEDS: dict[str, dict[str, str]] = {
    "tests": {"pytest": "pytest", "pytest_timeout": "pytest-timeout", **PROJECT},
    "data": PROJECT, "train_vs_graph": PROJECT, "dali": PROJECT, "ladder": PROJECT,
}
HOW_TO_GET = "make gpu-wheels and make gpu-check-deps: docs/gpu-check.md"
# what parts of the check use where present (module: package); the report names the missing ones
OPTIONAL = {"ruamel.yaml": "ruamel.yaml", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
            "xdist": "pytest-xdist", "nvidia.dali": "DALI", "deepspeed": "DeepSpeed",
            "matplotlib": "matplotlib"}
NEEDS_DATA = ("train_vs_graph", "dali", "ladder")
# each check's share of the default budget, in seconds (estimates: no GPU has run this check): the
# tests, about 490 s of jobs on one GPU in one pytest worker by tests/gpu_parts.py's estimates (about
# half that on 2 workers, with pytest-xdist); 36 samples of 360 x 720 (about 0.75 s each on one CPU
# core); 2 x 12 steps of `short` with 12 validations each; 11 DALI batches; the ladder's rungs (about 10 s
# each, torch.compile's first compile of `short` about a minute) get what the checks before leave
# them, and the rungs past the end are reported "not run: out of time"
SHARES_S = {"tests": 490, "data": 25, "train_vs_graph": 30, "dali": 15, "ladder": 40}
BUDGET_S = sum(SHARES_S.values())
CONFIG = "gpu_check"  # the config the runs use: `short` on the generated data
IMG_SIZE = (360, 720)
VALID_SAMPLES = 16  # validation samples per epoch of the training runs
REPORT = "report"
# a batch the DALI pipeline gives must equal the PyTorch loader's up to the last bit of the
# normalisation, which runs on the GPU there (as tests/test_dali.py)
DALI_RTOL = DALI_ATOL = 1e-6
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Context:
    args: argparse.Namespace
    out: Path  # the report folder
    work: Path  # temporary: data, training runs, benchmark output
    yaml: Path | None = None  # the runs' config file, once the data exists
    dali_error: str | None = None  # why DALI cannot be imported, if it cannot
    deadline: float = math.inf  # time.monotonic() by which the running check must end
    parts: dict[str, Any] | None = None  # the tests' results by part (tests/gpu_parts.py)

    def time_left(self) -> float:
        """Seconds a subprocess of the running check may take: --timeout, or less before the
        check's deadline."""
        return max(1.0, min(self.args.timeout, self.deadline - time.monotonic()))


# ------------------------------------------------------------------ results ---
def result(status: str, reason: str = "", **details: Any) -> dict[str, Any]:
    return {"status": status, "reason": reason, **details}


def passed(reason: str = "", **details: Any) -> dict[str, Any]:
    return result("pass", reason, **details)


def failed(reason: str, **details: Any) -> dict[str, Any]:
    return result("fail", reason, **details)


def skipped(reason: str, **details: Any) -> dict[str, Any]:
    return result("skipped", reason, **details)


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return False


def missing(check: str) -> list[str]:
    """The packages ``check`` needs and this python cannot import."""
    return [package for module, package in NEEDS.get(check, {}).items() if not importable(module)]


def needs_text(packages: list[str]) -> str:
    return f"needs {', '.join(packages)} ({HOW_TO_GET})"


def run_check(name: str, check: Callable[[Context], dict[str, Any]], ctx: Context) -> dict[str, Any]:
    """One check's result; an exception inside it is its failure, not the script's."""
    t0 = time.perf_counter()
    try:
        out = check(ctx)
    except Exception as err:  # isolation is the point
        log.exception("check %s raised", name)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        out = failed(f"{type(err).__name__}: {first} (traceback in gpu_check.log)")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def deadlines(start: float, budget_s: float, names: list[str]) -> dict[str, float]:
    """When each check must end: ``start`` plus its share of ``budget_s`` and those of the
    checks before it (SHARES_S, scaled to the budget)."""
    scale, end, out = budget_s / BUDGET_S, start, {}
    for name in names:
        end += SHARES_S.get(name, 0) * scale
        out[name] = end
    return out


def run_plan(plan: list[tuple[str, Callable[[Context], dict[str, Any]]]], ctx: Context,
             report: dict[str, Any], skip: set[str]) -> None:
    """Run the checks in order into ``report["checks"]``, each within its deadline, rewriting the
    report after each one (a later crash or kill still leaves the results so far)."""
    ends = deadlines(time.monotonic(), ctx.args.budget_s, [name for name, _ in plan])
    for name, check in plan:
        ctx.deadline = ends[name]
        if name in skip:
            res = skipped(f"--skip {name}")
            if name == "tests":  # the report still names every part
                from tests import gpu_parts

                ctx.parts = gpu_parts.all_skipped("--skip tests")
        elif missing(name):
            res = skipped(needs_text(missing(name)))
            if name == "tests":
                from tests import gpu_parts

                ctx.parts = gpu_parts.all_skipped(res["reason"])
        elif name in NEEDS_DATA and ctx.yaml is None:
            res = skipped("no data: the data check did not produce it")
        elif time.monotonic() >= ctx.deadline:
            res = skipped(f"{NOT_RUN}: the checks before it used its share of the {ctx.args.budget_s:.0f} s "
                          f"budget")
        else:
            print(f"{name} ...", flush=True)
            res = run_check(name, check, ctx)
        report["checks"][name] = res
        print(f"{name:<15} {res['status']:<8} {res.get('seconds', 0):6.0f} s  {res['reason']}", flush=True)
        if name == "tests" and ctx.parts:
            report["parts"] = ctx.parts
            for part, r in ctx.parts.items():
                print(f"  {part:<17} {r['status']:<8} {r['seconds']:6.0f} s  {r['reason']}", flush=True)
        write_report(report, ctx.out)


# --------------------------------------------------------------- processes ---
def child_env() -> dict[str, str]:
    """This environment for the project's scripts: no launcher variables (a child must not think
    it is one rank of many), the repository on the path before whatever the python needs."""
    from scripts.workers import with_repo_on_path
    from utils.device import cuda_available

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    if cuda_available():  # under pytest: no forks of the suite's fork server, unproven with CUDA
        env = {k: v for k, v in env.items() if not k.startswith("FAST_START_")}
    env["PYTHONUNBUFFERED"] = "1"
    return with_repo_on_path(env)


def run_logged(cmd: list[str], log_path: Path, timeout: float, **env: str) -> int | None:
    """Run ``cmd`` in the repository with its output in ``log_path`` (and ``env`` added to the
    environment); its exit code, or None when it ran past ``timeout`` seconds (it and its
    children are then killed)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("running %s (output in %s)", " ".join(cmd), log_path)
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**child_env(), **env},
                                start_new_session=True)  # its own process group, to stop it whole
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tail_reason(log_path: Path, limit: int = 300) -> str:
    """The line of a log that most likely says what went wrong."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no output ({log_path} unreadable)"
    if not lines:
        return "no output"
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return (errors or lines)[-1][:limit]


def exit_text(rc: int | None, timeout: float) -> str:
    return f"ran past {timeout:.0f} s" if rc is None else f"exited with {rc}"


# ------------------------------------------------------------- environment ---
def refusal() -> str | None:
    """One line saying why this machine cannot run the check, or None when it can."""
    try:
        import torch
    except Exception as err:  # a broken torch install is reported in one line too
        first = (str(err).strip().splitlines() or [""])[0]
        return (f"error: {sys.executable} cannot import torch ({type(err).__name__}: {first}); run "
                f"gpu_check.py with a python that has torch 2.8 or newer: make gpu-check PYTHON=/path/to/"
                f"python (on a GPU node, the container's), or activate .venv (make venv) first")
    from utils.compat import check_torch
    from utils.device import cuda_available

    problem = check_torch()
    if problem:
        return f"error: {problem}"
    if not cuda_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"error: gpu_check.py needs a GPU with CUDA, and torch {torch.__version__} ({build}) "
                f"finds none on this machine; run it on a GPU node (make test checks everything else)")
    return None


def dali_status() -> tuple[str | None, str | None]:
    """(DALI version, None) or (None, why it cannot be imported)."""
    try:
        import nvidia.dali as dali
    except Exception as err:  # any import failure means: no DALI here
        return None, f"{type(err).__name__}: {err}"
    return getattr(dali, "__version__", "unknown"), None


def nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.strip().splitlines()
    return lines[0].strip() if res.returncode == 0 and lines else None


def environment() -> dict[str, Any]:
    """Versions and the GPU."""
    import torch

    from utils import device as dev

    facts = dev.gpu_facts(0)
    nccl, cudnn = facts.pop("nccl"), facts.pop("cudnn")
    dali_version, dali_error = dali_status()
    pytest_spec = importlib.util.find_spec("pytest")
    return {
        "python": platform.python_version(), "python_executable": sys.executable, "host": platform.node(),
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "cudnn": cudnn, "nccl": nccl, "driver": nvidia_driver(),
        "dali": dali_version, "dali_error": dali_error,
        "pytest": _version_of("pytest") if pytest_spec else None,
        "gpu": facts,
    }


def safe_environment() -> dict[str, Any]:
    """environment(), or what went wrong asking for it (the checks still run); either way the
    optional packages this python lacks."""
    lacking = {"missing": [package for module, package in OPTIONAL.items() if not importable(module)]}
    try:
        return {**environment(), **lacking}
    except Exception as err:  # isolation, as for the checks
        log.exception("reading the environment failed")
        return {"error": f"{type(err).__name__}: {err}", "dali_error": dali_status()[1], **lacking}


def _version_of(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------- tests ---
def pytest_command(results: Path, workers: int) -> list[str]:
    """pytest on every `cuda` test of the part table's files (less those it leaves out), the table's
    plugin writing each test's result to ``results``; on ``workers`` pytest-xdist workers when
    there are more than one and pytest-xdist is installed."""
    from tests import gpu_parts

    files = sorted({name.split("::")[0] for name in gpu_parts.TESTS})
    xdist = workers > 1 and importlib.util.find_spec("xdist") is not None
    spread = ["-n", str(workers), "--dist", "load"] if xdist else []
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "tests.gpu_parts", "-p", "no:cacheprovider",
            "-q", "-rs", *spread, *[f"--deselect={name}" for name in gpu_parts.left_out()], *files]


def check_tests(ctx: Context, gpus: int | None = None) -> dict[str, Any]:
    """The `cuda` tests, then every part's result from theirs (``ctx.parts``)."""
    from tests import gpu_parts
    from utils import device as dev

    gpus = dev.gpu_count() if gpus is None else gpus
    logs = ctx.out / "logs"
    results, log_path = logs / "cuda_tests.jsonl", logs / "cuda_tests.log"
    results.unlink(missing_ok=True)
    timeout = ctx.time_left()
    rc = run_logged(pytest_command(results, ctx.args.test_workers), log_path, timeout,
                    **{gpu_parts.RESULTS_ENV: str(results), "GPU_CHECK_LOGS": str(logs / "parts")})
    found = gpu_parts.read_results(results)
    if rc is None:  # stopped at the tests' share: those that did not finish were not run
        not_run = f"{NOT_RUN}: the tests' {timeout:.0f} s share ran out (logs/cuda_tests.log)"
    else:
        not_run = f"did not run: pytest exited with {rc}: {tail_reason(log_path)} (logs/cuda_tests.log)"
    ctx.parts = gpu_parts.part_results(found, gpus, not_run)
    counts = {s: sum(r["outcome"] == s for r in found.values()) for s in ("passed", "failed", "skipped")}
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
               f"(logs/cuda_tests.log)")
    bad = [name for name, r in ctx.parts.items() if r["status"] == "fail"]
    cut = f"; {NOT_RUN} after {timeout:.0f} s: the parts' rows name the tests not run" if rc is None else ""
    if bad:
        return failed(f"{summary}; failing parts: {', '.join(bad)}{cut}", **counts)
    if rc is None:
        return (passed if counts["passed"] else skipped)(f"{summary}{cut}", **counts)
    if rc not in (0, 1) and not found:
        return failed(f"pytest exited with {rc} and ran no test: {tail_reason(log_path)}", **counts)
    if not counts["passed"]:  # with CUDA here, every cuda test skipped means something is off
        return failed(f"{summary}: no cuda test ran", **counts)
    return passed(summary, **counts)


# -------------------------------------------------------------------- data ---
def write_run_config(cfg: Any, path: Path) -> Path:
    """``cfg`` as configuration CONFIG of a YAML file the project's scripts read."""
    from ruamel.yaml import YAML

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        YAML().dump({CONFIG: cfg.to_dict()}, f)
    return path


def check_data(ctx: Context) -> dict[str, Any]:
    from utils.config import DEFAULT_YAML, load_config, with_overrides
    from utils.synthetic_era5 import generate

    a = ctx.args
    data = ctx.work / "data"
    generate(data, IMG_SIZE, a.samples_per_year, {"train": [2016], "valid": [2017], "test": []},
             seed=0)
    cfg = with_overrides(load_config(DEFAULT_YAML, "short"), data_dir=str(data), img_size=IMG_SIZE,
                         expdir=str(ctx.work / "runs"), global_batch_size=a.batch,
                         limit_nsamples_val=VALID_SAMPLES, num_data_workers=a.workers)
    ctx.yaml = write_run_config(cfg, ctx.work / "gpu_check.yaml")
    return passed(f"{a.samples_per_year} samples per split at {IMG_SIZE[0]} x {IMG_SIZE[1]}",
                  samples_per_year=a.samples_per_year, model=describe_model(cfg))


def describe_model(cfg: Any) -> str:
    m = cfg.model
    h, w = m.img_size
    return (f"ViT embed {m.embed_dim}, depth {m.depth}, {m.num_heads} heads, patch {m.patch_size} "
            f"on {h} x {w}, batch {cfg.optim.global_batch_size}")


# ---------------------------------------------------------- train vs graph ---
def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_losses(reference: list[dict[str, Any]], other: list[dict[str, Any]], rtol: float,
                   names: tuple[str, str] = ("train.py", "train_graph.py")) -> dict[str, Any]:
    """Every epoch's train_loss and val_loss (metrics.jsonl records) of two runs, compared."""
    if not reference or not other:
        return failed(f"no epoch was logged by {names[0] if not reference else names[1]}")
    steps = [r["step"] for r in reference], [r["step"] for r in other]
    if steps[0] != steps[1]:
        return failed(f"the runs logged at different steps: {steps[0]} and {steps[1]}")
    rows, worst = [], (0.0, "", 0)
    for a, b in zip(reference, other):
        row = {"epoch": a["epoch"], "step": a["step"]}
        for key in ("train_loss", "val_loss"):
            x, y = float(a[key]), float(b[key])
            if not (math.isfinite(x) and math.isfinite(y)):
                return failed(f"epoch {a['epoch']}: {key} is {x} in {names[0]} and {y} in {names[1]}")
            rel = relative_difference(x, y)
            row[key] = [x, y]
            if rel >= worst[0]:
                worst = (rel, key, a["epoch"])
        rows.append(row)
    rel, key, epoch = worst
    details = {"rtol": rtol, "max_rel_diff": rel, "epochs": rows}
    where = f"epoch {epoch} {key}"
    if rel > rtol:
        x, y = next(r[key] for r in rows if r["epoch"] == epoch)
        return failed(f"{where}: {names[0]} {x:.6f}, {names[1]} {y:.6f} differ by {rel:.2%} "
                      f"(tolerance {rtol:.1%})", **details)
    return passed(f"{len(rows)} epochs to step {rows[-1]['step']}: losses agree within {rtol:.1%} "
                  f"(largest difference {rel:.3%}, {where})", **details)


def mean_rate(records: list[dict[str, Any]]) -> float:
    """Mean samples/s of the epochs after the first (warm-up, graph capture), or of the first."""
    rates = [r["samples_per_sec"] for r in records[1:] or records]
    return sum(rates) / len(rates)


RUNS = (("train", "train.py"), ("graph", "train_graph.py"))  # (run name, script): reference first


def check_train_vs_graph(ctx: Context, runs: tuple[tuple[str, str], ...] = RUNS) -> dict[str, Any]:
    from scripts.instruments import read_metrics
    from utils.config import load_config

    run_root = load_config(ctx.yaml, CONFIG).exp_path / CONFIG
    records = []
    for label, script in runs:
        log_path = ctx.out / "logs" / f"{label}.log"
        timeout = ctx.time_left()
        rc = run_logged([sys.executable, str(REPO / script), "--yaml_config", str(ctx.yaml),
                         "--config", CONFIG, "--run_num", label, "--num_iters", str(ctx.args.steps),
                         "--amp_mode", "bf16"], log_path, timeout)
        if rc is None and time.monotonic() >= ctx.deadline:
            return skipped(f"{NOT_RUN}: {script} stopped at the end of the check's share")
        if rc != 0:
            return failed(f"{script} {exit_text(rc, timeout)}: {tail_reason(log_path)}")
        found = sorted(run_root.glob(f"*/{label}/metrics.jsonl"))
        if not found:
            return failed(f"{script} wrote no metrics.jsonl")
        shutil.copy(found[0], ctx.out / "logs" / f"{label}_metrics.jsonl")
        records.append(read_metrics(found[0].parent))
    names = (runs[0][1], runs[1][1])
    res = compare_losses(records[0], records[1], ctx.args.loss_rtol, names)
    if records[0] and records[1]:
        res["samples_per_sec"] = {name: mean_rate(recs) for name, recs in zip(names, records)}
    return res


# -------------------------------------------------------------------- DALI ---
def dali_compare(yaml: Path, batch: int = 4) -> dict[str, Any]:
    """The DALI GPU pipeline's batches against the PyTorch loader's: two training epochs (two
    shuffles) and the validation set (its last batch partial). Runs in a child process."""
    from utils import device as dev
    from utils.config import load_config, with_overrides
    from utils.data_loader import get_data_loader
    from utils.data_loader_dali import DALIBatches

    cfg = with_overrides(load_config(yaml, CONFIG), num_data_workers=1, limit_nsamples=4 * batch,
                         limit_nsamples_val=2 * batch + 2)
    device = dev.pick_device(0)
    compared, worst = 0, 0.0
    for split, train, epochs in (("train", True, (0, 1)), ("valid", False, (0,))):
        dali = DALIBatches(cfg, split, batch, train, device=device)
        try:
            for epoch in epochs:
                loader, _, sampler = get_data_loader(cfg, split, batch, train)
                sampler.set_epoch(epoch)
                dali.set_epoch(epoch)
                for got, ref in itertools.zip_longest(dali, loader):
                    if got is None or ref is None:
                        return failed(f"{split} epoch {epoch}: DALI and PyTorch give different numbers "
                                      f"of batches")
                    for a, b in zip(got, ref):
                        a = a.cpu()
                        if a.shape != b.shape:
                            return failed(f"{split} epoch {epoch}: DALI batch of shape {tuple(a.shape)}, "
                                          f"PyTorch {tuple(b.shape)}")
                        diff = (a - b).abs()
                        worst = max(worst, diff.max().item())
                        if bool((diff > DALI_ATOL + DALI_RTOL * b.abs()).any()):
                            return failed(f"{split} epoch {epoch}: values differ by up to "
                                          f"{diff.max().item():.3g}", max_abs_diff=worst)
                    compared += 1
        finally:
            dali.close()
    dev.synchronize(device)
    return passed(f"{compared} batches (train epochs 0 and 1, valid) equal within rtol {DALI_RTOL:g}, "
                  f"atol {DALI_ATOL:g} (largest difference {worst:.3g})", batches=compared,
                  max_abs_diff=worst)


def check_dali(ctx: Context) -> dict[str, Any]:
    if ctx.dali_error:
        return skipped(f"NVIDIA DALI is not importable ({ctx.dali_error})")
    out = ctx.work / "dali.json"
    log_path = ctx.out / "logs" / "dali.log"
    timeout = ctx.time_left()
    rc = run_logged([sys.executable, str(Path(__file__).resolve()), "--dali_worker", str(ctx.yaml),
                     str(out)], log_path, timeout)
    if rc != 0 or not out.is_file():
        return failed(f"the DALI comparison {exit_text(rc, timeout)}: {tail_reason(log_path)}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------ ladder ---
def run_rung(ctx: Context, name: str) -> dict[str, Any]:
    a = ctx.args
    slug = name.lstrip("+")
    bench_dir = ctx.work / "ladder" / slug
    log_path = ctx.out / "logs" / f"ladder_{slug}.log"
    timeout = ctx.time_left()
    rc = run_logged([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--yaml_config",
                     str(ctx.yaml), "--config", CONFIG, "--rungs", name, "--no_bare",
                     "--steps", str(a.ladder_steps), "--warmup", "3", "--profile_steps", "2",
                     "--loader_batches", "4", "--workers", str(a.workers), "--amp", "bf16",
                     "--matmul_size", str(a.matmul_size),
                     "--out_dir", str(bench_dir)], log_path, timeout)
    if rc is None and time.monotonic() >= ctx.deadline:
        return skipped(f"{NOT_RUN}: stopped at the end of the ladder's share")
    if rc != 0:
        return failed(f"benchmark.py {exit_text(rc, timeout)}: {tail_reason(log_path)}")
    bench = json.loads((bench_dir / "benchmark.json").read_text())
    shutil.copy(bench_dir / "benchmark.md", ctx.out / "logs" / f"ladder_{slug}.md")
    if not bench["rungs"]:  # its reason is a line 'skipping NAME: why' on stderr
        lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith(f"skipping {name}")]
        return skipped(lines[-1] if lines else "benchmark.py left it out")
    r = bench["rungs"][0]
    if "failed" in r:  # its training loss is not finite: not timed
        return failed(f"the rung does not train: {r['failed']}", settings=r["settings"])
    details = {k: r[k] for k in ("samples_per_sec", "mfu", "mfu_shapes", "step_ms", "breakdown_ms",
                                 "peak_memory_bytes", "warmup_seconds", "settings")}
    details.update(matmul_peak_flops=bench["matmul_peak_flops"], shape_peak_flops=bench["shape_peak_flops"],
                   flops_per_sample=bench["flops_per_sample"])
    if not 0 < r["mfu"] <= 1:
        return failed(f"MFU {r['mfu']:.0%} is outside (0, 100%]: the matmul peak or the FLOP count "
                      f"is wrong", **details)
    return passed("", **details)


def check_ladder(ctx: Context) -> dict[str, Any]:
    rungs = []
    for name in ctx.args.rungs:
        if name == "+DALI" and ctx.dali_error:
            res = skipped("NVIDIA DALI is not importable; the later rungs keep the PyTorch DataLoader")
        elif time.monotonic() >= ctx.deadline:
            res = skipped(f"{NOT_RUN}: the ladder's share of the {ctx.args.budget_s:.0f} s budget was spent")
        else:
            print(f"  rung {name} ...", flush=True)
            res = run_check(f"ladder {name}", lambda c, n=name: run_rung(c, n), ctx)
        rungs.append({"name": name, **res})
    bad = [r["name"] for r in rungs if r["status"] == "fail"]
    measured = [r for r in rungs if r["status"] == "pass"]
    if bad:
        return failed(f"rung(s) {', '.join(bad)} failed (logs/ladder_*.log)", rungs=rungs)
    if not measured:
        return skipped("no rung ran", rungs=rungs)
    best = max(measured, key=lambda r: r["samples_per_sec"])
    return passed(f"{len(measured)} rung{'s' * (len(measured) != 1)} measured; fastest {best['name']}: "
                  f"{best['samples_per_sec']:.1f} samples/s, MFU {best['mfu']:.1%}", rungs=rungs)


# ------------------------------------------------------------------ report ---
def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """OUT/report.json (everything) and OUT/report.md (for people)."""
    from scripts import instruments

    return instruments.write_report(out, REPORT, markdown(report), report)


def overall(report: dict[str, Any]) -> dict[str, int]:
    """Results counted over the parts and the checks; the tests check, which the parts detail,
    only when there are no parts or it failed for a reason no part shows (no test ran, say)."""
    counts = {"pass": 0, "fail": 0, "skipped": 0}
    parts = report.get("parts") or {}
    part_failed = any(r["status"] == "fail" for r in parts.values())
    tests = report["checks"].get("tests", {}).get("status")
    own = not parts or (tests == "fail" and not part_failed)
    rows = [*parts.values(), *[r for name, r in report["checks"].items() if name != "tests" or own]]
    for res in rows:
        counts[res["status"]] = counts.get(res["status"], 0) + 1
    return counts


def markdown(report: dict[str, Any]) -> str:
    counts = overall(report)
    verdict = "FAIL" if counts["fail"] else "PASS"
    lines = [f"# GPU check: {verdict} ({counts['pass']} passed, {counts['fail']} failed, "
             f"{counts['skipped']} skipped)", "",
             f"{report.get('started', '')}; {report.get('seconds', 0):.0f} s; `{report.get('command', '')}`",
             ""]
    lines += _environment_md(report.get("environment", {}))
    lines += _parts_md(report.get("parts") or {})
    lines += ["## Checks", "", "| check | result | seconds | details |", "|---|---|---|---|"]
    for name, res in report["checks"].items():
        reason = _cell(res.get("reason", ""))
        lines.append(f"| {name} | {res['status']} | {res.get('seconds', 0):.0f} | {reason} |")
    lines += _losses_md(report["checks"].get("train_vs_graph", {}))
    lines += _ladder_md(report["checks"].get("ladder", {}), report["checks"].get("data", {}).get("model"),
                        report.get("options", {}))
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _parts_md(parts: dict[str, Any]) -> list[str]:
    """One row per part: its result, seconds, where its tests ran, their numbers, the reasons."""
    if not parts:
        return []
    from tests.gpu_parts import numbers_text, short

    lines = ["## Parts (the cuda tests, by tests/gpu_parts.py)", "",
             "| part | result | seconds | where | numbers | details |", "|---|---|---|---|---|---|"]
    for name, res in parts.items():
        tests = res["tests"]
        where = "; ".join(dict.fromkeys(t["where"] for t in tests if t["where"] and t["status"] != "skipped"))
        numbers = " / ".join((f"{short(t['test'])}: " if len(tests) > 1 else "") + numbers_text(t["numbers"])
                             for t in tests if t["numbers"])
        lines.append(f"| {name} | {res['status']} | {res['seconds']:.0f} | {_cell(where)} | {_cell(numbers)} "
                     f"| {_cell(res['title'] + ('. ' + res['reason'] if res['reason'] else ''))} |")
    return [*lines, ""]


def _environment_md(env: dict[str, Any]) -> list[str]:
    if not env:
        return []
    lacking = ([f"Not installed for this python: {', '.join(env['missing'])} (the parts that need them are "
                f"skipped; {HOW_TO_GET}).", ""] if env.get("missing") else [])
    if "error" in env:
        return [f"Reading the versions and the GPU failed: {env['error']}", "", *lacking]
    gpu = env.get("gpu", {})
    rows = [("GPU", f"{gpu.get('name')}, {gpu.get('memory_bytes', 0) / 2**30:.1f} GiB, compute capability "
                    f"{gpu.get('capability')} ({gpu.get('count')} visible)"),
            ("driver", env.get("driver") or "unknown"),
            ("torch", f"{env.get('torch')} (CUDA {env.get('cuda_runtime')}, cuDNN {env.get('cudnn')}, "
                      f"NCCL {env.get('nccl')})"),
            ("DALI", env.get("dali") or f"not importable ({env.get('dali_error')})"),
            ("Python", f"{env.get('python')} ({env.get('python_executable')})"),
            ("pytest", env.get("pytest") or "not installed")]
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "", *lacking]


def _losses_md(res: dict[str, Any]) -> list[str]:
    if not res.get("epochs"):
        return []
    lines = ["", f"## train.py against train_graph.py (bf16, tolerance {res['rtol']:.1%})", "",
             "| epoch | step | train loss: train.py | train_graph.py | val loss: train.py | train_graph.py |",
             "|---|---|---|---|---|---|"]
    for r in res["epochs"]:
        (t1, t2), (v1, v2) = r["train_loss"], r["val_loss"]
        lines.append(f"| {r['epoch']} | {r['step']} | {t1:.6f} | {t2:.6f} | {v1:.6f} | {v2:.6f} |")
    rates = res.get("samples_per_sec")
    if rates:
        speeds = ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        lines += ["", f"Samples/s after the first epoch: {speeds}."]
    return lines


def _ladder_md(res: dict[str, Any], model: str | None, options: dict[str, Any]) -> list[str]:
    rungs = res.get("rungs")
    if not rungs:
        return []
    lines = ["", "## Optimization ladder (scripts/benchmark.py, one process per rung)", "",
             f"{model or 'The `short` model'}; {options.get('ladder_steps')} timed steps per rung.", ""]
    peaks = next((r["matmul_peak_flops"] for r in rungs if "matmul_peak_flops" in r), None)
    if peaks:
        measured = ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in peaks.items())
        lines += [f"Matmul peak measured: {measured} (fp32 with TF32, as the trainer runs it).", ""]
    lines += ["| rung | result | samples/s | MFU | step ms | peak memory GiB | note |",
              "|---|---|---|---|---|---|---|"]
    for r in rungs:
        reason = str(r.get("reason", "")).replace("|", "\\|")
        if r["status"] != "pass":
            lines.append(f"| {r['name']} | {r['status']} | | | | | {reason} |")
            continue
        mem = r.get("peak_memory_bytes")
        mem_text = f"{mem / 2**30:.1f}" if mem else "n/a"
        note = f" {reason} " if reason else " "
        lines.append(f"| {r['name']} | pass | {r['samples_per_sec']:.2f} | {r['mfu']:.1%} "
                     f"| {r['step_ms']:.0f} | {mem_text} |{note}|")
    return lines


# -------------------------------------------------------------------- main ---
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="checks: " + ", ".join(CHECKS))
    p.add_argument("--out", type=Path, default=Path("logs/gpu_check"),
                   help="folder of the report and the logs (default: logs/gpu_check)")
    p.add_argument("--skip", action="append", default=[], metavar="CHECK",
                   help="leave a check out (repeat, or separate with commas): " + ", ".join(CHECKS))
    p.add_argument("--steps", type=int, default=12, help="training steps of train.py and train_graph.py")
    p.add_argument("--loss_rtol", type=float, default=0.02,
                   help="largest relative difference allowed between the two runs' logged losses")
    p.add_argument("--ladder_steps", type=int, default=5, help="timed steps per ladder rung")
    p.add_argument("--rungs", default=None,
                   help="comma-separated ladder rungs (default: all of scripts/benchmark.py's)")
    p.add_argument("--batch", type=int, default=16, help="global batch size (short's is 16)")
    p.add_argument("--workers", type=int, default=4, help="data loader workers")
    p.add_argument("--matmul_size", type=int, default=2048,
                   help="size of the square matmuls that measure each rung's peak FLOP/s (benchmark.py)")
    p.add_argument("--test_workers", type=int, default=2,
                   help="pytest-xdist workers of the tests, where pytest-xdist is installed (1: none)")
    p.add_argument("--samples_per_year", type=int, default=18,
                   help="synthetic samples per split (about 21 MB each at 360 x 720; 18: one batch "
                        "of 16 (t, t + 1) pairs and the validation's)")
    p.add_argument("--budget_s", type=float, default=BUDGET_S,
                   help=f"seconds the whole check may take (default {BUDGET_S}), shared out as "
                        + ", ".join(f"{k} {v}" for k, v in SHARES_S.items()))
    p.add_argument("--timeout", type=float, default=600, help="seconds each subprocess may run at most")
    p.add_argument("--work_dir", type=Path, default=None,
                   help="where the temporary data and runs go (default: the system's temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the temporary data and runs")
    p.add_argument("--dali_worker", nargs=2, metavar=("YAML", "OUT_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.skip = {s.strip() for item in args.skip for s in item.split(",") if s.strip()}
    unknown = args.skip - set(CHECKS)
    if unknown:
        p.error(f"unknown check(s) for --skip: {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    if min(args.steps, args.ladder_steps, args.batch, args.test_workers) < 1 or args.workers < 0 \
            or args.loss_rtol <= 0 or args.matmul_size < 2 or args.budget_s <= 0:
        p.error("--steps, --ladder_steps, --batch and --test_workers must be at least 1, --workers "
                "at least 0, --loss_rtol and --budget_s above 0")
    if args.samples_per_year < args.batch + 2:
        p.error(f"--samples_per_year must be at least --batch + 2 ({args.batch + 2}): one batch of "
                f"(t, t + 1) pairs")
    return args


def resolve_rungs(args: argparse.Namespace) -> str | None:
    """Turn --rungs into a list of names; a one-line error for unknown ones."""
    from scripts.benchmark import RUNG_NAMES

    names = [n.strip() for n in (args.rungs or ",".join(RUNG_NAMES)).split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNG_NAMES]
    if unknown:
        return f"error: unknown rung(s) {', '.join(unknown)}; choose from {', '.join(RUNG_NAMES)}"
    args.rungs = names
    return None


def setup_logging(path: Path) -> None:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


PLAN: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("tests", check_tests), ("data", check_data), ("train_vs_graph", check_train_vs_graph),
    ("dali", check_dali), ("ladder", check_ladder),
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dali_worker:  # the child process of the dali check
        yaml, out = args.dali_worker
        Path(out).write_text(json.dumps(dali_compare(Path(yaml))))
        return 0
    ladder = "ladder" not in args.skip and not missing("ladder")  # the rungs' names need the project
    problem = refusal() or (resolve_rungs(args) if ladder else None)
    if problem:
        sys.stderr.write(problem + "\n")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    setup_logging(args.out / "gpu_check.log")
    if set(NEEDS_DATA) <= args.skip:
        args.skip.add("data")
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.work_dir))
    ctx = Context(args=args, out=args.out, work=work)
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "options": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()
                    if k != "dali_worker"},
        "environment": safe_environment(),
        "checks": {},
    }
    env = report["environment"]
    ctx.dali_error = env.get("dali_error")
    if env.get("missing"):
        print(f"not installed: {', '.join(env['missing'])}; the parts that need them are skipped", flush=True)
    if "gpu" in env:
        print(f"{env['gpu']['name']}; torch {env['torch']}, CUDA {env['cuda_runtime']}, NCCL {env['nccl']}, "
              f"DALI {env['dali'] or 'not importable'}; report in {args.out}", flush=True)
    try:
        run_plan(PLAN, ctx, report, args.skip)
    finally:
        report["seconds"] = round(time.perf_counter() - t0, 1)
        md_path, _ = write_report(report, args.out)
        if args.keep:
            print(f"temporary data and runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    counts = overall(report)
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped in "
          f"{report['seconds']:.0f} s; report: {md_path} (and .json)")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
