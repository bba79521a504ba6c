#!/usr/bin/env python
"""The figures the pages show under "What you should see", each with the command that prints it,
and a pass that reruns those commands as written and compares.

    python scripts/page_figures.py                 # every page; a long run (the full trainings)
    python scripts/page_figures.py --pages 05 06   # some pages
    python scripts/page_figures.py --day logs/course_day   # outputs of scripts/course_day.py's commands

A figure is a number on a page, written in [brackets] in FIGURES below with the page's text
around it, the command that prints it and where in its output. The number of digits the page
shows is the rounding: the figure holds if the printed value, rounded so, is what the page says
(where a figure differs from CPU to CPU, the page shows fewer digits). A time or a rate holds
within its share `within` of the page's value, on the machine the page names beside it (times
move with a machine's load; on another CPU they are that CPU's). Figures that do not depend
on how long the run trains (parameter counts, memory per rank, bytes per step) are also checked
by the course walk (tests/test_readme.py), which runs every command with few steps; the losses of
full runs are checked here. The pass writes OUT/figures.json with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRAIN_SCRIPTS = ("train.py", "train_mp.py", "train_graph.py")


@dataclass(frozen=True)
class Figure:
    page: str  # the page's file name in docs/, without .md
    command: str  # as the page writes it (the walk checks the figure of a command of a bash block)
    printed: str  # a regular expression with one group: the value in what the command prints
    shown: str  # the page's text around the figure, the figure in [brackets]
    pick: int = 0  # which match of `printed` (-1: the last, as a run's final loss)
    scale: float = 1.0  # printed value x scale = the page's unit (1e-6: parameters in millions)
    walk: bool = False  # independent of the run's length: the course walk checks it too
    within: float = 0.0  # a time or a rate: holds within this share of the page's value

    @property
    def text(self) -> str:
        return re.sub(r"\[([\d.]+)]", r"\1", self.shown)

    def on_page(self) -> bool:
        """The page holds the figure's text (a line break counts as a space)."""
        words = " ".join((REPO / "docs" / f"{self.page}.md").read_text().split())
        return " ".join(self.text.split()) in words

    @property
    def value(self) -> str:
        return re.search(r"\[([\d.]+)]", self.shown).group(1)


def rounded(value: float, like: str) -> str:
    """`value` with as many decimals as the page's `like` has."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    return f"{value:.{decimals}f}"


def decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def twice_rounded(raw: str, figure: Figure) -> bool:
    """A printed value with more digits than the page's, itself rounded: 0.5145 may be 0.51452,
    which a page rounds to 0.515. True if the page's figure is within both roundings of it."""
    unit = 10.0 ** -decimals(raw) * figure.scale
    page_unit = 10.0 ** -decimals(figure.value)
    if unit >= page_unit:
        return False
    return abs(float(raw) * figure.scale - float(figure.value)) <= 0.5 * (unit + page_unit) + 1e-12


def check(figure: Figure, output: str) -> str | None:
    """None if `output` prints the page's figure; else what is wrong, in one line."""
    found = re.findall(figure.printed, output)
    if not found or not -len(found) <= figure.pick < len(found):
        return (f"{figure.page}: `{figure.command}` printed nothing like {figure.printed!r} "
                f"for {figure.text!r}")
    value = float(found[figure.pick]) * figure.scale
    printed = rounded(value, figure.value)
    if figure.within and abs(value - float(figure.value)) > figure.within * float(figure.value):
        return (f"{figure.page}: {figure.text!r} says {figure.value}, `{figure.command}` measured "
                f"{printed}, more than {figure.within:.0%} off: rerun the page's command and update the page")
    if not figure.within and printed != figure.value and not twice_rounded(found[figure.pick], figure):
        return (f"{figure.page}: {figure.text!r} says {figure.value}, `{figure.command}` printed "
                f"{printed}: rerun the page's command and update the page")
    return None


TINY = "python train.py --config tiny"
SP = ("torchrun --standalone --nproc_per_node 2 scripts/mp_memory.py --config tiny --tensor_parallel 2 "
      "--sequence_parallel")
TP4 = "torchrun --standalone --nproc_per_node 4 scripts/mp_memory.py --config tiny --tensor_parallel 4"
CLIP_FSDP = ("torchrun --standalone --nproc_per_node 2 train.py --config tiny_short --data_parallel fsdp "
             "--grad_clip_norm 0.1 --memory_snapshot --run_num clipped_fsdp")
HSDP = ("torchrun --standalone --nproc_per_node 4 train.py --config tiny_short --data_parallel hsdp "
        "--dp_shard 2 --run_num hsdp")
COMPARE = ("python scripts/compare_runs.py logs/tiny/2GPU/00 logs/tiny/2GPU/bf16 logs/tiny/2GPU/powersgd "
           "--out logs/plots/compression.png")
