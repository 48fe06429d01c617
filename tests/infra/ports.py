"""Free loopback ports for test servers (Slurm daemons, Prometheus, exporters).

The kernel picks each port (bind to port 0); all sockets of one round stay open until the round
ends, so one call never returns the same port twice. Each port is then checked with the agent's
own rule (bindable on the IPv4 wildcard and on ``::``), because slurmd binds the wildcard.
"""

from __future__ import annotations

import contextlib
import socket

from agent.node.ports import is_bindable

_ROUNDS = 20


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free on 127.0.0.1 (and on the wildcard) right now."""
    chosen: list[int] = []
    for _ in range(_ROUNDS):
        picked: list[int] = []
        with contextlib.ExitStack() as stack:
            for _ in range(count - len(chosen)):
                sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                sock.bind(("127.0.0.1", 0))
                picked.append(sock.getsockname()[1])
        chosen += [p for p in picked if p not in chosen and is_bindable(p)]
        if len(chosen) >= count:
            return chosen[:count]
    raise OSError(f"could not find {count} free loopback ports")


def free_port() -> int:
    """One port that is free on 127.0.0.1 (and on the wildcard) right now."""
    return free_ports(1)[0]
