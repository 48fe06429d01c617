"""Rendezvous by file: each agent publishes ``J/rendezvous/<name>.json``; the head reads them all.

Files tell who is where (discovery); live health travels over each agent's HTTP ``/status``,
because shared file systems cache attributes for seconds. Records are written atomically, so a
reader never sees half of one; temp files are skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import trio

from agent.job.atomicfile import is_temp_name, write_atomic
from agent.job.paths import JobDir
from agent.job.records import RECORD_SCHEMA, RendezvousRecord

log = logging.getLogger(__name__)


def write_record(job: JobDir, record: RendezvousRecord) -> None:
    """Publish (or replace) this agent's record, stamping ``updated_at``."""
    record.updated_at = time.time()
    write_atomic(job.record(record.name), msgspec.json.encode(record), mode=0o644)


@dataclass
class Records:
    """What the rendezvous folder holds now: valid records by name, and readable problems."""

    by_name: dict[str, RendezvousRecord] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def read_records(job: JobDir) -> Records:
    """Read every record; a foreign schema or an unreadable file becomes a problem, not a crash."""
    result = Records()
    try:
        entries = sorted(job.rendezvous.iterdir())
    except FileNotFoundError:
        return result
    for path in entries:
        if is_temp_name(path.name) or path.suffix != ".json":
            continue
        name = path.stem
        try:
            raw = msgspec.json.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            result.problems[name] = f"{path}: unreadable rendezvous record ({exc})"
            continue
        schema = raw.get("schema") if isinstance(raw, dict) else None
        if schema != RECORD_SCHEMA:
            result.problems[name] = (
                f"{path}: rendezvous record schema {schema!r}, this agent reads {RECORD_SCHEMA}; "
                "every agent of a job must run the same tilert-agent version"
            )
            continue
        try:
            result.by_name[name] = msgspec.convert(raw, RendezvousRecord)
        except msgspec.ValidationError as exc:
            result.problems[name] = f"{path}: malformed rendezvous record ({exc})"
    return result


async def watch_records(
    job: JobDir, on_change: Callable[[Records], None], *, interval_s: float = 0.1
) -> None:
    """Call ``on_change`` with the records whenever the folder's content changes (runs forever)."""
    last: bytes | None = None
    while True:
        records = read_records(job)
        fingerprint = msgspec.json.encode(
            [
                sorted((n, r.updated_at, r.ports) for n, r in records.by_name.items()),
                sorted(records.problems.items()),
            ]
        )
        if fingerprint != last:
            last = fingerprint
            on_change(records)
        await trio.sleep(interval_s)
