"""Who this agent is: its index, node name and the address peers reach it on.

Slurm tells us through the environment (one task per node, one step per role group, so
``SLURM_PROCID`` is the index within the role); outside Slurm the flag and the hostname do.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from agent.errors import BadInput
from agent.job.names import HEAD_NAME, agent_name
from agent.job.vocab import Role


@dataclass(frozen=True)
class Identity:
    """Who this agent is: its role and index, the node it runs on and the address peers use."""

    role: Role
    index: int
    node: str
    address: str
    slurm_job_id: str | None

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``."""
        return agent_name(self.role, self.index)

    @property
    def is_head(self) -> bool:
        """The head agent (prefill-0) gates and runs the router."""
        return self.name == HEAD_NAME


class IdentityError(BadInput):
    """The environment does not say who we are (a user-facing error, exit 2)."""


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface; ``lo`` is 127.0.0.1."""
    if interface == "lo":
        return "127.0.0.1"
    addrs = psutil.net_if_addrs().get(interface)
    if not addrs:
        known = ", ".join(sorted(psutil.net_if_addrs())) or "none"
        raise IdentityError(
            f"network_interface {interface!r} (cluster file) does not exist on this node; "
            f"interfaces here: {known}"
        )
    for addr in addrs:
        if addr.family == socket.AF_INET:
            return addr.address
    raise IdentityError(
        f"network_interface {interface!r} (cluster file) has no IPv4 address on this node; "
        "TileRT's tilert_host must be a bare IPv4 address"
    )


def resolve_identity(
    role: Role,
    index: int | None,
    network_interface: str | None,
    env: Mapping[str, str] = os.environ,
) -> Identity:
    """Work out index, node and address from the flag, Slurm's environment and the interface."""
    if index is None:
        procid = env.get("SLURM_PROCID")
        if procid is not None:
            try:
                index = int(procid)
            except ValueError:
                raise IdentityError(f"SLURM_PROCID={procid!r} is not a number") from None
        else:
            index = 0
    if index < 0:
        raise IdentityError(f"--index must be >= 0, got {index}")
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if network_interface:
        address = interface_address(network_interface)
    else:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = "127.0.0.1"
    return Identity(role, index, node, address, env.get("SLURM_JOB_ID"))
