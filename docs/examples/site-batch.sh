#!/bin/bash
# A site's own batch script for tilert agents (docs/batch-script.md): 1 prefill node + 2 decode
# nodes of the job folder that `tilert-submit RECIPE --dry-run --job-dir DIR` made. Submit with
#   sbatch --output=DIR/logs/sbatch.out --export=ALL,JOB_DIR=DIR site-batch.sh
#SBATCH --job-name=tilert-site
# One agent per node: one task per node, every node of the plan (prefill + decode workers).
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
# SIGTERM to every agent (no B:, so not to this shell) 120 s before the time limit: they drain.
#SBATCH --signal=TERM@120
# The site's own lines, e.g.:
##SBATCH --gpus-per-node=8
##SBATCH --exclusive
##SBATCH --partition=gpu

set -u
JOB_DIR=${JOB_DIR:?set JOB_DIR to the job folder tilert-submit --dry-run wrote}
AGENT=${TILERT_AGENT:-tilert-agent}
DECODES=2  # the plan's decode workers: nodes 1..DECODES of the allocation

# A step without -c gets every CPU of its node; stale values from the submitting shell would
# shrink it.
unset SLURM_CPUS_PER_TASK SRUN_CPUS_PER_TASK SLURM_EXACT
# Each step in a process group of its own: a SIGTERM meant for this shell (scancel --full) must
# not reach the srun clients, which would kill their agents instead of letting them drain.
set -m

# Each agent in a step of its own on its own node, with its index: every step's task is
# SLURM_PROCID 0, so --index says which worker it is. On GPU nodes add --gres=gpu:N (the GPUs
# of one worker) to each srun line, as the job folder's sbatch.sh does.
srun --nodes=1 --ntasks=1 --relative=0 --kill-on-bad-exit=0 \
  "$AGENT" --role prefill --index 0 --job-dir "$JOB_DIR" &
head=$!
for ((i = 0; i < DECODES; i++)); do
  srun --nodes=1 --ntasks=1 --relative=$((i + 1)) --kill-on-bad-exit=0 \
    "$AGENT" --role decode --index "$i" --job-dir "$JOB_DIR" &
done

# From here on SIGTERM is the agents' to handle; this shell waits for them.
trap '' TERM
rc=0
wait "$head" || rc=$?
# The head (prefill-0) ended: the job is over (stopped, failed, or ended by its benchmark). A
# decode still running drains on SIGTERM; a head that crashed did not tell them.
scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
wait
exit "$rc"
