"""The single-device optimization ladder on CPU: each rung trains what the baseline trains."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, subprocess_env
from training.context import RunContext
from training.launcher import arg_parser, resolve_config
from training.trainer import EagerStep, Trainer
from utils import device as dev
from utils.config import with_overrides
from utils.metrics import relative_l2_loss
from utils.profiling import TRACE_DIR

BATCH = 4


def make_trainer(cfg, tmp_path: Path, step: type[EagerStep] = EagerStep, device: str = "cpu") -> Trainer:
    ctx = RunContext(device=torch.device(device), run_dir=tmp_path / "run")
    return Trainer(cfg, ctx, BATCH, step=step)


def fixed_batches(n: int, cfg, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    h, w = cfg.img_size
    return [(torch.randn(BATCH, cfg.n_in_channels, h, w, generator=g),
             torch.randn(BATCH, cfg.n_out_channels, h, w, generator=g)) for _ in range(n)]


def train_losses(trainer: Trainer, batches) -> list[float]:
    return [trainer.train_step(inp, tar).item() for inp, tar in batches]


# ------------------------------------------------------------ flags and YAML ---
def test_flag_overrides_yaml_only_when_given(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("x:\n  num_data_workers: 3\n  enable_fused: True\n  enable_jit: True\n"
                    "  amp_mode: bf16\n  data_loader_config: dali\n  profile_epoch: 2\n")
    parser = arg_parser("test")
    kept = resolve_config(parser.parse_args(["--yaml_config", str(yaml), "--config", "x"]))
    assert (kept.num_data_workers, kept.enable_fused, kept.enable_jit, kept.amp_mode,
            kept.data_loader_config, kept.profile_epoch) == (3, True, True, "bf16", "dali", 2)
    # the original tutorial ignored --num_data_workers 0 and overwrote enable_* from flags
    changed = resolve_config(parser.parse_args(
        ["--yaml_config", str(yaml), "--config", "x", "--num_data_workers", "0",
         "--no-enable_fused", "--amp_mode", "none", "--data_loader_config", "pytorch",
         "--profile_epoch", "0", "--profile"]))
    assert (changed.num_data_workers, changed.enable_fused, changed.enable_jit, changed.amp_mode,
            changed.data_loader_config, changed.profile_epoch, changed.profile) == \
        (0, False, True, "none", "pytorch", 0, True)


@pytest.mark.parametrize("overrides, message", [
    ({"profile": True}, "--profile needs a profiling window"),
    ({"profile_epoch": -1}, "'profile_epoch' must be 0 or more"),
    ({"profile_epoch": 0, "profile_num_steps": 0}, "'profile_num_steps' must be None or at least 1"),
])
def test_profiling_keys_are_validated(cfg_factory, overrides, message):
    with pytest.raises(ValueError, match=message):
        cfg_factory(**overrides)


# ----------------------------------------------------------------- precision ---
def test_a_cpu_without_low_precision_arithmetic_is_named_at_start(monkeypatch, cfg_factory):
    """A CPU without bf16 arithmetic (AVX2 only) computes bf16 matmuls in generic code, 40 times
    slower than fp32 measured on one: the run says so in one line at start. The measurement is
    machine-dependent, so the line's rule is tested with the measurement faked."""
    from training.launcher import precision_warning

    cpu = torch.device("cpu")
    assert dev.low_precision_slowdown(cpu, "none") == 1.0
    assert dev.low_precision_slowdown(cpu, "bf16") > 0
    monkeypatch.setattr(dev, "low_precision_slowdown", lambda device, amp: 40.0)
    line = precision_warning(cfg_factory(amp_mode="bf16").optim, cpu)
    assert line.startswith("bf16 matmuls take 40 times as long as fp32 ones on this CPU (it has no bf16 "
                           "arithmetic") and "--amp_mode none trains in fp32" in line
    monkeypatch.setattr(dev, "low_precision_slowdown", lambda device, amp: 0.3)  # AVX-512 BF16: faster
    assert precision_warning(cfg_factory(amp_mode="bf16").optim, cpu) is None


