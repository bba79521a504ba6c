# Source inside each Slurm task (`srun bash -c 'source export_DDP_vars.sh && python ...'`):
# copies Slurm's task numbering into the names torchrun uses. Optional for train.py,
# which reads the SLURM_* names itself (distributed/env.py), but handy for other tools.
export RANK=${SLURM_PROCID:?not inside a Slurm task}
export LOCAL_RANK=${SLURM_LOCALID:-0}
export WORLD_SIZE=${SLURM_NTASKS:-1}
per_node=${SLURM_TASKS_PER_NODE:-$WORLD_SIZE}   # "4(x2)" or "4,3": the first node's count
per_node=${per_node%%[(,]*}
export LOCAL_WORLD_SIZE=$per_node
# every task must name the same master: the job's first node, not its own host
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | head -n 1)}
export MASTER_ADDR=${MASTER_ADDR:-$(hostname)}   # no scontrol: a single node
export MASTER_PORT=${MASTER_PORT:-29500}
unset per_node
