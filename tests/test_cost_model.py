"""The cost model (scripts/cost_model.py) against the code it models: parameter shapes, FLOPs
(torch.utils.flop_counter) and activation memory (autograd's saved tensors) on the serial model
in this process; bytes, memory and FLOPs of every rank in real training runs of several
layouts; the plan's ranking; the command line's errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distributed.parallelize import apply_activation_checkpointing
from networks.vit import build_vit
from scripts import cost_model as cm
from scripts.cost_measure import ActivationMeter, measure_layout
from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import write_test_yaml
from utils import attention
from utils.config import DEFAULT_YAML, load_config, with_overrides
from utils.metrics import relative_l2_loss

pytestmark = pytest.mark.timeout(300)

# constants of an imaginary machine: the plan and the time need some, the checks here don't time
MACHINE = {"name": "test", "overlap": 0.0, "cores": 4, "by_ranks": {
    str(r): {"matmul_flops": {"float32": {"large": 1e11, "small": 5e10},
                              "bfloat16": {"large": 4e11, "small": 2e11}},
             "memory_bandwidth": 1e10, "adam_seconds_per_parameter": 1e-9,
             "collectives": {k: [1e-4, 1e9] for k in cm.RING}} for r in (1, 2, 4)}}


def tiny(**overrides):
    return with_overrides(load_config(DEFAULT_YAML, "tiny"), **overrides)


@pytest.mark.parametrize("overrides", [{}, {"num_experts": 4, "moe_top_k": 2}])
def test_parameter_shapes_are_the_models(overrides):
    cfg = tiny(**overrides)
    real = [(n, tuple(p.shape)) for n, p in build_vit(cfg.model).named_parameters()]
    assert cm.parameter_shapes(cm.Model.from_config(cfg)) == real


def test_another_backbone_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="the cost model's formulas are the ViT's .* none for backbone afno"):
        cm.main(["--config", "tiny_afno"])


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_flops_and_activations_of_the_serial_model(checkpointing):
    """FlopCounterMode (attention by the math kernel, whose matmuls it sees) and the saved tensors
    of one forward and backward of the real model, batch 2, against the formulas: in fp32, and
    under bf16 autocast (bf16 matmul inputs, outputs and weight copies; an fp32 residual stream)."""
    cfg = tiny()
    model = apply_activation_checkpointing(build_vit(cfg.model), checkpointing)
    x, y = torch.randn(2, 20, 32, 64), torch.randn(2, 20, 32, 64)
    with FlopCounterMode(display=False) as counter, attention.kernel("math"):
        relative_l2_loss(model(x), y).backward()
    lay = cm.Layout(1, batch=2, checkpointing=checkpointing)
    m = cm.Model.from_config(cfg)
    assert cm.flops(m, lay)["total"] == counter.get_total_flops()
    for dtype in ("float32", "bfloat16"):
        meter = ActivationMeter()
        hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
        with hooks, attention.kernel("default"), autocast:
            loss = relative_l2_loss(model(x), y)
        loss.backward()
        assert cm.activation_bytes(m, lay, dtype=dtype)["total"] == meter.peak, dtype
    assert cm.activation_bytes(m, lay, dtype="bfloat16")["total"] < cm.activation_bytes(m, lay)["total"]


def test_layouts_measured_in_real_runs(data_dir, tmp_path):
    """Three training runs (train_mp.py's loop): every rank's FLOPs, bytes and calls of each
    collective, parameters, gradients, optimizer state and saved activations exactly as predicted:
    a GPipe pipeline of 2 stages of tensor parallel 2 (transfers, micro-batches in flight), every
    block recomputed; context parallel's gathers and per-parameter gradient sums, every other
    block recomputed; HSDP (FSDP's padding), 2 groups of 2 ranks; the asynchronous pipeline with
    weight stashing (the first stage's forward recomputed in backward, one micro-batch's
    activations at a time, the older weight version it held)."""
    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    m = cm.Model.from_config(load_config(yaml, "tiny"))
    layouts = [cm.Layout(4, tp=2, pp=2, schedule="gpipe", checkpointing="full", batch=8),
               cm.Layout(2, cp=2, checkpointing="selective", batch=8),
               cm.Layout(4, "hsdp", dp_shard=2, batch=8),
               cm.Layout(2, pp=2, schedule="async_1f1b", stashing="stash", microbatches=2, batch=8)]
    for lay in layouts:
        flags = lay.flags() + [f"--data_dir={data_dir}", "--limit_nsamples=40"]
        records = measure_layout(lay.name, lay.ranks, flags, tmp_path / "runs", "tiny", str(yaml), steps=4)
        assert len(records) == lay.ranks
        row = cm.check_layout(m, lay, MACHINE, records)
        assert row["flops_error"] == row["bytes_error"] == row["memory_error"] == 0, (lay.name, records)
        for r in records:
            want = {k: v[1] for k, v in cm.collectives(m, lay, r["pp_rank"]).items()}
            assert r["comm_calls"] == want, lay.name


def test_a_mixture_of_experts(data_dir, tmp_path):
    """FLOPs of the serial model with experts (top-2, dropless) as FlopCounterMode counts them; and
    expert parallelism on 2 ranks in a real run: each rank's parameters, gradients, optimizer
    state, gradient all-reduce and calls exactly as predicted, and, as what a rank computes and
    receives depends on the routing, the FLOPs and all-to-all bytes of the two ranks together."""
    cfg = tiny(num_experts=4, moe_top_k=2)
    x, y = torch.randn(2, 20, 32, 64), torch.randn(2, 20, 32, 64)
    with FlopCounterMode(display=False) as counter, attention.kernel("math"):
        relative_l2_loss(build_vit(cfg.model)(x), y).backward()
    assert cm.flops(cm.Model.from_config(cfg), cm.Layout(1, batch=2))["total"] == counter.get_total_flops()

    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    m = cm.Model.from_config(with_overrides(load_config(yaml, "tiny"), num_experts=4, moe_top_k=2))
    lay = cm.Layout(2, ep=2, batch=8)
    flags = lay.flags() + [f"--data_dir={data_dir}", "--limit_nsamples=40", "--num_experts=4",
                           "--moe_top_k=2"]
    records = measure_layout(lay.name, 2, flags, tmp_path / "runs", "tiny", str(yaml), steps=4)
    predicted = cm.collectives(m, lay)
    for r in records:
        mem = cm.memory(m, lay, 0, r["dp_rank"])
        assert (mem["parameters"], mem["gradients"], mem["optimizer_state"]) == (
            r["held"]["parameters"], r["held"]["step_gradients"], r["held"]["optimizer_state"])
        assert r["comm_bytes"]["all_reduce"] == predicted["all_reduce"][0]
        assert r["comm_calls"] == {k: v[1] for k, v in predicted.items()}
    assert sum(r["comm_bytes"]["all_to_all"] for r in records) == 2 * predicted["all_to_all"][0]
    assert sum(r["flops"] for r in records) == 2 * cm.flops(m, lay)["total"]


def test_the_plan_ranks_what_fits():
    cfg = tiny()
    m = cm.Model.from_config(cfg)
    rows = cm.plan(m, 4, 16, 2**30, MACHINE, cfg=cfg)
    seconds = [r["seconds"] for r in rows]
    assert seconds == sorted(seconds) and len(rows) > 10
    assert {r["layout"].ranks for r in rows} == {4}
    # only layouts the code runs: pipelines do not combine with context parallelism here
    everything = cm.candidate_layouts(m, 4, 16)
    assert any(lay.pp > 1 and lay.cp > 1 for lay in everything)
    assert not any(r["layout"].pp > 1 and r["layout"].cp > 1 for r in rows)
    # HSDP where the data-parallel ranks span nodes
    assert any(lay.data_parallel == "hsdp" for lay in cm.candidate_layouts(m, 4, 16, cfg, per_node=2))
    # a memory limit between the layouts' needs keeps only those under it
    needs = sorted({r["memory"] for r in rows})
    limit = needs[len(needs) // 2]
    kept = cm.plan(m, 4, 16, limit, MACHINE, cfg=cfg)
    assert kept and all(r["memory"] <= limit for r in kept) and len(kept) < len(rows)


def test_pipeline_bubble_and_overlap_in_the_time():
    m = cm.Model.from_config(tiny())
    few, many = (cm.step_time(m, cm.Layout(2, pp=2, microbatches=k), MACHINE) for k in (2, 8))
    assert few["pipeline bubble"] > many["pipeline bubble"] > 0  # (p - 1) / m of a step
    # no flush, no bubble: the asynchronous pipeline fills once per run (and after a checkpoint)
    for k in (2, 8):
        assert "pipeline bubble" not in cm.step_time(m, cm.Layout(2, pp=2, microbatches=k,
                                                                  schedule="async_1f1b"), MACHINE)
    hidden = cm.step_time(m, cm.Layout(2), {**MACHINE, "overlap": 1.0})
    assert hidden["communication"] < cm.step_time(m, cm.Layout(2), MACHINE)["communication"]


def test_the_asynchronous_pipelines_weight_versions(cfg_factory):
    """What the cost model says each of 4 stages holds (stash: p - s versions with one
    micro-batch per step, 1 + ceil((p - 1 - s) / m) with m; vertical sync: p; 2BW: 2; none: 1)
    is what the stages held at most: as tests/test_async_pipeline.py counts them in its runs of
    each mode, and here with 2 micro-batches per step (4 stages in one process, 8 steps); and its
    bytes are that many copies of the stage's parameters beyond the newest."""
    from tests.test_async_pipeline import RULES, simulate

    def predicted(mode, m):
        lay = cm.Layout(4, pp=4, schedule="async_1f1b", stashing=mode, microbatches=m, batch=m)
        return [cm.weight_versions(lay, s) for s in range(4)]

    for mode, (m, _, versions) in RULES.items():
        assert predicted(mode, m) == versions, mode
    assert predicted("none", 1) == [1, 1, 1, 1]
    cfg = cfg_factory(depth=4)
    model = build_vit(cfg.model)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 20, 16, 32, generator=gen), torch.randn(2, 20, 16, 32, generator=gen))
               for _ in range(8)]
    for mode in ("stash", "vertical"):
        engines = simulate(model, 4, mode, 2, batches)
        assert [e.most_versions for e in engines] == predicted(mode, 2), mode
    mem = cm.memory(cm.Model.from_config(cfg), cm.Layout(4, pp=4, schedule="async_1f1b", microbatches=1))
    assert mem["weight versions"] == 3 * mem["parameters"]  # the first of 4 stages: 4 versions


