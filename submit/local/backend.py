"""Jobs on this machine: the ``--local`` supervisor runs them in the foreground, SIGTERM stops them.

The submitter records its pid and start time in the first status.json, then becomes the
supervisor (``submit.local.run``) by exec'ing it: same pid, a command line that names the job
directory and carries no ``--set`` value, the secrets in its environment. It stops its agents (each
drains its engines) when it gets SIGTERM, and they die with it if it is SIGKILLed.

``stop`` signals only that process: a stale job directory's pid may name a stranger by now (pids
are reused), so the pid's start time and command line are checked first, through a pidfd, which
cannot be redirected to a new process between the check and the signal.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from agent.job.paths import JobDir
from agent.job.plan import Plan
from agent.job.records import JobStatus
from agent.problems import printable
from submit.backend import Backend, BackendError

# The signals that stop a job. From the moment status.json names the submitter until the
# supervisor listens for them they are blocked (pending, not lost): the mask survives the exec.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
# A start time read again later may differ by the wall clock's adjustments since boot (psutil
# derives it from the boot time, which moves with them); a pid reused within a second of the
# supervisor's start that also names this job directory is not a case to design for.
START_TIME_SLACK_S = 1.0


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process (not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited process its parent has not reaped yet (a zombie) still answers signal 0. Its
    # state is read where psutil reads it on Linux (the letter after the command's closing
    # parenthesis in /proc/PID/stat): `tilert-submit status` asks this of every live local job,
    # and importing psutil costs most of an interpreter's start (docs/performance.md,
    # "CLI imports").
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


SUPERVISOR_MODULE = "submit.local.run"


def supervisor_argv(job: JobDir) -> list[str]:
    """The supervisor's command line: this interpreter, the module, the absolute job directory."""
    return [sys.executable, "-m", SUPERVISOR_MODULE, str(job.root.absolute())]


def _pid(status: JobStatus) -> int:
    if not status.local_pid:
        raise ValueError("status.json names no local supervisor")
    return status.local_pid


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _is_supervisor_of(cmdline: list[str], job: JobDir) -> bool:
    """Whether ``cmdline`` is, whole, the supervisor's of ``job``: a Python interpreter, ``-m
    submit.local.run`` and the job directory itself (``supervisor_argv``), nothing else."""
    if len(cmdline) != 4 or cmdline[1:3] != ["-m", SUPERVISOR_MODULE]:
        return False
    if not os.path.basename(cmdline[0]).startswith("python") or not os.path.isabs(cmdline[3]):
        return False
    try:
        return os.path.samefile(cmdline[3], job.root)
    except OSError:
        return False


def process_facts(pid: int) -> tuple[float, list[str]] | str:
    """Live ``pid``'s start time and command line (what tells it from a stranger that reuses
    the pid), or why they cannot be had."""
    import psutil  # imported for `stop` and a submission only (see pid_alive)

    try:
        proc = psutil.Process(pid)
        return proc.create_time(), proc.cmdline()
    except psutil.NoSuchProcess:
        return f"pid {pid} is gone"
    except psutil.Error as exc:
        return f"pid {pid} cannot be inspected ({type(exc).__name__})"


def not_the_supervisor(job: JobDir, status: JobStatus) -> str | None:
    """Why the live pid status.json names is not this job's supervisor, or None when it is:
    its start time must be the one status.json recorded and its whole command line the
    supervisor's (a forged start time on another process is refused by its command line)."""
    pid = _pid(status)
    if status.local_started_at is None:
        return (
            f"status.json names pid {pid} without the supervisor's start time "
            "(local_started_at), so it cannot be told from another process that reuses the pid"
        )
    facts = process_facts(pid)
    if isinstance(facts, str):
        return facts
    started, cmdline = facts
    if abs(started - status.local_started_at) > START_TIME_SLACK_S:
        return (
            f"pid {pid} started at {_when(started)}, but this job's supervisor started at "
            f"{_when(status.local_started_at)}: the pid now names another process"
        )
    if not _is_supervisor_of(cmdline, job):
        shown = printable(shlex.join(cmdline))
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        return (
            f"pid {pid} ({shown or 'no command line'}) is not this job's supervisor "
            f"(python -m {SUPERVISOR_MODULE} {job.root})"
        )
    return None


def _wait_exit(pidfd: int, limit: float) -> bool:
    """Whether the process behind ``pidfd`` exits within ``limit`` s (a pidfd reads as exited)."""
    readable, _, _ = select.select([pidfd], [], [], max(limit, 0.0))
    return bool(readable)


class LocalBackend(Backend):
    """A job whose agents are children of a ``tilert-submit --local`` process on this machine."""

    def owns(self, status: JobStatus) -> bool:
        """Whether status.json records a local supervisor's pid."""
        return bool(status.local_pid)

    def claim(self, status: JobStatus) -> None:
        """Name this process (pid, start time) as the supervisor, and hold stop signals for it."""
        # A `stop` may read status.json the moment it exists: its SIGTERM must wait for the
        # supervisor's handler, not meet the default action (exit 143, the job `pending` for good).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        import psutil  # imported for `stop` and a submission only (see pid_alive)

        status.local_pid = os.getpid()
        status.local_started_at = psutil.Process().create_time()

    def submit(self, job: JobDir, plan: Plan, secrets: Mapping[str, str]) -> NoReturn:
        """Become the supervisor (exec, same pid): it runs the agents here, in the foreground.

        Never returns: this process is the job now (status.json's ``local_pid``)."""
        del plan  # the supervisor reads J/plan.json
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, supervisor_argv(job), {**os.environ, **secrets})
        except OSError as exc:
            raise BackendError(
                f"cannot start the local supervisor {sys.executable}: {exc}"
            ) from None

    def is_running(self, status: JobStatus) -> bool:
        """Whether the supervisor's pid is alive (``stop`` checks it is the supervisor)."""
        return pid_alive(_pid(status))

    def gone(self, status: JobStatus) -> str:
        """The supervisor is gone."""
        pid = _pid(status)
        return f"the local supervisor (pid {pid}) is gone but status.json still says {status.state}"

    def summary(self, status: JobStatus) -> str:
        """The supervisor's pid."""
        return f"local supervisor pid: {_pid(status)}"

    def stop(self, job: JobDir, status: JobStatus, limit: float) -> None:
        """SIGTERM the verified supervisor and wait for it to exit; SIGKILL it after ``limit``."""
        pid = _pid(status)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            print("it had already exited")
            return
        try:
            why = not_the_supervisor(job, status)
            if why is not None:
                raise BackendError(
                    f"not signalling pid {pid}: {why}. The job's supervisor is gone or "
                    "status.json does not prove which process it is; if you know better, stop "
                    "that process yourself"
                )
            if status.state == "stopping":
                # A stop is under way (another `stop`, a Ctrl-C): a second signal would force it.
                print(
                    f"the local job is already stopping: waiting for pid {pid} (up to {limit:g}s)"
                )
            else:
                print(
                    f"stopping the local job: SIGTERM to its supervisor pid {pid} "
                    f"(up to {limit:g}s)"
                )
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            if _wait_exit(pidfd, limit):
                print("stopped")
                return
            print(
                f"pid {pid} did not exit within {limit:g}s; "
                "sending SIGKILL (its agents die with it)"
            )
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)
