#!/usr/bin/env python
"""Train the ERA5 ViT with tensor and context parallelism inside a model group, data parallel across.

    torchrun --standalone --nproc_per_node 4 train_mp.py --config tiny --tensor_parallel 2   # tp 2 x dp 2
    sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4

The same loop as train.py; what differs is only which mesh dimensions are larger than 1.
The ranks form a device mesh of tensor (tp), context (cp) and data (dp) parallel groups
(distributed/mesh.py); the serial model is split into this rank's part by
distributed/parallelize.py; data is sharded over dp only, so every rank of a model group
sees the same batch; gradients are synchronised as each parameter's tag says
(distributed/tags.py); checkpoints hold the consolidated weights and optimizer state
(distributed/consolidate.py), so a run can continue with another layout (or in train.py).
Run directories name every parallel size (logs/CONFIG/4GPU_tp2_cp1_dp2/RUN).
"""

import sys

from utils.compat import require_supported_torch

require_supported_torch()  # before anything that needs a newer torch is imported

from training.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n\n")[0], model_parallel=True))
