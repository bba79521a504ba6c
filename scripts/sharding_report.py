#!/usr/bin/env python
"""What sharding saves, measured: memory per rank and communication per step for ddp, zero1
and fsdp at 1, 2 and 4 ranks, activation memory with and without checkpointing, and which
configurations fit on a 40 GB A100 on paper.

    python scripts/sharding_report.py --config tiny_large --out logs/sharding

Every measurement is a real training run (train.py's loop, `--num_iters` steps, on CPU with
gloo via torchrun, or on the GPUs there are). Memory per rank is rank 0's, from the run's
metrics.jsonl: exact tensor sizes of parameters, gradients and Adam's state (this rank's
shards), the process's peak resident memory on CPU. Communication is counted by wrapping
the collectives during the training steps: DDP's gradient all-reduce (a comm hook), FSDP's
all-gathers and reduce-scatters, ZeRO-1's parameter broadcasts. Writes OUT/sharding.md
(the tables), OUT/sharding.json and OUT/sharding_memory.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.instruments import read_metrics, write_report  # noqa: E402
from scripts.workers import run_worker, worker_env  # noqa: E402

MODES = ("ddp", "zero1", "fsdp")
COMM_FILE = "comm.json"
A100_GB = 40


# ------------------------------------------------------------ the worker (one rank) ---
def worker(argv: list[str]) -> int:
    from scripts.instruments import CollectiveCounter, count_ddp_gradients
    from training.launcher import main
    from training.trainer import Callback

    class CommCount(Callback):
        """The bytes each kind of collective moves in the training steps (rank 0 writes them,
        per step, to RUN_DIR/comm.json)."""

        def __init__(self) -> None:
            self.counter, self.steps = CollectiveCounter().install(), 0

        def model_built(self, trainer) -> None:
            count_ddp_gradients(trainer.model, trainer.ctx.dp_group)

        def step_start(self, trainer) -> None:
            self.counter.active = True

        def step_end(self, trainer, loss) -> None:
            self.counter.active = False
            self.steps += 1

        def fit_end(self, trainer) -> None:
            if trainer.ctx.is_main:
                per_step = {k: v / max(1, self.steps) for k, v in self.counter.bytes.items()}
                (trainer.ctx.run_dir / COMM_FILE).write_text(json.dumps(per_step))

    return main(argv=argv, description="train.py counting its collectives", callbacks=[CommCount()])


# ------------------------------------------------------------------ the driver ---
def measure(args: argparse.Namespace, mode: str, ranks: int, checkpointing: str = "none") -> dict:
    name = f"{mode}_{ranks}_{checkpointing}"
    flags = [f"--yaml_config={args.yaml_config}", f"--config={args.config}", f"--run_num={name}",
             f"--expdir={args.out / 'runs'}", f"--num_iters={args.steps}", "--checkpoint_every=0",
             f"--global_batch_size={args.batch}", f"--data_parallel={mode}",
             f"--activation_checkpointing={checkpointing}", "--limit_nsamples_val=8",
             f"--limit_nsamples={args.batch * args.steps}", *args.flags]
    # a fixed mmap threshold: glibc otherwise moves it as the process frees large blocks, and
    # the peak resident memory of the same run would vary from one run to the next
    run_worker(__file__, ranks, flags, worker_env(MALLOC_MMAP_THRESHOLD_=str(1 << 20)))
    run_dir = next((args.out / "runs" / args.config).glob(f"*/{name}"))
    m = read_metrics(run_dir)[-1]
    comm = json.loads((run_dir / COMM_FILE).read_text()) if (run_dir / COMM_FILE).is_file() else {}
    return {"mode": mode, "ranks": ranks, "checkpointing": checkpointing, "memory_MiB": m["memory_MiB"],
            "samples_per_sec": m["samples_per_sec"], "comm_bytes_per_step": comm}


def on_paper_bytes(params: int, mode: str, ranks: int) -> dict[str, float]:
    """Per rank, mixed-precision Adam as the ZeRO paper counts it: 2 bytes/parameter of fp16
    weights, 2 of gradients, 12 of optimizer state (fp32 weights and two moments)."""
    weights, grads, optim = 2.0 * params, 2.0 * params, 12.0 * params
    if mode in ("zero1", "fsdp"):
        optim /= ranks
    if mode == "fsdp":
        weights /= ranks
        grads /= ranks
    return {"weights": weights, "gradients": grads, "optimizer": optim}


def activation_bytes(cfg, local_batch: int, checkpointing: str) -> float:
    """Activations saved for backward per rank in bf16, after Korthikanti et al. (2022): about
    34 s h bytes per block per sample without the attention matrix (fused attention kernels do
    not store it); full recomputation keeps only each block's input (2 s h) plus one block's
    activations while it is recomputed; selective recomputes every other block."""
    tokens = (cfg.model.img_size[0] // cfg.model.patch_size) * (cfg.model.img_size[1] // cfg.model.patch_size)
    per_block = 34.0 * tokens * cfg.model.embed_dim * local_batch
    block_input = 2.0 * tokens * cfg.model.embed_dim * local_batch
    if checkpointing == "full":
        return cfg.model.depth * block_input + per_block
    if checkpointing == "selective":  # blocks 0, 2, 4, ... recomputed
        return math.ceil(cfg.model.depth / 2) * block_input + (cfg.model.depth // 2 + 1) * per_block
    return cfg.model.depth * per_block


def fits_table(configs: list[str], yaml: str) -> list[str]:
    from networks.backbone import build_on_meta
    from utils.config import load_config

    lines = ["| config | parameters | ranks | local batch | activation checkpointing | ddp GB | zero1 GB "
             "| fsdp GB |", "|---|---|---|---|---|---|---|---|"]
    for name in configs:
        cfg = load_config(yaml, name)
        _, params = build_on_meta(cfg.model)
        for ranks in (4, 64):
            local = max(1, cfg.optim.global_batch_size // ranks)
            for ac in ("none", "full"):
                cells = []
                for mode in MODES:
                    total = sum(on_paper_bytes(params, mode, ranks).values()) + \
                        activation_bytes(cfg, local, ac)
                    gb = total / 1e9
                    cells.append(f"{gb:.1f} {'fits' if gb < A100_GB * 0.9 else '**no**'}")
                lines.append(f"| {name} | {params / 1e6:.0f}M | {ranks} | {local} | {ac} | "
                             + " | ".join(cells) + " |")
    return lines


# The measured peak of a run, and what it is: on a GPU the CUDA allocator's peak of the
# device's memory (the run's own process, so one phase each); on a CPU the process's
# peak resident memory (weights, activations, data, libraries).
PEAKS = (("allocator_peak_MiB", "CUDA allocator peak MiB"), ("peak_rss_MiB", "peak RSS MiB"))


def peak(memory: dict[str, float]) -> tuple[float, str]:
    """(MiB, what it is) of a run's memory report."""
    for key, name in PEAKS:
        if key in memory:
            return memory[key], name
    return float("nan"), "peak MiB"


