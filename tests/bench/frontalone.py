"""The front door alone in a process of its own, before one upstream URL: the events per second
one front process sustains (``tests/bench/frontcost.py``) without a head beside it.
``python -m tests.bench.frontalone PORT UPSTREAM_URL [--slots N] [--hypercorn]``: the same
``Front`` the head runs (admission, retries, the stream watch), its router always serving at
``UPSTREAM_URL``; ``--hypercorn``: served by hypercorn (``agent/web/server.py``) instead of the
fronts' own server (``agent/web/h11server.py``), to measure one beside the other.
"""

from __future__ import annotations

import argparse

import trio

from agent.front import Front, FrontFigures, RouterNow
from agent.job.frontpolicy import FrontPolicy
from agent.web import server
from agent.web.server import bound_socket


async def main(port: int, upstream: str, slots: int, hypercorn: bool) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    now = RouterNow(upstream, serving=True)
    front = Front(
        model="m",
        policy=FrontPolicy(),
        router=lambda: now,
        figures=FrontFigures(None, {"job": "bench"}),
        capacity=lambda: slots,
    )
    sock = bound_socket("127.0.0.1", port)
    if not hypercorn:
        await front.run(sock)
        return
    async with front.connected():
        await server.serve(front.app, sock)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("upstream")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--hypercorn", action="store_true")
    args = parser.parse_args()
    trio.run(main, args.port, args.upstream, args.slots, args.hypercorn)
