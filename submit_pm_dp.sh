#!/bin/bash
# Data parallel on Perlmutter: one task per GPU, 4 per node. Choose the nodes at submission:
#   sbatch -N 4 submit_pm_dp.sh --config=bs64_opt
# Every argument goes to train.py. DATADIR, LOGDIR, IMAGE, ENABLE_PROFILING, PROFILE_OUTPUT
# and REQUEUE are read from the environment (see scripts/slurm_common.sh).
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH --ntasks-per-node 4
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-node 4
#SBATCH --time=01:00:00
#SBATCH --signal=USR1@90
#SBATCH -J vit-era5
#SBATCH -o logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -f "$REPO/train.py" ] || REPO=${SLURM_SUBMIT_DIR:-$PWD}
source "$REPO/scripts/slurm_common.sh" 2>/dev/null || {
  echo "error: run sbatch from the repository's top folder (no scripts/slurm_common.sh in $REPO)" >&2
  exit 2
}
run_training train.py "$@"
