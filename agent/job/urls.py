"""The job's HTTP addresses, built in one place: an engine's or an agent's base URL, the router's
(``agent.router_port`` on the head's node) and the front door's (its bound port).

Plain ``http://host:port``: every address is on the cluster's network, given as the node's
address (``agent.node.identity``) or a record's.
"""

from __future__ import annotations

from agent.job.plan import Plan


def base_url(host: str, port: int) -> str:
    """``http://host:port``, the base every path of a process on ``port`` hangs from."""
    return f"http://{host}:{port}"


def router_url(address: str, plan: Plan) -> str:
    """The serving router's base URL on the head's node (``address``)."""
    return base_url(address, plan.router.port)


def front_url(address: str, port: int) -> str:
    """The front door's base URL (``agent.front.port``, probed upward at the head's start)."""
    return base_url(address, port)
