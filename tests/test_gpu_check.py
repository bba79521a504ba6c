"""scripts/gpu_check.py: its refusal without CUDA, its report, its loss comparison, its check
isolation; the checks themselves on a GPU (marked cuda)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import gpu_check as gc
from tests import gpu_parts
from tests.conftest import REPO, subprocess_env

SCRIPT = REPO / "scripts" / "gpu_check.py"


# ----------------------------------------------------------------- refusal ---
def test_refuses_without_cuda_in_one_line(tmp_path):
    out = tmp_path / "report"
    # subprocess_env() hides every GPU (CUDA_VISIBLE_DEVICES=), so this runs on GPU machines too
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: gpu_check.py needs a GPU with CUDA"), res.stderr
    assert res.stdout == ""
    assert not out.exists()


BARE = ("ruamel", "ruamel.yaml", "nvidia.dali", "deepspeed", "matplotlib")  # a GPU image's python lacks them


def bare_python(folder: Path, fake_cuda: bool, absent: tuple[str, ...] = BARE) -> dict[str, str]:
    """The environment of a python that cannot import ``absent`` (a sitecustomize sets them to None
    in sys.modules) and, with ``fake_cuda``, believes it has a GPU."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["import sys", f"for name in {absent!r}:", "    sys.modules[name] = None"]
    if fake_cuda:
        lines += ["import torch", "torch.cuda.is_available = lambda: True"]
    (folder / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_a_gpu_machine_with_only_torch_gets_a_report_by_part(tmp_path):
    """torch, h5py and tensorboard but no ruamel.yaml, DALI, DeepSpeed or matplotlib (faked on a
    CPU: those modules unimportable, CUDA reported available): no traceback, every part and check
    skipped with what it needs, each missing piece named, exit status 0 (nothing failed)."""
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                         env=bare_python(tmp_path / "site", fake_cuda=True), cwd=REPO, timeout=120)
    said = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in said, said
    assert "not installed: ruamel.yaml, DALI, DeepSpeed, matplotlib" in res.stdout, said
    report = json.loads((out / "report.json").read_text())
    assert report["environment"]["missing"] == ["ruamel.yaml", "DALI", "DeepSpeed", "matplotlib"]
    assert {name: r["status"] for name, r in report["checks"].items()} == dict.fromkeys(gc.CHECKS, "skipped")
    assert report["checks"]["tests"]["reason"].startswith("needs ruamel.yaml (make gpu-wheels")
    assert report["checks"]["data"]["reason"].startswith("needs ruamel.yaml")
    assert list(report["parts"]) == [part.name for part in gpu_parts.PARTS]
    assert all(p["reason"].startswith("needs ruamel.yaml") for p in report["parts"].values())
    md = (out / "report.md").read_text()
    assert md.startswith(f"# GPU check: PASS (0 passed, 0 failed, {len(gpu_parts.PARTS) + 4} skipped)"), md
    assert "Not installed for this python: ruamel.yaml, DALI, DeepSpeed, matplotlib" in md


def test_a_test_file_skipped_as_it_is_collected_reports_its_tests(tmp_path):
    """tests/test_dali.py skips itself at collection where DALI is missing; its tests in the part
    table are reported skipped with that reason, not as tests that did not run."""
    results = tmp_path / "results.jsonl"
    env = {**bare_python(tmp_path / "site", fake_cuda=False, absent=("nvidia.dali",)),
           gpu_parts.RESULTS_ENV: str(results)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.gpu_parts", "-p", "no:cacheprovider",
                          "-q", "tests/test_dali.py"], cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 5, res.stdout + res.stderr  # pytest: no test ran
    found = gpu_parts.read_results(results)
    name = "tests/test_dali.py::test_gpu_pipeline_equals_pytorch"
    assert list(found) == [name] and found[name]["outcome"] == "skipped", found
    assert "nvidia.dali" in found[name]["reason"]
    row = gpu_parts.part_results(found, 1, "did not run")["dali_gpu"]["tests"][0]
    assert row["test"] == name and row["status"] == "skipped" and "nvidia.dali" in row["reason"], row


def test_tests_cut_off_by_the_budget_are_not_run_not_failed():
    parts = gpu_parts.part_results({}, 1, f"{gpu_parts.NOT_RUN}: the tests' 490 s share ran out")
    assert parts["hsdp"]["status"] == "skipped" and "not run: out of time" in parts["hsdp"]["reason"]
    assert parts["hsdp"]["status"] != "fail"
    assert gpu_parts.part_results({}, 1, "did not run: pytest exited with 4")["hsdp"]["status"] == "fail"


