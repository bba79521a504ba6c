#!/usr/bin/env python
"""Asynchronous SGD on the course's model: Hogwild (with and without a lock), a parameter
server and a fixed staleness, against synchronous data parallelism.

    python scripts/async_sgd.py --config tiny --mode hogwild --workers 2
    torchrun --standalone --nproc_per_node 3 scripts/async_sgd.py --config tiny --mode server
    python scripts/async_sgd.py --config tiny --mode delayed --staleness 3

The training is in training/async_sgd.py, the server's messages in distributed/param_server.py;
flags are train.py's, and the modes' own (--mode, --workers, --staleness, --slow_rank, --slow_ms).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.compat import require_supported_torch  # noqa: E402

require_supported_torch()  # before anything that needs a newer torch is imported

from training.async_sgd import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
