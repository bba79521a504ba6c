#!/usr/bin/env python
"""Train the ERA5 ViT on one device, or data parallel on many (torchrun or srun).

    python train.py --config tiny                       # one CPU or GPU
    torchrun --standalone --nproc_per_node 4 train.py --config short   # 4 ranks, DDP

The loop lives in training/trainer.py, the set-up in training/launcher.py; this script
is the lesson's entry point.
"""

import sys

from training.launcher import main
from training.trainer import Trainer

if __name__ == "__main__":
    sys.exit(main(Trainer, description=__doc__.split("\n\n")[0]))
