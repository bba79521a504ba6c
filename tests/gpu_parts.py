"""The GPU check's parts: which `cuda` tests check which feature, on how many GPUs, within what time.

`make gpu-check` (scripts/gpu_check.py) runs every `cuda`-marked test once and reports per part;
the tests ask the same table how to run on this machine (:func:`plan`), so the report and the
tests agree on what ran where. This module needs nothing but the standard library: the script
imports it before anything else, and pytest loads it as a plugin (``-p tests.gpu_parts``) that
writes every test's outcome to a file as soon as the test ends (:func:`pytest_runtest_logreport`),
so that a run stopped at its time limit still reports the tests it finished.

Where the ranks go. NCCL refuses two ranks on one GPU, so a test of N ranks runs over NCCL, a rank
per GPU, where N GPUs are visible. With fewer it runs its N ranks sharing the GPUs over gloo
(``--dist_backend gloo``) when gloo does every collective it needs for CUDA tensors: all-reduce,
broadcast, all-gather, all-to-all, and reduce-scatter (an all-reduce and a copy in torch's gloo
backend) do; send and receive do not (torch's backend table), so pipelines need a GPU per stage.
A test that cannot run here is skipped with the reason, and the report says so.

Time. The whole check must end within ten minutes on one H100 (gpu_check.py's ``--budget_s``).
Each test's ``budget_s`` is an estimate, not a measurement (no GPU has run these tests yet): 10 s
for a run in one process (interpreter and torch import 3-5 s, CUDA context and kernels' first
use 1-2 s, a few steps of the test model and its validation, a checkpoint), 15 s for a torchrun
job of 2 ranks and 20 s for 4 (the launcher, the ranks' start, the process group's set-up), a
minute for torch.compile's first compile of the blocks. gpu_check.py holds the check to the
budget whatever the estimates say.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

RESULTS_ENV = "GPU_CHECK_RESULTS"  # the file the plugin appends one JSON line per test to
NOT_RUN = "not run: out of time"  # a test the check's budget cut off: neither passed nor failed
FILE = "tests/test_gpu_parts.py"

# why a test cannot run its ranks sharing one GPU over gloo
NO_SEND_RECV = ("pipeline stages pass activations with send and recv, which gloo does not do for GPU "
                "tensors (torch's backend table)")
NCCL_ONLY = ("it checks NCCL's own timeout and watchdog, and NCCL refuses two ranks on one GPU (the "
             "gloo path is checked on CPU by make test)")
LOCAL_RANK_GPU = ("DeepSpeed gives each rank the GPU of its local rank (cuda:LOCAL_RANK), so its "
                  "ranks cannot share one GPU")


@dataclass(frozen=True)
class GpuTest:
    """One `cuda` test: the ranks it starts at once, why those ranks cannot share GPUs over gloo
    ("" when they can), its time estimate, and the known defect it checks for, which the report
    names when it fails ("" when none)."""

    ranks: int = 1
    no_gloo: str = ""
    budget_s: int = 10
    defect: str = ""
    # False: left out of make gpu-check, which runs the same check at full size (``why_left_out``)
    in_gpu_check: bool = True


LEFT_OUT = ("left out of make gpu-check, whose own check of the same name runs right after the tests "
            "at full size")

TESTS: dict[str, GpuTest] = {
    # ---- this project's features (tests/test_gpu_parts.py) ----
    f"{FILE}::test_deepspeed_offload_one_process": GpuTest(1, budget_s=25),
    f"{FILE}::test_deepspeed_zero3_offload_two_ranks": GpuTest(2, LOCAL_RANK_GPU, budget_s=30),
    f"{FILE}::test_expert_parallel_all_to_all": GpuTest(2, budget_s=15),
    f"{FILE}::test_compression_hooks": GpuTest(2, budget_s=25),  # three jobs at once
    f"{FILE}::test_hang_is_named_on_nccl": GpuTest(
        2, NCCL_ONLY, budget_s=45, defect="the hang diagnosis cut short by NCCL's watchdog"),
    f"{FILE}::test_fsdp_offload_clipped_checkpointed": GpuTest(
        2, budget_s=20,
        defect="a checkpoint, clipping or LAMB's norms of shards held in host memory"),
    f"{FILE}::test_hsdp_with_memory_snapshot": GpuTest(4, budget_s=25),
    f"{FILE}::test_zero1_stop_signal_and_resume": GpuTest(2, budget_s=30),
    f"{FILE}::test_cost_model_calibrates_and_checks": GpuTest(
        1, budget_s=30,
        defect="fp32 calibrated without TF32, or a calibration that assumes 4 GPUs"),
    f"{FILE}::test_context_and_sequence_parallel": GpuTest(4, budget_s=20),
    f"{FILE}::test_pipeline_schedule[gpipe]": GpuTest(2, NO_SEND_RECV, budget_s=15),
    f"{FILE}::test_pipeline_schedule[1f1b]": GpuTest(2, NO_SEND_RECV, budget_s=15),
    f"{FILE}::test_pipeline_schedule[interleaved_1f1b]": GpuTest(2, NO_SEND_RECV, budget_s=15),
    f"{FILE}::test_pipeline_schedule[zero_bubble]": GpuTest(2, NO_SEND_RECV, budget_s=15),
    f"{FILE}::test_fp16_scaler_with_ddp": GpuTest(2, budget_s=15),
    f"{FILE}::test_graph_checkpoint_resumed_by_train_py": GpuTest(
        1, budget_s=25, defect="a train_graph.py checkpoint's tensor learning rate refused by Adam"),
    f"{FILE}::test_sharded_checkpoint_resumes": GpuTest(2, budget_s=30),
    f"{FILE}::test_compile_with_fsdp_and_tp": GpuTest(4, budget_s=75),
    f"{FILE}::test_freezing_with_ddp_and_its_cache": GpuTest(
        2, budget_s=20, defect="the gradient-norm rule reading no block under DDP"),
    f"{FILE}::test_freezing_with_pipeline_stages_recut": GpuTest(2, NO_SEND_RECV, budget_s=20),
    f"{FILE}::test_asynchronous_pipeline_on_two_gpus": GpuTest(2, NO_SEND_RECV, budget_s=20),
    f"{FILE}::test_asynchronous_modes_on_two_gpus": GpuTest(2, NO_SEND_RECV, budget_s=30),
    f"{FILE}::test_training_through_dali_on_the_gpu": GpuTest(budget_s=10),
    f"{FILE}::test_tensor_parallel_with_ddp_and_with_offloaded_fsdp": GpuTest(
        4, budget_s=25, defect="a consolidated checkpoint gathering offloaded shards over NCCL"),
    # ---- the defects' own GPU tests, beside their CPU tests ----
    "tests/test_communication.py::test_on_nccl_the_diagnosis_comes_before_nccls_watchdog": GpuTest(
        2, NCCL_ONLY, budget_s=20, defect="the hang diagnosis cut short by NCCL's watchdog"),
    "tests/test_communication.py::test_the_overlap_timeline_times_the_gpus_work_not_its_launches": GpuTest(
        budget_s=3, defect="comm_overlap.py timing kernel launches instead of the GPU's work"),
    "tests/test_clipping.py::test_offloaded_fsdp_clips_and_reports_on_nccl": GpuTest(
        budget_s=15, defect="clipping offloaded shards over an NCCL-only group"),
    "tests/test_experts.py::test_an_expert_parallel_layer_synchronises_once_on_a_gpu": GpuTest(
        budget_s=3, defect="more than one host sync per mixture-of-experts layer"),
    "tests/test_memory_record.py::test_a_gpu_step_is_recorded_with_python_frames_only": GpuTest(
        budget_s=10, defect="a memory snapshot writing C++ stacks inside a watched step"),
    "tests/test_cost_model.py::test_the_fp32_rate_is_tf32s_as_the_trainer_runs": GpuTest(
        budget_s=5, defect="fp32 calibrated without TF32"),
    # ---- single-device GPU paths tested elsewhere ----
    "tests/test_ladder.py::test_graph_replay_matches_eager[none]": GpuTest(budget_s=10),
    "tests/test_ladder.py::test_graph_replay_matches_eager[bf16]": GpuTest(budget_s=5),
    "tests/test_ladder.py::test_benchmark_cuda_phases_count_the_backward_kernels": GpuTest(budget_s=20),
    "tests/test_ladder.py::test_fp32_peak_is_measured_with_tf32_as_the_trainer_runs": GpuTest(budget_s=5),
    "tests/test_dali.py::test_gpu_pipeline_equals_pytorch": GpuTest(budget_s=5),
    "tests/test_gpu_check.py::test_environment_names_the_gpu": GpuTest(budget_s=2),
    "tests/test_gpu_check.py::test_train_and_graph_runs_agree": GpuTest(budget_s=30, in_gpu_check=False),
    "tests/test_gpu_check.py::test_dali_check_on_the_gpu": GpuTest(budget_s=15, in_gpu_check=False),
    "tests/test_gpu_check.py::test_ladder_check_measures_every_rung": GpuTest(budget_s=45,
                                                                              in_gpu_check=False),
}
# the one-process reference runs the tests compare with, started together once per test session
REFERENCES_BUDGET_S = 15


@dataclass(frozen=True)
class Part:
    name: str
    title: str  # what it checks, for the report
    features: tuple[str, ...]  # the GPU paths it covers (tests/test_gpu_check.py lists them all)
    tests: tuple[str, ...]  # keys of TESTS; a test that combines features serves several parts


def _t(*names: str) -> tuple[str, ...]:
    return tuple(n if "::" in n else f"{FILE}::{n}" for n in names)


PARTS: tuple[Part, ...] = (
    Part("deepspeed", "DeepSpeed's engine: ZeRO-2 with offload in one process, ZeRO-3 with offload on 2 "
         "ranks, against train.py", ("DeepSpeed (any stage, offload)",),
         _t("test_deepspeed_offload_one_process", "test_deepspeed_zero3_offload_two_ranks")),
    Part("experts", "expert parallelism: 4 experts over 2 ranks (all-to-all), top-2 with a capacity, "
         "clipped, against one process", ("expert parallelism's all-to-all",),
         _t("test_expert_parallel_all_to_all")),
    Part("compression", "DDP's compression hooks bf16, fp16 and PowerSGD on 2 ranks: half the bytes "
         "(fewer for PowerSGD) and the uncompressed loss within 1 % (5 %)", ("compression hooks",),
         _t("test_compression_hooks")),
    Part("hang_nccl", "a frozen rank named in one line over NCCL before NCCL's watchdog ends the job",
         ("the hang diagnosis on NCCL",), _t("test_hang_is_named_on_nccl")),
    Part("fsdp_offload", "FSDP with --cpu_offload on 2 ranks, clipped, LAMB, a sharded checkpoint "
         "mid-run and at the end, against one process", ("FSDP offload", "clipping"),
         _t("test_fsdp_offload_clipped_checkpointed")),
    Part("hsdp", "HSDP: 2 groups of 2 ranks, clipped, LAMB, against one process",
         ("HSDP",), _t("test_hsdp_with_memory_snapshot")),
    Part("zero1", "ZeRO-1 on 2 ranks, clipped, LAMB, against one process", ("ZeRO-1",),
         _t("test_zero1_stop_signal_and_resume")),
    Part("memory_snapshot", "--memory_snapshot on 4 HSDP ranks: every rank's step by kind and the CUDA "
         "allocator's history", ("memory snapshots",), _t("test_hsdp_with_memory_snapshot")),
    Part("cost_model", "scripts/cost_model.py --calibrate (fp32 with TF32) and --check on the visible "
         "GPUs", ("the cost model's calibration and check",), _t("test_cost_model_calibrates_and_checks")),
    Part("context_sequence", "context parallelism 2 x tensor parallelism 2 with sequence parallelism, "
         "clipped, LAMB, against one process", ("context and sequence parallelism",),
         _t("test_context_and_sequence_parallel")),
    Part("schedules", "pipeline schedules GPipe, 1F1B, interleaved 1F1B and zero bubble on 2 ranks, "
         "against one process", ("interleaved and zero-bubble schedules", "the flushed schedules"),
         _t("test_pipeline_schedule[gpipe]", "test_pipeline_schedule[1f1b]",
            "test_pipeline_schedule[interleaved_1f1b]", "test_pipeline_schedule[zero_bubble]")),
    Part("tp_layouts", "tensor parallelism with DDP (activation checkpointing, 2 micro-batches) and with "
         "FSDP and --cpu_offload (a consolidated checkpoint of offloaded shards), against one process",
         ("tensor parallel with DDP", "activation checkpointing and accumulation", "FSDP x tp offload"),
         _t("test_tensor_parallel_with_ddp_and_with_offloaded_fsdp")),
    Part("fp16", "fp16 with its GradScaler, DDP on 2 ranks, clipped, against fp16 in one process",
         ("fp16 with its scaler",), _t("test_fp16_scaler_with_ddp")),
    Part("clipping", "gradient clipping without offload (ZeRO-1, tp x cp) and with it (FSDP offload), "
         "against one process", ("clipping",),
         _t("test_zero1_stop_signal_and_resume", "test_context_and_sequence_parallel",
            "test_fsdp_offload_clipped_checkpointed")),
    Part("resume", "resuming on a GPU: a train_graph.py checkpoint continued by train.py, a stopped "
         "ZeRO-1 run, a sharded FSDP checkpoint", ("resume on a GPU (graphs to eager included)",),
         _t("test_graph_checkpoint_resumed_by_train_py", "test_zero1_stop_signal_and_resume",
            "test_sharded_checkpoint_resumes")),
    Part("dcp", "sharded (DCP) checkpoints: FSDP on 2 ranks fails after its step-3 checkpoint and "
         "resumes to the one-process losses", ("sharded (DCP) checkpoints on NCCL",),
         _t("test_sharded_checkpoint_resumes")),
    Part("stop_signal", "a stop signal on one rank: every rank stops at the same step after the "
         "checkpoint (status 75), and the rerun resumes exactly", ("stop signals",),
         _t("test_zero1_stop_signal_and_resume")),
    Part("lamb", "LAMB's per-tensor norms over ZeRO-1, FSDP offload, HSDP and tp x cp against one "
         "process", ("LAMB",),
         _t("test_zero1_stop_signal_and_resume", "test_fsdp_offload_clipped_checkpointed",
            "test_hsdp_with_memory_snapshot", "test_context_and_sequence_parallel")),
    Part("compile", "torch.compile'd blocks with FSDP x tensor parallelism on 4 ranks against one "
         "process", ("torch.compile with the parallel layouts",), _t("test_compile_with_fsdp_and_tp")),
    Part("freezing", "part 12: blocks frozen during the run (out of the optimizer and DDP's all-reduce, "
         "their output cached; the gradient-norm rule under DDP; pipeline stages re-cut) against one "
         "process", (),
         _t("test_freezing_with_ddp_and_its_cache", "test_freezing_with_pipeline_stages_recut")),
    Part("asynchronous", "part 13: the asynchronous 1F1B (stash, none, vertical, 2bw) on 2 stages over "
         "NCCL, against the same runs on the CPU", (),
         _t("test_asynchronous_pipeline_on_two_gpus", "test_asynchronous_modes_on_two_gpus")),
    Part("defects", "the review's GPU defects, each on its own: the NCCL hang named in time, "
         "comm_overlap.py's GPU timeline, clipping offloaded shards on NCCL, one host sync per MoE layer, "
         "Python-only snapshot stacks, TF32 in the calibration", (),
         _t("tests/test_communication.py::test_on_nccl_the_diagnosis_comes_before_nccls_watchdog",
            "tests/test_communication.py::test_the_overlap_timeline_times_the_gpus_work_not_its_launches",
            "tests/test_clipping.py::test_offloaded_fsdp_clips_and_reports_on_nccl",
            "tests/test_experts.py::test_an_expert_parallel_layer_synchronises_once_on_a_gpu",
            "tests/test_memory_record.py::test_a_gpu_step_is_recorded_with_python_frames_only",
            "tests/test_cost_model.py::test_the_fp32_rate_is_tf32s_as_the_trainer_runs")),
    Part("graph_replay", "CUDA graph replay equals eager (fp32, bf16)", (),
         _t("tests/test_ladder.py::test_graph_replay_matches_eager[none]",
            "tests/test_ladder.py::test_graph_replay_matches_eager[bf16]")),
    Part("benchmark", "scripts/benchmark.py on CUDA: the step's phases between CUDA events, the fp32 "
         "peak with TF32", (),
         _t("tests/test_ladder.py::test_benchmark_cuda_phases_count_the_backward_kernels",
            "tests/test_ladder.py::test_fp32_peak_is_measured_with_tf32_as_the_trainer_runs")),
    Part("dali_gpu", "the DALI GPU pipeline's batches equal the PyTorch loader's, and train.py through it "
         "trains as through the PyTorch loader", (),
         _t("tests/test_dali.py::test_gpu_pipeline_equals_pytorch", "test_training_through_dali_on_the_gpu")),
    Part("gpu_check_small", "scripts/gpu_check.py's own checks on the test model", (),
         _t("tests/test_gpu_check.py::test_environment_names_the_gpu",
            "tests/test_gpu_check.py::test_train_and_graph_runs_agree",
            "tests/test_gpu_check.py::test_dali_check_on_the_gpu",
            "tests/test_gpu_check.py::test_ladder_check_measures_every_rung")),
)


# ------------------------------------------------------------------- the plan ---
def plan(test: str, gpus: int) -> tuple[str | None, str]:
    """How ``test`` runs with ``gpus`` visible GPUs: (backend, where) with backend "one process",
    "nccl" or "gloo"; or (None, why it cannot run here)."""
    t = TESTS[test]
    if gpus < 1:
        return None, "needs a CUDA GPU"
    if t.ranks == 1:
        return "one process", "one GPU"
    if gpus >= t.ranks:
        return "nccl", f"NCCL, a rank per GPU ({t.ranks} of {gpus})"
    if t.no_gloo:
        return None, f"needs {t.ranks} GPUs ({gpus} visible): {t.no_gloo}"
    return "gloo", f"gloo, {t.ranks} ranks sharing {gpus} GPU(s) (NCCL needs {t.ranks})"


def backend_flags(backend: str) -> list[str]:
    """The entry scripts' flags for a backend of :func:`plan`."""
    return ["--dist_backend", "gloo"] if backend == "gloo" else []


