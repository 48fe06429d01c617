"""Rendezvous by file: each agent publishes ``J/rendezvous/<name>.json``; the head reads them all.

Files tell who is where (discovery); live health travels over each agent's HTTP ``/status``,
because shared file systems cache attributes for seconds. Records are written atomically, yet an
NFS client can still show a half-written one for a moment, and anyone can drop a file into the
folder: a reader trusts nothing it finds there. One bad file makes at most that agent's record
bad, never the folder: a record is read only as a regular file under ``MAX_RECORD_BYTES``, never
through a symbolic link, and only under its own agent's name; a file no expected agent would write
is ignored; an unreadable record is retried for ``RECORD_RETRY_S`` before it counts.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio

from agent.errors import RuntimeFailure
from agent.job.atomicfile import is_temp_name, write_atomic
from agent.job.names import parse_agent_name
from agent.job.paths import JobDir
from agent.job.records import RECORD_SCHEMA, RendezvousRecord
from agent.problems import printable

# A record is a few hundred bytes; anything much larger is not one (and is not read whole).
MAX_RECORD_BYTES = 64 * 1024
# How long an unreadable record is read again before it counts (an NFS client may show a record
# half-written, or not yet replaced, for about its attribute cache time).
RECORD_RETRY_S = 3.0
WATCH_INTERVAL_S = 0.1


class RecordProblem(RuntimeFailure):
    """A file in the rendezvous folder that is not a usable record; the message names the file."""


def write_record(job: JobDir, record: RendezvousRecord) -> None:
    """Publish (or replace) this agent's record, stamping ``updated_at``."""
    record.updated_at = time.time()
    data = msgspec.to_builtins(record)
    if data.get("exited") is None:
        data.pop("exited", None)  # a running agent's record has no last word
    write_atomic(job.record(record.name), msgspec.json.encode(data), mode=0o644)


def _read_bytes(path: Path) -> bytes:
    """The content of a regular file, never through a symbolic link and never past the limit."""
    # O_NONBLOCK: a FIFO planted under a record's name must not block the head on open.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RecordProblem(
                f"{path}: a symbolic link, not followed (an agent writes its record as a file)"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecordProblem(f"{path}: not a regular file")
        data = f.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordProblem(f"{path}: larger than {MAX_RECORD_BYTES} bytes, not a record")
    return data


def read_record(path: Path, name: str) -> RendezvousRecord:
    """The record of agent ``name`` at ``path``, or ``RecordProblem`` saying what is wrong with it.

    ``FileNotFoundError`` when it is gone (not a problem: the agent has not written it yet).
    """
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RecordProblem(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not data.strip():
        raise RecordProblem(f"{path}: empty")
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # "[[[[..." nests past msgspec's limit
        raise RecordProblem(f"{path}: not JSON, or cut short ({exc})") from None
    schema = raw.get("schema") if isinstance(raw, dict) else None
    if schema != RECORD_SCHEMA:
        raise RecordProblem(
            f"{path}: rendezvous record schema {repr(schema)[:40]}, this agent reads "
            f"{RECORD_SCHEMA}; every agent of a job must run the same tilert-agent version"
        )
    try:
        record = msgspec.convert(raw, RendezvousRecord)
    except msgspec.ValidationError as exc:
        raise RecordProblem(f"{path}: malformed rendezvous record ({exc})") from None
    if record.name != name:
        raise RecordProblem(
            f"{path}: the record of '{printable(record.name)}', not of {name}; a record counts "
            "only under its own agent's name"
        )
    if parse_agent_name(name) != (record.role, record.index):
        raise RecordProblem(
            f"{path}: says role '{printable(record.role)}' index {record.index}, which is not "
            f"{name}"
        )
    return record


@dataclass
class Records:
    """What the rendezvous folder holds now: valid records and problems by agent name, and the
    files no expected agent would write (ignored)."""

    by_name: dict[str, RendezvousRecord] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    strays: list[str] = field(default_factory=list)


def read_records(job: JobDir, expected: Collection[str]) -> Records:
    """Read the record of every ``expected`` agent present; never raises for a bad file."""
    result = Records()
    try:
        entries = sorted(os.listdir(job.rendezvous))
    except OSError:
        return result  # not created yet, or the job directory is gone: nothing to read
    for entry in entries:
        if is_temp_name(entry):
            continue
        name, dot, suffix = entry.rpartition(".")
        if not dot or suffix != "json":
            continue
        if name not in expected:
            result.strays.append(printable(entry))
            continue
        try:
            result.by_name[name] = read_record(job.rendezvous / entry, name)
        except FileNotFoundError:
            continue  # replaced or removed between listing and reading
        except RecordProblem as exc:
            result.problems[name] = str(exc)
    return result


class RecordRetry:
    """Which record problems count: those that lasted ``retry_s``; until then an agent keeps its
    last good record (an NFS reader may see a record half-written for a moment)."""

    def __init__(self, retry_s: float = RECORD_RETRY_S) -> None:
        self.retry_s = retry_s
        self._good: dict[str, RendezvousRecord] = {}
        self._bad_since: dict[str, float] = {}

    def take(self, found: Records, now: float) -> Records:
        """What the folder says once transient problems are set aside."""
        result = Records(strays=found.strays)
        for name, record in found.by_name.items():
            self._good[name] = record
            self._bad_since.pop(name, None)
        for name in list(self._bad_since):
            if name not in found.problems:
                del self._bad_since[name]  # gone: not bad any more
        for name, problem in found.problems.items():
            since = self._bad_since.setdefault(name, now)
            if now - since >= self.retry_s:
                result.problems[name] = problem
        result.by_name = dict(self._good)
        return result


async def watch_records(
    job: JobDir,
    expected: Collection[str],
    on_change: Callable[[Records], None],
    *,
    interval_s: float = WATCH_INTERVAL_S,
    retry_s: float = RECORD_RETRY_S,
) -> None:
    """Call ``on_change`` with the records whenever what they say changes (runs forever).

    A record that cannot be read is retried for ``retry_s`` before it is reported; meanwhile its
    agent keeps its last good record.
    """
    retry = RecordRetry(retry_s)
    last: bytes | None = None
    while True:
        records = retry.take(read_records(job, expected), trio.current_time())
        fingerprint = msgspec.json.encode(
            [
                sorted((n, r.updated_at, r.ports, r.exited) for n, r in records.by_name.items()),
                sorted(records.problems.items()),
                records.strays,
            ]
        )
        if fingerprint != last:
            last = fingerprint
            on_change(records)
        await trio.sleep(interval_s)
