"""Processes of a test: alive or gone, a job's processes found by scanning the process table.

A job's processes are found the way an operator would: every process whose command line names the
job directory, their descendants, and the stand-ins and routers listening on the job's published
ports (their command lines do not name the directory). "Gone" waits until each has ended, with a
bound; a zombie counts as gone (an orphan may wait for a lazy init to reap it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil

from tests.kit.jobdir import job_ports

T = TypeVar("T")

# What a --mock job runs besides the agents (their command lines do not name the job directory).
STANDIN_MARKERS = ("agent.standins.", "tilert.pd_vllm.pd_router")
_POLL_S = 0.02


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _running(proc: psutil.Process) -> bool:
    """``proc`` (same pid *and* start time) still runs and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _left_after(items: Iterable[T], running: Callable[[T], bool], timeout: float) -> list[T]:
    """The ``items`` still running after up to ``timeout`` seconds (returns once none is)."""
    items = list(items)
    deadline = time.monotonic() + timeout
    while True:
        left = [item for item in items if running(item)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(_POLL_S)


def still_alive(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of ``procs`` still running (same pid *and* start time) after ``timeout``."""
    return _left_after(procs, _running, timeout)


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (empty as soon as all are gone)."""
    return _left_after(pids, alive, timeout)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def command_lines() -> Iterator[tuple[psutil.Process, str]]:
    """Every process on the machine with its command line, skipping those that end, turn zombie
    or deny access while the table is read (another test's or tool's process can, at any time)."""
    for proc in psutil.process_iter():
        try:
            yield proc, " ".join(proc.cmdline())
        except psutil.Error:
            continue


def describe(procs: Iterable[psutil.Process]) -> str:
    """pid and command line of each process, one a line."""
    return "\n".join(f"  {p.pid}: {_cmdline(p)[:200]}" for p in procs) or "  (none)"


def job_processes(job: Path, ports: Iterable[int] = ()) -> list[psutil.Process]:
    """Every live process of the job: those naming the job directory, their descendants, and
    stand-ins or routers listening on one of ``ports`` (the job's published ports)."""
    needle = str(job)
    found: dict[int, psutil.Process] = {}
    port_set = set(ports)
    for proc, cmd in command_lines():
        if needle in cmd:
            found[proc.pid] = proc
        elif port_set and any(m in cmd for m in STANDIN_MARKERS):
            with contextlib.suppress(psutil.Error):
                listening = {c.laddr.port for c in proc.net_connections("inet") if c.laddr}
                if listening & port_set:
                    found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found[child.pid] = child
    return still_alive(list(found.values()), 0)


def running_processes(job: Path, at_least: int) -> tuple[set[int], list[psutil.Process]]:
    """The job's ports and live processes, at least ``at_least`` of them."""
    ports = job_ports(job)
    procs = job_processes(job, ports)
    assert len(procs) >= at_least, describe(procs)
    return ports, procs


def assert_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Every one of ``procs`` ends within ``timeout``."""
    left = still_alive(procs, timeout)
    assert not left, "left behind:\n" + describe(left)


def assert_nothing_left(job: Path, timeout: float) -> None:
    """Every process of the job (by a fresh scan) ends within ``timeout``."""
    assert_gone(job_processes(job, job_ports(job)), timeout)


def kill_all(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each (teardown of a failed test)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def agent_process(job: Path, name: str) -> psutil.Process:
    """The ``tilert-agent`` process of agent ``name`` of ``job``."""
    role, index = name.rsplit("-", 1)
    for proc in job_processes(job):
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            is_agent = "agent.main" in cmd or any(c.endswith("tilert-agent") for c in cmd)
            if (
                is_agent
                and cmd[cmd.index("--role") + 1] == role
                and cmd[cmd.index("--index") + 1] == index
            ):
                return proc
    raise AssertionError(f"no agent process {name} for {job}")