def test_bf16_autocast_stays_close_to_fp32(cfg_factory, tmp_path):
    batches = fixed_batches(4, cfg_factory())
    fp32 = train_losses(make_trainer(cfg_factory(), tmp_path / "a"), batches)
    bf16 = train_losses(make_trainer(cfg_factory(amp_mode="bf16"), tmp_path / "b"), batches)
    # bf16 keeps 8 significant bits (relative rounding 2**-9 = 0.2 %); matmuls accumulate in
    # fp32 and weights stay fp32, so after 4 Adam steps the loss differs by well under 2 %.
    # It must differ at all, or autocast did nothing.
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * abs(a)
    assert fp32 != bf16


def test_fp16_with_grad_scaler_trains_on_cpu(cfg_factory, tmp_path):
    trainer = make_trainer(cfg_factory(amp_mode="fp16"), tmp_path)
    assert trainer.scaler is not None
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses = train_losses(trainer, fixed_batches(2, trainer.cfg))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_fused_adam_matches_unfused(cfg_factory, tmp_path):
    batches = fixed_batches(3, cfg_factory())
    plain = make_trainer(cfg_factory(), tmp_path / "a")
    fused = make_trainer(cfg_factory(enable_fused=True), tmp_path / "b")
    assert fused.optimizer.param_groups[0]["fused"] and not plain.optimizer.param_groups[0]["fused"]
    train_losses(plain, batches)
    train_losses(fused, batches)
    for p, q in zip(plain.model.parameters(), fused.model.parameters()):
        # same update formula; the fused kernel only orders float operations differently
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_model_and_loss_match_eager(cfg_factory, tmp_path, caplog):
    eager = make_trainer(cfg_factory(depth=1), tmp_path / "eager")  # compile time grows with depth
    compiled = make_trainer(cfg_factory(enable_jit=True, depth=1), tmp_path / "compiled")
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in compiled.model.blocks.values())  # parallelize compiled each block in place
    inp, tar = fixed_batches(1, compiled.cfg)[0]
    results = []
    for trainer in (eager, compiled):
        trainer.model.zero_grad(set_to_none=True)
        pred = trainer.model(inp)
        loss = trainer.loss_fn(pred, tar)
        loss.backward()
        results.append((pred.detach(), loss.detach(),
                        [p.grad.clone() for p in trainer.model.parameters()]))
    (p0, l0, g0), (p1, l1, g1) = results
    # inductor fuses and reorders float32 arithmetic: agreement to float32 rounding, not bits
    torch.testing.assert_close(p1, p0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # bf16 autocast: the compiled blocks gave NaN on some Intel AMX CPUs for the strided tokens
    # the patch embedding leaves; the model hands its blocks contiguous ones (networks/vit.py)
    seen = []
    compiled.raw_model.blocks["0"].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad(), dev.autocast(torch.device("cpu"), "bf16"):
        bf16 = [trainer.model(inp).float() for trainer in (eager, compiled)]
    assert seen and all(x.is_contiguous() for x in seen)
    assert torch.isfinite(bf16[1]).all()
    # bf16 rounds to 8 significant bits: the two orders of arithmetic differ by a few 1e-3
    torch.testing.assert_close(bf16[1], bf16[0], rtol=0.05, atol=0.05)
    compiled.train_data.set_epoch(0)
    with caplog.at_level("INFO", logger="training.reporting"):
        compiled.cfg = compiled.cfg.replace(num_iters=1)
        compiled.train_epoch(0, 0)
    assert "torch.compile: compiling the model in the first step" in caplog.text
    assert "torch.compile: first step done in" in caplog.text


def test_compile_bf16_check_names_a_wrong_layout(monkeypatch, caplog):
    from scripts import compile_bf16_check as check

    monkeypatch.setattr(check, "block_errors", lambda: {"strided": 0.004, "contiguous": 0.004})
    with caplog.at_level("INFO", logger="compile_bf16_check"):
        assert check.main([]) == 0
    assert "AMX" in caplog.text or "AVX" in caplog.text or "torch" in caplog.text
    caplog.clear()
    monkeypatch.setattr(check, "block_errors", lambda: {"strided": float("nan"), "contiguous": 0.004})
    with caplog.at_level("INFO", logger="compile_bf16_check"):
        assert check.main([]) == 1
    assert "strided    input" in caplog.text and "WRONG" in caplog.text
    assert "the model gives its blocks contiguous tokens" in caplog.text


# ----------------------------------------------------------------- profiling ---
def test_profiling_window_and_torch_trace_on_cpu(cfg_factory, tmp_path, monkeypatch):
    cfg = cfg_factory(limit_nsamples=16, num_iters=8, profile=True, profile_epoch=1,
                      profile_start_step=1, profile_num_steps=2)
    trainer = make_trainer(cfg, tmp_path)
    calls = []
    monkeypatch.setattr(dev, "cuda_profiler_start", lambda: calls.append(("start", trainer.step)))
    monkeypatch.setattr(dev, "cuda_profiler_stop", lambda: calls.append(("stop", trainer.step)))
    trainer.fit()
    # 4 steps per epoch: epoch 1, steps 1-2 are global steps 5 and 6
    assert calls == [("start", 5), ("stop", 6)]
    traces = list((trainer.ctx.run_dir / TRACE_DIR).glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"step 5", "step 6", "forward", "backward", "optimizer"} <= names
    assert not {"step 4", "step 7"} & names


def test_profiling_window_after_training_is_an_error(cfg_factory, tmp_path):
    cfg = cfg_factory(limit_nsamples=16, num_iters=8, profile_epoch=2)
    with pytest.raises(ValueError, match="starts after the last of 8 training steps"):
        make_trainer(cfg, tmp_path)


# -------------------------------------------------------------- CUDA graphs ---
@pytest.mark.skipif(dev.cuda_available(), reason="checks the message on machines without CUDA")
def test_train_graph_without_cuda_exits_with_one_line(cfg_factory):
    res = subprocess.run([sys.executable, str(REPO / "train_graph.py"), "--config", "tiny"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA Graphs need a GPU" in lines[0]


@pytest.mark.cuda
@pytest.mark.parametrize("amp_mode", ["none", "bf16"])
def test_graph_replay_matches_eager(cfg_factory, tmp_path, amp_mode):
    sys.path.insert(0, str(REPO))
    from training.graphs import EAGER_WARMUP_STEPS, GraphStep

    cfg = cfg_factory(amp_mode=amp_mode, num_iters=10)
    batches = [(x.cuda(), y.cuda()) for x, y in fixed_batches(EAGER_WARMUP_STEPS + 5, cfg)]
    eager = train_losses(make_trainer(cfg, tmp_path / "a", device="cuda"), batches)
    graph_trainer = make_trainer(cfg, tmp_path / "b", GraphStep, device="cuda")
    graphed = train_losses(graph_trainer, batches)
    assert graph_trainer.variant.graph is not None
    # capturable Adam computes the same update with device-side step counts; the replayed
    # kernels are the eager ones, so the losses agree to float rounding
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- benchmark ---
def test_benchmark_smoke_writes_every_field(cfg_factory, tmp_path, capsys, monkeypatch):
    """Every field of every rung; and a rung configured to diverge (+AMP, a learning rate of
    1e30: its loss is not finite from its second step on) reported as failed, not timed."""
    from ruamel.yaml import YAML

    from scripts import benchmark

    yaml = tmp_path / "bench.yaml"
    with open(yaml, "w") as f:
        YAML().dump({"t": cfg_factory().to_dict()}, f)
    rungs = ["baseline", "+workers", "+DALI", "+AMP", "+fused"]  # +compile: see the compile test
    configs = benchmark.rung_configs
    monkeypatch.setattr(benchmark, "rung_configs", lambda *args, **kwargs: [
        (name, with_overrides(cfg, lr=1e30) if name == "+AMP" else cfg)
        for name, cfg in configs(*args, **kwargs)])
    out = tmp_path / "bench"
    benchmark.main(["--yaml_config", str(yaml), "--config", "t", "--steps", "2", "--warmup", "1",
                    "--profile_steps", "1", "--loader_batches", "2", "--matmul_size", "128", "--workers", "1",
                    "--shape_seconds", "0.01", "--rungs", ",".join(rungs), "--out_dir", str(out)])
    report = json.loads((out / "benchmark.json").read_text())
    assert [r["name"] for r in report["rungs"]] == rungs
    assert sorted(p.name for p in out.iterdir()) == ["benchmark.json", "benchmark.md"]  # no rung folders
    progress = capsys.readouterr().err
    assert "rung 1/5 baseline ..." in progress and "s left at this pace" in progress
    assert report["flops_per_sample"] > 0 and set(report["matmul_peak_flops"]) == {"fp32", "bf16"}
    assert set(report["shape_peak_flops"]) == {"fp32", "bf16"} and all(report["shape_peak_flops"].values())
    # the diverging rung: failed at the step its loss stopped being finite, no speed, no bare loop
    failed = report["rungs"].pop(3)
    assert failed["name"] == "+AMP" and failed["failed_step"] == 2
    assert not math.isfinite(failed["failed_loss"])
    assert failed["failed"] == f"training loss is {failed['failed_loss']} at step 2"
    assert not {"samples_per_sec", "mfu", "mfu_shapes", "vs_bare"} & set(failed)
    assert [(f["name"], f["step"]) for f in report["failed"]] == [("+AMP", 2)]
    assert f"FAILED: {failed['failed']}, not timed" in progress
    assert report["best"]["name"] != "+AMP"
    rungs.remove("+AMP")
    for r in report["rungs"]:
        assert r["samples_per_sec"] > 0 and r["mfu"] > 0
        dtype = benchmark.dtype_name(r["settings"]["amp_mode"])  # MFU against either peak of its dtype
        for key, peaks in (("mfu", "matmul_peak_flops"), ("mfu_shapes", "shape_peak_flops")):
            rate = report["flops_per_sample"] * r["samples_per_sec"]
            assert r[key] == pytest.approx(rate / report[peaks][dtype])
        assert {"data_wait", "forward", "backward", "optimizer", "other"} <= set(r["breakdown_ms"])
        assert all(r["breakdown_ms"][k] > 0 for k in ("forward", "backward", "optimizer"))
        assert r["peak_memory_bytes"] > 0
        assert r["loader"]["samples_per_sec"] > 0 and r["loader"]["raw_h5py_samples_per_sec"] > 0
        ratios = r["loader"]["ratios"]  # one per loader pass, each against its own raw pass
        assert len(ratios) == benchmark.LOADER_REPEATS
        assert r["loader"]["ratio_to_raw"] == statistics.median(ratios)
    assert report["rungs"][2]["settings"]["data_loader_config"] == "dali"
    assert failed["settings"]["amp_mode"] == report["rungs"][3]["settings"]["amp_mode"] == "bf16"
    assert report["bare"][0]["samples_per_sec"] > 0
    # each rung against a bare loop with its own settings, run right after it
    assert len(report["bare"]) == len(rungs)
    assert all(r["vs_bare"] == r["samples_per_sec"] / b["samples_per_sec"]
               and b["settings"]["amp_mode"] == r["settings"]["amp_mode"]
               for r, b in zip(report["rungs"], report["bare"]))
    assert {a["dtype"] for a in report["attention"]} == {"fp32", "bf16"}
    assert sum(a["chosen"] for a in report["attention"]) == 2  # one kernel per dtype
    assert report["best"]["samples_per_sec_vs_bare"] > 0
    table = (out / "benchmark.md").read_text()
    assert all(f"| {name} |" in table for name in rungs)
    assert f"| +AMP | **failed**: {failed['failed']}, not timed |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| rung |", "| +AMP |", "| baseline |"))]
    assert len({row.count("|") for row in rows}) == 1  # the failed rung's row has every column
    # the header names the CPU's model and matrix instructions, and torch's CPU kernels
    assert f"CPU {dev.cpu_description()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}" \
        in table.splitlines()[0]
    assert report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "| 128 x 32 x 96 | 2 |" in table  # q/k/v of the 2 blocks: 4 samples of 32 tokens, 32 -> 96


