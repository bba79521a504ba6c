#!/usr/bin/env python
"""Print what a job runs on (torch, CUDA, NCCL, DALI, GPUs) in one line, and whether the torch
is new enough. The submit scripts run it once before training, so a failed job's log says
what it ran on.

    python scripts/versions.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from utils import device as dev  # noqa: E402
from utils.compat import check_torch  # noqa: E402


def main() -> int:
    device = torch.device("cuda", 0) if dev.cuda_available() else torch.device("cpu")
    print(f"environment: {dev.environment_summary(device)}", flush=True)
    problem = check_torch()
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
