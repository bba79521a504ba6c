#!/usr/bin/env python
"""Does torch.compile give the eager result for a transformer block under bf16 autocast on this
CPU, whatever the memory layout of the block's input?

On a 2-core Intel Xeon with AMX (torch 2.13.0+cpu and 2.15.0, CPU capability AVX512), one
compiled ``Block`` fed the tokens as the patch embedding leaves them (a transposed, non-contiguous
(B, N, D) tensor) returned NaN under bf16 autocast, while the same values made contiguous gave the
eager result; fp32, or bf16 without compile, were right. The ViT therefore hands its blocks
contiguous tokens (networks/vit.py), and this script checks a CPU for the fault itself:

    python scripts/compile_bf16_check.py

It prints the CPU, torch, and for each input layout the largest difference from eager; the exit
status is 1 if the compiled block is wrong for either layout (the model is safe on such a CPU as
long as the contiguous one is right).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from networks.vit import Block  # noqa: E402
from utils import device as dev  # noqa: E402

log = logging.getLogger("compile_bf16_check")

# bf16 keeps 8 significant bits; a block of a few matmuls of width 128 lands within a few
# hundredths of eager (0.004 to 0.008 measured); NaN or a wrong kernel is far outside
TOLERANCE = 0.05


def block_errors(batch: int = 16, tokens: int = 128, dim: int = 128, heads: int = 4,
                 seed: int = 0) -> dict[str, float]:
    """Largest |compiled - eager| of one block's output under bf16 autocast, for the input in the
    patch embedding's transposed layout ("strided") and copied into (B, N, D) order
    ("contiguous"); NaN if the compiled output has any."""
    torch.manual_seed(seed)
    eager = Block(dim, heads, 4.0, 0.0)
    compiled = Block(dim, heads, 4.0, 0.0)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    strided = torch.randn(batch, dim, tokens).transpose(1, 2)  # (B, N, D) with strides of (B, D, N)
    errors = {}
    for name, x in (("strided", strided), ("contiguous", strided.contiguous())):
        with torch.no_grad(), dev.autocast(torch.device("cpu"), "bf16"):
            want, got = eager(x).float(), compiled(x).float()
        errors[name] = float("nan") if not torch.isfinite(got).all() else (got - want).abs().max().item()
    return errors


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("torch %s on %s (torch's CPU capability %s)", torch.__version__, dev.cpu_description(),
             torch.backends.cpu.get_cpu_capability())
    errors = block_errors()
    bad = [name for name, err in errors.items() if not err <= TOLERANCE]  # NaN compares False
    for name, err in errors.items():
        log.info("%-10s input: compiled block vs eager under bf16 autocast: max |difference| %s%s",
                 name, f"{err:.4f}", "  WRONG" if name in bad else "")
    if bad:
        log.info("torch.compile is wrong here for %s input under bf16 autocast%s", " and ".join(bad),
                 "; the model gives its blocks contiguous tokens, so it trains" if "contiguous" not in bad
                 else ": train without --enable_jit in bf16 on this CPU")
        return 1
    log.info("torch.compile matches eager here for both layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