def test_benchmark_counts_cpu_attention_flops(cfg_factory):
    from torch.utils.flop_counter import FlopCounterMode

    from networks.vit import build_vit
    from scripts.benchmark import CPU_ATTENTION_FLOPS, flops_per_sample

    cfg = cfg_factory()  # 16 x 32 grid, patch 4: 32 tokens; 4 heads of 8; depth 2
    counted = flops_per_sample(cfg, BATCH, torch.device("cpu"))
    # everything but the CPU attention kernels, which count zero here whether or not this torch
    # knows them (2.13 does not, 2.15 does): the benchmark must add attention exactly once
    plain = FlopCounterMode(display=False, custom_mapping={op: lambda *args, **kwargs: 0
                                                           for op in CPU_ATTENTION_FLOPS})
    with plain:
        inp, tar = fixed_batches(1, cfg)[0]
        relative_l2_loss(build_vit(cfg.model)(inp), tar).backward()
    # per layer and sample: QK^T and AV forward (2 x 2 x heads x N^2 x head_dim), backward
    # 2.5 x that (torch's formula recomputes the scores)
    attention = 3.5 * 2 * 2 * 4 * 32**2 * 8 * cfg.depth
    assert counted - plain.get_total_flops() / BATCH == attention


def test_shape_peak_counts_the_flops_of_the_models_linear_layers(cfg_factory, monkeypatch):
    """The shape peak times every distinct (M, K, N) of the model's linear layers, forward and
    the two backward products: their FLOPs, weighted by the layers that have each shape, are the
    FLOPs torch counts in the model's matmuls in a step, and the peak is FLOPs over seconds."""
    from torch.utils.flop_counter import FlopCounterMode

    from networks.vit import build_vit
    from scripts import benchmark, cost_measure

    cfg = cfg_factory()  # 16 x 32 grid, patch 4: 32 tokens of width 32; 2 blocks; 20 x 16 outputs a token
    shapes = benchmark.linear_shapes(cfg, BATCH)
    m = BATCH * 32
    assert shapes == {(m, 32, 96): 2, (m, 32, 32): 2, (m, 32, 128): 2, (m, 128, 32): 2, (m, 32, 320): 1}
    counter = FlopCounterMode(display=False)
    inp, tar = fixed_batches(1, cfg)[0]
    with counter:
        relative_l2_loss(build_vit(cfg)(inp), tar).backward()
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counted.items() if str(op) in ("aten.mm", "aten.addmm", "aten.bmm"))
    assert sum(layers * 6 * m_ * k * n for (m_, k, n), layers in shapes.items()) == matmuls
    for (m_, k, n) in shapes:  # what is timed for a shape is its three products, nothing more
        call, flops = cost_measure.layer_products(m_, k, n, torch.float32, torch.device("cpu"))
        with FlopCounterMode(display=False) as one:
            call()
        assert flops == one.get_total_flops() == 6 * m_ * k * n
    # the peak: the step's linear FLOPs over their seconds (times faked: a shape takes K ms)
    monkeypatch.setattr(benchmark, "fastest_call", lambda fn, device, seconds: 1e-3 * seconds_k.pop(0))
    seconds_k = [k for (_, k, _) in sorted(shapes)]
    peak = benchmark.shape_peak(shapes, torch.device("cpu"), torch.float32)
    flops = sum(layers * 6 * m_ * k * n for (m_, k, n), layers in shapes.items())
    assert peak["flops_per_sec"] == pytest.approx(flops / sum(layers * 1e-3 * k for (_, k, _), layers
                                                                in shapes.items()))
    assert [(r["m"], r["k"], r["n"], r["layers"]) for r in peak["shapes"]] == \
        [(*shape, layers) for shape, layers in sorted(shapes.items())]
    assert all(r["flops_per_sec"] == r["flops"] / r["seconds"] for r in peak["shapes"])