def test_the_gpu_wheels_hold_what_the_check_needs_and_every_dependency():
    """requirements-gpu-check.txt is installed with --no-deps on a machine without an index: it
    must name the packages the checks need (and pytest-xdist) and each one's dependencies, on
    Python 3.10 and newer, by the metadata of the versions installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (REPO / "requirements-gpu-check.txt").read_text()
    pinned = {canonicalize_name(n) for n in re.findall(r"^([\w.-]+)==\S+$", text, re.M)}
    wanted = {canonicalize_name(p) for needs in gc.NEEDS.values() for p in needs.values()} - {"h5py"}
    assert wanted | {"pytest-xdist"} <= pinned
    for name in pinned:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # pytest's for Python 3.10 only, not installed here
            continue
        for line in requires:
            req = Requirement(line)
            for version in ("3.10", "3.11", "3.12", "3.13"):
                if req.marker is None or req.marker.evaluate({"python_version": version, "extra": ""}):
                    assert canonicalize_name(req.name) in pinned, f"{name} needs {line} (Python {version})"
    make = (REPO / "Makefile").read_text()
    assert "--no-index --no-deps --find-links $(GPU_WHEELS)" in make and "GPU_WHEELS := logs/" in make


def test_help_needs_no_gpu():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert res.returncode == 0
    assert all(name in res.stdout for name in gc.CHECKS) and "--skip" in res.stdout


def test_options_are_checked():
    args = gc.parse_args(["--skip", "tests,dali", "--skip", "ladder"])
    assert args.skip == {"tests", "dali", "ladder"}
    with pytest.raises(SystemExit):
        gc.parse_args(["--skip", "benchmark"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--batch", "16", "--samples_per_year", "17"])  # 16 pairs need 18 steps
    args = gc.parse_args(["--rungs", "baseline, +AMP"])
    assert gc.resolve_rungs(args) is None and args.rungs == ["baseline", "+AMP"]
    assert gc.resolve_rungs(gc.parse_args(["--rungs", "baseline,+turbo"])).startswith(
        "error: unknown rung(s) +turbo")


# -------------------------------------------------------- loss comparison ---
def records(*losses: tuple[float, float]) -> list[dict]:
    return [{"epoch": i + 1, "step": 2 * (i + 1), "train_loss": t, "val_loss": v, "samples_per_sec": 10.0}
            for i, (t, v) in enumerate(losses)]


def test_losses_within_tolerance_pass():
    res = gc.compare_losses(records((1.0, 0.9), (0.8, 0.7)), records((1.001, 0.9), (0.8, 0.707)), 0.02)
    assert res["status"] == "pass", res["reason"]
    assert res["max_rel_diff"] == pytest.approx(0.007 / 0.707)
    assert "epoch 2 val_loss" in res["reason"]
    assert [r["train_loss"] for r in res["epochs"]] == [[1.0, 1.001], [0.8, 0.8]]


@pytest.mark.parametrize("other, message", [
    (records((1.0, 0.9), (0.8, 0.75)),
     "epoch 2 val_loss: train.py 0.700000, train_graph.py 0.750000 differ by 6.67% (tolerance 2.0%)"),
    (records((1.0, 0.9)), "the runs logged at different steps: [2, 4] and [2]"),
    (records((1.0, float("nan")), (0.8, 0.7)),
     "epoch 1: val_loss is 0.9 in train.py and nan in train_graph.py"),
    ([], "no epoch was logged by train_graph.py"),
])
def test_losses_that_disagree_fail_with_the_reason(other, message):
    res = gc.compare_losses(records((1.0, 0.9), (0.8, 0.7)), other, 0.02)
    assert res["status"] == "fail"
    assert res["reason"] == message


def test_mean_rate_leaves_out_the_first_epoch():
    recs = records((1.0, 1.0), (1.0, 1.0), (1.0, 1.0))
    for r, rate in zip(recs, (1.0, 10.0, 20.0)):
        r["samples_per_sec"] = rate
    assert gc.mean_rate(recs) == 15.0
    assert gc.mean_rate(recs[:1]) == 1.0


# ------------------------------------------------------------------ report ---
def sample_report() -> dict:
    losses = gc.compare_losses(records((1.0, 0.9), (0.8, 0.7)), records((1.001, 0.9), (0.8, 0.7)), 0.02)
    rung = gc.passed("", samples_per_sec=12.345, mfu=0.451, step_ms=1296.0, peak_memory_bytes=20 * 2**30,
                     matmul_peak_flops={"fp32": 4.0e14, "bf16": 8.0e14})
    return {
        "started": "2026-01-01 00:00:00 UTC", "seconds": 512.3, "command": "python scripts/gpu_check.py",
        "options": {"batch": 16, "ladder_steps": 10},
        "environment": {
            "torch": "2.13.0+cu128", "cuda_runtime": "12.8", "cudnn": 91002, "nccl": "2.27.3",
            "driver": "570.86", "dali": None, "dali_error": "ModuleNotFoundError: No module named 'nvidia'",
            "python": "3.12.3", "python_executable": "/usr/bin/python3", "pytest": "8.3.0",
            "gpu": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30, "capability": "9.0",
                    "count": 1}},
        "checks": {
            "tests": gc.passed("7 passed, 0 failed, 0 errors, 1 skipped", passed=7, failed=0, errors=0,
                               skipped=1, failing=[], seconds=81.0),
            "data": gc.passed("48 samples per split at 360 x 720", model="ViT embed 384, depth 12",
                              seconds=40.0),
            "train_vs_graph": {**losses, "samples_per_sec": {"train.py": 30.0, "train_graph.py": 31.5},
                               "seconds": 95.0},
            "dali": gc.skipped("NVIDIA DALI is not importable (No module named 'nvidia')", seconds=0.0),
            "ladder": gc.failed("rung(s) +compile failed (logs/ladder_*.log)", seconds=200.0, rungs=[
                {"name": "baseline", **rung},
                {"name": "+DALI", **gc.skipped("NVIDIA DALI is not importable")},
                {"name": "+compile", **gc.failed("benchmark.py exited with 1: InductorError | boom")},
            ]),
        },
    }


def test_report_writes_markdown_and_json(tmp_path):
    report = sample_report()
    md_path, json_path = gc.write_report(report, tmp_path / "out")
    assert (md_path.name, json_path.name) == ("report.md", "report.json")
    assert json.loads(json_path.read_text()) == report
    md = md_path.read_text()
    assert md.startswith("# GPU check: FAIL (3 passed, 1 failed, 1 skipped)\n")
    assert "| GPU | NVIDIA H100 80GB HBM3, 80.0 GiB, compute capability 9.0 (1 visible) |" in md
    assert "| torch | 2.13.0+cu128 (CUDA 12.8, cuDNN 91002, NCCL 2.27.3) |" in md
    assert "| DALI | not importable (ModuleNotFoundError: No module named 'nvidia') |" in md
    assert "| tests | pass | 81 | 7 passed, 0 failed, 0 errors, 1 skipped |" in md
    assert "| dali | skipped | 0 | NVIDIA DALI is not importable (No module named 'nvidia') |" in md
    assert "| 1 | 2 | 1.000000 | 1.001000 | 0.900000 | 0.900000 |" in md
    assert "train.py 30.0, train_graph.py 31.5" in md
    assert "ViT embed 384, depth 12; 10 timed steps per rung." in md
    assert "fp32 400.0 TFLOP/s, bf16 800.0 TFLOP/s" in md
    assert "| baseline | pass | 12.35 | 45.1% | 1296 | 20.0 | |" in md
    assert "| +DALI | skipped | | | | | NVIDIA DALI is not importable |" in md
    assert "| +compile | fail | | | | | benchmark.py exited with 1: InductorError \\| boom |" in md


def test_report_without_failures_passes(tmp_path):
    report = sample_report()
    del report["checks"]["ladder"]
    report["environment"] = {"error": "RuntimeError: CUDA error: unknown error"}
    md_path, _ = gc.write_report(report, tmp_path)
    md = md_path.read_text()
    assert md.startswith("# GPU check: PASS (3 passed, 0 failed, 1 skipped)\n")
    assert "Reading the versions and the GPU failed: RuntimeError: CUDA error: unknown error" in md
    assert "Optimization ladder" not in md


# --------------------------------------------------------------- isolation ---
def test_a_failing_check_is_reported_and_the_others_run(tmp_path, capsys, caplog):
    args = gc.parse_args(["--out", str(tmp_path / "out")])
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    report = {"started": "", "command": "", "options": {}, "environment": {}, "checks": {}}
    ran = []

    def fine(name):
        def check(c):
            ran.append(name)
            if name == "data":
                c.yaml = tmp_path / "run.yaml"
            return gc.passed("fine")
        return check

    def boom(c):
        ran.append("boom")
        raise RuntimeError("CUDA error: device-side assert triggered\nmore lines")

    plan = [("tests", boom), ("data", fine("data")), ("train_vs_graph", boom), ("dali", fine("dali")),
            ("ladder", fine("ladder"))]
    gc.run_plan(plan, ctx, report, skip={"dali"})
    checks = report["checks"]
    assert ran == ["boom", "data", "boom", "ladder"]
    assert [c["status"] for c in checks.values()] == ["fail", "pass", "fail", "skipped", "pass"]
    assert checks["tests"]["reason"].startswith("RuntimeError: CUDA error: device-side assert triggered (")
    assert checks["dali"]["reason"] == "--skip dali"
    assert "check tests raised" in caplog.text and "more lines" in caplog.text  # the whole traceback
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(written["checks"]) == ["tests", "data", "train_vs_graph", "dali", "ladder"]
    assert "ladder          pass" in capsys.readouterr().out


def test_checks_that_need_data_are_skipped_without_it(tmp_path):
    args = gc.parse_args(["--out", str(tmp_path / "out")])
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    report = {"checks": {}}

    def no_data(c):
        raise OSError("No space left on device")

    plan = [("data", no_data), *[(name, lambda c: gc.passed("ran")) for name in gc.NEEDS_DATA]]
    gc.run_plan(plan, ctx, report, skip=set())
    assert report["checks"]["data"]["reason"].startswith("OSError: No space left on device")
    for name in gc.NEEDS_DATA:
        assert report["checks"][name] == {"status": "skipped", "reason": "no data: the data check did not "
                                          "produce it"}


def test_subprocess_failures_and_timeouts_are_results(tmp_path):
    log = tmp_path / "child.log"
    rc = gc.run_logged([sys.executable, "-c", "print('loading'); import sys; sys.exit('error: bad data')"],
                       log, timeout=60)
    assert rc == 1 and gc.tail_reason(log) == "error: bad data"
    rc = gc.run_logged([sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(60)"],
                       log, timeout=1)
    assert rc is None and gc.exit_text(rc, 1) == "ran past 1 s"
    assert gc.tail_reason(log) == "waiting"


def test_data_check_writes_data_and_the_run_config(tmp_path, monkeypatch):
    from utils.config import load_config

    monkeypatch.setattr(gc, "IMG_SIZE", (16, 32))  # the real 360 x 720 takes minutes on a CPU
    args = gc.parse_args(["--samples_per_year", "20", "--batch", "4", "--workers", "1"])
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    res = gc.check_data(ctx)
    assert res["status"] == "pass", res
    cfg = load_config(ctx.yaml, gc.CONFIG)
    assert (cfg.img_size, cfg.global_batch_size, cfg.num_data_workers) == ((16, 32), 4, 1)
    assert cfg.embed_dim == load_config(REPO / "config" / "ViT.yaml", "short").embed_dim
    assert cfg.limit_nsamples_val == gc.VALID_SAMPLES
    assert (Path(cfg.data_dir) / "train" / "2016.h5").is_file()
    assert (Path(cfg.data_dir) / "valid" / "2017.h5").is_file()
    assert "patch 8 on 16 x 32, batch 4" in res["model"]


# ------------------------------------------- the checks on the test data ---
# Each check's subprocesses may run this long here, well inside pytest's limit for the test
# (pyproject.toml): a hung subprocess becomes a failed check that names it, not a pytest
# timeout with nothing to read (the script's default, 600 s, is for real GPU runs).
SUBPROCESS_LIMIT_S = 120


def small_ctx(cfg_factory, tmp_path: Path, rungs: str, steps: int = 8) -> gc.Context:
    """A context over the test data set: the tiny model, 4 steps per epoch."""
    args = gc.parse_args(["--out", str(tmp_path / "out"), "--steps", str(steps), "--ladder_steps", "2",
                          "--rungs", rungs, "--batch", "4", "--workers", "1", "--matmul_size", "256",
                          "--timeout", str(SUBPROCESS_LIMIT_S)])
    gc.resolve_rungs(args)
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path, dali_error=gc.dali_status()[1])
    cfg = cfg_factory(limit_nsamples=16, expdir=str(tmp_path / "runs"))
    ctx.yaml = gc.write_run_config(cfg, tmp_path / "run.yaml")
    return ctx


def test_the_checks_here_stop_their_subprocesses_before_pytest_stops_them():
    import re

    pytest_limit = int(re.search(r"^timeout = (\d+)$", (REPO / "pyproject.toml").read_text(), re.M).group(1))
    # a check runs at most two subprocesses in turn (the two trainings), each within the limit
    assert pytest_limit > 2 * SUBPROCESS_LIMIT_S
    assert gc.parse_args(["--timeout", str(SUBPROCESS_LIMIT_S)]).timeout == SUBPROCESS_LIMIT_S


@pytest.mark.slow
def test_two_runs_are_trained_and_compared(cfg_factory, tmp_path):
    """The subprocess and metrics.jsonl plumbing on CPU: train.py twice (train_graph.py needs CUDA)
    gives the same losses to the bit."""
    ctx = small_ctx(cfg_factory, tmp_path, "baseline", steps=4)
    res = gc.check_train_vs_graph(ctx, runs=(("first", "train.py"), ("second", "train.py")))
    assert res["status"] == "pass", res["reason"]
    assert [r["step"] for r in res["epochs"]] == [4] and res["max_rel_diff"] == 0.0
    assert (ctx.out / "logs" / "second_metrics.jsonl").is_file()
    ctx.args.steps = 0  # train.py refuses --num_iters 0
    broken = gc.check_train_vs_graph(ctx, runs=(("bad", "train.py"), ("second", "train.py")))
    assert broken["status"] == "fail" and broken["reason"].startswith("train.py exited with 2: error:")


def test_dali_check_compares_the_pipelines(cfg_factory, tmp_path):
    """On CPU the DALI pipeline runs on the CPU; the comparison and its child process are the same."""
    pytest.importorskip("nvidia.dali")
    ctx = small_ctx(cfg_factory, tmp_path, "baseline")
    res = gc.check_dali(ctx)
    assert res["status"] == "pass", res["reason"]
    assert res["batches"] == 4 + 4 + 3  # two training epochs of 16 samples, 10 validation samples
    ctx.dali_error = "ModuleNotFoundError: No module named 'nvidia'"
    assert gc.check_dali(ctx) == gc.skipped("NVIDIA DALI is not importable (ModuleNotFoundError: No "
                                            "module named 'nvidia')")


@pytest.mark.slow
def test_ladder_check_runs_the_benchmark_per_rung(cfg_factory, tmp_path):
    ctx = small_ctx(cfg_factory, tmp_path, "baseline")
    res = gc.check_ladder(ctx)
    assert res["status"] == "pass", res["reason"]
    (rung,) = res["rungs"]
    assert rung["name"] == "baseline" and rung["samples_per_sec"] > 0 and 0 < rung["mfu"] <= 1
    assert set(rung["matmul_peak_flops"]) == {"fp32", "bf16"}
    assert (ctx.out / "logs" / "ladder_baseline.md").is_file()


# ------------------------------------------------------------ the parts ---
# the GPU paths that had no GPU test: each must be a part's feature
ISSUE_FEATURES = (
    "DeepSpeed (any stage, offload)", "expert parallelism's all-to-all", "compression hooks",
    "the hang diagnosis on NCCL", "FSDP offload", "HSDP", "ZeRO-1", "memory snapshots",
    "the cost model's calibration and check", "context and sequence parallelism",
    "interleaved and zero-bubble schedules", "fp16 with its scaler", "clipping",
    "resume on a GPU (graphs to eager included)", "sharded (DCP) checkpoints on NCCL", "stop signals",
    "LAMB", "torch.compile with the parallel layouts",
    # the second review's: the GPU paths that had no test
    "the flushed schedules", "tensor parallel with DDP", "activation checkpointing and accumulation",
    "FSDP x tp offload",
)


def test_the_part_table_covers_every_unchecked_gpu_path():
    covered = {f for part in gpu_parts.PARTS for f in part.features}
    assert covered == set(ISSUE_FEATURES), (set(ISSUE_FEATURES) - covered, covered - set(ISSUE_FEATURES))
    named = [t for part in gpu_parts.PARTS for t in part.tests]
    assert set(named) == set(gpu_parts.TESTS)  # every test serves a part, every part's test exists
    assert len({part.name for part in gpu_parts.PARTS}) == len(gpu_parts.PARTS)
    assert all(part.tests for part in gpu_parts.PARTS)
    # a test named by the table is a cuda test of its file (the left-out ones are checked by name;
    # the others run, skipped, in test_the_tests_check_on_cpu_names_every_part)
    for name in gpu_parts.left_out():
        path, function = name.split("::")
        assert f"def {function.split('[')[0]}(" in (REPO / path).read_text(), name
    files = {name.split("::")[0] for name in gpu_parts.TESTS}
    marked = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("test_*.py")
              if "pytest.mark.cuda" in p.read_text()}
    assert marked <= files, f"cuda tests outside the part table's files: {marked - files}"


def test_the_plan_runs_ranks_over_nccl_or_gloo_and_names_what_cannot_run():
    plan, t = gpu_parts.plan, "tests/test_gpu_parts.py::"
    pipelines = [n for n in gpu_parts.TESTS if "test_pipeline_schedule" in n]
    assert len(pipelines) == 4
    for name in pipelines:  # one GPU: gloo cannot send GPU tensors
        backend, why = plan(name, 1)
        assert backend is None and why.startswith("needs 2 GPUs (1 visible): pipeline stages pass "
                                                  "activations with send and recv, which gloo does not do")
        assert plan(name, 2) == ("nccl", "NCCL, a rank per GPU (2 of 2)")
    assert plan(t + "test_hang_is_named_on_nccl", 1)[0] is None
    assert "NCCL refuses two ranks on one GPU" in plan(t + "test_hang_is_named_on_nccl", 1)[1]
    assert plan(t + "test_deepspeed_zero3_offload_two_ranks", 1)[0] is None
    assert plan(t + "test_hsdp_with_memory_snapshot", 1) == (
        "gloo", "gloo, 4 ranks sharing 1 GPU(s) (NCCL needs 4)")
    assert plan(t + "test_hsdp_with_memory_snapshot", 2)[0] == "gloo"
    assert plan(t + "test_hsdp_with_memory_snapshot", 4)[0] == "nccl"
    assert plan(t + "test_cost_model_calibrates_and_checks", 1) == ("one process", "one GPU")
    assert all(plan(name, 0) == (None, "needs a CUDA GPU") for name in gpu_parts.TESTS)
    assert gpu_parts.backend_flags("gloo") == ["--dist_backend", "gloo"]
    assert gpu_parts.backend_flags("nccl") == gpu_parts.backend_flags("one process") == []
    # what one GPU cannot check is said per part
    parts = gpu_parts.part_results({}, 1, "did not run")
    assert parts["schedules"]["status"] == "skipped" and "send and recv" in parts["schedules"]["reason"]
    assert parts["hang_nccl"]["status"] == "skipped"
    assert parts["hsdp"]["status"] == "fail" and parts["hsdp"]["reason"].endswith("did not run")


def test_the_tests_fit_their_share_of_the_ten_minutes():
    assert gc.BUDGET_S == 600 and gc.parse_args([]).budget_s == 600
    for gpus in (1, 2, 4):  # on make gpu-check's 2 workers, each starting the references once
        assert gpu_parts.estimated_seconds(gpus) / 2 + gpu_parts.REFERENCES_BUDGET_S <= gc.SHARES_S["tests"]
    # on one GPU (the machines lent for a check) in one worker: without pytest-xdist
    assert gpu_parts.estimated_seconds(1) <= gc.SHARES_S["tests"]


def _result(outcome, reason="", seconds=1.0, **numbers):
    return {"outcome": outcome, "reason": reason, "seconds": seconds, "numbers": numbers}


def test_parts_combine_their_tests_results():
    t = "tests/test_gpu_parts.py::"
    results = {
        t + "test_zero1_stop_signal_and_resume": _result("passed", seconds=20.0, max_rel_diff=1e-6),
        t + "test_context_and_sequence_parallel": _result("passed", seconds=10.0),
        t + "test_fsdp_offload_clipped_checkpointed": _result("failed", "AssertionError: boom"),
        t + "test_deepspeed_offload_one_process": _result("skipped", "DeepSpeed is not installed"),
        "tests/test_new.py::test_unlisted": _result("passed"),
    }
    parts = gpu_parts.part_results(results, 1, "not finished: the tests ran past their 300 s")
    assert parts["zero1"]["status"] == "pass" and parts["zero1"]["seconds"] == 20.0
    assert parts["zero1"]["tests"][0]["numbers"] == {"max_rel_diff": 1e-6}
    clipping = parts["clipping"]  # zero1 and tp x cp passed, FSDP offload failed
    assert clipping["status"] == "fail" and clipping["seconds"] == 31.0
    assert "test_fsdp_offload_clipped_checkpointed: AssertionError: boom" in clipping["reason"]
    assert ("a known defect it checks for: a checkpoint, clipping or LAMB's norms of shards held in host "
            "memory") in clipping["reason"]
    assert parts["deepspeed"]["status"] == "skipped"  # one skipped, the other cannot run on 1 GPU
    assert "DeepSpeed is not installed" in parts["deepspeed"]["reason"]
    assert "DeepSpeed gives each rank the GPU of its local rank" in parts["deepspeed"]["reason"]
    assert parts["experts"]["status"] == "fail"  # no result, and it could have run
    assert parts["experts"]["reason"].endswith("not finished: the tests ran past their 300 s")
    assert parts["gpu_check_small"]["tests"][1]["reason"] == gpu_parts.LEFT_OUT
    assert parts["unlisted"]["status"] == "fail"
    assert "not in tests/gpu_parts.py's table" in parts["unlisted"]["reason"]
    assert gpu_parts.numbers_text({"max_rel_diff": 1.5e-5, "val_loss": [0.5, 0.25], "steps": 6}) == (
        "max_rel_diff 1.5e-05; val_loss 0.500000 vs 0.250000; steps 6")


def test_the_results_plugin_writes_each_test_as_it_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no GPU here')\n\n"
        "def test_passes(record_property):\n    record_property('numbers', {'max_rel_diff': 0.5})\n\n"
        "def test_fails():\n    assert 1 == 2, 'the losses differ'\n\n"
        "def test_skips():\n    pytest.skip('needs 2 GPUs (1 visible)')\n\n"
        "def test_errors(broken):\n    pass\n")
    results = tmp_path / "results.jsonl"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.gpu_parts", "-p", "no:cacheprovider",
                          "-q", str(tmp_path / "test_sample.py")], cwd=REPO, capture_output=True, text=True,
                         env=subprocess_env(**{gpu_parts.RESULTS_ENV: str(results)}), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    found = {name.split("::")[1]: r for name, r in gpu_parts.read_results(results).items()}
    assert {k: r["outcome"] for k, r in found.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skips": "skipped", "test_errors": "failed"}
    assert found["test_passes"]["numbers"] == {"max_rel_diff": 0.5}
    assert found["test_fails"]["reason"].startswith("AssertionError: the losses differ")
    assert found["test_skips"]["reason"] == "needs 2 GPUs (1 visible)"
    assert found["test_errors"]["reason"] == "RuntimeError: no GPU here (in setup)"
    assert gpu_parts.read_results(tmp_path / "none.jsonl") == {}


def test_the_tests_check_on_cpu_names_every_part(tmp_path, monkeypatch):
    """The tests check end to end on a CPU: pytest runs every cuda test of the table, each skips
    with the reason, and the report names every part with its status and the reason."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a GPU machine's CPU suite too
    args = gc.parse_args(["--out", str(tmp_path / "out"), "--test_workers", "1"])
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    res = gc.check_tests(ctx, gpus=0)
    assert res["status"] == "fail" and res["reason"].endswith("no cuda test ran"), res
    found = gpu_parts.read_results(tmp_path / "out" / "logs" / "cuda_tests.jsonl")
    assert set(found) == set(gpu_parts.TESTS) - set(gpu_parts.left_out())  # each once, none unlisted
    assert all(r["outcome"] == "skipped" for r in found.values())
    assert all(r["reason"].startswith("needs a CUDA GPU") for r in found.values())
    assert res["skipped"] == len(found) and res["passed"] == 0
    assert list(ctx.parts) == [part.name for part in gpu_parts.PARTS]
    assert all(p["status"] == "skipped" and "needs a CUDA GPU" in p["reason"] for p in ctx.parts.values())
    report = {"started": "", "command": "", "options": {}, "environment": {}, "parts": ctx.parts,
              "checks": {"tests": {**res, "seconds": 9.0}}}
    md = gc.markdown(report)
    # no part failed, but no test ran: the tests check's own failure is counted
    assert md.startswith(f"# GPU check: FAIL (0 passed, 1 failed, {len(gpu_parts.PARTS)} skipped)")
    for part in gpu_parts.PARTS:
        row = rf"^\| {part.name} \| skipped \| 0 \| +\| +\| .*needs a CUDA GPU"
        assert re.search(row, md, re.M), part.name