COMM = "torchrun --standalone --nproc_per_node 2 scripts/comm_overlap.py --config tiny --out logs/comm"
ONEBIT_RUNS = ["torchrun --standalone --nproc_per_node 2 train.py --config tiny --optimizer OneBitAdam "
               "--onebit_warmup_steps 32 --run_num onebit32",
               "torchrun --standalone --nproc_per_node 2 train.py --config tiny --optimizer OneBitAdam "
               "--run_num onebit100"]
ONEBIT = ("python scripts/compare_runs.py logs/tiny/2GPU/00 logs/tiny/2GPU/onebit32 logs/tiny/2GPU/onebit100 "
          "--out logs/plots/onebit.png")
RANGE = "python scripts/lr_range_test.py --config tiny"
STUDY = "python scripts/batch_scaling.py --config tiny"
STUDY_ROWS = ["| Adam, constant | 0.0137 | 0.0270 | 0.0675 | 0.191 | 0.379 | 0.566 |",
              "| Adam, linear | 0.0137 | 0.0203 | 0.0389 | 0.0818 | 0.515 | 0.768 |",
              "| Adam, sqrt | 0.0137 | 0.0222 | 0.0410 | **0.0671** | **0.116** | **0.181** |",
              "| LAMB, constant | 0.0105 | 0.0338 | 0.276 | 0.550 | 0.730 | 0.844 |",
              "| LAMB, linear | **0.0105** | **0.0145** | **0.0281** | 0.0740 | 0.126 | 0.298 |",
              "| LAMB, sqrt | 0.0105 | 0.0191 | 0.0511 | 0.153 | 0.292 | 0.433 |"]


def study_cell(row: str, column: int) -> str:
    """batch_scaling.py's table of final validation losses: optimizer and rule, then one per batch."""
    name, rule = row.strip("| ").split(" | ")[0].split(", ")
    return rf"(?m)^{name}\s+{rule}\s+" + r"\S+\s+" * column + r"([\d.]+)"


FREEZE = ("python train.py --config tiny --freeze_schedule formula --freeze_every 80 --freeze_cache_mib 64 "
          "--run_num freeze")
SHRINK = ("torchrun --standalone --nproc_per_node 2 train_mp.py --config tiny --pipeline_parallel 2 "
          "--freeze_schedule steps --freeze_steps 40 80 160 --freeze_cache_mib 64 --run_num freeze")
FREEZE_REPORT = "python scripts/freeze_report.py --init logs/tiny/1GPU/00/checkpoint.pt --out logs/freezing"
ASYNC = "python scripts/async_report.py --out logs/async"


def async_row(mode: str, ms: int, column: int) -> str:
    """async_report.py's straggler table: the `column`-th number of a mode, slowed or not."""
    return rf"(?m)^\| {mode} \| {ms} ms \|" + r"[^|\n]*\|" * column + r" ([\d.]+)"


CALIBRATE = "python scripts/cost_model.py --calibrate --out logs/cost_model"
CHECK = "python scripts/cost_model.py --check --out logs/cost_model"
PLAN = "python scripts/cost_model.py --config tiny --plan --gpus 4 --gpu_memory_gb 0.02 --out logs/cost_model"
CHECK_ROWS = [f"| {layout} | {predicted} | {measured} |" for layout, predicted, measured in [
    ("serial", 203, 187), ("dp2", 110, 110), ("dp4", 126, 115), ("dp2_zero1", 139, 109),
    ("dp4_zero1", 208, 140), ("dp2_fsdp", 143, 135), ("dp4_fsdp", 263, 227), ("tp2", 166, 160),
    ("cp2", 266, 225), ("dp2_tp2", 166, 236), ("pp2_gpipe_m4", 144, 122), ("pp2_1f1b_m4", 144, 130),
    ("pp4_gpipe_m4", 188, 156), ("pp4_1f1b_m4", 188, 145), ("dp2_ckpt_full", 136, 148)]]
PIPE = ("torchrun --standalone --nproc_per_node 2 train_mp.py --config tiny --pipeline_parallel 2 "
        "--pipeline_schedule 1f1b --num_microbatches 4")
DS_COMPARE = "python scripts/deepspeed_compare.py --config tiny --ranks 2 --out logs/deepspeed"
VAL, TRAIN, PARAMS = r"Avg val loss=([\d.]+)", r"Avg train loss=([\d.]+)", r"INFO (\d+) parameters"
MIB = r"Memory per rank \(MiB\): parameters ([\d.]+), gradients ([\d.]+), optimizer ([\d.]+)"


