"""Every part of the course on a GPU, through the command lines a learner types (marked `cuda`).

Each test trains the test model (tests/ddp_helpers.py's, with 4 blocks so that pipelines of 2 x 2
stages fit) for 6 steps of global batch 8 (2 steps per epoch) in a layout, and requires every
epoch's logged losses to equal those of one process (`python train.py`, same seed, data and global
batch) within a tolerance, as the CPU suite's parity tests do; which layouts and features each test
combines, how many GPUs it needs and why some cannot share one GPU: tests/gpu_parts.py, which also
says how each test runs here (:func:`tests.gpu_parts.plan`: NCCL with a rank per GPU, or gloo with
ranks sharing the GPUs, or skipped with the reason).

Tolerances. The runs in fp32 set NVIDIA_TF32_OVERRIDE=0 (the trainer turns TF32 on, whose 10-bit
products would differ between layouts by far more than the order of the sums does): what is left
is the order of sums (sharded reductions, split matmuls) and the GPU's atomics, about 1e-6 relative
per step, so 1e-4 over 6 steps (the CPU suite: 1e-5). Where a run rounds otherwise by design the
tolerance says why. Every job is a subprocess with a timeout; one that fails shows the end of its
output, and with GPU_CHECK_LOGS set (make gpu-check) every job's whole output is kept there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import gpu_parts
from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import WORKER, write_test_yaml
from training.sharded_checkpoint import DCP_DIR, LATEST
from utils import device as dev
from utils.checkpoint import CHECKPOINT_NAME
from utils.signals import EXIT_STOPPED

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

JOB_TIMEOUT_S = 240  # one job (a healthy one: 10-30 s on a GPU, torch.compile's first compile more)
LOSS_RTOL = 1e-4  # fp32 without TF32: see the module's docstring
CLIP = 0.05  # below every step's gradient norm of the test model: clipping acts on each step
# the reference most tests compare with: clipped, and LAMB (per-tensor norms over every layout's
# shards and slices; its rate is relative, 0.05 trains visibly here)
LAMB = {"grad_clip_norm": CLIP, "optimizer_type": "LAMB", "weight_decay": 0.01, "lr": 0.05}
# Adam at a constant rate: a run continued with a larger --num_iters is the same run (the graph
# trainer captures plain Adam and no clipping; DeepSpeed steps Adam itself)
ADAM = {"lr_schedule": "constant"}
# a mixture of experts in every block, top-2, with a capacity that drops tokens, clipped
MOE = {"num_experts": 4, "moe_top_k": 2, "moe_every": 1, "moe_capacity_factor": 0.75, "moe_aux_weight": 0.1,
       "grad_clip_norm": 0.2}
FP16 = {"amp_mode": "fp16", "grad_clip_norm": CLIP}
REFERENCES = {"lamb": LAMB, "adam": ADAM, "moe": MOE, "fp16": FP16}


# ------------------------------------------------------------------ helpers ---
def visible_gpus() -> int:
    return dev.gpu_count()


def where(request: pytest.FixtureRequest) -> str:
    """This test's backend on this machine (tests/gpu_parts.py), or skip with the reason."""
    backend, text = gpu_parts.plan(request.node.nodeid, visible_gpus())
    if backend is None:
        pytest.skip(text)
    return backend


def job_env(tf32: bool = False, **extra: str) -> dict[str, str]:
    """The jobs' environment: the GPUs visible. A new interpreter for each (no fork of the suite's
    fork server, tests/fast_start: whether a fork of it can use CUDA has not been shown), and
    without TF32 unless ``tf32``."""
    env = subprocess_env(gpus=True, fast_start=not dev.cuda_available(), **extra)
    if not tf32:
        env["NVIDIA_TF32_OVERRIDE"] = "0"  # cuBLAS and cuDNN then compute fp32 in fp32
    return env


def flags(setup: dict, expdir: Path, run_num: str, **values) -> list[str]:
    """The test model's flags: 6 steps of global batch 8 on 16 samples, 33 validation samples."""
    merged = {"yaml_config": setup["yaml"], "config": "tiny", "data_dir": setup["data_dir"],
              "expdir": expdir, "run_num": run_num, "num_iters": 6, "global_batch_size": 8,
              "limit_nsamples": 16, "limit_nsamples_val": 33, "checkpoint_every": 0, **values}
    out = []
    for key, value in merged.items():
        if isinstance(value, bool):
            out.append(f"--{key}" if value else f"--no-{key}")
        else:
            out.append(f"--{key}={value}")
    return out


def command(script: str | Path, ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            str(script), *args]