def test_a_rung_whose_loss_is_not_finite_stops_before_it_is_timed():
    from scripts.benchmark import NonFiniteLossError, ProfilerPhases, RungClock

    clock = RungClock(torch.device("cpu"), timed_from=2, profile_from=5, phases=ProfilerPhases())
    clock.begin()
    clock.step_end(None, torch.tensor(1.0))  # two warm-up steps, the second not finite
    with pytest.raises(NonFiniteLossError, match="training loss is inf at step 2"):
        clock.step_end(None, torch.tensor(float("inf")))
    assert clock.t_start is None  # the timed window never opened
    # the first step that is not finite is the one named, whatever comes after it
    for loss in (float("nan"), 3.0):
        clock.step_end(None, torch.tensor(loss))
    assert clock.first_non_finite() == (2, float("inf"))
    fine = RungClock(torch.device("cpu"), timed_from=1, profile_from=2, phases=ProfilerPhases())
    fine.begin()
    fine.step_end(None, torch.tensor(0.5))
    assert fine.t_start is not None and fine.first_non_finite() is None


def test_rounds_of_a_rung_report_the_median_round_and_the_median_ratio():
    """--rounds N: each round of a rung is followed by its bare loop; on a busy machine one round
    can be slow on either side, so the rung reports its median round and the median of the
    rounds' own ratios (not the ratio of two medians from different rounds)."""
    from scripts.benchmark import median_round

    def round_(rate: float, bare: float) -> dict:
        return {"samples_per_sec": rate, "bare_samples_per_sec": bare, "vs_bare": rate / bare,
                "step_ms": 1000 / rate}

    rounds = [round_(10.0, 10.0), round_(6.0, 12.0), round_(9.0, 9.5)]
    rung = median_round(rounds)
    assert rung["samples_per_sec"] == 9.0 and rung["step_ms"] == 1000 / 9.0  # the median round, whole
    assert rung["bare_samples_per_sec"] == 10.0  # the bare loops' median
    assert rung["vs_bare"] == 9.0 / 9.5  # ratios 1.0, 0.5, 0.947: their median
    assert [r["samples_per_sec"] for r in rung["rounds"]] == [10.0, 6.0, 9.0]
    assert median_round(rounds[:1]) is rounds[0]
    assert median_round(rounds[:2])["samples_per_sec"] == 6.0  # even: the lower middle round


