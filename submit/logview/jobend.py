"""When a followed job, or the followed agents, have ended, and how: ``logs -f`` exits with it.

Like ``kubectl logs -f``, which ends with its container: ``tilert-submit logs J -f`` ends once
``status.json`` says ``stopped`` (exit 0) or ``failed`` (exit 1), and with NAMEs once each named
agent (or the router) is ``stopped`` or ``failed`` (1 when any failed). A job whose writer is gone
without saying so (the local supervisor killed, the Slurm job ended) has failed too. Before the
last read the follower waits for the job's processes to end, within the drain grace, because the
head says ``stopped`` or ``failed`` while the other agents may still be writing their last lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from agent.job.names import ROUTER_NAME
from agent.job.paths import JobDir
from agent.job.records import JobAgent, JobStatus
from submit.choice import backend_of

# The exit code of each final state.
FINAL = {"stopped": 0, "failed": 1}
ENDING = ("stopping", "stopped", "failed")
# squeue is a remote call: ask it at most this often.


@dataclass(frozen=True)
class Ended:
    """How what was followed ended: the exit code (0 stopped, 1 failed) and why."""

    code: int
    why: str
    # The whole job ended (wait for its processes before the last read), not only the NAMEs.
    job: bool


class JobEnd:
    """Checks, one call at a time, whether the job (or the agents ``names``) has ended."""

    def __init__(self, job: JobDir, names: list[str] | None) -> None:
        self.job = job
        # Sources with a state of their own in status.json (the benchmark has none: it ends
        # with the job).
        self.names = names
        self._asked = float("-inf")
        self._running: bool | None = True
        # At most the backend's own pace; faster once the end is awaited (gone_now).
        self.ask_every_s = float("inf")

    def check(self) -> Ended | None:
        """The end, once there is one; None while it runs (or status.json cannot be read)."""
        try:
            status = self.job.read_status()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        if self.names:
            ends = [_agent_end(_entry(status, name)) for name in self.names]
            if all(end is not None for end in ends):
                done = [end for end in ends if end is not None]
                return Ended(max(e.code for e in done), "; ".join(e.why for e in done), job=False)
        if status.state in FINAL:
            why = f"the job {status.state}" + (f": {status.error}" if status.error else "")
            return Ended(FINAL[status.state], why, job=True)
        gone = self.gone(status)
        if gone is not None:
            return Ended(1, gone, job=True)
        return None

    def gone(self, status: JobStatus) -> str | None:
        """Why the job's processes are known to be gone, or None (running, or cannot tell)."""
        backend = backend_of(status)
        if backend is None:
            return None
        now = time.monotonic()
        if now - self._asked >= min(backend.ask_every_s, self.ask_every_s):
            self._asked = now
            self._running = backend.is_running(status)
        return backend.gone(status) if self._running is False else None

    def gone_now(self) -> bool:
        """Whether the job's processes have ended (they write no more); True when there is
        nothing to watch (a job started by hand or by systemd) or status.json is unreadable."""
        self.ask_every_s = 1.0  # waiting for the end now: ask more often
        try:
            status = self.job.read_status()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return True
        if not status.slurm_job_id and status.local_pid is None:
            return True
        return self.gone(status) is not None

    def winding_down(self, name: str) -> bool:
        """Whether ``name``'s agent, or the job, is stopping or has ended (its stream may end)."""
        try:
            status = self.job.read_status()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return False
        entry = _entry(status, name)
        return status.state in ENDING or (entry is not None and entry.state in ENDING)


def never_submitted(job: JobDir) -> str | None:
    """Why ``logs -f`` of ``job`` would wait for nothing: a ``--dry-run`` job that no backend
    claimed and no agent has started (no rendezvous record, no log folder); else None."""
    try:
        status = job.read_status()
        started = any(job.rendezvous.glob("*.json")) or any(job.logs.iterdir())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if status.state != "pending" or status.slurm_job_id or status.local_pid or started:
        return None
    return (
        f"{job.root} was never submitted (status.json is pending, names no Slurm job and no local "
        "supervisor, and no agent has started): nothing will write its logs; submit the recipe "
        "without --dry-run, or start its agents (docs/systemd.md), then follow it"
    )


def _entry(status: JobStatus, name: str) -> JobAgent | None:
    if name == ROUTER_NAME:
        return status.router
    return next((a for a in status.agents if a.name == name), None)


def _agent_end(entry: JobAgent | None) -> Ended | None:
    if entry is None or entry.state not in FINAL:
        return None
    return Ended(FINAL[entry.state], f"{entry.name} {entry.state}", job=False)
