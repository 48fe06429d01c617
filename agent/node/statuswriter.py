"""The head's two files for others: ``status.json`` (users, ``tilert-submit status``) and
``targets.json`` (Prometheus' file_sd list of every agent's ``/metrics``).

status.json is written on every change and, as a heartbeat, every 5 s even when nothing changed
(readers tell a live head from a dead one by ``updated_at``). A write that fails (full disk,
read-only or removed job directory) never stops the head: ``JobWrites`` retries it and the head's
``/status`` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import msgspec
import trio

from agent.job.atomicfile import write_atomic
from agent.job.paths import JobDir
from agent.job.records import JobStatus, RendezvousRecord
from agent.job.urls import front_url
from agent.node.jobwrites import JobWrites

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

    def __init__(self, job: JobDir, snapshot: Callable[[], JobStatus], writes: JobWrites) -> None:
        self.job = job
        self.snapshot = snapshot
        self.writes = writes
        self._written = b""

    def write(self, *, force: bool = False) -> None:
        """Write status.json if its content changed (``updated_at`` aside), or when ``force``."""
        if force or self._content(self.snapshot()) != self._written:
            self.writes.write(str(self.job.status), self._write_now)

    @staticmethod
    def _content(status: JobStatus) -> bytes:
        return msgspec.json.encode(msgspec.structs.replace(status, updated_at=0.0))

    def _write_now(self) -> None:
        # The latest snapshot, also when retried: a retry must not write an older state.
        status = self.snapshot()
        self.job.write_status(status)
        self._written = self._content(status)

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
            hostport = urlsplit(record.metrics_url).netloc
            if not hostport:
                continue  # an agent that exited before it had an endpoint
            # No role/node/slurm_job_id here: the pages carry them (docs/design.md, Observability).
            labels = {"agent": name}
            if "front" in record.ports:  # the head's: where the job's clients go (agent.front)
                labels["front_url"] = front_url(record.address, record.ports["front"])
            targets.append({"targets": [hostport], "labels": labels})
        data = msgspec.json.encode(targets) + b"\n"
        self.writes.write(
            str(self.job.targets), lambda: write_atomic(self.job.targets, data, mode=0o644)
        )
