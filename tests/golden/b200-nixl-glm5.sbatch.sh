#!/bin/bash
# Rendered by tilert-submit for glm5-tilert-disagg. Only the job directory and fixed
# flags are in this script; the agents read everything else from $JOB_DIR/plan.json.
#SBATCH --job-name=glm5-tilert-disagg
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --account=my-account
#SBATCH --partition=gpu
#SBATCH --time=04:00:00
#SBATCH --signal=TERM@120
#SBATCH --output="/shared/jobs/glm5-run/logs/sbatch.out"

set -u
JOB_DIR=/shared/jobs/glm5-run
AGENT=(/opt/tilert/bin/tilert-agent)

# No --cpus-per-task on the steps: a step without it is given every CPU the job holds on
# its nodes (all of them with --exclusive), so process-launched engines inherit them;
# -c would imply --exact and shrink the step. Stale values from the submitting shell
# would do the same.
unset SLURM_CPUS_PER_TASK SRUN_CPUS_PER_TASK SLURM_EXACT

# Each step in its own process group (job control): a SIGTERM meant for this shell
# (scancel --full, --batch) must not reach the srun clients, which would abort their
# steps with SIGKILL instead of letting the agents drain.
set -m
pids=()

# prefill: nodes 0..0 of the allocation
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=0 --job-name=prefill --export=ALL --kill-on-bad-exit=0 --gres=gpu:8 \
  "${AGENT[@]}" --role prefill --job-dir "$JOB_DIR" &
pids+=("$!")

# decode: nodes 1..1 of the allocation
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=1 --job-name=decode --export=ALL --kill-on-bad-exit=0 --gres=gpu:8 \
  "${AGENT[@]}" --role decode --job-dir "$JOB_DIR" &
pids+=("$!")

# From here on SIGTERM is the agents' to handle (tilert-submit stop, the time limit):
# they drain their engines and exit, the steps end, and this shell waits for them.
trap '' TERM
failed=0
while [ "${#pids[@]}" -gt 0 ]; do
  # wait -n wakes when a running step ends; a step that ended before it was called is
  # not reported by it, so every step no longer running is collected by its pid.
  wait -n || true
  running=" $(jobs -pr | tr '\n' ' ') "
  left=()
  for pid in "${pids[@]}"; do
    case "$running" in
      *" $pid "*) left+=("$pid") ;;
      *)
        rc=0
        wait "$pid" || rc=$?
        if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
          # A step failed (its agents could not run their role): end the job.
          failed=1
          scancel "$SLURM_JOB_ID" || true
        fi
        ;;
    esac
  done
  # (the +-form keeps bash < 4.4 happy under set -u with an empty array)
  pids=(${left[@]+"${left[@]}"})
done
exit "$failed"
