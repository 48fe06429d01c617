"""Free loopback ports for test servers (Slurm daemons, Prometheus, exporters, routers).

Ports are drawn at random below the kernel's ephemeral range (``ip_local_port_range``) and
checked with the agent's own rule (bindable on the IPv4 wildcard and on ``::``, because slurmd
binds the wildcard). Not from the ephemeral range: a port the kernel handed out (bind to port 0)
and we gave back is the kind it gives the next outgoing connection, and a server binding it a
second later then fails with "address in use" by chance (seen with a cell's router). The job
port bases of ``tests.kit.jobs.isolated_sets`` sit at 20000-29999: these stay below them.
"""

from __future__ import annotations

import random
from pathlib import Path

from agent.node.ports import is_bindable

LOW, HIGH = 10000, 20000
_TRIES = 200
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ceiling() -> int:
    """The first port not to draw from: the ephemeral range's start, at most ``HIGH``."""
    try:
        start = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return HIGH
    return HIGH if start <= LOW else min(HIGH, start)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free on 127.0.0.1 (and on the wildcard) right now."""
    chosen: list[int] = []
    ceiling = _ceiling()
    for _ in range(_TRIES):
        port = random.randrange(LOW, ceiling)
        if port not in chosen and is_bindable(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"could not find {count} free loopback ports in {LOW}-{ceiling - 1}")


def free_port() -> int:
    """One port that is free on 127.0.0.1 (and on the wildcard) right now."""
    return free_ports(1)[0]
