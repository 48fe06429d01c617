"""Launchers: how the agent starts, watches and stops engine processes.

Two launchers, one ``Engine`` contract (docs/launchers.md says what each guarantees):

- ``process``: a plain child of the agent in its own process group (``pid == pgid``), stdin
  /dev/null, stdout+stderr on one pipe, ``PR_SET_PDEATHSIG=SIGKILL`` set in the child before exec,
  plus a *lifeline*: a tiny ``/bin/sh`` watcher inside the engine's process group that holds the read
  end of a pipe whose only write end is the agent's. When the agent dies by any means (SIGKILL
  included) the pipe reaches EOF and the watcher SIGKILLs the whole group, grandchildren included.
- ``pyxis``: a nested ``srun --overlap`` step of the agent's own job (with pyxis container flags
  when the spec has an image), stopped with ``scancel --signal=TERM JOB.STEP``: SIGTERM to the srun
  client would abort the step with SIGKILL.

Why the main thread: ``PR_SET_PDEATHSIG`` fires when the parent *thread* exits, and trio's
``run_process``/``open_process`` fork from a worker thread that retires after 10 s idle, which
would SIGKILL the engine 10 s after spawn. So engines are forked here, in the trio thread, with
``subprocess.Popen`` (a few milliseconds: measured 3-4 ms), and their exit is awaited through a
pidfd (``os.pidfd_open`` + ``trio.lowlevel.wait_readable``), never through a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

import psutil
import trio

ENGINE_ID_ENV = "TILERT_ENGINE_ID"
# A preflight spec is named "<engine>-preflight": under pyxis it shares its engine's named
# container, so the image is imported once, by the preflight, and every restart reuses it.
PREFLIGHT_SUFFIX = "-preflight"
RUN_OUTPUT_LIMIT = 1 << 20

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

# Source the setup script, then become the engine: `exec` keeps the pid, so the leader is still
# the engine itself. The argv is saved first because a sourced script sees (and may change) "$@".
_SETUP_WRAPPER = (
    '__tilert_setup=$1; shift; __tilert_argv=("$@"); set --; '
    '. "$__tilert_setup" && exec "${__tilert_argv[@]}"'
)
# The lifeline watcher: it ignores the polite signals its group receives on a graceful stop, and
# when the agent's write end closes (the agent exited or died) it SIGKILLs its own process group.
_LIFELINE_PROCESS = "trap '' TERM INT HUP QUIT; read _ ; kill -9 0"
# The pyxis watcher ends the step instead (the step's processes are not in our process group).
_LIFELINE_STEP = (
    "trap '' TERM INT HUP QUIT; read _ ; "
    'scancel --signal=KILL "$1" 2>/dev/null; scancel "$1" 2>/dev/null; kill -9 0'
)


@dataclass(frozen=True)
class LaunchSpec:
    """What to run and how: the complete environment, argv, and (pyxis) container settings."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path | None = None
    image: str | None = None
    mounts: tuple[str, ...] = ()
    setup_script: Path | None = None
    # pyxis: names whose values in ``env`` must win over the image's own (srun --container-env);
    # without it the image's value of a variable it defines (PATH, CUDA_*, NCCL_*) takes precedence.
    container_env: tuple[str, ...] = ()


class Engine(Protocol):
    """One running engine."""

    @property
    def pid(self) -> int | None:
        """The engine's own leader process (pyxis: None until it is found on this node)."""
        ...

    output: trio.abc.ReceiveStream

    @property
    def returncode(self) -> int | None:
        """The exit status once ended: a code, or -signal like subprocess."""
        ...

    async def wait(self) -> int:
        """Wait for the engine to end; its exit status."""
        ...

    async def stop(self, grace_s: float) -> int:
        """SIGTERM, ``grace_s``, SIGKILL, reap, sweep leftovers; idempotent; the exit status."""
        ...

    def kill(self) -> None:
        """SIGKILL everything now (synchronous, for emergencies)."""
        ...

    def descendants(self) -> list[psutil.Process]:
        """The engine's process tree on this node (leader first), for CPU and memory metrics."""
        ...


class Launcher(Protocol):
    """Starts engines, and short commands through the same path (the preflight)."""

    name: str

    async def start(self, spec: LaunchSpec) -> Engine:
        """Start the engine described by ``spec``."""
        ...

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        """Run a short command to its end; its status and merged output (RunTimeout at timeout)."""
        ...