def test_the_attention_kernel_has_a_rate_of_its_own():
    """A calibrated machine times attention's two products at the fused kernel's measured rate
    (on this CPU below the layers' matmuls); a machine without one (vendor figures) at theirs."""
    m = cm.Model.from_config(tiny())
    slow = json.loads(json.dumps(MACHINE))
    for entry in slow["by_ranks"].values():
        entry["matmul_flops"]["float32"]["attention"] = 1e9
    base, with_kernel = (cm.step_time(m, cm.Layout(1), machine)["compute"] for machine in (MACHINE, slow))
    attention_flops = sum(f for name, f, _ in cm.layer_costs(m, cm.Layout(1)) if name.startswith("attention"))
    assert attention_flops > 0
    # each attention product now takes f / 1e9 s instead of at most f / 5e10 (or its bytes' time)
    assert attention_flops * (1 / 1e9 - 1 / 5e10) * (1 - 1e-9) <= with_kernel - base <= attention_flops / 1e9


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/cost_model.py", *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)


def test_command_line(tmp_path):
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(MACHINE))
    done = run_cli("--config", "tiny", "--ranks", "2", "--data_parallel", "fsdp", "--machine", str(machine))
    assert done.returncode == 0 and "all_gather" in done.stdout and "samples/s" in done.stdout
    done = run_cli("--config", "tiny", "--plan", "--gpus", "4", "--gpu_memory_gb", "1",
                   "--machine", str(machine))
    assert done.returncode == 0 and "fastest first" in done.stdout
    missing = ["--machine", str(tmp_path / "none.json")]
    for bad, says in ((["--config", "nope"], "error:"), (missing, "--calibrate")):
        done = run_cli(*bad)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr


