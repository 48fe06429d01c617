"""The service's cells on the submit backends (``agent.service.launcher.CellLauncher``).

A cell is submitted exactly as a person would submit the job: ``tilert-submit RECIPE [--cluster
F] [--set ...] [--mock ...] --job-dir S/cells/cell-N`` (same checks, same job directory, secrets
from the recipe), run as a child of the service front:

- **Slurm** (``SlurmCells``): the child sbatches the job and exits; its job id is read from the
  cell's ``status.json``. ``squeue -h -j ID -o %T|%L|%r`` gives whether it runs, its time left and
  why it waits; ``stop`` is the Slurm backend's (TERM, drain, then scancel).
- **Local** (``LocalCells``): the child (``--local``) becomes the cell's supervisor in a session of
  its own, so the cell outlives a front that is SIGKILLed and a restarted front adopts it; its pid
  and start time are its identity. Its time left is its start plus the recipe's
  ``slurm.time_limit`` (the local supervisor honours that limit as Slurm would).

The child's output goes to ``S/cells/cell-N.out``. Cells that share one host (``--local``, or a
cluster file whose ``network_interface`` is ``lo``) are each given a router port and a front door
port of their own (``--set agent.router_port``, ``agent.front.port``: ``own_ports``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import trio

from agent.job.paths import JobDir
from agent.job.records import JobStatus
from agent.service.launcher import CellFacts, CellIds
from agent.service.records import CellRecord
from submit.backend import BackendError
from submit.local.backend import START_TIME_SLACK_S, LocalBackend, pid_alive
from submit.slurm import client
from submit.slurm.backend import SlurmBackend

# How long a Slurm submission (the child tilert-submit and its sbatch) may take.
SUBMIT_LIMIT_S = 120.0
# squeue's one line per cell: state, time left, reason.
_SQUEUE_FORMAT = "%T|%L|%r"


def cell_argv(args: Sequence[str], job: JobDir) -> list[str]:
    """The command that submits one cell: this interpreter's tilert-submit, ``args`` (the recipe
    and its flags, as ``serve`` got them), the cell's job directory."""
    return [sys.executable, "-m", "submit.cli", *args, "--job-dir", str(job.root)]


def _out(job: JobDir) -> Path:
    return job.root.with_name(f"{job.root.name}.out")


def _read(job: JobDir) -> JobStatus | None:
    with contextlib.suppress(Exception):
        return job.read_status()
    return None