class RunTimeout(TimeoutError):
    """A ``Launcher.run`` command outlived its timeout and was killed; ``output`` is what it said."""

    def __init__(self, spec: LaunchSpec, timeout_s: float, output: bytes) -> None:
        super().__init__(f"{spec.name}: still running after {timeout_s:g}s; killed")
        self.output = output


def setup_wrapped_argv(spec: LaunchSpec) -> list[str]:
    """The argv to exec: the spec's own, or bash sourcing the setup script then exec'ing it."""
    if spec.setup_script is None:
        return list(spec.argv)
    return ["bash", "-c", _SETUP_WRAPPER, "tilert-setup", str(spec.setup_script), *spec.argv]


# ---- spawning from the main thread ---------------------------------------------------------


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


class _Child:
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
        self, script: str, args: Sequence[str] = (), env: dict[str, str] | None = None
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


# ---- process launcher ----------------------------------------------------------------------


class ProcessEngine:
    """An engine that is a plain child of the agent."""

    def __init__(self, child: _Child) -> None:
        self._child = child
        self.output: trio.abc.ReceiveStream = child.output

    @property
    def pid(self) -> int:
        """The engine's own pid (also its process group id)."""
        return self._child.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once ended: code, or -signal."""
        return self._child.returncode

    async def wait(self) -> int:
        """Wait until the engine ends; its exit status."""
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
    """Engines as plain children of the agent (tests, bare metal, systemd, --local, --mock)."""

    name = "process"

    async def start(self, spec: LaunchSpec) -> ProcessEngine:
        """Fork the engine from this (the main) thread; OSError when it cannot be started."""
        child = _Child(setup_wrapped_argv(spec), spec.env, spec.cwd)
        try:
            child.attach_lifeline(_LIFELINE_PROCESS)
        except BaseException:
            await child.abandon()
            raise
        await trio.lowlevel.checkpoint()
        return ProcessEngine(child)

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        """Run a short command to its end through this launcher."""
        return await run_to_end(self, spec, timeout_s=timeout_s)


async def run_to_end(
    launcher: Launcher, spec: LaunchSpec, *, timeout_s: float
) -> tuple[int, bytes]:
    """Start ``spec`` through ``launcher``, collect its output, kill it at ``timeout_s``."""
    engine = await launcher.start(spec)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        while True:
            try:
                data = await engine.output.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            if size < RUN_OUTPUT_LIMIT:
                chunks.append(bytes(data[: RUN_OUTPUT_LIMIT - size]))
                size += len(chunks[-1])

    read_done = trio.Event()

    async def read_all() -> None:
        await read()
        read_done.set()

    try:
        with trio.move_on_after(timeout_s) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                await engine.wait()
                # The group is gone, so EOF is due; a stray escaped holder must not stall us.
                with trio.move_on_after(2.0):
                    await read_done.wait()
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            with trio.CancelScope(shield=True):
                await engine.stop(0)
            raise RunTimeout(spec, timeout_s, b"".join(chunks))
        return engine.returncode if engine.returncode is not None else -1, b"".join(chunks)
    finally:
        with trio.CancelScope(shield=True):
            if engine.returncode is None:
                await engine.stop(0)
            await engine.output.aclose()


# ---- pyxis launcher ------------------------------------------------------------------------

_STEP_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def pyxis_container_name(spec: LaunchSpec) -> str:
    """The job-stable pyxis container of a spec: restarts and the preflight reuse its import."""
    return "tilert-" + _STEP_NAME_UNSAFE.sub("_", spec.name.removesuffix(PREFLIGHT_SUFFIX))


def pyxis_srun_argv(
    spec: LaunchSpec,
    job_id: str,
    node: str,
    container_name: str,
    *,
    step_name: str | None = None,
    srun: str = "srun",
) -> list[str]:
    """The nested step's srun command line; container flags only when the spec has an image."""
    argv = [
        srun,
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={step_name or 'tilert-' + spec.name}",
        # The task's environment is srun's own, which is exactly spec.env (plus the marker):
        # ALL, stated, so a SLURM_EXPORT_ENV in that environment cannot narrow it.
        "--export=ALL",
    ]
    if spec.image is not None:
        argv += [
            f"--container-image={spec.image}",
            f"--container-name={container_name}",
            "--no-container-mount-home",
            "--no-container-entrypoint",
        ]
        if spec.mounts:
            argv.append("--container-mounts=" + ",".join(spec.mounts))
        if spec.cwd is not None:
            argv.append(f"--container-workdir={spec.cwd}")
        names = list(dict.fromkeys([*spec.container_env, ENGINE_ID_ENV]))
        names = [n for n in names if n in spec.env]
        if names:
            argv.append("--container-env=" + ",".join(names))
    elif spec.cwd is not None:
        argv.append(f"--chdir={spec.cwd}")
    return argv + setup_wrapped_argv(spec)