def test_each_check_ends_by_its_share_of_the_budget(tmp_path):
    assert gc.deadlines(100.0, 600, ["tests", "data"]) == {"tests": 590.0, "data": 615.0}
    assert gc.deadlines(0.0, 300, ["data", "ladder"]) == {"data": 12.5, "ladder": 32.5}
    args = gc.parse_args(["--out", str(tmp_path / "out"), "--budget_s", "0.6"])  # tests' share: 0.49 s
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    seen = {}

    def slow(c):
        seen["tests"] = c.time_left()
        time.sleep(0.7)  # past its own deadline and the data's (0.515 s)
        return gc.passed("slow")

    report = {"checks": {}}
    gc.run_plan([("tests", slow), ("data", lambda c: gc.passed("never"))], ctx, report, skip=set())
    assert "parts" not in report  # the slow stand-in for the tests gave none
    assert seen["tests"] == 1.0  # a subprocess gets a second at least
    assert report["checks"]["data"]["status"] == "skipped"  # cut off: neither passed nor failed
    assert report["checks"]["data"]["reason"] == ("not run: out of time: the checks before it used its share "
                                                  "of the 1 s budget")


def test_parts_left_out_are_named_skipped(tmp_path):
    args = gc.parse_args(["--out", str(tmp_path / "out"), "--skip", "tests"])
    ctx = gc.Context(args=args, out=tmp_path / "out", work=tmp_path)
    report = {"checks": {}}
    gc.run_plan([("tests", gc.check_tests)], ctx, report, skip=args.skip)
    assert list(report["parts"]) == [part.name for part in gpu_parts.PARTS]
    assert all(p["status"] == "skipped" and p["reason"] == "--skip tests" for p in report["parts"].values())
    assert gc.overall(report) == {"pass": 0, "fail": 0, "skipped": len(gpu_parts.PARTS)}