def dp_run(ranks: int) -> str:
    return (f"torchrun --standalone --nproc_per_node={ranks} train.py --config tiny --limit_nsamples 320 "
            f"--num_iters 60 --run_num {ranks}ranks")


def dp_rate(ranks: int, flags: str, name: str) -> str:
    """Page 3's throughput runs: dp_run's, with `flags`, in a run folder of their own."""
    return dp_run(ranks).replace(f"--run_num {ranks}ranks", f"{flags}--run_num {name}")


def mb_per_step(run: str) -> str:
    """compare_runs.py's "gradient MB per step" (the column before samples/s) in the run's row."""
    return rf"(?m)^\| {re.escape(run)} \|.*\| ([\d.]+) \| [\d.]+ \|$"


def cell(row: str, column: int) -> str:
    """The number in a markdown table's ``row`` (its first cell), ``column`` cells after it."""
    return rf"\| {re.escape(row)} \|" + r" [\d.]+ \|" * column + r" ([\d.]+) \|"


def md_cell(row: str, column: int) -> str:
    """The number in the `column`-th cell after a printed markdown row's first (`row`); bold, a % or
    an x allowed."""
    return (rf"(?m)^\| \**{re.escape(row)}\** \|" + r"[^|\n]*\|" * column
            + r" \**([\d.]+)\**[%x]? \|")


def row_figures(page: str, command: str, row: str, printed: list[str | None], within: float = 0.0,
                label_cells: int = 1) -> list[Figure]:
    """A figure for each number of the page's table `row` after its first `label_cells` cells, in
    order: the k-th is printed where `printed[k]` finds it (None, or past the list's end: not here)."""
    start = [i for i, ch in enumerate(row) if ch == "|"][label_cells]
    numbers = list(re.finditer(r"\d+(?:\.\d+)?", row[start:]))
    assert len(printed) <= len(numbers), (row, len(numbers))
    return [Figure(page, command, pattern, row[:start + m.start()] + f"[{m.group()}]", within=within)
            for m, pattern in zip(numbers, printed) if pattern is not None]


def attention_ms(dtype: str, kernel: str, part: int) -> str:
    """The benchmark's attention table: forward (part 0) or backward (1) ms of a kernel."""
    return rf"\| {dtype} \| \**{kernel}\** \|" + r" [\d.]+ \|" * part + r" ([\d.]+) \|"


BENCH = "python scripts/benchmark.py --config tiny --rungs baseline,+AMP --steps 20"
FLASH = BENCH + " --attention_kernel flash"
LADDER = "python scripts/benchmark.py --config small --steps 6 --warmup 2 --profile_steps 1"
PROFILE = "python scripts/plot_profile.py --run_dir logs/tiny_short/1GPU/profile --out logs/plots/profile.png"
LADDER_ROWS = ["| baseline | 6.32 | 0.96x | 762 | 1683 | 64.2% | 68.2% |",
               "| +workers | 6.81 | 0.99x | 727 | 1720 | 69.3% | 73.6% |",
               "| +DALI | 7.18 | 0.97x | 667 | 1430 | 73.0% | 77.5% |",
               "| +AMP | 14.06 | 1.00x | 358 | 737 | 36.5% | 39.6% |",
               "| +fused | 13.05 | 0.94x | 424 | 759 | 33.8% | 36.8% |",
               "| +compile | 13.68 | 1.06x | 410 | 788 | 35.5% | 38.5% |"]


DRY_RUN = "python scripts/dry_run.py sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4"


def tp_run(flags: str) -> str:
    """Page 5's 40-step runs, each in a run folder of its own (sp's layout is tp's)."""
    name = "_".join(w.strip("-") for w in flags.split() if not w.isdigit()) + "".join(
        w for w in flags.split() if w.isdigit())
    return (f"torchrun --standalone --nproc_per_node 4 train_mp.py --config tiny {flags} --num_iters 40 "
            f"--limit_nsamples 320 --run_num {name}")


def mib(kind: int) -> str:
    """One of the trainer's memory line's numbers: 0 parameters, 1 gradients, 2 optimizer."""
    parts = MIB.split("([\\d.]+)")
    numbers = ["([\\d.]+)" if i == kind else "[\\d.]+" for i in range(len(parts) - 1)]
    return "".join(p + n for p, n in zip(parts, numbers)) + parts[-1]


def memory(page: str, command: str, shown: str, kind: int) -> Figure:
    return Figure(page, command, mib(kind), shown, walk=True)