class Jobs:
    """Start jobs (several at once), wait for them within their timeout, keep their output."""

    def __init__(self, folder: Path, test: str) -> None:
        keep = os.environ.get("GPU_CHECK_LOGS")
        self.folder = Path(keep) / re.sub(r"[^\w.-]+", "_", test) if keep else folder / "job_logs"
        self.folder.mkdir(parents=True, exist_ok=True)

    def start(self, label: str, cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        log = self.folder / f"{label}.log"
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return proc, log

    def run(self, *jobs: tuple[str, list[str], dict[str, str]], timeout: float = JOB_TIMEOUT_S
            ) -> dict[str, tuple[int, str, float]]:
        """label -> (exit status, output, seconds) of jobs started together; a job past the timeout
        is killed with its process group and fails the test."""
        started = {label: (*self.start(label, cmd, env), time.monotonic()) for label, cmd, env in jobs}
        out = {}
        try:
            for label, (proc, log, t0) in started.items():
                left = max(1.0, timeout - (time.monotonic() - t0))
                try:
                    code = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{label} ran past {timeout:.0f} s; its output: {log}\n"
                                         f"{tail(log.read_text())}") from None
                out[label] = (code, log.read_text(), round(time.monotonic() - t0, 1))
        finally:
            for proc, _, _ in started.values():
                if proc.poll() is None:
                    kill_group(proc)
        return out


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


def ok(result: tuple[int, str, float], label: str = "job") -> str:
    code, output, _ = result
    assert code == 0, f"{label} exited with {code}:\n{tail(output)}"
    return output


def run_folder(expdir: Path, run_num: str) -> Path:
    found = sorted(Path(expdir).glob(f"tiny/*/{run_num}"))
    assert len(found) == 1, f"run {run_num}: expected one run folder under {expdir}, found {found}"
    return found[0]


def metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    assert path.is_file(), f"{folder} has no metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(reference: list[dict], logged: list[dict], rtol: float, keys=("train_loss", "val_loss")) -> dict:
    """Every epoch ``logged`` has against the reference's at the same step; the numbers for the
    report (the largest relative difference, the last losses, the allocator's peak)."""
    by_step = {m["step"]: m for m in reference}
    assert logged and all(m["step"] in by_step for m in logged), \
        f"logged steps {[m['step'] for m in logged]}, reference {sorted(by_step)}"
    assert logged[-1]["step"] == reference[-1]["step"], "the run did not reach the reference's last step"
    worst = 0.0
    for m in logged:
        for key in keys:
            a, b = by_step[m["step"]][key], m[key]
            rel = abs(a - b) / max(abs(a), abs(b), 1e-12)
            assert rel <= rtol, f"step {m['step']} {key}: one process {a:.7f}, this layout {b:.7f} differ " \
                                f"by {rel:.2e} (tolerance {rtol:g})"
            worst = max(worst, rel)
    last, ref = logged[-1], reference[-1]
    numbers = {"max_rel_diff": worst, "train_loss": [ref["train_loss"], last["train_loss"]],
               "val_loss": [ref["val_loss"], last["val_loss"]]}
    peak = last.get("memory_MiB", {}).get("allocator_peak_MiB")
    if peak is not None:
        numbers["allocator_peak_MiB"] = round(peak, 1)
    return numbers


def model_parameters(folder: Path) -> int:
    state = torch.load(folder / CHECKPOINT_NAME, map_location="cpu", weights_only=False)["model"]
    return sum(t.numel() for t in state.values())


# ----------------------------------------------------------------- fixtures ---
@pytest.fixture(scope="module")
def setup(data_dir, tmp_path_factory) -> dict:
    """The YAML file of the test model with 4 blocks, and the data."""
    path = write_test_yaml(tmp_path_factory.mktemp("gpu_yaml") / "ViT.yaml", depth=4)
    return {"yaml": path, "data_dir": data_dir}


@pytest.fixture(scope="module")
def references(setup, tmp_path_factory) -> dict[str, Path]:
    """The one-process runs the tests compare with (REFERENCES), started together: name -> folder."""
    expdir = tmp_path_factory.mktemp("references")
    jobs = Jobs(expdir, "references")
    done = jobs.run(*[(name, command("train.py", 1, flags(setup, expdir, name, **values)), job_env())
                      for name, values in REFERENCES.items()])
    for name, result in done.items():
        ok(result, f"the one-process reference {name}")
    return {name: run_folder(expdir, name) for name in REFERENCES}


# ---------------------------------------------------------------- DeepSpeed ---
def needs_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed for this python (make deepspeed)")


