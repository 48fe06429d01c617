"""The ``process`` backend: each process a plain child of the agent (child.py's ``Child``).

For tests, bare metal, systemd, ``--local`` and ``--mock``. The child is forked from the main
thread with PDEATHSIG and a lifeline that SIGKILLs its whole process group when the agent dies.
"""

from __future__ import annotations

import signal

import psutil
import trio

from agent.launch.child import Child
from agent.launch.spec import LaunchSpec, run_to_end, setup_wrapped_argv


class LocalProcess:
    """A process that is a plain child of the agent."""

    def __init__(self, child: Child) -> None:
        self._child = child
        self.output: trio.abc.ReceiveStream = child.output

    @property
    def pid(self) -> int:
        """The process's own pid (also its process group id)."""
        return self._child.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once ended: code, or -signal."""
        return self._child.returncode

    async def wait(self) -> int:
        """Wait until the process ends; its exit status."""
        return await self._child.wait()

    async def stop(self, grace_s: float) -> int:
        """SIGTERM the group, wait ``grace_s``, SIGKILL the group, reap, sweep; the status."""
        if self._child.returncode is None:
            self._child.tree()  # remember the tree while it is still connected to the leader
            self._child.signal_group(signal.SIGTERM)
            self._child.signal_group(signal.SIGCONT)  # a stopped group gets its TERM now
            with trio.move_on_after(max(grace_s, 0.0)):
                return await self._child.wait()
            self._child.kill_now()
        return await self._child.wait()

    def kill(self) -> None:
        """SIGKILL the whole group now."""
        self._child.kill_now()

    def descendants(self) -> list[psutil.Process]:
        """Leader and its descendants (empty once ended)."""
        return self._child.tree()


class ProcessLauncher:
    """Processes as plain children of the agent (tests, bare metal, systemd, --local, --mock)."""

    name = "process"

    async def start(self, spec: LaunchSpec) -> LocalProcess:
        """Fork the process from this (the main) thread; OSError when it cannot be started."""
        child = Child(setup_wrapped_argv(spec), spec.env, spec.cwd)
        try:
            child.attach_lifeline()
        except BaseException:
            await child.abandon()
            raise
        await trio.lowlevel.checkpoint()
        return LocalProcess(child)

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        """Run a short command to its end through this launcher."""
        return await run_to_end(self, spec, timeout_s=timeout_s)