def test_benchmark_measures_peaks_under_the_trainer_matmul_settings(monkeypatch):
    from scripts import benchmark

    calls = []
    monkeypatch.setattr(benchmark.dev, "configure_matmul", lambda device: calls.append(("configure", device)))
    monkeypatch.setattr(benchmark, "matmul_peak",
                        lambda device, dtype, n: calls.append(("peak", dtype)) or 1.0)
    cpu = torch.device("cpu")
    assert benchmark.measure_peaks(cpu, "bf16", 64) == {"none": 1.0, "bf16": 1.0}
    # TF32 (on CUDA) is set before the fp32 peak is measured, not only later by the Trainer
    assert calls == [("configure", cpu), ("peak", torch.float32), ("peak", torch.bfloat16)]


class ClockEvent:
    """Stands in for torch.Event on CPU: record() notes the host clock."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        assert self.t is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: ClockEvent) -> float:
        return 1000.0 * (end.t - self.t)


def test_event_phases_bracket_the_trainer_ranges(cfg_factory, tmp_path):
    from scripts.benchmark import EventPhases

    trainer = make_trainer(cfg_factory(), tmp_path)
    original = dev.nvtx_range
    clock = EventPhases(torch.device("cpu"), make_event=ClockEvent)
    clock.start()
    try:
        train_losses(trainer, fixed_batches(2, trainer.cfg))
        with dev.nvtx_range("step 7"):  # not a phase: passed through, not timed
            pass
    finally:
        clock.stop()
    assert dev.nvtx_range is original
    names = [name for name, _, _ in clock.pairs]
    assert names == ["forward", "backward", "optimizer"] * 2
    # one phase's end comes before the next one's start, so the phases never overlap
    times = [t for _, begin, end in clock.pairs for t in (begin.t, end.t)]
    assert times == sorted(times)
    ms = clock.ms_per_step(2)
    assert set(ms) == {"forward", "backward", "optimizer"} and all(v > 0 for v in ms.values())
    total = 1000.0 * (clock.pairs[-1][2].t - clock.pairs[0][1].t) / 2
    assert sum(ms.values()) <= total + 1e-6


def test_rungs_without_dali_keep_the_pytorch_loader(cfg_factory, monkeypatch):
    from scripts.benchmark import dali_available, rung_configs

    base = cfg_factory()
    names = ["+DALI", "+AMP", "+fused"]
    with_dali = rung_configs(base, names, 1, "bf16", cuda=False, dali=True)
    assert [n for n, _ in with_dali] == names
    assert all(c.data_loader_config == "dali" for _, c in with_dali)
    without = rung_configs(base, names, 1, "bf16", cuda=False, dali=False)
    assert [n for n, _ in without] == ["+AMP", "+fused"]
    assert all(c.data_loader_config == "pytorch" and c.amp_mode == "bf16" and c.num_data_workers == 1
               for _, c in without)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` raises ImportError
    assert not dali_available()


@pytest.mark.cuda
def test_benchmark_cuda_phases_count_the_backward_kernels(cfg_factory, tmp_path):
    from ruamel.yaml import YAML

    from scripts import benchmark

    yaml = tmp_path / "bench.yaml"
    with open(yaml, "w") as f:
        YAML().dump({"t": cfg_factory().to_dict()}, f)
    out = tmp_path / "bench"
    original = dev.nvtx_range
    benchmark.main(["--yaml_config", str(yaml), "--config", "t", "--steps", "3", "--warmup", "1",
                    "--profile_steps", "2", "--loader_batches", "2", "--matmul_size", "512",
                    "--workers", "1", "--rungs", "baseline,+AMP,+graphs", "--no_bare", "--out_dir", str(out)])
    assert dev.nvtx_range is original
    report = json.loads((out / "benchmark.json").read_text())
    rungs = {r["name"]: r for r in report["rungs"]}
    assert set(rungs) == {"baseline", "+AMP", "+graphs"}
    for name in ("baseline", "+AMP"):
        b = rungs[name]["breakdown_ms"]
        assert all(b[k] > 0 for k in ("forward", "backward", "optimizer")), b
        # backward runs about twice the forward's kernels; the profiler's main-thread range
        # credited it with almost none of them (launched from autograd's device thread)
        assert b["backward"] > 0.5 * b["forward"], b
        assert b["forward"] + b["backward"] + b["optimizer"] < 2 * rungs[name]["step_ms"], b
    assert rungs["+graphs"]["breakdown_ms"]["graph replay"] > 0
    assert all(0 < r["mfu"] < 1 for r in rungs.values())


@pytest.mark.cuda
def test_fp32_peak_is_measured_with_tf32_as_the_trainer_runs(monkeypatch):
    from scripts.benchmark import matmul_peak, measure_peaks

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored afterwards
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    true_fp32 = matmul_peak(cuda, torch.float32, 2048)
    peaks = measure_peaks(cuda, "bf16", 2048)
    assert torch.backends.cuda.matmul.allow_tf32
    if torch.cuda.get_device_capability(cuda)[0] >= 8:  # Ampere and newer have TF32 tensor cores
        assert peaks["none"] > 1.5 * true_fp32, (peaks, true_fp32)


def test_a_slow_dtype_ends_the_peak_climb_and_mfu_above_100_is_not_shown(monkeypatch):
    """A CPU without bf16 arithmetic took minutes for one bf16 matmul of 4096: a size whose first
    call runs past the budget is the last one timed. Its peak then depends on the shape, and an
    MFU above 100 % is shown as such, not as a number."""
    from scripts import benchmark

    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape[0]) or real_mm(a, b))
    assert benchmark.matmul_peak(torch.device("cpu"), torch.float32, 64, reps=2, budget_s=0.0) > 0
    assert calls == [8]  # the first size only: its first call ran past a budget of 0 s
    calls.clear()
    benchmark.matmul_peak(torch.device("cpu"), torch.float32, 64, reps=2, budget_s=60.0)
    assert calls == [s for s in (8, 16, 32, 64, 128) for _ in range(3)]
    assert benchmark.mfu_text(0.383) == "38.3%" and benchmark.mfu_text(5.6) == "(\\*)"


def test_dali_missing_is_one_clean_error(cfg_factory, monkeypatch):
    """Without DALI installed: the install hint as a DataError, and no traceback from the
    half-built loader's clean-up afterwards."""
    import gc

    from utils.data_loader import DataError
    from utils.data_loader_dali import DALIBatches

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` raises ImportError
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(DataError, match="pip install .*nvidia-dali-cuda120"):
        DALIBatches(cfg_factory(data_loader_config="dali"), "train", 4, train=True)
    gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]


@pytest.mark.parametrize("argv, message", [
    (["--config", "smal"], "error: unknown config 'smal'"),
    (["--matmul_size", "1"], "error: --warmup and --workers must be at least 0, --matmul_size at least 2"),
    (["--rungs", "+turbo"], r"error: unknown rung\(s\) \+turbo"),
    (["--rounds", "0"], "error: --steps, --profile_steps, --loader_batches and --rounds must be at least 1"),
    (["--shape_seconds", "0"], "error: --shape_seconds must be above 0"),
])
def test_benchmark_bad_options_are_one_line_errors(argv, message):
    from scripts.benchmark import main as benchmark_main

    with pytest.raises(SystemExit, match=message):
        benchmark_main(argv)
