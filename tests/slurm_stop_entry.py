"""A stand-in for a training job stopped by a signal (tests/test_slurm.py): rank 0 says every rank
stopped after the checkpoint (the launcher's marker, TRAINING_STOPPED_FILE) and exits 75 at once;
the other ranks are still running when srun's --kill-on-bad-exit ends them. Requeued, every rank
exits 0."""

import os
import sys
import time

if int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
    print(f"rank {os.environ.get('SLURM_PROCID')}: requeued run done", flush=True)
    sys.exit(0)
if os.environ.get("SLURM_PROCID") == "0":
    with open(os.environ["TRAINING_STOPPED_FILE"], "w") as f:
        f.write("step 3\n")
    sys.exit(75)
time.sleep(60)
