"""The child handling both backends share: PDEATHSIG, a pidfd wait, the lifeline, the tree sweep.

A ``Child`` is a process the agent started in its own process group (``pid == pgid``), stdin
/dev/null, stdout+stderr on one pipe, ``PR_SET_PDEATHSIG=SIGKILL`` set in the child before the
program runs, plus a *lifeline*: a tiny ``/bin/sh`` watcher inside that process group that holds
the read end of a pipe whose only write end is the agent's. When the agent dies by any means
(SIGKILL included) the pipe reaches EOF and the watcher acts (by default it SIGKILLs the whole
group, grandchildren included).

No Python runs in the child: ``subprocess.Popen`` gets no ``preexec_fn``, so CPython starts it with
vfork, which holds the calling thread only until the child's first exec. A ``preexec_fn`` would
hold the trio thread, deaf to SIGINT and SIGTERM, until the child execs, for as long as a stalled
child likes (docs/launchers.md). PDEATHSIG is set instead by an exec chain that adds well under a
millisecond: util-linux's ``setpriv --pdeathsig KILL`` sets it and execs ``/bin/sh``, which exits
unless its parent is still the agent (the agent may have died before the ``prctl``, and then nothing
would ever fire), and execs the program. ``pid`` is the program's own pid throughout.

Why the main thread: ``PR_SET_PDEATHSIG`` fires when the parent *thread* exits, and trio's
``run_process``/``open_process`` start processes from a worker thread that retires after 10 s idle,
which would SIGKILL the child 10 s after spawn. So children are started here, in the trio thread,
with ``subprocess.Popen``, and their exit is awaited through a pidfd (``os.pidfd_open`` +
``trio.lowlevel.wait_readable``), never through a thread.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import psutil
import trio

# Run by /bin/sh after setpriv set PDEATHSIG: $0 is the agent's pid, "$@" the rest of the chain.
# A parent that died before the prctl left us orphaned: nothing would ever fire, so end here.
_PARENT_CHECK = '[ "$PPID" = "$0" ] || exit 1; exec "$@"'
# What a shell may add to the environment it passes on (dash and bash set PWD, bash sets SHLVL):
# ``env`` puts them back as they were, so the program gets exactly the spec's environment.
_SHELL_SET = ("PWD", "SHLVL")
# The lifeline watcher: it ignores the polite signals its group receives on a graceful stop, and
# when the agent's write end closes (the agent exited or died) it SIGKILLs its own process group.
LIFELINE_KILL_GROUP = "trap '' TERM INT HUP QUIT; read _ ; kill -9 0"
# Where the tools are looked for besides the agent's PATH (a batch environment may have a short
# one).
_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@functools.cache
def _wrapper_tools() -> tuple[str, str] | None:
    """setpriv and env when setpriv knows ``--pdeathsig`` (util-linux 2.33+); None otherwise.

    Checked once per process, by running the whole chain.
    """
    search = os.environ.get("PATH", "") + os.pathsep + _SYSTEM_PATH
    setpriv, env = shutil.which("setpriv", path=search), shutil.which("env", path=search)
    if setpriv is None or env is None:
        return None
    probe = [setpriv, "--pdeathsig", "KILL", "/bin/sh", "-c", _PARENT_CHECK, str(os.getpid())]
    try:
        done = subprocess.run(
            [*probe, env, "--", "/bin/sh", "-c", ":"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (setpriv, env) if done.returncode == 0 else None


def die_with_parent_prefix(env: dict[str, str]) -> list[str]:
    """The argv prefix that sets PDEATHSIG and checks the parent before the program runs.

    Empty where setpriv cannot set it (util-linux before 2.33): the lifeline still kills the
    child when the agent dies, from the moment ``attach_lifeline`` returns (docs/launchers.md).
    """
    tools = _wrapper_tools()
    if tools is None:
        return []
    setpriv, env_bin = tools
    unset = [arg for name in _SHELL_SET if name not in env for arg in ("-u", name)]
    restore = [f"PWD={env['PWD']}"] if "PWD" in env else []
    return [
        setpriv,
        "--pdeathsig",
        "KILL",
        "/bin/sh",
        "-c",
        _PARENT_CHECK,
        str(os.getpid()),
        env_bin,
        *unset,
        "--",
        *restore,
    ]


def _check_program(program: str, env: dict[str, str], cwd: Path | None) -> None:
    """Raise what Popen would when ``program`` cannot be executed: the exec is in the wrapper
    now."""
    if os.sep in program:
        found = os.path.join(cwd, program) if cwd is not None else program
        if not os.path.isfile(found):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if not os.access(found, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
        return
    search = os.pathsep.join(os.get_exec_path(env))
    if shutil.which(program, path=search) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


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
        argv = list(argv)
        if not argv:
            raise ValueError("an empty argv")
        _check_program(argv[0], env, cwd)
        # ``env`` would take a program named NAME=VALUE for an assignment: start it unwrapped.
        prefix = die_with_parent_prefix(env) if "=" not in argv[0] else []
        read_fd, write_fd = os.pipe()
        try:
            # No preexec_fn: the trio thread is held only until the wrapper's exec (see above).
            self.popen = subprocess.Popen(
                [*prefix, *argv],
                stdin=subprocess.DEVNULL,
                stdout=write_fd,
                stderr=write_fd,
                env=env,
                cwd=cwd,
                process_group=0,
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
            try:
                watcher.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                # Still busy (pyxis: its scancel waits for slurmctld) or in uninterruptible
                # sleep: a thread reaps it whenever it ends, so no zombie and no Popen dropped
                # while it runs.
                threading.Thread(target=watcher.wait, name="lifeline-reaper", daemon=True).start()

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