def test_deepspeed_offload_one_process(setup, references, tmp_path, request, record_property):
    """ZeRO-2 with ZeRO-Offload (Adam's state and step on the CPU) in one process against train.py.
    Tolerance 1e-3: DeepSpeed's CPU Adam (a vectorised kernel of its own) rounds otherwise."""
    where(request)
    needs_deepspeed()
    run = Jobs(tmp_path, request.node.name).run(
        ("ds2", command("train.py", 1, flags(setup, tmp_path, "ds2", engine="deepspeed", zero_stage=2,
                                             cpu_offload=True, **ADAM)), job_env()))
    ok(run["ds2"])
    numbers = compare(metrics(references["adam"]), metrics(run_folder(tmp_path, "ds2")), 1e-3)
    record_property("numbers", {**numbers, "seconds": run["ds2"][2]})


def test_deepspeed_zero3_offload_two_ranks(setup, references, tmp_path, request, record_property):
    """ZeRO-3 with offload (parameters too) on 2 ranks over NCCL against train.py."""
    where(request)
    needs_deepspeed()
    run = Jobs(tmp_path, request.node.name).run(
        ("ds3", command("train.py", 2, flags(setup, tmp_path, "ds3", engine="deepspeed", zero_stage=3,
                                             cpu_offload=True, **ADAM)), job_env()))
    ok(run["ds3"])
    numbers = compare(metrics(references["adam"]), metrics(run_folder(tmp_path, "ds3")), 1e-3)
    record_property("numbers", {**numbers, "seconds": run["ds3"][2]})


# ------------------------------------------------------------------ experts ---
def test_expert_parallel_all_to_all(setup, references, tmp_path, request, record_property):
    """train_mp.py --expert_parallel 2: each rank holds 2 of the 4 experts, tokens travel by
    all-to-all. Tolerance 1e-3: a token whose top-2 choice differs by rounding goes elsewhere."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("ep2", command("train_mp.py", 2, flags(setup, tmp_path, "ep2", expert_parallel=2, **MOE)
                        + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["ep2"])
    folder = run_folder(tmp_path, "ep2")
    assert folder.parent.name.endswith("_ep2"), folder
    numbers = compare(metrics(references["moe"]), metrics(folder), 1e-3)
    record_property("numbers", {**numbers, "seconds": run["ep2"][2]})


# -------------------------------------------------------------- compression ---
# how far each compressed run's validation loss may be from the uncompressed one's (as on CPU)
COMPRESSION_MARGIN = {"bf16": 0.01, "fp16": 0.01, "powersgd": 0.05}


def test_compression_hooks(setup, references, tmp_path, request, record_property):
    """DDP on 2 ranks with each of torch's hooks (the three jobs at once): bf16 and fp16 hand half of
    fp32's bytes to the all-reduce, PowerSGD fewer; each run changed the gradients (its training
    loss is not the uncompressed one's) and still trains (its validation loss within the margin)."""
    backend = where(request)
    jobs = [(name, command("train.py", 2, flags(setup, tmp_path, name, grad_compression=name, **LAMB)
                           + gpu_parts.backend_flags(backend)), job_env()) for name in COMPRESSION_MARGIN]
    done = Jobs(tmp_path, request.node.name).run(*jobs)
    reference = metrics(references["lamb"])[-1]
    fp32_bytes = 4 * model_parameters(references["lamb"])
    numbers, sent = {}, {}
    for name, margin in COMPRESSION_MARGIN.items():
        ok(done[name], name)
        last = metrics(run_folder(tmp_path, name))[-1]
        sent[name] = last["grad_comm_bytes_per_step"]
        rel = abs(last["val_loss"] - reference["val_loss"]) / reference["val_loss"]
        assert rel <= margin, f"{name}: validation loss {last['val_loss']:.6f}, uncompressed " \
                              f"{reference['val_loss']:.6f} ({rel:.2%} apart, margin {margin:.0%})"
        if name != "fp16":  # fp16's 11 bits can leave this model's first LAMB steps unchanged
            assert last["train_loss"] != reference["train_loss"], f"{name}: the hook changed nothing"
        numbers[f"{name}_val_rel_diff"] = rel
        numbers[f"{name}_MB_per_step"] = round(sent[name] / 1e6, 4)
    assert sent["bf16"] == sent["fp16"] == fp32_bytes / 2, (sent, fp32_bytes)
    assert sent["powersgd"] < sent["bf16"], sent
    record_property("numbers", {**numbers, "fp32_MB_per_step": round(fp32_bytes / 1e6, 4)})


# --------------------------------------------------------------------- hang ---
HANG_TIMEOUT_S = 10  # --collective_timeout_s of the frozen job


