#!/bin/bash
# One GPU on Perlmutter (or one CPU task on any Slurm): sbatch submit_pm.sh --config=short
# Every argument goes to train.py. DATADIR, LOGDIR, IMAGE, ENABLE_PROFILING, PROFILE_OUTPUT
# and REQUEUE are read from the environment (see scripts/slurm_common.sh).
#SBATCH -C gpu
#SBATCH -q shared
#SBATCH -n 1
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-task 1
#SBATCH --time=01:00:00
#SBATCH --signal=USR1@90
#SBATCH -J vit-era5
#SBATCH -o logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

# sbatch runs a copy of this file from its spool folder: find the repository from the
# folder the job was submitted from when the file's own folder is not it.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -f "$REPO/train.py" ] || REPO=${SLURM_SUBMIT_DIR:-$PWD}
source "$REPO/scripts/slurm_common.sh" 2>/dev/null || {
  echo "error: run sbatch from the repository's top folder (no scripts/slurm_common.sh in $REPO)" >&2
  exit 2
}
run_training train.py "$@"
