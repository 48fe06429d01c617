"""Launch: how the agent starts, watches and stops the processes it runs on its node.

One contract, two backends, chosen by the cluster file (``launcher: process|pyxis``); what each
guarantees, and why, is in docs/launchers.md:

- ``spec``: the contract: ``LaunchSpec`` (what to run), ``Launcher`` (starts it),
  ``ProcessHandle`` (what a start gives back), ``RunTimeout``, the setup-script wrapper;
- ``child``: what both backends share: a child forked from the main thread with PDEATHSIG, its
  exit awaited through a pidfd, a lifeline that kills it when the agent dies, the tree sweep;
- ``process``: ``ProcessLauncher``, whose handles are ``LocalProcess`` (a plain child of the agent);
- ``pyxis``: ``PyxisLauncher``, whose handles are ``PyxisStep`` (a nested ``srun --overlap`` step
  of the agent's job, in a pyxis container, stopped with ``scancel``).

Beside the launchers, and imported as modules: ``jobspecs`` (the job's launch specs: mounts,
container env, setup script; ``SpecBuilder``, the one type of a spec builder), ``commands`` (each
engine's argv and environment),
``scratch`` (each engine's own temp and cache folders), ``preflight`` (seconds-long checks through
the same launcher before the long load), ``enginechecks`` (what the preflight checks for an engine,
and the TileRT connector stand-in decision) and ``interpreter`` (which Python runs a program).

Words: an *engine* is the server a role runs (vLLM prefill, TileRT decode); the recipe's
``engine`` key names its *engine type*. A *process handle* is what a launcher returns for anything
it starts: an engine, the router, a preflight, or (``--local``) an agent. The handle is never
called an engine here.

May import: the standard library, trio, psutil, msgspec, and ``agent.facts``, ``agent.problems``,
``agent.errors``, ``agent.job`` (commands reads the plan); nothing of ``agent.recipe``,
``agent.standins`` (the stand-ins are run by module name, and ``agent.facts`` says where the
connector stand-in lies), ``agent.node`` or above.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from agent.launch.process import LocalProcess, ProcessLauncher
    from agent.launch.pyxis import PyxisLauncher, PyxisStep
    from agent.launch.spec import Launcher, LaunchSpec, ProcessHandle, RunTimeout

__all__ = [
    "LaunchSpec",
    "Launcher",
    "LocalProcess",
    "ProcessHandle",
    "ProcessLauncher",
    "PyxisLauncher",
    "PyxisStep",
    "RunTimeout",
    "make_launcher",
]

# Imported on first use: ``tilert-submit --dry-run`` reads ``commands`` (the engines' argv) and
# must not pay for trio and psutil, which the launchers need (~100 ms of its ~250 ms).
_HOMES = {
    "LocalProcess": "agent.launch.process",
    "ProcessLauncher": "agent.launch.process",
    "PyxisLauncher": "agent.launch.pyxis",
    "PyxisStep": "agent.launch.pyxis",
    "Launcher": "agent.launch.spec",
    "LaunchSpec": "agent.launch.spec",
    "ProcessHandle": "agent.launch.spec",
    "RunTimeout": "agent.launch.spec",
}


def __getattr__(name: str) -> Any:
    """The launch names, each imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def make_launcher(
    kind: Literal["process", "pyxis"], *, slurm_job_id: str | None, node: str | None
) -> Launcher:
    """The launcher the cluster file names (``launcher: process|pyxis``)."""
    if kind == "process":
        from agent.launch.process import ProcessLauncher

        return ProcessLauncher()
    if kind == "pyxis":
        if not slurm_job_id or not node:
            raise ValueError(
                "launcher: pyxis needs a Slurm job (SLURM_JOB_ID) and this node's name "
                "(SLURMD_NODENAME); run the agent inside the job, or set launcher: process "
                "in the cluster file"
            )
        from agent.launch.pyxis import PyxisLauncher

        return PyxisLauncher(slurm_job_id, node)
    raise ValueError(f"unknown launcher {kind!r}: use process or pyxis (cluster file key launcher)")