def test_hang_is_named_on_nccl(setup, tmp_path, request, record_property):
    """Rank 1 stops itself (SIGSTOP) in its step 3's backward (tests/ddp_worker.py). Over NCCL, whose
    watchdog ends a process at the collective timeout, rank 0 must still name rank 1 in one line
    before the job ends (NCCL's watchdog, which ends the process at the timeout, must not cut the
    diagnosis short). The test then
    ends the frozen rank by the pid in the line, as its operator would."""
    where(request)
    cmd = command(WORKER, 2, flags(setup, tmp_path, "hang", num_iters=5000,
                                   collective_timeout_s=HANG_TIMEOUT_S))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(DDP_TEST_FREEZE_AT="1:3"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines, named_at = [], None
    try:
        for text in proc.stdout:
            lines.append(text)
            if "gave up at step" in text:
                named_at = time.monotonic() - start
                os.kill(int(re.search(r"pid (\d+)", text).group(1)), signal.SIGKILL)
                break
        lines.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            kill_group(proc)
    out = "".join(lines)
    keep = Jobs(tmp_path, request.node.name).folder / "hang.log"
    keep.write_text(" ".join(cmd) + "\n\n" + out)
    line = next((ln for ln in out.splitlines() if "gave up at step" in ln), None)
    assert line is not None, f"no rank named the frozen one; the job's output ends:\n{tail(out)}"
    assert "rank 1 stopped responding" in line, line
    assert proc.returncode != 0
    elapsed = time.monotonic() - start
    assert elapsed < 60 + HANG_TIMEOUT_S + 45, elapsed  # start-up, 3 steps, the timeout, the diagnosis
    record_property("numbers", {"named_after_s": round(named_at, 1), "job_seconds": round(elapsed, 1)})


# ------------------------------------------------------------ data parallel ---
def test_fsdp_offload_clipped_checkpointed(setup, references, tmp_path, request, record_property):
    """FSDP on 2 ranks with its shards, their gradients and LAMB's state in pinned host memory
    (--cpu_offload), clipped, with a sharded checkpoint at step 3 and at the end: the checkpoint and
    the clipping norm meet shards in host memory."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("offload", command("train.py", 2, flags(setup, tmp_path, "offload", data_parallel="fsdp",
                                                 cpu_offload=True, checkpoint_every=3, **LAMB)
                            + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["offload"])
    folder = run_folder(tmp_path, "offload")
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    assert (folder / DCP_DIR / LATEST).read_text().strip() == "step_00000006"
    assert "checkpoint at step 3" in run["offload"][1], "no checkpoint at step 3"
    record_property("numbers", {**numbers, "seconds": run["offload"][2]})


def test_hsdp_with_memory_snapshot(setup, references, tmp_path, request, record_property):
    """HSDP: 4 ranks in 2 groups of 2 (each group shards the model, the groups average), clipped,
    with --memory_snapshot: every rank records its second step by kind, and the CUDA allocator's
    history. The collective timeout is short (60 s): recording must not stall a watched phase of
    the step past it."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("hsdp", command("train.py", 4, flags(setup, tmp_path, "hsdp", data_parallel="hsdp", dp_shard=2,
                                              memory_snapshot=True, collective_timeout_s=60, **LAMB)
                         + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["hsdp"])
    folder = run_folder(tmp_path, "hsdp")
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    whole = 4 * model_parameters(references["lamb"])  # fp32 bytes of the whole model
    records = [json.loads((folder / "memory" / f"memory_phases_rank{rank}.json").read_text())
               for rank in range(4)]
    for rank, record in enumerate(records):
        assert record["process_peak_kind"] == "CUDA allocator", f"rank {rank} recorded on {record['device']}"
        phases = {p["phase"]: p for p in record["phases"]}
        assert list(phases) == ["start", "forward", "backward", "optimizer"], f"rank {rank}: {list(phases)}"
        held = phases["start"]["parameters"]  # half of the model: a sharding group of 2
        assert 0.4 * whole <= held <= 0.6 * whole, f"rank {rank} holds {held} bytes of parameters of {whole}"
        assert phases["forward"]["activations"] > 0, f"rank {rank}: no activations after forward"
        assert record["process_peak"] > held, f"rank {rank}: allocator peak {record['process_peak']}"
    with open(folder / "memory" / "memory_snapshot_rank0.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and snapshot["device_traces"], "the allocator's history is empty"
    record_property("numbers", {**numbers, "seconds": run["hsdp"][2],
                                "rank0_step_peak_MiB": round(records[0]["process_peak"] / 2**20, 1)})


def test_zero1_stop_signal_and_resume(setup, references, tmp_path, request, record_property):
    """ZeRO-1 on 2 ranks, clipped: SIGUSR1 reaches rank 1 in its step 3; both ranks stop at the same
    step after rank 0's checkpoint, and the job ends with the stop status (75). The same command
    again resumes there and ends with the one-process losses."""
    backend = where(request)
    args = flags(setup, tmp_path, "zero1", data_parallel="zero1", stop_check_every=1, **LAMB) \
        + gpu_parts.backend_flags(backend)
    jobs = Jobs(tmp_path, request.node.name)
    first = jobs.run(("stopped", command(WORKER, 2, args), job_env(DDP_TEST_SIGNAL_AT="1:3")))["stopped"]
    assert first[0] != 0 and f"exitcode  : {EXIT_STOPPED}" in first[1], tail(first[1])
    folder = run_folder(tmp_path, "zero1")
    stopped_at = torch.load(folder / CHECKPOINT_NAME, map_location="cpu", weights_only=False)["step"]
    assert 3 <= stopped_at < 6, stopped_at
    second = jobs.run(("resumed", command("train.py", 2, args), job_env()))["resumed"]
    assert "resumed from" in ok(second, "the rerun")
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    record_property("numbers", {**numbers, "stopped_at_step": stopped_at,
                                "seconds": round(first[2] + second[2], 1)})


def test_sharded_checkpoint_resumes(setup, references, tmp_path, request, record_property):
    """FSDP on 2 ranks writes a sharded (DCP) checkpoint at step 3, mid-epoch, and rank 0 fails in
    step 4 (tests/ddp_worker.py); the same command resumes from it to the one-process losses."""
    backend = where(request)
    args = flags(setup, tmp_path, "dcp", data_parallel="fsdp", checkpoint_every=3, **LAMB) \
        + gpu_parts.backend_flags(backend)
    jobs = Jobs(tmp_path, request.node.name)
    first = jobs.run(("failed", command(WORKER, 2, args), job_env(DDP_TEST_RAISE_AT="0:4")))["failed"]
    assert first[0] != 0, tail(first[1])
    folder = run_folder(tmp_path, "dcp")
    assert (folder / DCP_DIR / LATEST).read_text().strip() == "step_00000003"
    second = jobs.run(("resumed", command("train.py", 2, args), job_env()))["resumed"]
    assert "resumed from" in ok(second, "the rerun")
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    record_property("numbers", {**numbers, "seconds": round(first[2] + second[2], 1)})


def test_fp16_scaler_with_ddp(setup, references, tmp_path, request, record_property):
    """fp16 with its GradScaler on 2 DDP ranks, clipped (the gradients unscaled before the norm),
    against fp16 in one process: the ranks see the same all-reduced gradients, so their scalers skip
    the same steps as the one process's. Tolerance 1e-2: fp16 products of half batches round
    otherwise than those of the whole."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("fp16", command("train.py", 2, flags(setup, tmp_path, "fp16", **FP16)
                         + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["fp16"])
    numbers = compare(metrics(references["fp16"]), metrics(run_folder(tmp_path, "fp16")), 1e-2)
    record_property("numbers", {**numbers, "seconds": run["fp16"][2]})


# ----------------------------------------------------------- model parallel ---
def test_context_and_sequence_parallel(setup, references, tmp_path, request, record_property):
    """train_mp.py on 4 ranks: tensor parallel 2 x context parallel 2, with sequence parallelism
    (the tokens between the tensor-parallel layers split over the tp ranks), clipped."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("tp2cp2", command("train_mp.py", 4, flags(setup, tmp_path, "tp2cp2", tensor_parallel=2,
                                                   context_parallel=2, sequence_parallel=True, **LAMB)
                           + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["tp2cp2"])
    folder = run_folder(tmp_path, "tp2cp2")
    assert folder.parent.name == "4GPU_tp2_cp2_dp1", folder
    assert "sequence parallel" in (folder / "out.log").read_text()
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    record_property("numbers", {**numbers, "seconds": run["tp2cp2"][2]})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_schedule(schedule, setup, references, tmp_path, request, record_property):
    """2 pipeline ranks (the flushed GPipe and 1F1B, which freezing and the Perlmutter commands use:
    a stage each; interleaved 1F1B and zero bubble: 2 stages each), 4 micro-batches of 2 samples,
    clipped: the serial losses (send and receive over NCCL: these need 2 GPUs)."""
    where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("pp2", command("train_mp.py", 2, flags(setup, tmp_path, "pp2", pipeline_parallel=2,
                                                pipeline_schedule=schedule, **LAMB)), job_env()))
    ok(run["pp2"])
    folder = run_folder(tmp_path, "pp2")
    assert folder.parent.name.endswith("_pp2"), folder
    numbers = compare(metrics(references["lamb"]), metrics(folder), LOSS_RTOL)
    record_property("numbers", {**numbers, "seconds": run["pp2"][2]})


