"""Ending the whole job from the head, as ``tilert-submit stop`` does.

A benchmark with ``keep_serving: false`` ends the job once it is done, and every agent must drain,
not only the head's node. Under Slurm that is ``scancel --signal=TERM`` of the job: every step's
task (every agent, the head included) gets SIGTERM and drains, and the batch shell waits for them
(not ``--full``, which would signal the batch shell too). Outside Slurm there is nothing to do
here: the ``--local`` supervisor stops the other agents when the head exits, and every other agent
(systemd's, one started by hand) sees the end in ``status.json`` or the head's last word and ends
with it (``agent.node.jobwatch``).
"""

from __future__ import annotations

import logging

import trio

from agent.node.identity import Identity

SCANCEL_TIMEOUT_S = 30.0


async def end_job(identity: Identity, log: logging.Logger, why: str) -> None:
    """Ask every agent of the job to drain and exit (under Slurm); log what was done."""
    if not identity.slurm_job_id:
        log.info("head: ending the job (%s): the other agents stop when the head exits", why)
        return
    argv = ["scancel", "--signal=TERM", identity.slurm_job_id]
    log.info("head: ending the job (%s): %s", why, " ".join(argv))
    try:
        with trio.fail_after(SCANCEL_TIMEOUT_S):
            done = await trio.run_process(
                argv, capture_stdout=True, capture_stderr=True, check=False
            )
    except (OSError, trio.TooSlowError) as exc:
        log.warning("head: %s failed (%s); the job ends when its time limit does", argv[0], exc)
        return
    if done.returncode != 0:
        log.warning(
            "head: %s exited %d: %s", " ".join(argv), done.returncode, done.stderr.decode().strip()
        )