def test_gpu_systems_time_collectives_by_ring_and_link():
    """On a GPU node an all-reduce moves 2 (g - 1) / g of its payload per rank, an all-gather
    (g - 1) / g, over NVLink inside a node and the network across; the published comparison
    calibrates each tutorial on its own single-GPU run."""
    a100 = cm.GPU_SYSTEMS["a100-perlmutter"]
    (lat, nvlink), (net_lat, net) = a100["links"]["node"], a100["links"]["network"]
    assert cm.collective_seconds(a100, "all_reduce", 4, 1e9, 2) == pytest.approx(2 * lat + 1.5e9 / nvlink)
    assert cm.collective_seconds(a100, "all_gather", 4, 1e9, 1) == pytest.approx(lat + 0.75e9 / nvlink)
    assert cm.collective_seconds(a100, "all_reduce", 8, 1e9, 1, spans_nodes=True) == pytest.approx(
        net_lat + 1.75e9 / net)
    rows = cm.published(str(DEFAULT_YAML))
    for row in rows:
        assert 0 < row["share"] < 1
        if row["run"].split()[1] == "single":  # the calibrating row is met exactly
            assert row["predicted"] == pytest.approx(row["published"])
    assert {r["run"].split()[0] for r in rows} == {"SC23", "SC25"}