def test_make_gpu_check_uses_the_python_that_runs_it_and_installs_nothing():
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^gpu-check:(.*)$", makefile, re.M)
    assert target and target.group(1).strip() == "", f"gpu-check has prerequisites: {target.group(1)}"
    # as a reader's shell runs it: not as a sub-make of `make test` (whose MAKELEVEL makes make print
    # the directories it enters, and whose MAKEFLAGS would pass its own variables down)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    for python in (None, "/opt/container/bin/python"):
        cmd = ["make", "-n", "gpu-check", "ARGS=--skip ladder"] + ([f"PYTHON={python}"] if python else [])
        dry = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.strip().splitlines()
        assert lines == [f"{python or 'python3'} scripts/gpu_check.py --skip ladder"], lines
        assert "pip" not in dry.stdout and ".venv" not in dry.stdout


# --------------------------------------------------------------- on a GPU ---
@pytest.fixture
def gpu_ctx(cfg_factory, tmp_path) -> gc.Context:
    return small_ctx(cfg_factory, tmp_path, "baseline,+DALI,+AMP")  # +graphs: test_ladder.py


@pytest.mark.cuda
def test_environment_names_the_gpu():
    env = gc.environment()
    assert env["gpu"]["name"] and env["gpu"]["memory_bytes"] > 2**30 and env["gpu"]["count"] >= 1
    assert env["cuda_runtime"] and env["torch"]
    assert (env["dali"] is None) == (env["dali_error"] is not None)


