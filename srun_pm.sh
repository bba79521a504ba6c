#!/bin/bash
# Inside an interactive allocation on Perlmutter: run one of the repository's scripts as the
# submit scripts run train.py, one process per task of the allocation (srun), in NERSC's
# PyTorch container with the data at /data and the runs at /logs (scripts/slurm_common.sh).
# From the repository's top folder, for example:
#   salloc -C gpu -q interactive -t 30 -n 1 -c 32 --gpus-per-task 1 -A <your project>
#   bash srun_pm.sh train_graph.py --config short --amp_mode bf16
#   bash srun_pm.sh scripts/lr_range_test.py --config short
# DATADIR, LOGDIR, IMAGE, NATIVE and ENABLE_PROFILING are read from the environment, as by the
# submit scripts.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: srun_pm.sh runs inside an allocation: salloc first (see its first lines), or submit a batch job with sbatch submit_pm.sh" >&2
  exit 2
fi
if [ $# -lt 1 ] || [ ! -f "$REPO/$1" ]; then
  echo "error: usage: bash srun_pm.sh SCRIPT [ARGS...], SCRIPT a Python file of this repository (train.py, scripts/lr_range_test.py, ...)" >&2
  exit 2
fi
source "$REPO/scripts/slurm_common.sh"
run_training "$@"
