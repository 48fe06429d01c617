"""The ``pyxis`` backend: each process a nested ``srun --overlap`` step of the agent's own job.

The step runs in a pyxis container when the spec has an image. It is stopped with
``scancel --signal=TERM JOB.STEP``, never by signalling the srun client: SIGTERM to an srun client
aborts the step with SIGKILL. The agent holds the srun client as a ``Child`` (PDEATHSIG), and its
lifeline cancels the step when the agent dies. The step's leader is found on this node by a marker
in its environment (``TILERT_ENGINE_ID``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import replace

import msgspec
import psutil
import trio

from agent.job.plan import Plan
from agent.launch.child import Child
from agent.launch.spec import LaunchSpec, run_to_end, setup_wrapped_argv

ENGINE_ID_ENV = "TILERT_ENGINE_ID"
# A preflight spec is named "<engine>-preflight": under pyxis it shares its engine's named
# container, so the image is imported once, by the preflight, and every restart reuses it.
PREFLIGHT_SUFFIX = "-preflight"

# The step's watcher ends the step (its processes are not in our process group), then its group.
_LIFELINE_STEP = (
    "trap '' TERM INT HUP QUIT; read _ ; "
    'scancel --signal=KILL "$1" 2>/dev/null; scancel "$1" 2>/dev/null; kill -9 0'
)
_STEP_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def pyxis_flags(plan: Plan) -> list[str]:
    """The recipe's container flags for every pyxis step (agent.pyxis_flags); [] without."""
    return [] if isinstance(plan.pyxis_flags, msgspec.UnsetType) else list(plan.pyxis_flags)


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
        argv += spec.container_flags
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


class PyxisStep:
    """A process running as a nested srun step; the agent holds its srun client."""

    _LOOKUP_INTERVAL_S = 0.5

    def __init__(
        self, launcher: PyxisLauncher, client: Child, marker: str, step: str | None, since: float
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
        """The step's leader on this node (found by its marker), None until it is there."""
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
            # srun forks helpers that inherit the marker: the client's whole tree is not the step.
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
        """The step's leader on this node and its descendants (empty until it is found)."""
        pid = self.pid
        if pid is None or self._client.returncode is not None:
            return []
        return self._client.tree(pid)


class PyxisLauncher:
    """Processes as nested ``srun --overlap`` steps of the agent's job, in pyxis containers."""

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

    async def start(self, spec: LaunchSpec) -> PyxisStep:
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
        child = Child(argv, env, None)  # the step's cwd is --chdir / --container-workdir
        try:
            step = await self._find_step(child, step_name)
            if step is not None:
                child.attach_lifeline(_LIFELINE_STEP, [step], env=self._watcher_env())
            elif child.returncode is None:
                child.attach_lifeline()
            # else: the step already ended and was reaped while we looked for it; a watcher now
            # would outlive it with nobody to reap it.
        except BaseException:
            await child.abandon()
            raise
        return PyxisStep(self, child, marker, step, since)

    def _watcher_env(self) -> dict[str, str]:
        env = {"PATH": self.client_env.get("PATH", os.defpath)}
        scancel_dir = os.path.dirname(shutil.which(self.scancel_bin, path=env["PATH"]) or "")
        if scancel_dir:
            env["PATH"] = scancel_dir + os.pathsep + env["PATH"]
        for key in ("SLURM_CONF",):
            if key in self.client_env:
                env[key] = self.client_env[key]
        return env

    async def _find_step(self, child: Child, step_name: str) -> str | None:
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