def estimated_seconds(gpus: int) -> int:
    """The estimated time of make gpu-check's tests with ``gpus`` GPUs, in one worker: each test
    that runs there once, the reference runs included."""
    return REFERENCES_BUDGET_S + sum(t.budget_s for name, t in TESTS.items()
                                     if t.in_gpu_check and plan(name, gpus)[0] is not None)


def left_out() -> list[str]:
    """The tests make gpu-check deselects (see LEFT_OUT)."""
    return [name for name, t in TESTS.items() if not t.in_gpu_check]


# ------------------------------------------------------------ pytest plugin ---
_phases: dict[str, dict[str, Any]] = {}
_writer = [True]  # whether this process writes the lines: not a pytest-xdist worker (its controller does)


def pytest_configure(config: Any) -> None:
    _writer[0] = not hasattr(config, "workerinput")


def pytest_runtest_logreport(report: Any) -> None:
    """With GPU_CHECK_RESULTS set: after each test's teardown, one JSON line with its outcome
    (a failure in any phase fails it; a skip in set-up or call skips it), its seconds (all phases),
    the reason (the skip's, or the failure's one-line summary) and the numbers it recorded
    (``record_property("numbers", {...})``)."""
    path = os.environ.get(RESULTS_ENV)
    if not path or not _writer[0]:
        return
    entry = _phases.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "reason": "",
                                               "numbers": {}})
    entry["seconds"] += report.duration
    if report.failed and entry["outcome"] != "failed":
        entry["outcome"], entry["reason"] = "failed", _failure_line(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"], entry["reason"] = "skipped", _skip_reason(report)
    for key, value in report.user_properties:
        if key == "numbers":
            entry["numbers"].update(value)
    if report.when == "teardown":
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, **_phases.pop(report.nodeid)}, default=str) + "\n")


