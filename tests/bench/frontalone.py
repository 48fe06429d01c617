"""The front door alone in a process of its own, before one upstream URL: the events per second
one front process sustains (``tests/bench/frontcost.py``) without a head beside it.
``python -m tests.bench.frontalone PORT UPSTREAM_URL [--slots N]``: the same ``Front`` the head
runs (admission, retries, the stream watch), its router always serving at ``UPSTREAM_URL``.
"""

from __future__ import annotations

import argparse

import trio

from agent.front import Front, FrontFigures, RouterNow
from agent.job.frontpolicy import FrontPolicy
from agent.web.server import bound_socket


async def main(port: int, upstream: str, slots: int) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    now = RouterNow(upstream, serving=True)
    front = Front(
        model="m",
        policy=FrontPolicy(),
        router=lambda: now,
        figures=FrontFigures(None, {"job": "bench"}),
        capacity=lambda: slots,
    )
    await front.run(bound_socket("127.0.0.1", port))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("upstream")
    parser.add_argument("--slots", type=int, default=256)
    args = parser.parse_args()
    trio.run(main, args.port, args.upstream, args.slots)