def test_calibration_times_matmuls_under_the_trainers_settings(monkeypatch):
    """The Trainer turns TF32 on for fp32 matmuls on a GPU (utils.device.configure_matmul): every
    matmul the calibration times runs after the same call, on the calibration's device."""
    from scripts import cost_measure
    from utils import device as dev

    configured, after = [], []
    monkeypatch.setattr(dev, "configure_matmul", lambda device, allow_tf32=True: configured.append(device))
    original = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: after.append(bool(configured)) or original(a, b))
    cost_measure.compute_rates(seconds=0.002)
    assert configured == [cost_measure.calibration_device()]
    assert after and all(after)


@pytest.mark.cuda
def test_the_fp32_rate_is_tf32s_as_the_trainer_runs(monkeypatch):
    """On Ampere and newer the fp32 rate the calibration measures is TF32's, several times true fp32's."""
    from scripts.benchmark import matmul_peak
    from scripts.cost_measure import compute_rates

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored afterwards
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    true_fp32 = matmul_peak(cuda, torch.float32, 1024)
    rate = compute_rates(seconds=0.05)["matmul_flops"]["float32"]["large"]
    assert torch.backends.cuda.matmul.allow_tf32
    if torch.cuda.get_device_capability(cuda)[0] >= 8:
        assert rate > 1.5 * true_fp32, (rate, true_fp32)


def _fake_calibration_runs(started: list[int]):
    """subprocess.run for calibrate: notes the ranks torchrun would start, answers as rank 0 does."""
    rate = {"large": 1e12, "small": 1e12, "attention": 1e12}
    rates = {"matmul_flops": {d: rate for d in ("float32", "bfloat16")},
             "memory_bandwidth": 1e11, "adam_seconds_per_parameter": 1e-9}
    points = [[size, 1e-4 + size / 1e10] for size in (2**12, 2**18, 2**20, 2**22)]

    def run(cmd, **kwargs):
        ranks = int(next(a for a in cmd if a.startswith("--nproc_per_node=")).split("=")[1])
        started.append(ranks)
        data = {"collectives": {k: points for k in ("all_reduce", "broadcast")} if ranks > 1 else {},
                "compute": [rates] * ranks}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(data) + "\n", stderr="")

    return run


