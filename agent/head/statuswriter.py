"""The head's two files for others: ``status.json`` (users, ``tilert-submit status``) and
``targets.json`` (Prometheus' file_sd list of every agent's ``/metrics``).

status.json is written on every change and, as a heartbeat, every 5 s even when nothing changed
(readers tell a live head from a dead one by ``updated_at``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec
import trio

from agent.job.atomicfile import write_atomic
from agent.job.paths import JobDir
from agent.job.records import JobStatus, RendezvousRecord

STATUS_REFRESH_S = 5.0


def read_local_supervisor(job: JobDir) -> tuple[int | None, float | None]:
    """The ``--local`` supervisor's pid and start time, recorded before it started any agent."""
    try:
        status = job.read_status()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    return status.local_pid, status.local_started_at


class StatusWriter:
    """Writes ``snapshot()`` to status.json when it changed, and every 5 s (``heartbeat``)."""

    def __init__(self, job: JobDir, snapshot: Callable[[], JobStatus]) -> None:
        self.job = job
        self.snapshot = snapshot
        self._written = b""

    def write(self, *, force: bool = False) -> None:
        """Write status.json if its content changed (``updated_at`` aside), or when ``force``."""
        status = self.snapshot()
        content = msgspec.json.encode(msgspec.structs.replace(status, updated_at=0.0))
        if force or content != self._written:
            self._written = content
            self.job.write_status(status)

    async def heartbeat(self) -> None:
        """Rewrite status.json every ``STATUS_REFRESH_S`` (runs forever)."""
        while True:
            await trio.sleep(STATUS_REFRESH_S)
            self.write(force=True)

    def write_targets(self, records: Mapping[str, RendezvousRecord]) -> None:
        """targets.json: one ``host:port`` per agent that published its record, labelled
        ``agent``."""
        targets = []
        for name, record in records.items():
            hostport = record.metrics_url.split("//", 1)[1].split("/", 1)[0]
            # No role/node/slurm_job_id here: the pages carry them (docs/design.md, Observability).
            targets.append({"targets": [hostport], "labels": {"agent": name}})
        write_atomic(self.job.targets, msgspec.json.encode(targets) + b"\n", mode=0o644)
