#!/usr/bin/env python
"""Plot how a mixture of experts shared out its tokens: each expert's share per epoch, per MoE
layer, with the share dropped by the capacity and the balancing loss.

    python scripts/plot_experts.py --run_dir logs/tiny/1GPU/moe_top2 --out logs/plots/experts.png

Reads RUN_DIR/metrics.jsonl (``moe``: per MoE layer, the epoch's mean over its steps of each
expert's share of the token assignments, the share dropped, and the balancing loss; rank 0's
tokens). The per-step values are in TensorBoard (``MoE/...``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.plot_training import read_metrics  # noqa: E402


def plot(epochs: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in epochs]
    layers = len(epochs[0]["moe"])
    experts = len(epochs[0]["moe"][0]) - 2
    fig, axes = plt.subplots(1, layers, figsize=(5.5 * layers, 4), squeeze=False, sharey=True,
                             constrained_layout=True)
    for layer, ax in enumerate(axes[0]):
        for e in range(experts):
            ax.plot(steps, [ep["moe"][layer][e] for ep in epochs], "o-", label=f"expert {e}")
        ax.plot(steps, [ep["moe"][layer][experts] for ep in epochs], "x--", color="black", label="dropped")
        ax.axhline(1 / experts, color="gray", lw=0.8, ls=":", label="even share")
        aux = epochs[-1]["moe"][layer][experts + 1]
        ax.set_title(f"MoE layer {layer} (balancing loss at the end {aux:.3f})")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("share of the token assignments (epoch mean)")
    fig.suptitle(title)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("logs/plots/experts.png"))
    args = p.parse_args(argv)
    epochs = read_metrics(args.run_dir)
    if "moe" not in epochs[0]:
        p.error(f"{args.run_dir} has no mixture of experts (train with --num_experts N)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(epochs, args.out, f"tokens per expert: {args.run_dir}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