def own_ports() -> list[str]:
    """``--set`` flags giving a cell a router port and a front door port of its own, free on
    this machine now: cells that share one host (``--local``, or Slurm nodes that are all this
    host, ``network_interface: lo``) must not share them. The agents' own ports are probed from
    their bases, so those never collide."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(2)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        router, front = (int(sock.getsockname()[1]) for sock in socks)
    return ["--set", f"agent.router_port={router}", "--set", f"agent.front.port={front}"]


def _when_started(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


class LocalCells:
    """Cells run here, each by a detached ``tilert-submit --local`` (the module docstring)."""

    backend: Literal["local", "slurm"] = "local"
    early_signal_s = 0.0

    def __init__(self, args: Sequence[str], time_limit_s: float | None) -> None:
        self.args = [*args, "--local"]
        self.time_limit_s = time_limit_s
        # Children of this front, reaped as they exit (an adopted cell is not one).
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    async def submit(self, job: JobDir) -> CellIds:
        """Start the cell's supervisor in its own session; its pid and start time."""
        proc = await trio.to_thread.run_sync(self._spawn, job)
        self._children[proc.pid] = proc
        return CellIds(local_pid=proc.pid, local_started_at=_when_started(proc.pid))

    def _spawn(self, job: JobDir) -> subprocess.Popen[bytes]:
        job.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(_out(job), "ab") as out:
                return subprocess.Popen(
                    cell_argv([*self.args, *own_ports()], job),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise BackendError(f"cannot start {sys.executable}: {exc.strerror or exc}") from None

    def _alive(self, cell: CellRecord) -> bool:
        pid = cell.local_pid
        if pid is None:
            return False
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            del self._children[pid]
            return False
        if not pid_alive(pid):
            return False
        started = _when_started(pid)
        # A pid reused by another process since (its start time differs) is not the cell.
        return (
            cell.local_started_at is None
            or started is None
            or abs(started - cell.local_started_at) <= START_TIME_SLACK_S
        )

    async def facts(self, cell: CellRecord, job: JobDir) -> CellFacts:
        """Whether its supervisor lives; time left from its start and slurm.time_limit."""
        del job
        running = self._alive(cell)
        left = None
        if running and self.time_limit_s is not None and cell.local_started_at is not None:
            left = max(cell.local_started_at + self.time_limit_s - time.time(), 0.0)
        return CellFacts(running=running, time_left_s=left)

    async def stop(self, cell: CellRecord, job: JobDir, limit: float) -> None:
        """SIGTERM the supervisor (the local backend's stop: its agents drain), wait for it."""
        if not self._alive(cell):
            return
        status = _read(job)
        if status is None or status.local_pid != cell.local_pid:
            # Not yet the supervisor (status.json not written): its stop signals are held, so a
            # SIGTERM now is met by the supervisor's handler.
            if cell.local_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(cell.local_pid, signal.SIGTERM)
            return
        await trio.to_thread.run_sync(LocalBackend().stop, job, status, limit)
        child = self._children.pop(cell.local_pid or 0, None)
        if child is not None:
            child.poll()


class SlurmCells:
    """Cells submitted to Slurm (the module docstring)."""

    backend: Literal["local", "slurm"] = "slurm"
    # Slurm may send the TERM before the time limit up to a minute earlier than asked.
    early_signal_s = 60.0

    def __init__(self, args: Sequence[str], *, one_host: bool = False) -> None:
        self.args = list(args)
        # Every node is this host (network_interface: lo, a local test cluster): own ports.
        self.one_host = one_host

    async def submit(self, job: JobDir) -> CellIds:
        """Run ``tilert-submit`` for the cell (it sbatches it); the Slurm job id it recorded."""
        return await trio.to_thread.run_sync(self._submit, job)

    def _submit(self, job: JobDir) -> CellIds:
        job.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(_out(job), "ab") as out:
                ports = own_ports() if self.one_host else []
                done = subprocess.run(
                    cell_argv([*self.args, *ports], job),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=SUBMIT_LIMIT_S,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            raise BackendError(
                f"tilert-submit did not submit within {SUBMIT_LIMIT_S:g} s (see {_out(job)})"
            ) from None
        except OSError as exc:
            raise BackendError(f"cannot start {sys.executable}: {exc.strerror or exc}") from None
        status = _read(job)
        if done.returncode == 0 and status is not None and status.slurm_job_id:
            return CellIds(slurm_job_id=status.slurm_job_id)
        why = status.error if status is not None and status.error else f"see {_out(job)}"
        raise BackendError(f"tilert-submit exited {done.returncode}: {why}")

    async def facts(self, cell: CellRecord, job: JobDir) -> CellFacts:
        """squeue's state, time left (``%L``) and reason (``%r``) for the cell's job."""
        del job
        return await trio.to_thread.run_sync(squeue_facts, cell.slurm_job_id or "")

    async def stop(self, cell: CellRecord, job: JobDir, limit: float) -> None:
        """The Slurm backend's stop: TERM (the agents drain), then scancel after ``limit``."""
        status = _read(job)
        if status is None or not status.slurm_job_id:
            if cell.slurm_job_id is None:
                return
            await trio.to_thread.run_sync(lambda: client.scancel(cell.slurm_job_id or ""))
            return
        await trio.to_thread.run_sync(SlurmBackend().stop, job, status, limit)


def squeue_facts(job_id: str) -> CellFacts:
    """One ``squeue`` of a job: running (or queued), time left, pending reason."""
    from agent.recipe.serviceplan import slurm_seconds

    try:
        done = client.run_client(
            ["squeue", "-h", "-j", job_id, "-o", _SQUEUE_FORMAT], timeout=client.QUERY_TIMEOUT_S
        )
    except client.SlurmError as exc:
        if "Invalid job id" in str(exc):
            return CellFacts(running=False)
        return CellFacts(running=None)
    line = done.stdout.strip().split("\n", 1)[0].strip()
    if not line:
        return CellFacts(running=False)
    state, left, reason = [*line.split("|", 2), "", ""][:3]
    if state in client.ENDED_STATES:
        return CellFacts(running=False)
    try:
        left_s = slurm_seconds(left) if state == "RUNNING" else None
    except ValueError:
        left_s = None
    pending = reason if state == "PENDING" and reason not in ("", "None") else None
    return CellFacts(running=True, time_left_s=left_s, pending_reason=pending)


def launcher_for(
    local: bool, args: Sequence[str], time_limit_s: float | None, *, one_host: bool = False
) -> LocalCells | SlurmCells:
    """The launcher ``serve`` runs its cells with (``one_host``: Slurm's nodes are this host)."""
    return LocalCells(args, time_limit_s) if local else SlurmCells(args, one_host=one_host)
