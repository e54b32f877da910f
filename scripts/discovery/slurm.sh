#!/bin/sh
# Host discovery for a Slurm allocation: prints `node:slots` for every node of the job's
# allocation that is not drained, draining, down or failing, so that elastic-run leaves a node
# an administrator drains and takes it back once it is resumed.
#
#   salloc -N4 --ntasks-per-node=2 \
#     elastic-run --min-np 2 --host-discovery-script scripts/discovery/slurm.sh \
#       --launcher-template 'srun --overlap -N1 -n1 -w {host} sh -c {command}' \
#       --driver-address "$(hostname)" python3 train.py
#
# Slots: $ELASTIC_SLOTS_PER_NODE if set, else the job's tasks per node ($SLURM_NTASKS_PER_NODE,
# or the first count of $SLURM_TASKS_PER_NODE such as "2(x4)"), else 1.
set -eu
if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  echo "slurm.sh: SLURM_JOB_NODELIST is not set: run elastic-run inside an allocation (salloc, sbatch)" >&2
  exit 2
fi
slots=${ELASTIC_SLOTS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-}}
if [ -z "$slots" ] && [ -n "${SLURM_TASKS_PER_NODE:-}" ]; then
  slots=$(printf '%s' "$SLURM_TASKS_PER_NODE" | sed 's/[(,].*//')
fi
slots=${slots:-1}
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
# %t: the node's compact state (idle, alloc, mix, drain, drng, down, fail, ...); a trailing
# * or ~ means not responding or powered down.
sinfo -h -N -n "$(printf '%s' "$nodes" | paste -sd, -)" -o '%N %t' | sort -u |
  while read -r node state; do
    case "$state" in
      drain*|drng*|down*|fail*|maint*|*\*|*~) ;;
      *) echo "$node:$slots" ;;
    esac
  done