def pytest_collectreport(report: Any) -> None:
    """A test file skipped as it is collected (``pytest.importorskip("nvidia.dali")``) reports no
    test: each of its tests in the table is written as skipped with the file's reason. (Written by
    whichever process collects it, pytest-xdist's workers too: a repeated line says the same.)"""
    path = os.environ.get(RESULTS_ENV)
    if not path or not report.skipped:
        return
    reason = _skip_reason(report)
    with open(path, "a") as f:
        for name in TESTS:
            if name.startswith(f"{report.nodeid}::"):
                f.write(json.dumps({"test": name, "outcome": "skipped", "seconds": 0.0, "reason": reason,
                                    "numbers": {}}) + "\n")


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _failure_line(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = getattr(crash, "message", None) or getattr(report, "longreprtext", "") or "failed"
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    where = f" (in {report.when})" if report.when != "call" else ""
    return (lines[0] if lines else "failed")[:400] + where


def read_results(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The plugin's lines, by test (a missing file: none)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.strip():
            entry = json.loads(line)
            out[entry.pop("test")] = entry
    return out


# ------------------------------------------------------------------ results ---
STATUS = {"passed": "pass", "failed": "fail", "skipped": "skipped"}


def part_results(results: dict[str, dict[str, Any]], gpus: int, not_run: str) -> dict[str, dict[str, Any]]:
    """Every part's result from the tests' (:func:`read_results`): failed if a test failed, passed
    if one passed and none failed, else skipped; a test without a result is skipped when it cannot
    run here or was left out, and fails with ``not_run`` otherwise. Tests found that the table does
    not name make a part of their own ("unlisted"), which fails."""
    out = {}
    for part in PARTS:
        rows = [_test_row(name, results.get(name), gpus, not_run) for name in part.tests]
        out[part.name] = _combine(part.title, rows)
    unlisted = [_test_row(name, r, gpus, not_run) for name, r in results.items() if name not in TESTS]
    if unlisted:
        for row in unlisted:
            row.update(status="fail",
                       reason=f"not in tests/gpu_parts.py's table ({row['reason'] or row['status']})")
        out["unlisted"] = _combine("cuda tests the part table does not name", unlisted)
    return out


def all_skipped(reason: str) -> dict[str, dict[str, Any]]:
    """Every part skipped for one ``reason`` (the tests left out, or no pytest to run them)."""
    rows = {name: {"test": name, "where": "", "budget_s": t.budget_s, "status": "skipped", "reason": reason,
                   "seconds": 0.0, "numbers": {}} for name, t in TESTS.items()}
    return {part.name: {"status": "skipped", "title": part.title, "reason": reason, "seconds": 0.0,
                        "tests": [rows[name] for name in part.tests]} for part in PARTS}


def _test_row(name: str, result: dict[str, Any] | None, gpus: int, not_run: str) -> dict[str, Any]:
    t = TESTS.get(name, GpuTest())
    backend, where = plan(name, gpus) if name in TESTS else (None, "")
    row = {"test": name, "where": where if backend else "", "budget_s": t.budget_s}
    if result is not None:
        return {**row, "status": STATUS[result["outcome"]], "reason": result["reason"],
                "seconds": round(result["seconds"], 1), "numbers": result.get("numbers", {})}
    if not t.in_gpu_check:
        return {**row, "status": "skipped", "reason": LEFT_OUT, "seconds": 0.0, "numbers": {}}
    if backend is None:
        return {**row, "status": "skipped", "reason": where, "seconds": 0.0, "numbers": {}}
    status = "skipped" if not_run.startswith(NOT_RUN) else "fail"  # cut off by the budget, or lost
    return {**row, "status": status, "reason": not_run, "seconds": 0.0, "numbers": {}}


def _combine(title: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    statuses = {r["status"] for r in rows}
    status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else "skipped"
    notes = [f"{short(r['test'])}: {r['reason']}" for r in rows
             if r["status"] == "fail" or (r["status"] == "skipped" and r["reason"])]
    if status == "fail":
        notes += [f"a known defect it checks for: {TESTS[r['test']].defect}" for r in rows
                  if r["status"] == "fail" and r["test"] in TESTS and TESTS[r["test"]].defect]
    return {"status": status, "title": title, "reason": "; ".join(notes),
            "seconds": round(sum(r["seconds"] for r in rows), 1), "tests": rows}


def short(test: str) -> str:
    """A test's name without its file, for the report."""
    return test.split("::", 1)[-1]


def numbers_text(numbers: dict[str, Any]) -> str:
    """A test's recorded numbers in one line: losses, the largest difference, memory, rates."""
    parts = []
    for key, value in numbers.items():
        if isinstance(value, float):
            text = f"{value:.1e}" if key.endswith("rel_diff") else f"{value:.6g}"
        elif isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
            text = " vs ".join(f"{v:.6f}" for v in value)
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return "; ".join(parts)
