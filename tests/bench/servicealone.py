"""The service front in a process of its own, its one cell a running job: the service front's
own cost beside the front door's (``tests/bench/frontcost.py``, "service front + cell").
``python -m tests.bench.servicealone PORT JOB_DIR``: the same ``ServiceFront`` that
``tilert-submit serve`` runs, its table one ``ready`` cell, the job at ``JOB_DIR`` (its front door
and its ready decodes, read once from its status.json as the cell keeper reads them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import trio

from agent.job.frontpolicy import FrontPolicy
from agent.job.paths import JobDir
from agent.service.figures import ServiceFigures
from agent.service.front import ServiceFront
from agent.service.keeper import ready_decodes
from agent.service.records import CellRecord
from agent.web.server import bound_socket


def cell(job: Path) -> CellRecord:
    """The job at ``job`` as the keeper puts a ready cell in the table."""
    status = JobDir(job).read_status()
    if status.front_url is None:
        raise SystemExit(f"{job}: status.json has no front_url (the job has no front door)")
    return CellRecord(
        name="cell-1", state="ready", front_url=status.front_url, decodes=ready_decodes(status)
    )


async def main(port: int, job: Path) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    front = ServiceFront(FrontPolicy(), ServiceFigures())
    front.set_cells([cell(job)])
    await front.run(bound_socket("127.0.0.1", port))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("job", type=Path)
    args = parser.parse_args()
    trio.run(main, args.port, args.job)
