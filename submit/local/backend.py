"""Jobs on this machine: the ``--local`` supervisor runs them in the foreground, SIGTERM stops them.

The supervisor records its pid in status.json; it stops its agents (each drains its engines) when
it gets SIGTERM, and they die with it if it is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

import psutil

from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import JobStatus
from submit.backend import Backend, wait_until


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited process its parent has not reaped yet (a zombie) still answers signal 0.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _pid(status: JobStatus) -> int:
    if not status.local_pid:
        raise ValueError("status.json names no local supervisor")
    return status.local_pid


class LocalBackend(Backend):
    """A job whose agents are children of a ``tilert-submit --local`` process on this machine."""

    def owns(self, status: JobStatus) -> bool:
        """Whether status.json records a local supervisor's pid."""
        return bool(status.local_pid)

    def submit(self, job: JobDir, plan: Plan, secrets: Mapping[str, str]) -> int:
        """Run the agents here, in the foreground, until they fail or a signal stops them."""
        # trio and the launchers only for the one command that runs agents.
        from submit.local.run import run_local

        return run_local(job, plan, dict(secrets))

    def is_running(self, status: JobStatus) -> bool:
        """Whether the supervisor process is alive."""
        return pid_alive(_pid(status))

    def gone(self, status: JobStatus) -> str:
        """The supervisor is gone."""
        pid = _pid(status)
        return f"the local supervisor (pid {pid}) is gone but status.json still says {status.state}"

    def summary(self, status: JobStatus) -> str:
        """The supervisor's pid."""
        return f"local supervisor pid: {_pid(status)}"

    def stop(self, status: JobStatus, limit: float) -> int:
        """SIGTERM the supervisor and wait for it to exit; SIGKILL it after ``limit``."""
        pid = _pid(status)
        print(f"stopping the local job: SIGTERM to its supervisor pid {pid} (up to {limit:g}s)")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            print("it had already exited")
            return 0
        if wait_until(lambda: not pid_alive(pid), limit):
            print("stopped")
            return 0
        print(f"pid {pid} did not exit within {limit:g}s; sending SIGKILL (its agents die with it)")
        os.kill(pid, signal.SIGKILL)
        return 0
