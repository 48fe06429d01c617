"""The child handling both backends share: PDEATHSIG, a pidfd wait, the lifeline, the tree sweep.

A ``Child`` is a process the agent forked in its own process group (``pid == pgid``), stdin
/dev/null, stdout+stderr on one pipe, ``PR_SET_PDEATHSIG=SIGKILL`` set in the child before exec,
plus a *lifeline*: a tiny ``/bin/sh`` watcher inside that process group that holds the read end of
a pipe whose only write end is the agent's. When the agent dies by any means (SIGKILL included) the
pipe reaches EOF and the watcher acts (by default it SIGKILLs the whole group, grandchildren
included).

Why the main thread: ``PR_SET_PDEATHSIG`` fires when the parent *thread* exits, and trio's
``run_process``/``open_process`` fork from a worker thread that retires after 10 s idle, which
would SIGKILL the child 10 s after spawn. So children are forked here, in the trio thread, with
``subprocess.Popen`` (a few milliseconds: measured 3-4 ms), and their exit is awaited through a
pidfd (``os.pidfd_open`` + ``trio.lowlevel.wait_readable``), never through a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import trio

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

# The lifeline watcher: it ignores the polite signals its group receives on a graceful stop, and
# when the agent's write end closes (the agent exited or died) it SIGKILLs its own process group.
LIFELINE_KILL_GROUP = "trap '' TERM INT HUP QUIT; read _ ; kill -9 0"


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when its parent thread dies; exit if it already did."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork and prctl: then nothing would ever fire.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "engines must be forked from the main (trio) thread: PR_SET_PDEATHSIG fires when the "
            "forking thread exits, and trio's worker threads retire after 10 s idle"
        )


class Child:
    """A child of the agent in its own process group, with a lifeline watcher in that group."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path | None) -> None:
        _require_main_thread()
        read_fd, write_fd = os.pipe()
        try:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=write_fd,
                stderr=write_fd,
                env=env,
                cwd=cwd,
                process_group=0,
                preexec_fn=_die_with_parent(os.getpid()),
                close_fds=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.pid = self.popen.pid
        self.output = trio.lowlevel.FdStream(read_fd)
        # The leader is our unreaped child: its pid cannot be reused, so the pidfd names it.
        self._pidfd = os.pidfd_open(self.pid)
        self._waiting = False
        self._changed = trio.Event()
        self._lifeline_w: int | None = None
        self._watcher: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}

    # -- lifeline ------------------------------------------------------------------------------

    def attach_lifeline(
        self,
        script: str = LIFELINE_KILL_GROUP,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """Start the watcher in the child's process group; it acts when the agent's end closes."""
        life_r, life_w = os.pipe()
        try:
            self._watcher = subprocess.Popen(
                ["/bin/sh", "-c", script, "tilert-lifeline", *args],
                stdin=life_r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env if env is not None else {"PATH": os.defpath},
                process_group=self.pid,
                close_fds=True,
            )
        except BaseException:
            os.close(life_w)
            raise
        finally:
            os.close(life_r)
        # Only this process holds the write end (CLOEXEC; Popen closes inherited fds).
        self._lifeline_w = life_w

    # -- exit ----------------------------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """The leader's exit status once reaped."""
        return self.popen.returncode

    async def wait(self) -> int:
        """Wait for the leader's exit (one task reads the pidfd; the others wait for it)."""
        while self.popen.returncode is None:
            if self._waiting:
                await self._changed.wait()
                continue
            self._waiting = True
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
                self._ended()
            finally:
                self._waiting = False
                self._changed.set()
                self._changed = trio.Event()
        return self.popen.returncode

    def _ended(self) -> None:
        """The leader is a zombie: kill what is left of its group, then reap it, then close up."""
        # Before reaping: the zombie still holds the pgid, so this cannot hit a reused number.
        self.signal_group(signal.SIGKILL)
        self._kill_seen()
        self.popen.wait()
        self._close_lifeline()
        with contextlib.suppress(OSError):
            os.close(self._pidfd)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (a no-op once it is reaped)."""
        if self.popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _close_lifeline(self) -> None:
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)
            self._lifeline_w = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            # It was in the group we just SIGKILLed (or acts on the EOF now): gone within a moment.
            with contextlib.suppress(ProcessLookupError):
                watcher.kill()
            # (If it is in uninterruptible sleep, subprocess reaps it later.)
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(timeout=2.0)

    # -- the tree ------------------------------------------------------------------------------

    def tree(self, root: int | None = None) -> list[psutil.Process]:
        """``root`` (default the leader) and its descendants, remembered for the final sweep."""
        root = self.pid if root is None else root
        if root == self.pid and self.popen.returncode is not None:
            return []
        try:
            leader = psutil.Process(root)
            procs = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            return []
        out = []
        for proc in procs:
            known = self._seen.get(proc.pid)
            # psutil compares pid and creation time: a reused pid is a different process.
            if known is None or known != proc:
                self._seen[proc.pid] = known = proc
            out.append(known)
        return out

    def _kill_seen(self) -> None:
        """SIGKILL every descendant ever seen that is still the same process (escaped ones too)."""
        for proc in list(self._seen.values()):
            if proc.pid == self.pid:
                continue
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil refuses a pid that now names another process
        self._seen.clear()

    async def abandon(self) -> None:
        """Kill and reap a child whose start could not be completed (shielded: it must end)."""
        self.kill_now()
        with trio.CancelScope(shield=True):
            await self.wait()

    def kill_now(self) -> None:
        """SIGKILL the group and every descendant seen (synchronous)."""
        self.tree()
        self.signal_group(signal.SIGKILL)
        self._kill_seen()