def memory_table(rows: list[dict], params: int) -> list[str]:
    kind = peak(rows[0]["memory_MiB"])[1] if rows else "peak MiB"
    lines = ["| data_parallel | ranks | parameters MiB | gradients MiB | Adam state MiB | sum | "
             f"bytes/parameter | fp32 on paper | {kind} |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["memory_MiB"]
        total = m["parameters_MiB"] + m["gradients_MiB"] + m["optimizer_MiB"]
        paper = {"ddp": 16.0, "zero1": 8 + 8 / r["ranks"], "fsdp": 16 / r["ranks"]}[r["mode"]]
        lines.append(f"| {r['mode']} | {r['ranks']} | {m['parameters_MiB']:.2f} | {m['gradients_MiB']:.2f} "
                     f"| {m['optimizer_MiB']:.2f} | {total:.2f} | {total * 2**20 / params:.2f} | "
                     f"{paper:.2f} | {peak(m)[0]:.0f} |")
    return lines


def comm_table(rows: list[dict], params: int) -> list[str]:
    lines = ["| data_parallel | ranks | all-reduce MiB | all-gather MiB | reduce-scatter MiB | broadcast MiB "
             "| total / fp32 model size |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["comm_bytes_per_step"]
        mib = {k: c.get(k, 0) / 2**20 for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
        lines.append(f"| {r['mode']} | {r['ranks']} | " + " | ".join(f"{v:.2f}" for v in mib.values())
                     + f" | {sum(c.values()) / (4 * params):.2f} |")
    return lines


def checkpointing_table(acts: list[dict]) -> list[str]:
    kind = peak(acts[0]["memory_MiB"])[1] if acts else "peak MiB"
    lines = [f"| activation_checkpointing | {kind} | samples/s |", "|---|---|---|"]
    for a in acts:
        mib = peak(a["memory_MiB"])[0]
        lines.append(f"| {a['checkpointing']} | {mib:.0f} | {a['samples_per_sec']:.1f} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['mode']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, color in (("parameters_MiB", "tab:blue"), ("gradients_MiB", "tab:orange"),
                       ("optimizer_MiB", "tab:green")):
        values = [r["memory_MiB"][key] for r in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label=key.replace("_MiB", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB on rank 0")
    ax.set_title("Training state per rank (measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def driver(argv: list[str] | None = None) -> int:
    from networks.backbone import build, count_parameters
    from utils.config import DEFAULT_YAML, load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny_large")
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="data_parallel modes to measure")
    p.add_argument("--steps", type=int, default=2, help="training steps per measurement")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--out", type=Path, default=Path("logs/sharding"))
    p.add_argument("--paper_configs", nargs="*", default=["base", "large", "xl"],
                   help="configs for the on-paper A100 table")
    p.add_argument("--checkpointing", nargs="+", choices=("none", "selective", "full"),
                   default=["none", "selective", "full"], help="activation checkpointing modes to measure")
    p.add_argument("flags", nargs="*", help="more train.py flags after --, e.g. -- --data_dir DIR")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    params = count_parameters(build(load_config(args.yaml_config, args.config).model))
    rows = [measure(args, mode, n) for mode in args.modes for n in args.ranks
            if not (n == 1 and mode != "ddp")]
    acts = [measure(args, "ddp", 1, ac) for ac in args.checkpointing]
    md = [f"Config `{args.config}`: {params} parameters, global batch {args.batch}, {args.steps} steps, "
          "fp32.",
          "", "Memory per rank (rank 0):", "", *memory_table(rows, params), "",
          "Communication per training step (rank 0, payload of each collective):", "",
          *comm_table([r for r in rows if r["ranks"] > 1], params), "",
          "Activation checkpointing, 1 rank:", "", *checkpointing_table(acts), "",
          f"On paper, per GPU (bf16 mixed-precision Adam, 16 bytes/parameter as in the ZeRO paper, plus "
          f"activations; 'fits' leaves 10% of a {A100_GB} GB A100 free):", "",
          *fits_table(args.paper_configs, args.yaml_config)]
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "sharding", "\n".join(md), {"rows": rows, "checkpointing": acts})
    plot(rows, args.out / "sharding_memory.png")
    print("\n".join(md))
    print(f"wrote {args.out / 'sharding.md'} and {args.out / 'sharding_memory.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(driver())
