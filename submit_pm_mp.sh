#!/bin/bash
# Model parallel on Perlmutter: one task per GPU, 4 per node; tensor (and context) parallel
# groups inside a node, data parallel across nodes. Choose the nodes at submission:
#   sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4
#   sbatch --nodes 4 submit_pm_mp.sh --config=mp_patch4 --context_parallel=4
#   sbatch --nodes 2 submit_pm_mp.sh --config=mp --tensor_parallel=4 --pipeline_parallel=2
# Nodes x 4 must be divisible by tensor_parallel x context_parallel x pipeline_parallel
# (pipeline stages vary slowest: across nodes). Every argument goes to
# train_mp.py. DATADIR, LOGDIR, IMAGE, ENABLE_PROFILING, PROFILE_OUTPUT and REQUEUE are read
# from the environment (see scripts/slurm_common.sh).
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH --ntasks-per-node 4
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-node 4
#SBATCH --time=01:00:00
#SBATCH --signal=USR1@90
#SBATCH -J vit-era5-mp
#SBATCH -o logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -f "$REPO/train_mp.py" ] || REPO=${SLURM_SUBMIT_DIR:-$PWD}
source "$REPO/scripts/slurm_common.sh" 2>/dev/null || {
  echo "error: run sbatch from the repository's top folder (no scripts/slurm_common.sh in $REPO)" >&2
  exit 2
}
run_training train_mp.py "$@"
