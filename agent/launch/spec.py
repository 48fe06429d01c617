"""The launcher contract: what to start (``LaunchSpec``), what comes back (``ProcessHandle``).

Both backends (``process``, ``pyxis``) implement ``Launcher`` and hand out a ``ProcessHandle``;
the supervisor, the head and the local runner see nothing else. docs/launchers.md says what each
backend guarantees behind this contract.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import trio

from agent.errors import RuntimeFailure

# ``Launcher.run`` keeps the first MiB of a command's output: any preflight report fits, and a
# runaway command cannot fill the agent's memory.
RUN_OUTPUT_LIMIT = 1 << 20

# Source the setup script, then become the program: `exec` keeps the pid, so the leader is still
# the program itself. The argv is saved first because a sourced script sees (and may change) "$@".
_SETUP_WRAPPER = (
    '__tilert_setup=$1; shift; __tilert_argv=("$@"); set --; '
    '. "$__tilert_setup" && exec "${__tilert_argv[@]}"'
)


def exit_description(code: int, noun: str = "code") -> str:
    """How a process ended, from its return code: ``exited with code 1`` (or ``status``, the
    ``noun``), ``was killed by SIGKILL`` (a negative code is a signal, as Python reports it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with {noun} {code}"


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
    # pyxis: container flags of the recipe (agent.pyxis_flags: --container-writable, ...).
    container_flags: tuple[str, ...] = ()


class ProcessHandle(Protocol):
    """One process a launcher started (an engine, the router, a preflight, a local agent)."""

    @property
    def pid(self) -> int | None:
        """The process's own leader (pyxis: None until it is found on this node)."""
        ...

    output: trio.abc.ReceiveStream

    @property
    def returncode(self) -> int | None:
        """The exit status once ended: a code, or -signal like subprocess."""
        ...

    async def wait(self) -> int:
        """Wait for the process to end; its exit status."""
        ...

    async def stop(self, grace_s: float) -> int:
        """SIGTERM, ``grace_s``, SIGKILL, reap, sweep leftovers; idempotent; the exit status."""
        ...

    def kill(self) -> None:
        """SIGKILL everything now (synchronous, for emergencies)."""
        ...

    def descendants(self) -> list[psutil.Process]:
        """The process tree on this node (leader first), for CPU and memory metrics."""
        ...


class Launcher(Protocol):
    """Starts processes (engines, the router), and short commands the same way (the preflight)."""

    name: str

    async def start(self, spec: LaunchSpec) -> ProcessHandle:
        """Start the process described by ``spec``."""
        ...

    async def run(self, spec: LaunchSpec, *, timeout_s: float) -> tuple[int, bytes]:
        """Run a short command to its end; its status and merged output (RunTimeout at timeout)."""
        ...


class RunTimeout(RuntimeFailure, TimeoutError):
    """A ``Launcher.run`` command outlived its timeout and was killed; ``output``: what it said."""

    def __init__(self, spec: LaunchSpec, timeout_s: float, output: bytes) -> None:
        super().__init__(f"{spec.name}: still running after {timeout_s:g}s; killed")
        self.output = output


def setup_wrapped_argv(spec: LaunchSpec) -> list[str]:
    """The argv to exec: the spec's own, or bash sourcing the setup script then exec'ing it."""
    if spec.setup_script is None:
        return list(spec.argv)
    return ["bash", "-c", _SETUP_WRAPPER, "tilert-setup", str(spec.setup_script), *spec.argv]


async def run_to_end(
    launcher: Launcher, spec: LaunchSpec, *, timeout_s: float
) -> tuple[int, bytes]:
    """Start ``spec`` through ``launcher``, collect its output, kill it at ``timeout_s``."""
    process = await launcher.start(spec)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        while True:
            try:
                data = await process.output.receive_some(65536)
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
                await process.wait()
                # The group is gone, so EOF is due; a stray escaped holder must not stall us.
                with trio.move_on_after(2.0):
                    await read_done.wait()
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            with trio.CancelScope(shield=True):
                await process.stop(0)
            raise RunTimeout(spec, timeout_s, b"".join(chunks))
        return process.returncode if process.returncode is not None else -1, b"".join(chunks)
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                await process.stop(0)
            await process.output.aclose()