def test_compile_with_fsdp_and_tp(setup, references, tmp_path, request, record_property):
    """torch.compile'd blocks (--enable_jit) under FSDP x tensor parallelism on 4 ranks (the
    tensor-parallel collectives are graph breaks, FSDP's hooks wrap the compiled blocks).
    Tolerance 1e-3: Inductor's fused kernels round otherwise than eager's."""
    backend = where(request)
    run = Jobs(tmp_path, request.node.name).run(
        ("jit", command("train_mp.py", 4, flags(setup, tmp_path, "jit", data_parallel="fsdp",
                                                tensor_parallel=2, enable_jit=True, **LAMB)
                        + gpu_parts.backend_flags(backend)), job_env()))
    ok(run["jit"])
    folder = run_folder(tmp_path, "jit")
    numbers = compare(metrics(references["lamb"]), metrics(folder), 1e-3)
    compiled = re.search(r"torch.compile: first step done in ([\d.]+) s", (folder / "out.log").read_text())
    assert compiled, "the run did not compile (no 'torch.compile: first step done' line in out.log)"
    record_property("numbers", {**numbers, "first_step_s": float(compiled.group(1)),
                                "seconds": run["jit"][2]})


# ------------------------------------------------------------------- resume ---
def test_graph_checkpoint_resumed_by_train_py(setup, references, tmp_path, request, record_property):
    """train_graph.py (CUDA graphs, capturable Adam) to step 4, then train.py in the same run folder
    to step 6 (the graphs save the learning rate as a tensor, which train.py's Adam must take):
    the one-process eager losses at every step. Tolerance 1e-3:
    capturable Adam keeps its step count on the GPU."""
    where(request)
    jobs = Jobs(tmp_path, request.node.name)
    graph = jobs.run(("graph", command("train_graph.py", 1, flags(setup, tmp_path, "g", num_iters=4, **ADAM)),
                      job_env()))["graph"]
    ok(graph, "train_graph.py")
    eager = jobs.run(("eager", command("train.py", 1, flags(setup, tmp_path, "g", **ADAM)),
                      job_env()))["eager"]
    assert "resumed from" in ok(eager, "train.py continuing the graph run")
    numbers = compare(metrics(references["adam"]), metrics(run_folder(tmp_path, "g")), 1e-3)
    record_property("numbers", {**numbers, "seconds": round(graph[2] + eager[2], 1)})