@pytest.mark.cuda
def test_train_and_graph_runs_agree(gpu_ctx):
    res = gc.check_train_vs_graph(gpu_ctx)
    assert res["status"] == "pass", res["reason"]
    assert [r["step"] for r in res["epochs"]] == [4, 8]
    assert (gpu_ctx.out / "logs" / "graph_metrics.jsonl").is_file()


@pytest.mark.cuda
def test_dali_check_on_the_gpu(gpu_ctx):
    res = gc.check_dali(gpu_ctx)
    assert res["status"] == ("skipped" if gpu_ctx.dali_error else "pass"), res["reason"]


@pytest.mark.cuda
def test_ladder_check_measures_every_rung(gpu_ctx):
    res = gc.check_ladder(gpu_ctx)
    assert res["status"] == "pass", res["reason"]
    rungs = {r["name"]: r for r in res["rungs"]}
    assert list(rungs) == ["baseline", "+DALI", "+AMP"]
    measured = [r for r in rungs.values() if r["status"] == "pass"]
    assert len(measured) == (2 if gpu_ctx.dali_error else 3)
    assert rungs["+AMP"]["settings"]["data_loader_config"] == ("pytorch" if gpu_ctx.dali_error else "dali")
    assert all(r["samples_per_sec"] > 0 and 0 < r["mfu"] <= 1 for r in measured)
