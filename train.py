#!/usr/bin/env python
"""Train the ERA5 ViT on one device, or data parallel on many (torchrun or srun).

    python train.py --config tiny                       # one CPU or GPU
    torchrun --standalone --nproc_per_node 4 train.py --config short   # 4 ranks, DDP

The loop lives in training/trainer.py, the set-up in training/launcher.py; this script
is the lesson's entry point.
"""

import sys

from utils.compat import require_supported_torch

require_supported_torch()  # before anything that needs a newer torch is imported

from training.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n\n")[0]))