# --------------------------------------------------------------- cost model ---
def test_cost_model_calibrates_and_checks(setup, tmp_path, request, record_property):
    """scripts/cost_model.py --calibrate on the visible GPUs (1 rank, and 2 where there are 2), then
    --check of the layouts that fit them. fp32 is calibrated with TF32, as the trainer runs it
    (the trainer turns TF32 on): on Ampere and newer its matmul rate is then at least a quarter of bf16's
    (TF32 tensor cores run at half bf16's rate; plain fp32 at a sixteenth). The check counts FLOPs
    and bytes exactly on any device; its times are the report's numbers."""
    where(request)
    gpus = visible_gpus()
    ranks, layouts = ("1,2", "serial,dp2") if gpus >= 2 else ("1", "serial")
    out = tmp_path / "cost_model"
    script = str(REPO / "scripts" / "cost_model.py")
    common = ["--config", "tiny", "--yaml_config", str(setup["yaml"]), "--out", str(out)]
    jobs = Jobs(tmp_path, request.node.name)
    env = job_env(tf32=True)  # what is measured is the trainer's fp32, TF32 on
    cal = jobs.run(("calibrate", [sys.executable, script, "--calibrate", "--calibrate_ranks", ranks,
                                  "--calibrate_calls", "5", "--calibrate_seconds", "0.05", *common], env))
    ok(cal["calibrate"], "--calibrate")
    machine = json.loads((out / "machine.json").read_text())
    rates = machine["by_ranks"]["1"]["matmul_flops"]
    ratio = rates["float32"]["large"] / rates["bfloat16"]["large"]
    if torch.cuda.get_device_capability(0)[0] >= 8:
        assert ratio >= 0.25, f"fp32 matmuls at {ratio:.1%} of bf16's: calibrated without TF32"
    check = jobs.run(("check", [sys.executable, script, "--check", "--only", layouts, "--steps", "5",
                                "--data_dir", str(setup["data_dir"]), *common], env))
    ok(check["check"], "--check")
    rows = json.loads((out / "check.json").read_text())
    assert sorted(r["layout"] for r in rows) == sorted(layouts.split(",")), rows
    numbers = {"fp32_to_bf16": round(ratio, 3),
               "fp32_TFLOPs": round(rates["float32"]["large"] / 1e12, 1),
               "bf16_TFLOPs": round(rates["bfloat16"]["large"] / 1e12, 1)}
    for r in rows:
        assert abs(r["flops_error"]) < 0.01 and abs(r["bytes_error"]) < 0.01, r
        numbers[f"{r['layout']}_time_rel_diff"] = r["time_error"]
        numbers[f"{r['layout']}_memory_rel_diff"] = r["memory_error"]
    record_property("numbers", numbers)