def _srun_status(code: int) -> int:
    """srun reports a task killed by signal N as 128+N; give it the subprocess spelling -N."""
    if 128 < code < 128 + 65:
        return -(code - 128)
    return code


def find_marked_leader(marker: str, *, exclude: set[int], since: float) -> int | None:
    """The oldest process carrying ``TILERT_ENGINE_ID=marker`` whose parent does not carry it."""
    carriers: dict[int, tuple[int, float]] = {}
    for proc in psutil.process_iter(["ppid", "create_time"]):
        info = proc.info
        if proc.pid in exclude or (info["create_time"] or 0) < since - 1.0:
            continue
        try:
            if proc.environ().get(ENGINE_ID_ENV) != marker:
                continue
        except (psutil.Error, OSError):
            continue
        carriers[proc.pid] = (info["ppid"], info["create_time"])
    leaders = [(t, pid) for pid, (ppid, t) in carriers.items() if ppid not in carriers]
    return min(leaders)[1] if leaders else None


class PyxisEngine:
    """An engine running as a nested srun step; the agent holds its srun client."""

    _LOOKUP_INTERVAL_S = 0.5

    def __init__(
        self, launcher: PyxisLauncher, client: _Child, marker: str, step: str | None, since: float
    ) -> None:
        self._launcher = launcher
        self._client = client
        self._marker = marker
        self.step = step
        self._since = since
        self._pid: int | None = None
        self._looked_at = 0.0
        self.output: trio.abc.ReceiveStream = client.output

    @property
    def pid(self) -> int | None:
        """The engine leader on this node (found by its marker), None until it is there."""
        if self._client.returncode is not None:
            return self._pid
        if self._pid is not None:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(self._pid).create_time() >= self._since - 1.0:
                    return self._pid
            self._pid = None
        now = time.monotonic()
        if now - self._looked_at >= self._LOOKUP_INTERVAL_S:
            self._looked_at = now
            # srun forks helpers that inherit the marker: the client's whole tree is not the engine.
            exclude = {self._client.pid}
            with contextlib.suppress(psutil.Error):
                exclude |= {
                    p.pid for p in psutil.Process(self._client.pid).children(recursive=True)
                }
            self._pid = find_marked_leader(self._marker, exclude=exclude, since=self._since)
        return self._pid

    @property
    def srun_pid(self) -> int:
        """The srun client's pid (never signal it for a graceful stop)."""
        return self._client.pid

    @property
    def returncode(self) -> int | None:
        """The step's exit status as srun reports it (signal deaths as -N)."""
        code = self._client.returncode
        return None if code is None else _srun_status(code)

    async def wait(self) -> int:
        """Wait until the srun client (and so the step) ends; the status."""
        return _srun_status(await self._client.wait())

    async def stop(self, grace_s: float) -> int:
        """``scancel --signal=TERM`` the step, grace, ``scancel --signal=KILL`` + ``scancel``."""
        if self._client.returncode is None:
            self._remember_tree()
            if self.step is not None:
                await self._launcher.scancel("--signal=TERM", self.step)
            else:
                # No step yet (still being created): aborting it is all there is to do.
                self._client.signal_group(signal.SIGTERM)
            with trio.move_on_after(max(grace_s, 0.0)):
                return await self.wait()
            self._remember_tree()
            if self.step is not None:
                await self._launcher.scancel("--signal=KILL", self.step)
                await self._launcher.scancel(self.step)
                with trio.move_on_after(self._launcher.step_end_timeout_s):
                    return await self.wait()
            self._client.kill_now()
        return await self.wait()

    def _remember_tree(self) -> None:
        pid = self.pid
        if pid is not None:
            self._client.tree(pid)

    def kill(self) -> None:
        """SIGKILL the step's tasks and the srun client now."""
        self._remember_tree()
        if self.step is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [self._launcher.scancel_bin, "--signal=KILL", self.step],
                    env=self._launcher.client_env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=5,
                )
        self._client.kill_now()

    def descendants(self) -> list[psutil.Process]:
        """The engine leader on this node and its descendants (empty until it is found)."""
        pid = self.pid
        if pid is None or self._client.returncode is not None:
            return []
        return self._client.tree(pid)