FIGURES = [
    # page 1: the demo and the three sizes
    Figure("01-single-device", TINY, PARAMS, "on the 32 x 64 data ([0.89]M parameters)", scale=1e-6,
           walk=True),
    Figure("01-single-device", TINY, TRAIN, "Avg train loss=[0.456]"),
    Figure("01-single-device", TINY, VAL, "Avg val loss=[0.102]"),
    Figure("01-single-device", TINY, VAL, "| `tiny` | 0.89M | [0.0137] |", pick=-1),
    Figure("01-single-device", "python train.py --config tiny_small --run_num sizes", PARAMS,
           "| `tiny_small` | [0.15]M |", scale=1e-6, walk=True),
    Figure("01-single-device", "python train.py --config tiny_small --run_num sizes", VAL,
           "| `tiny_small` | 0.15M | [0.0216] |", pick=-1),
    Figure("01-single-device", "python train.py --config tiny_large --run_num sizes", PARAMS,
           "| `tiny_large` | [3.36]M |", scale=1e-6, walk=True),
    Figure("01-single-device", "python train.py --config tiny_large --run_num sizes", VAL,
           "| `tiny_large` | 3.36M | [0.0101] |", pick=-1),
    # page 2: the profile, the attention kernels, the ladder (times and rates of this machine)
    Figure("02-optimizations", PROFILE, r"(\d+) ms in steps", "four steps of about [130] ms", scale=0.25,
           within=0.3),
    Figure("02-optimizations", PROFILE, r"(\d+) ms waiting", "[6] ms in all between them", within=1.0),
    *(fig for command, row in [
        (FLASH, "| `tiny` (16, 4, 128, 32) | fp32 | 1.74 + 3.68 | 2.03 + 2.57 |"),
        (FLASH, "| `tiny` (16, 4, 128, 32) | bf16 | 1.55 + **8.99** | 2.29 + 3.12 |"),
        (LADDER, "| `small` (16, 8, 512, 32) | bf16 | 38.18 + 77.46 | 102.55 + 168.04 |")]
      for fig in row_figures("02-optimizations", command, row, [
          attention_ms(row.split(" | ")[1], kernel, part) for kernel in ("flash", "math") for part in (0, 1)],
          within=0.5, label_cells=2)),
    Figure("02-optimizations", FLASH, md_cell("baseline", 0),
           "`tiny` trained at [139] samples/s", within=0.3),
    Figure("02-optimizations", FLASH, md_cell("+AMP", 0),
           "[211] in bf16 with flash", within=0.3),
    Figure("02-optimizations", BENCH, md_cell("+AMP", 0), "[226] with `auto`", within=0.3),
    *(fig for row in LADDER_ROWS for fig in row_figures(
        "02-optimizations", LADDER, row, [md_cell(row.split(" | ")[0][2:], c) for c in (0, 2, 5, 6, 9, 10)],
        within=0.3)),
    Figure("02-optimizations", LADDER, r"one large square matmul fp32 ([\d.]+)", "goes from [202] to",
           within=0.3),
    Figure("02-optimizations", LADDER, r"one large square matmul fp32 [\d.]+, bf16 ([\d.]+)",
           "to [793] GFLOP/s", within=0.3),
    Figure("02-optimizations", LADDER, md_cell("+compile", 13), "warm-up took [13.6] s", within=0.5),
    Figure("02-optimizations", LADDER, md_cell("+fused", 13), "s against [4.4]", within=0.5),
    # page 3: the same validation losses on 1, 2 and 4 ranks (epochs 1-3 of 20 steps)
    *(Figure("03-data-parallel", dp_run(ranks), VAL, shown, pick=i) for ranks in (1, 2, 4)
      for i, shown in enumerate(["every printed digit, [0.408277]", "0.408277, [0.155965]",
                                 "0.155965, [0.126401]"])),
    # page 3: epoch 3's samples/s of each run (this machine's rates)
    *(Figure("03-data-parallel", command, r"epoch 3 is [\d.]+ sec, avg ([\d.]+) samples/sec", shown,
             within=0.3) for command, shown in [
          ("OMP_NUM_THREADS=1 " + dp_rate(1, "", "rate1"), "| 1 rank (`OMP_NUM_THREADS=1`) | [90.0] |"),
          (dp_rate(2, "", "rate2"), "| 2 ranks | [153.9] |"),
          (dp_rate(4, "", "rate4"), "| 4 ranks (on 2 cores) | [136.3] |"),
          (dp_rate(2, "--noddp ", "noddp2"), "| 2 ranks, `--noddp` | [159.8] |"),
          (dp_rate(4, "--noddp ", "noddp4"), "| 4 ranks, `--noddp` | [192.2] |"),
          (dp_rate(2, "--bucket_cap_mb 0.25 ", "bucket2"),
           "| 2 ranks, `--bucket_cap_mb 0.25` (13 buckets, not 1) | [145.0] |")]),
    # page 4: one step of each variant of the gradient's all-reduce (this machine's times)
    *(fig for row, printed in [
        ("| by hand after backward, per parameter | 162.4 | 55 |",
         [md_cell("all-reduce after backward, per parameter (by hand)", 0), None]),
        ("| by hand after backward, one flat buffer | 96.4 | 1 |",
         [md_cell("all-reduce after backward, one flat buffer", c) for c in (0, 2)]),
        ("| DDP, buckets of 25 MB / 1 MB / 0.25 MB | 94.6 / 101.3 / 108.6 | 1 / 4 / 13 |",
         [md_cell(f"DDP, buckets of {mb} MB", c) for c in (0, 2) for mb in ("25", "1", "0.25")]),
        ("| FSDP, prefetching the next block / two blocks | 138.3 / 139.4 |",
         [md_cell("FSDP, default prefetching (next block)", 0),
          md_cell("FSDP, explicit prefetching of two blocks", 0)])]
      for fig in row_figures("04-communication", COMM, row, printed, within=0.3)),
    *(Figure("04-communication", ONEBIT, rf"(?m)^\| {re.escape(run)} \|.*\| ([\d.]+) \|$", shown, within=0.3)
      for run, shown in [("2GPU/00", "| Adam (`2GPU/00`) | 3.57 | 0.0137 | [159] |"),
                         ("onebit32", "| `onebit32` | 0.17 | 0.0336 | [135] |"),
                         ("onebit100", "| `onebit100` | 0.17 | 0.0185 | [134] |")]),
    # page 4: bytes per step of the compressed runs (compare_runs' table), their final losses
    Figure("04-communication", COMPARE, mb_per_step("2GPU/00"), "| none (part 3's `2GPU/00`) | [3.57] |",
           walk=True),
    Figure("04-communication", COMPARE, mb_per_step("bf16"), "| `bf16`, `fp16` | [1.78] |", walk=True),
    # (PowerSGD sends whole gradients for its first steps: the walk's short runs do not show its bytes)
    Figure("04-communication", COMPARE, mb_per_step("powersgd"), "| `powersgd` (rank 4) | [0.24] |"),
    Figure("04-communication", "torchrun --standalone --nproc_per_node 2 train.py --config tiny "
           "--grad_compression powersgd --run_num powersgd", VAL, "| `powersgd` (rank 4) | 0.24 | [0.0229] |",
           pick=-1),
    # page 4: 1-bit Adam's final losses (the walk's 2 steps are all warm-up: Adam's bytes)
    Figure("04-communication", "torchrun --standalone --nproc_per_node 2 train.py --config tiny --optimizer "
           "OneBitAdam --onebit_warmup_steps 32 --run_num onebit32", VAL, "| `onebit32` | 0.17 | [0.0336] |",
           pick=-1),
    Figure("04-communication", "torchrun --standalone --nproc_per_node 2 train.py --config tiny --optimizer "
           "OneBitAdam --run_num onebit100", VAL, "| `onebit100` | 0.17 | [0.0185] |", pick=-1),
    # page 5: memory per rank (mp_memory.py, exact) and the same losses on every layout
    Figure("05-model-parallel", SP, r'"parameters_MiB": ([\d.]+)', "| tp = 2, sp (2) | [1.90] |", walk=True),
    Figure("05-model-parallel", SP, r'"saved_activations_MiB": ([\d.]+)',
           "| tp = 2, sp (2) | 1.90 | [9.81] |",
           walk=True),
    Figure("05-model-parallel", TP4, r'"parameters_MiB": ([\d.]+)', "| tp = 4 (4) | [1.14] |", walk=True),
    Figure("05-model-parallel", TP4, r'"saved_activations_MiB": ([\d.]+)', "| tp = 4 (4) | 1.14 | [9.07] |",
           walk=True),
    *(Figure("05-model-parallel", tp_run(flags), pattern, shown, pick=pick)
      for flags in ("--tensor_parallel 1", "--tensor_parallel 2", "--tensor_parallel 4",
                    "--tensor_parallel 2 --sequence_parallel",
                    "--tensor_parallel 2 --context_parallel 2")
      for pattern, shown, pick in ((TRAIN, "train [0.764634] then", 0), (TRAIN, "then [0.249722]", -1),
                                   (VAL, "validation [0.408277] then", 0), (VAL, "then [0.209705]", -1))),
    # page 6: what FSDP and HSDP keep per rank, the clipped runs' losses
    memory("06-sharding", CLIP_FSDP, "fsdp on 2 ranks keeps [1.9] / 1.9 / 3.5", 0),
    memory("06-sharding", CLIP_FSDP, "fsdp on 2 ranks keeps 1.9 / [1.9] / 3.5", 1),
    memory("06-sharding", CLIP_FSDP, "fsdp on 2 ranks keeps 1.9 / 1.9 / [3.5]", 2),
    memory("06-sharding", HSDP, "hsdp `--dp_shard 2` [1.9] / 1.9 / 3.5", 0),
    memory("06-sharding", HSDP, "hsdp `--dp_shard 2` 1.9 / 1.9 / [3.5]", 2),
    Figure("06-sharding", CLIP_FSDP, TRAIN, "| 1 (1-16) | 0.304 / 0.551 | [0.5618] |", pick=0),
    Figure("06-sharding", CLIP_FSDP, VAL, "| 2 (17-32) | 0.130 / 0.156 | 0.2414 | [0.2493] |", pick=-1),
    # page 8: the range tests, the runs at their rates, the scaling study
    *(Figure("08-large-batches", command, printed, shown) for command, printed, shown in [
        (RANGE, r"diverged at lr ([\d.]+)", "Adam diverged at [0.378]"),
        (RANGE, r"\(step (\d+)\)", "(step [186] of 200)"),
        (RANGE, r"lowest at lr ([\d.]+)", "of 200), lowest at [0.0135]"),
        (RANGE, r"suggested lr: ([\d.]+)", "suggested **[0.00135]**"),
        (RANGE + " --optimizer LAMB", r"diverged at lr ([\d.]+)", "LAMB diverged at [0.466]"),
        (RANGE + " --optimizer LAMB", r"lowest at lr ([\d.]+)", "0.466, lowest at [0.189]"),
        (RANGE + " --optimizer LAMB", r"suggested lr: ([\d.]+)", "suggested **[0.0189]**")]),
    *(Figure("08-large-batches", f"python train.py --config tiny {flags}", VAL, shown, pick=-1)
      for flags, shown in [
          ("--lr 0.00135 --run_num range_lr", "| `range_lr` (Adam, 0.00135) | [0.0126] |"),
          ("--lr_schedule onecycle --warmup 0 --lr 0.0135 --run_num onecycle",
           "| `onecycle` (Adam, 0.0135) | [0.0075] |"),
          ("--optimizer LAMB --lr 0.0189 --run_num lamb", "| `lamb` (LAMB, 0.0189) | [0.0082] |")]),
    *(fig for row in STUDY_ROWS
      for fig in row_figures("08-large-batches", STUDY, row, [study_cell(row, c) for c in range(6)])),
    # page 9: the mixture of experts' parameters; page 10: what DeepSpeed's stage 2 holds per rank
    Figure("09-experts", "python train.py --config tiny --num_experts 4 --run_num moe", PARAMS,
           "Twice the parameters ([1.68]M, not 0.89M)", scale=1e-6, walk=True),
    *(Figure("10-deepspeed", DS_COMPARE, cell("deepspeed 2", column), shown, walk=True)
      for column, shown in enumerate(["| stage 2 | [3.40] |", "| stage 2 | 3.40 | [1.70] |",
                                      "| stage 2 | 3.40 | 1.70 | [5.10] |"])),
    # page 11: the dry run of page 5's tp 4 x dp 4 (fake tensors: the same on every machine)
    *(Figure("11-cost-model", DRY_RUN, printed, shown, walk=True) for printed, shown in [
        (r"parameters\s+([\d.]+)", "| dry run | [170.2] |"),
        (r"activations\s+([\d.]+)", "| dry run | 170.2 | 170.2 | 340.4 | [16200.4] |"),
        (r"activations\s+[\d.]+\s+([\d.]+)", "| cost model | 170.2 | 170.2 | 340.4 | [14618.3] |"),
        (r"all_reduce over tp\s+([\d.]+)", "| dry run | 170.2 | 170.2 | 340.4 | 16200.4 | [9112.5] |"),
        (r"all_reduce over tp\s+[\d.]+\s+([\d.]+)",
         "| cost model | 170.2 | 170.2 | 340.4 | 14618.3 | [9112.5] |")]),
    # page 12: the formula with the cache (its epochs' log lines), the pipeline that shrinks
    *(Figure("12-freezing", FREEZE, printed, shown, pick=pick) for printed, shown, pick in [
        (r"step (\d+): 2 of 4 blocks frozen", "2 blocks frozen from step [80]", 0),
        (r"step (\d+): 3 of 4 blocks frozen", "3 from [160]", 0),
        (VAL, "validation loss [0.0177] against", -1),
        (r"served (\d+)% of the samples whole", "The cache held [22]% of the samples in epoch 3", 2),
        (r"extended (\d+)%", "extended [44]% and 56%", 3),
        (r"extended (\d+)%", "extended 44% and [56]%", 4),
        (r"served (\d+)% of the samples whole", "then served [99]-100%", 5),
        (r"served (\d+)% of the samples whole", "then served 99-[100]%", 6),
        (r"\(([\d.]+) MiB kept\)", "whole ([45.6] MiB", -1),
        (mib(1), "Gradients fell from [3.4] to", 0), (mib(1), "3.4 to [0.9] MiB", -1),
        (mib(2), "Adam's state from [6.8]", 0), (mib(2), "6.8 to [1.8]", -1)]),
    *(Figure("12-freezing", SHRINK, rf"step (\d+): the run continues with pipeline_parallel {pp}", shown,
             pick=pick)
      for pp, shown, pick in [(2, "at steps [40] and 80", 0), (2, "at steps 40 and [80]", 1),
                              (1, "pp 1 x dp 2 from step [160]", 0)]),
    # page 12: the report (step times of this machine; the fine-tuning's losses)
    *(fig for row in ["| 0 | 352 (352) | 352 (352) |", "| 2 | 279 (293) | 311 (262) |",
                      "| 4 | 229 (237) | 199 (177) |", "| 6 | 190 (180) | 93 (92) |",
                      "| 8 | 114 (123) | 10 (8) |"]
      for fig in row_figures("12-freezing", FREEZE_REPORT, row, [md_cell(row[2], c) for c in range(4)],
                             within=0.35)),
    *(fig for row, name in [("| every layer trains | 46.1 | 0.0164 |", "every layer trains"),
                            ("| the earliest frozen, cached (0, 1, 2, 3) | 22.9 | 0.0198 |",
                             "earliest blocks frozen (cached)"),
                            ("| the control, random (1, 3, 2, 0) | 34.0 | 0.0197 |", "random blocks frozen")]
      for fig in [*row_figures("12-freezing", FREEZE_REPORT, row, [md_cell(name, 2), None], within=0.3),
                  *row_figures("12-freezing", FREEZE_REPORT, row, [None, md_cell(name, 3)])]),
    # page 13: the schedules (bubble, rate), stale weights and gradients, the straggler
    *(fig for row, schedule, m in [("| 1F1B, flushed | 4 | 0.26 | 128.4 |", "1f1b", 4),
                                   ("| async, stash | 4 | 0.10 | 130.7 |", "async_1f1b", 4),
                                   ("| [GPipe](terms.md#gpipe), flushed | 1 | 0.52 | 93.2 |", "gpipe", 1),
                                   ("| async, stash | 1 | 0.13 | 133.7 |", "async_1f1b", 1)]
      for fig in [*row_figures("13-asynchronous", ASYNC, row, [
          None, rf"(?m)^\| {schedule} \| 2 \| {m} \| [\d.]+ \| ([\d.]+) \|$", None], within=0.5),
          *row_figures("13-asynchronous", ASYNC, row, [
              None, None, rf"(?m)^\| {schedule} \| 2 \| {m} \| ([\d.]+) \|$"], within=0.3)]),
    *(Figure("13-asynchronous", ASYNC, rf"\| {label} \| \d+ \|" + r" [\d.]+ \|" * k + r" ([\d.]+) \|",
             shown) for label, k, shown in [
        ("1F1B, flushed", 0, "1F1B flushed [0.1235] /"), ("1F1B, flushed", 1, "0.1235 / [0.0514]"),
        ("asynchronous, 2bw", 0, "(staleness 1) [0.169] /"), ("asynchronous, 2bw", 1, "0.169 / [0.192]"),
        ("asynchronous, stash", 0, "by stage) [0.204] /"), ("asynchronous, stash", 1, "0.204 / [0.222]"),
        ("asynchronous, none", 0, "no stashing [0.220] /"), ("asynchronous, none", 1, "0.220 / [0.288]"),
        ("asynchronous, vertical", 0, "everywhere) [0.252] /"),
        ("asynchronous, vertical", 1, "0.252 / [0.605]")]),
    *(Figure("13-asynchronous", ASYNC, rf"(?m)^\| {s} \| [\d.]+ \| ([\d.]+) \|$", shown) for s, shown in [
        (0, "validation loss [0.1235], 0.1704"), (1, "0.1235, [0.1704] and"), (3, "and [0.2579] at")]),
    *(fig for row, mode, ms in [("| DDP, 0 ms | 154.1 | 9.63 | 0.1235 | - |", "ddp", 0),
                                ("| DDP, 1000 ms | 14.4 | 0.90 | 0.1235 | - |", "ddp", 1000),
                                ("| server, 0 ms | 145.2 | 9.07 | 0.1664 | 0.98; 1.00 |", "server", 0),
                                ("| server, 1000 ms | 86.2 | 10.05 | 0.1361 | 0.82; 11.25 |", "server", 1000),
                                ("| Hogwild, 0 ms | 166.3 | 10.74 | 0.1608 | - |", "hogwild", 0),
                                ("| Hogwild, 1000 ms | 85.5 | 9.79 | 0.1315 | - |", "hogwild", 1000)]
      for fig in [*row_figures("13-asynchronous", ASYNC, row, [async_row(mode, ms, c) for c in (0, 1)],
                               within=0.35),
                  *row_figures("13-asynchronous", ASYNC, row, [None, None, async_row(mode, ms, 2)],
                               within=0.15 if mode != "ddp" else 0.0),
                  *row_figures("13-asynchronous", ASYNC, row, [None] * 3 + [
                      async_row(mode, ms, 4), rf"(?m)^\| {mode} \| {ms} ms \|.*\| [\d.]+, ([\d.]+) \|$"
                  ] if mode == "server" else [], within=0.5)]),
    # page 11: the check's predicted and measured step times, the plan's first layout (this machine's)
    *(fig for row in CHECK_ROWS for fig in row_figures(
        "11-cost-model", CHECK, row, [md_cell(row.split(" | ")[0][2:], c) for c in (7, 8)], within=0.3)),
    Figure("11-cost-model", PLAN, r"dp2_pp2_1f1b_m4\s+([\d.]+) ms", "`dp2_pp2_1f1b_m4`, [137.3] ms",
           within=0.3),
    # page 7: the pipeline's split, logged as the run starts
    Figure("07-pipeline-parallel", PIPE, r"1f1b schedule, (\d+) micro-batches",
           "1f1b schedule, [4] micro-batches",
           walk=True),
]