# ------------------------------------------------- parts 12 and 13: freezing, asynchronous ---
# the embedding and block 0 freeze at step 2, block 1 at step 4; the cache keeps their output
FREEZE = {"freeze_schedule": "steps", "freeze_cache_mib": 16.0, "lr_schedule": "constant"}
FREEZE_STEPS = ["--freeze_steps", "2", "4"]
# the gradient-norm rule, an interval of 2 steps: its decisions under DDP must be one process's
GRADNORM = {"freeze_schedule": "gradnorm", "freeze_every": 2, "lr_schedule": "constant"}


def test_freezing_with_ddp_and_its_cache(setup, tmp_path, request, record_property):
    """Part 12 on a GPU: blocks freeze during the run (out of the optimizer, out of DDP's
    all-reduce, run without autograd, their output cached), on 2 ranks against one process with
    the same freezing; both log the frozen blocks of each step."""
    backend = where(request)
    ranks = gpu_parts.backend_flags(backend)
    run = Jobs(tmp_path, request.node.name).run(
        ("one", command("train.py", 1, flags(setup, tmp_path, "one", **FREEZE) + FREEZE_STEPS), job_env()),
        ("dp2", command("train.py", 2, flags(setup, tmp_path, "dp2", **FREEZE) + FREEZE_STEPS + ranks),
         job_env()),
        ("gradnorm_one", command("train.py", 1, flags(setup, tmp_path, "gradnorm_one", **GRADNORM)),
         job_env()),
        ("gradnorm_dp2", command("train.py", 2, flags(setup, tmp_path, "gradnorm_dp2", **GRADNORM) + ranks),
         job_env()))
    for label in run:
        ok(run[label], label)
    one, dp2 = metrics(run_folder(tmp_path, "one")), metrics(run_folder(tmp_path, "dp2"))
    assert [m["frozen_blocks"] for m in dp2] == [m["frozen_blocks"] for m in one] == [[0, 0], [1, 1], [2, 2]]
    numbers = compare(one, dp2, LOSS_RTOL)
    # the gradient-norm rule decides from the blocks' gradients: under DDP as in one process
    g_one, g_dp2 = (metrics(run_folder(tmp_path, n)) for n in ("gradnorm_one", "gradnorm_dp2"))
    assert [m["frozen_blocks"] for m in g_dp2] == [m["frozen_blocks"] for m in g_one], (g_one, g_dp2)
    record_property("numbers", {**numbers, "seconds": run["dp2"][2],
                                "cache_hit_rate": dp2[-1].get("cache_hit_rate"),
                                "gradnorm_frozen": g_dp2[-1]["frozen_blocks"]})


# SGD at a constant rate, one micro-batch per step: the asynchronous rule's own test setting
ASYNC = {"pipeline_parallel": 2, "pipeline_schedule": "async_1f1b", "weight_stashing": "stash",
         "num_microbatches": 1, "optimizer_type": "SGD", "momentum": 0.0, "lr": 0.05,
         "lr_schedule": "constant", "checkpoint_every": 3, "async_drain_every": 3}


def test_asynchronous_pipeline_on_two_gpus(setup, tmp_path, request, record_property):
    """Part 13 on GPUs: the asynchronous 1F1B with weight stashing on 2 stages over NCCL (each
    pair of neighbours exchanges one group of messages per micro-batch; the pipeline drains at
    step 3, with a checkpoint), against the same run on the CPU over gloo, whose rule the CPU suite
    proves (tests/test_async_pipeline.py). Tolerance 1e-3: the two devices sum in other orders."""
    where(request)
    cpu_env = subprocess_env(fast_start=False)
    run = Jobs(tmp_path, request.node.name).run(
        ("gpu", command("train_mp.py", 2, flags(setup, tmp_path / "gpu", "async", **ASYNC)), job_env()),
        ("cpu", command("train_mp.py", 2, flags(setup, tmp_path / "cpu", "async", **ASYNC)), cpu_env))
    ok(run["gpu"], "2 GPUs")
    ok(run["cpu"], "CPU reference")
    gpu_folder = run_folder(tmp_path / "gpu", "async")
    assert gpu_folder.parent.name.endswith("_pp2"), gpu_folder
    assert "process group: nccl" in (gpu_folder / "out.log").read_text(), "the stages did not talk over NCCL"
    numbers = compare(metrics(run_folder(tmp_path / "cpu", "async")), metrics(gpu_folder), 1e-3)
    record_property("numbers", {**numbers, "seconds": run["gpu"][2]})