class PyxisLauncher:
    """Engines as nested ``srun --overlap`` steps of the agent's job, in pyxis containers."""

    name = "pyxis"

    def __init__(
        self,
        job_id: str,
        node: str,
        *,
        srun: str = "srun",
        squeue: str = "squeue",
        scancel: str = "scancel",
        step_lookup_timeout_s: float = 60.0,
        step_end_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.job_id = job_id
        self.node = node
        self.srun_bin = srun
        self.squeue_bin = squeue
        self.scancel_bin = scancel
        self.step_lookup_timeout_s = step_lookup_timeout_s
        self.step_end_timeout_s = step_end_timeout_s
        # Slurm client commands (squeue, scancel) run with the agent's environment (SLURM_CONF).
        self.client_env = dict(os.environ if env is None else env)

    async def start(self, spec: LaunchSpec) -> PyxisEngine:
        """Start the step, learn its JOB.STEP id; the leader pid is found later, on demand."""
        marker = uuid.uuid4().hex
        step_name = f"tilert-{spec.name}-{marker[:8]}"
        env = {**spec.env, ENGINE_ID_ENV: marker}
        marked = replace(spec, env=env)
        argv = pyxis_srun_argv(
            marked,
            self.job_id,
            self.node,
            pyxis_container_name(spec),
            step_name=step_name,
            srun=self.srun_bin,
        )
        since = time.time()
        child = _Child(argv, env, None)  # the step's cwd is --chdir / --container-workdir
        try:
            step = await self._find_step(child, step_name)
            if step is not None:
                child.attach_lifeline(_LIFELINE_STEP, [step], env=self._watcher_env())
            else:
                child.attach_lifeline(_LIFELINE_PROCESS)
        except BaseException:
            await child.abandon()
            raise
        return PyxisEngine(self, child, marker, step, since)

    def _watcher_env(self) -> dict[str, str]:
        env = {"PATH": self.client_env.get("PATH", os.defpath)}
        scancel_dir = os.path.dirname(shutil.which(self.scancel_bin, path=env["PATH"]) or "")
        if scancel_dir:
            env["PATH"] = scancel_dir + os.pathsep + env["PATH"]
        for key in ("SLURM_CONF",):
            if key in self.client_env:
                env[key] = self.client_env[key]
        return env

    async def _find_step(self, child: _Child, step_name: str) -> str | None:
        """The new step's JOB.STEP id by its unique name (squeue, with retries)."""
        deadline = trio.current_time() + self.step_lookup_timeout_s
        delay = 0.05
        while trio.current_time() < deadline and child.returncode is None:
            out = await self._client_command(
                [self.squeue_bin, "-h", "-s", "-j", self.job_id, "-o", "%i %j"], timeout_s=10
            )
            for line in out.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == step_name:
                    return parts[0]
            with trio.move_on_after(delay):
                await child.wait()
            delay = min(delay * 2, 1.0)
        return None

    async def scancel(self, *args: str) -> None:
        """``scancel ARGS`` (bounded; failures are logged by the caller's outcome, not raised)."""
        await self._client_command([self.scancel_bin, *args], timeout_s=15)

    async def _client_command(self, argv: list[str], *, timeout_s: float) -> str:
        # Short Slurm client commands need no PDEATHSIG: trio's worker-thread spawn is fine here.
        with trio.move_on_after(timeout_s):
            try:
                done = await trio.run_process(
                    argv,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=self.client_env,
                    stdin=b"",
                )
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise
                return ""
            return done.stdout.decode(errors="replace")
        return ""

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        """Run a short command to its end as a nested step."""
        return await run_to_end(self, spec, timeout_s=timeout_s)


def make_launcher(
    kind: Literal["process", "pyxis"], *, slurm_job_id: str | None, node: str | None
) -> Launcher:
    """The launcher the cluster file names (``launcher: process|pyxis``)."""
    if kind == "process":
        return ProcessLauncher()
    if kind == "pyxis":
        if not slurm_job_id or not node:
            raise ValueError(
                "launcher: pyxis needs a Slurm job (SLURM_JOB_ID) and this node's name "
                "(SLURMD_NODENAME); run the agent inside the job, or set launcher: process "
                "in the cluster file"
            )
        return PyxisLauncher(slurm_job_id, node)
    raise ValueError(f"unknown launcher {kind!r}: use process or pyxis (cluster file key launcher)")