# commands a figure's command reads the runs of (the pass runs them first, once)
NEEDS = {COMPARE: ["torchrun --standalone --nproc_per_node=2 train.py --config=tiny",
                   "torchrun --standalone --nproc_per_node 2 train.py --config tiny --grad_compression bf16 "
                   "--run_num bf16",
                   "torchrun --standalone --nproc_per_node 2 train.py --config tiny "
                   "--grad_compression powersgd --run_num powersgd"],
         CHECK: [CALIBRATE], PLAN: [CALIBRATE],
         ONEBIT: ["torchrun --standalone --nproc_per_node=2 train.py --config=tiny", *ONEBIT_RUNS]}


def machine() -> str:
    from utils.device import cpu_description

    return cpu_description()


def run(command: str, tmp: Path) -> str:
    """The command as written, its logs/ paths and run folders inside `tmp`."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and words[0].split("=")[0].isupper():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "torchrun":
        words[:1] = [sys.executable, "-m", "torch.distributed.run"]
    words = [str(tmp / w) if w.startswith("logs/") else w for w in words]
    if any(w.endswith(TRAIN_SCRIPTS) for w in words):
        words += ["--expdir", str(tmp / "logs")]
    result = subprocess.run(words, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: `{command}` failed:\n{result.stdout[-2000:]}")
    return result.stdout


def day_outputs(folders: list[Path]) -> dict[str, str]:
    """What each command a learner's day ran printed (its day.json lists them with their logs)."""
    outputs = {}
    for folder in folders:
        try:
            ran = json.loads((folder / "day.json").read_text())["commands"]
        except (OSError, ValueError, KeyError):
            raise SystemExit(f"error: {folder} has no day.json of scripts/course_day.py") from None
        outputs.update({c["command"]: (folder / c["log"]).read_text() for c in ran})
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", nargs="+", default=None, help="page numbers (01 ... 13); default all")
    parser.add_argument("--out", type=Path, default=Path("logs/figures"))
    parser.add_argument("--day", type=Path, nargs="+", default=[],
                        help="scripts/course_day.py's folders: the commands they ran are read, not rerun")
    args = parser.parse_args(argv)
    chosen = [f for f in FIGURES if args.pages is None or f.page[:2] in args.pages]
    if not chosen:
        raise SystemExit(f"error: no figures on pages {args.pages}; the pages are 01 to 13")
    results, outputs = [], day_outputs(args.day)
    with tempfile.TemporaryDirectory() as tmp:
        for figure in chosen:
            for command in [*NEEDS.get(figure.command, []), figure.command]:
                if command not in outputs:
                    print(f"running: {command}", flush=True)
                    outputs[command] = run(command, Path(tmp))
            problem = check(figure, outputs[figure.command]) if figure.on_page() else \
                f"{figure.page}: the page no longer says {figure.text!r}: update FIGURES in {__file__}"
            results.append({**asdict(figure), "problem": problem})
            print(problem or f"ok: {figure.page}: {figure.text}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "date": datetime.date.today().isoformat(), "figures": results}
    (args.out / "figures.json").write_text(json.dumps(report, indent=1))
    bad = [r for r in results if r["problem"]]
    print(f"{len(results) - len(bad)} of {len(results)} figures hold on {report['machine']}; "
          f"report in {args.out / 'figures.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
