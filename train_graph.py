#!/usr/bin/env python
"""Train as train.py does, with the whole training step replayed from a CUDA graph.

    python train_graph.py --config short --amp_mode bf16 --enable_fused

What changes against train.py is all in training/graphs.py (GraphStep): Adam with
its state on the GPU, eager warm-up on a side stream, one captured step replayed.
Flags are train.py's. Without CUDA the script exits with a one-line message.
"""

import sys

from utils.compat import require_supported_torch

require_supported_torch()  # before anything that needs a newer torch is imported

from training.graphs import GraphStep  # noqa: E402
from training.launcher import main  # noqa: E402
from utils import device as dev  # noqa: E402

if __name__ == "__main__":
    dev.require_cuda("CUDA Graphs")
    sys.exit(main(GraphStep, description=__doc__.split("\n\n")[0]))