@pytest.mark.parametrize("gpus", [1, 2])
def test_calibrate_and_check_use_the_gpus_the_machine_has(monkeypatch, tmp_path, capsys, gpus):
    """On a machine with 1 or 2 GPUs (NCCL: one rank per GPU) the calibration starts only the rank
    counts it has GPUs for, and the check runs only the layouts that fit, naming those left out."""
    from scripts import cost_measure
    from utils import device as dev

    monkeypatch.setattr(dev, "gpu_count", lambda: gpus)
    started: list[int] = []
    monkeypatch.setattr(subprocess, "run", _fake_calibration_runs(started))
    machine = cost_measure.calibrate((1, 2, 4))
    assert started == [1, 2][:gpus] and sorted(machine["by_ranks"]) == ["1", "2"][:gpus]
    left = ", ".join(str(r) for r in (1, 2, 4) if r > gpus)
    assert f"left out {left}: this machine has {gpus} GPU(s)" in capsys.readouterr().out

    measured = []
    monkeypatch.setattr(cost_measure, "calibrate", lambda *a: machine)
    monkeypatch.setattr(cost_measure, "measure_layout",
                        lambda name, ranks, *a, **k: measured.append((name, ranks)) or [])
    monkeypatch.setattr(cm, "check_layout", lambda m, lay, machine, records: {"layout": lay.name})
    args = cm.argparse.Namespace(out=tmp_path, recalibrate=True, calibrate_ranks="1,2,4", calibrate_calls=1,
                                 calibrate_seconds=0.01, only="", data_dir=None, config="tiny",
                                 yaml_config=None, steps=4)
    rows = cm.run_check(args, cm.Model.from_config(tiny()))
    fits = [lay for lay in cm.CHECKED if lay.ranks <= gpus]
    assert measured == [(lay.name, lay.ranks) for lay in fits] and len(rows) == len(fits)
    said = capsys.readouterr().out
    left = [lay.name for lay in cm.CHECKED if lay.ranks > gpus]
    assert f"left out, more ranks than this machine's {gpus} GPU(s): {', '.join(left)}" in said


def test_the_check_writes_its_numbers_without_matplotlib(monkeypatch, tmp_path, capsys):
    """A GPU image with torch alone: check.json and check.md are written, the plot is left out with
    a line, and the check does not fail."""
    import sys

    from scripts import instruments

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(cm, "run_check", lambda args, m: [])
    monkeypatch.setattr(cm, "check_table", lambda rows: "| layout |")

    def no_plot(rows, path):
        raise AssertionError("plotted without matplotlib")

    monkeypatch.setattr(cm, "plot_check", no_plot)
    written = []
    monkeypatch.setattr(instruments, "write_report", lambda out, name, md, rows: written.append(name))
    args = cm.argparse.Namespace(out=tmp_path)
    assert cm.check_command(args, cm.Model.from_config(tiny()), None) == 0
    assert written == ["check"]
    assert "no check.png: matplotlib is not installed" in capsys.readouterr().out


def test_the_calibrations_compute_is_done_before_a_collective_is_timed(monkeypatch):
    """On a GPU the host only queues matmuls: busy() waits for the device, or the timed collective
    would wait behind the queue and count the matmuls' time as its own."""
    from scripts import cost_measure
    from utils import device as dev

    waited = []
    monkeypatch.setattr(dev, "synchronize", lambda device: waited.append(device.type))
    cost_measure.busy(0.01)
    assert waited and set(waited) == {"cpu"}