def test_asynchronous_modes_on_two_gpus(setup, tmp_path, request, record_property):
    """The asynchronous 1F1B's other weight versions on 2 stages over NCCL (none: the newest
    weights; vertical: the first stage's version everywhere; 2bw: the version before the newest),
    each against the same run on the CPU. Tolerance 1e-3, as above."""
    where(request)
    cpu_env = subprocess_env(fast_start=False)
    modes = ("none", "vertical", "2bw")
    jobs = []
    for mode in modes:
        values = {**ASYNC, "weight_stashing": mode}
        jobs += [(f"gpu_{mode}", command("train_mp.py", 2, flags(setup, tmp_path / "gpu", mode, **values)),
                  job_env()),
                 (f"cpu_{mode}", command("train_mp.py", 2, flags(setup, tmp_path / "cpu", mode, **values)),
                  cpu_env)]
    run = Jobs(tmp_path, request.node.name).run(*jobs)
    numbers = {}
    for mode in modes:
        ok(run[f"gpu_{mode}"], f"{mode} on 2 GPUs")
        ok(run[f"cpu_{mode}"], f"{mode} on the CPU")
        cpu, gpu = (metrics(run_folder(tmp_path / where_, mode)) for where_ in ("cpu", "gpu"))
        found = compare(cpu, gpu, 1e-3)
        numbers[f"{mode}_rel_diff"] = found["max_rel_diff"]
    record_property("numbers", numbers)


def test_freezing_with_pipeline_stages_recut(setup, tmp_path, request, record_property):
    """Part 12 with a pipeline: 2 stages whose frozen blocks leave the pipeline as they freeze (the
    stages re-cut over the blocks still training), against one process with the same freezing."""
    where(request)
    values = {**FREEZE, "freeze_cache_mib": 0.0}
    run = Jobs(tmp_path, request.node.name).run(
        ("one", command("train.py", 1, flags(setup, tmp_path, "one", **values) + FREEZE_STEPS), job_env()),
        ("pp2", command("train_mp.py", 2, flags(setup, tmp_path, "pp2", pipeline_parallel=2,
                                                pipeline_schedule="1f1b", **values) + FREEZE_STEPS),
         job_env()))
    ok(run["one"], "one process")
    ok(run["pp2"], "2 stages")
    one, pp2 = metrics(run_folder(tmp_path, "one")), metrics(run_folder(tmp_path, "pp2"))
    assert [m["frozen_blocks"] for m in pp2] == [m["frozen_blocks"] for m in one]
    numbers = compare(one, pp2, LOSS_RTOL)
    record_property("numbers", {**numbers, "seconds": run["pp2"][2]})


def test_training_through_dali_on_the_gpu(setup, references, tmp_path, request, record_property):
    """train.py reading through the DALI GPU pipeline trains as through the PyTorch loader (the
    same batches, tests/test_dali.py): the one-process losses."""
    where(request)
    if importlib.util.find_spec("nvidia.dali") is None:
        pytest.skip("NVIDIA DALI is not installed for this python")
    run = Jobs(tmp_path, request.node.name).run(
        ("dali", command("train.py", 1, flags(setup, tmp_path, "dali", data_loader_config="dali", **LAMB)),
         job_env()))
    ok(run["dali"])
    numbers = compare(metrics(references["lamb"]), metrics(run_folder(tmp_path, "dali")), LOSS_RTOL)
    record_property("numbers", {**numbers, "seconds": run["dali"][2]})


def test_tensor_parallel_with_ddp_and_with_offloaded_fsdp(setup, references, tmp_path, request,
                                                          record_property):
    """train_mp.py on 4 ranks: tensor parallel 2 x DDP 2 with activation checkpointing and 2
    micro-batches per step; tensor parallel 2 x FSDP 2 with --cpu_offload (the shards in host
    memory, the groups on the GPUs), whose consolidated checkpoint at step 3 gathers offloaded
    shards. Both clipped, LAMB, against one process."""
    backend = where(request)
    extra = gpu_parts.backend_flags(backend)
    run = Jobs(tmp_path, request.node.name).run(
        ("ddp", command("train_mp.py", 4, flags(setup, tmp_path, "ddp", tensor_parallel=2,
                                                activation_checkpointing="full", grad_accum_steps=2, **LAMB)
                        + extra), job_env()),
        ("fsdp", command("train_mp.py", 4, flags(setup, tmp_path, "fsdp", tensor_parallel=2,
                                                 data_parallel="fsdp", cpu_offload=True, checkpoint_every=3,
                                                 **LAMB) + extra),
         job_env()))
    numbers = {}
    for label in ("ddp", "fsdp"):
        ok(run[label], label)
        found = compare(metrics(references["lamb"]), metrics(run_folder(tmp_path, label)), LOSS_RTOL)
        numbers[f"{label}_rel_diff"] = found["max_rel_diff"]
    assert (run_folder(tmp_path, "fsdp") / CHECKPOINT_NAME).is_file()
    record_property("numbers", numbers)
