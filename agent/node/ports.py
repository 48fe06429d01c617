"""Choosing ports on this node: probed bindable on IPv4 *and* ``::``, skipping peers' ports.

TileRT binds ``('::', port)`` dual-stack, so a port free on 0.0.0.0 but taken on ``::`` would
still fail it. A probe cannot reserve a port for an engine that binds minutes later; the supervisor
handles the rare loss (address in use before the first healthy answer -> new ports, new record).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Collection

MAX_PORT = 65535


def is_bindable(port: int) -> bool:
    """Whether ``port`` can be bound now on 0.0.0.0 and on ``::`` (where IPv6 exists)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            if exc.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                continue  # no IPv6 on this node: nothing to collide with
            raise
        with sock:
            # SO_REUSEADDR, as uvicorn (vLLM, TileRT, the router) and hypercorn set it: a port
            # whose old connections linger in TIME_WAIT is free for them, and must be for us too.
            # A port another socket listens on still fails this bind.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def choose_port(start: int, avoid: Collection[int] = (), *, limit: int = 2000) -> int:
    """The first bindable port at or above ``start`` that is not in ``avoid``."""
    port = start
    while port <= min(MAX_PORT, start + limit):
        if port not in avoid and is_bindable(port):
            return port
        port += 1
    raise OSError(f"no free port in {start}..{start + limit} on this node")


def choose_ports(
    bases: dict[str, int], avoid: Collection[int] = (), offset: int = 0
) -> dict[str, int]:
    """One free port per name, starting at ``base + offset``, all distinct."""
    taken = set(avoid)
    chosen: dict[str, int] = {}
    for name, base in bases.items():
        port = choose_port(base + offset, taken)
        chosen[name] = port
        taken.add(port)
    return chosen
