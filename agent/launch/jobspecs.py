"""The job's launch specs: one builder for every process an agent starts on its node.

The engines, the router, every preflight, the weights converter and the benchmark client get
their ``LaunchSpec`` from a ``JobSpecs``: the job's container mounts (under pyxis also the scratch
root, so the engines' temp and cache folders exist inside their containers), the setup script the
engine's preflight found, and the variables whose values must win over the image's own (pyxis
``--container-env``). The node agent, the head and a convert job all build theirs here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.job.plan import Plan
from agent.launch.commands import MANAGED_ENV
from agent.launch.pyxis import pyxis_flags
from agent.launch.spec import LaunchSpec

# (name, argv, env, image) -> a LaunchSpec with the job's mounts and settings: what the head, the
# weights gate and the benchmark client are handed (a ``JobSpecs``, or a plain one off the job).
SpecBuilder = Callable[[str, list[str], dict[str, str], str | None], LaunchSpec]


class JobSpecs:
    """Builds the LaunchSpecs of one agent's processes from the plan (a ``SpecBuilder``)."""

    def __init__(self, plan: Plan, *, scratch_root: Path) -> None:
        self.plan = plan
        # Set by the node agent once the engine's preflight found it (None: none, or not yet).
        self.setup_script: Path | None = None
        # Under pyxis the image's own value of a variable wins unless it is named: every variable
        # the recipe or the agent sets for an engine.
        self._ours = frozenset(
            {
                *plan.prefill.env,
                *plan.decode.env,
                *plan.router.env,
                *plan.prefill.secret_env,
                *plan.decode.secret_env,
                *plan.router.secret_env,
                *MANAGED_ENV,
                plan.visible_devices_env,
            }
        )
        mounts = tuple(plan.mounts)
        if plan.launcher == "pyxis":
            # The engines' scratch folders must exist inside their containers too.
            mounts += (f"{scratch_root}:{scratch_root}",)
        self.mounts = mounts
        # The recipe's pyxis container flags (agent.pyxis_flags; schema 1's srun_options).
        self.flags = tuple(pyxis_flags(plan))

    def __call__(
        self, name: str, argv: list[str], env: dict[str, str], image: str | None
    ) -> LaunchSpec:
        """A LaunchSpec with the job's mounts and the setup script the preflight found."""
        return LaunchSpec(
            name=name,
            argv=argv,
            env=env,
            image=image,
            mounts=self.mounts,
            setup_script=self.setup_script,
            container_env=tuple(sorted(k for k in self._ours if k in env)),
            container_flags=self.flags,
        )
