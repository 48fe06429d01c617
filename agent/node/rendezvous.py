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
import math
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
# Once no record has changed for WATCH_QUIET_S (a job that is up: its agents rewrite their records
# only when they restart, rejoin or leave), the folder is looked at every WATCH_IDLE_INTERVAL_S: a
# look ten times a second was half of an idle head's CPU (docs/performance.md, "An idle head").
# The head learns of a peer's death from its status connection, not from the folder, so only a
# rejoining agent's new ports wait for the slower look (at most 0.5 s beside its engine's start).
WATCH_QUIET_S = 5.0
WATCH_IDLE_INTERVAL_S = 0.5


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


# The folder is looked at every WATCH_INTERVAL_S, yet records are read only when something may have
# changed (docs/performance.md, "The head at scale"): the folder's own stat first (agents
# write by rename, which changes it), every file's stat (inode, size, mtime_ns) when it changed,
# was changed within RECENT_S (a file system's time stamps are coarse: two renames within one
# tick leave the same mtime) or every STAT_PASS_S (a file rewritten in place changes only its
# own stat), and every record read again every FULL_PASS_S whatever the stats say (an NFS client
# caches attributes for seconds, `actimeo`, and may show an old size and mtime).
STAT_PASS_S = 2.0
FULL_PASS_S = 10.0
RECENT_S = 1.0

_Key = tuple[int, int, int]  # a file's inode, size and mtime_ns


def _read_outcome(path: Path, name: str) -> RendezvousRecord | str | None:
    """The record at ``path``, or its problem; None when it is gone."""
    try:
        return read_record(path, name)
    except FileNotFoundError:
        return None  # replaced or removed between listing and reading
    except RecordProblem as exc:
        return str(exc)


class RecordReader:
    """Reads the rendezvous folder again and again, re-reading a record only when its file may
    have changed; ``read`` says whether anything did."""

    def __init__(self, job: JobDir, expected: Collection[str]) -> None:
        self.job = job
        self.expected = set(expected)
        self._path = str(job.rendezvous)  # as text: a Path joined per file per look is costly
        self._folder: tuple[int, int] | None = None
        self._seen: dict[str, tuple[_Key, RendezvousRecord | str]] = {}
        self._strays: list[str] = []
        self._stat_at = -math.inf
        self._full_at = -math.inf
        self._result: Records | None = None

    def expect(self, names: Collection[str]) -> None:
        """Take the records of ``names`` too (a decode joining the pool); looked at next read."""
        self.expected.update(names)
        self._folder = None

    def read(self, now: float) -> tuple[Records, bool]:
        """What the folder holds (``now`` on a monotonic clock), and whether it changed since the
        last read."""
        full = now - self._full_at >= FULL_PASS_S
        try:
            st = os.stat(self._path)
        except OSError:
            changed = bool(self._seen or self._strays)
            self._folder, self._seen, self._strays, self._result = None, {}, [], None
            return Records(), changed  # not created yet, or the job directory is gone
        folder = (st.st_ino, st.st_mtime_ns)
        recent = time.time() - st.st_mtime < RECENT_S
        if full or recent or folder != self._folder or now - self._stat_at >= STAT_PASS_S:
            self._folder, self._stat_at = folder, now
            if full:
                self._full_at = now
            changed = self._scan(full)
        else:
            changed = False
        if changed or self._result is None:
            self._result = self._records()
        return self._result, changed

    def _scan(self, full: bool) -> bool:
        try:
            entries = sorted(os.listdir(self._path))
        except OSError:
            entries = []
        changed = False
        seen: dict[str, tuple[_Key, RendezvousRecord | str]] = {}
        strays: list[str] = []
        for entry in entries:
            if is_temp_name(entry):
                continue
            name, dot, suffix = entry.rpartition(".")
            if not dot or suffix != "json":
                continue
            if name not in self.expected:
                strays.append(printable(entry))
                continue
            path = os.path.join(self._path, entry)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            before = self._seen.get(name)
            if before is not None and before[0] == key and not full:
                seen[name] = before
                continue
            outcome = _read_outcome(Path(path), name)
            if outcome is None:
                continue
            seen[name] = (key, outcome)
            changed = changed or before is None or before[1] != outcome
        changed = changed or seen.keys() != self._seen.keys() or strays != self._strays
        self._seen, self._strays = seen, strays
        return changed

    def _records(self) -> Records:
        result = Records(strays=list(self._strays))
        for name, (_, outcome) in self._seen.items():
            if isinstance(outcome, str):
                result.problems[name] = outcome
            else:
                result.by_name[name] = outcome
        return result


def read_records(job: JobDir, expected: Collection[str]) -> Records:
    """Read the record of every ``expected`` agent present; never raises for a bad file."""
    return RecordReader(job, expected).read(0.0)[0]


class RecordRetry:
    """Which record problems count: those that lasted ``retry_s``; until then an agent keeps its
    last good record (an NFS reader may see a record half-written for a moment)."""

    def __init__(self, retry_s: float = RECORD_RETRY_S) -> None:
        self.retry_s = retry_s
        self._good: dict[str, RendezvousRecord] = {}
        self._bad_since: dict[str, float] = {}

    @property
    def pending(self) -> bool:
        """Whether a problem is waiting out its retry (it may count at the next look)."""
        return bool(self._bad_since)

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
    idle_interval_s: float = WATCH_IDLE_INTERVAL_S,
    retry_s: float = RECORD_RETRY_S,
    reader: RecordReader | None = None,
) -> None:
    """Call ``on_change`` with the records whenever what they say changes (runs forever).

    A record that cannot be read is retried for ``retry_s`` before it is reported; meanwhile its
    agent keeps its last good record. Records are read again only when their files may have
    changed (``RecordReader``); every ``interval_s``, every ``idle_interval_s`` once nothing has
    changed for ``WATCH_QUIET_S``.
    """
    # A caller that passes its reader may make it expect more agents meanwhile.
    reader = reader if reader is not None else RecordReader(job, expected)
    retry = RecordRetry(retry_s)
    last: bytes | None = None
    changed_at = trio.current_time()
    while True:
        now = trio.current_time()
        found, changed = reader.read(now)
        if changed:
            changed_at = now
        # Unchanged files and no problem waiting out its retry: nothing to tell.
        if changed or retry.pending or last is None:
            records = retry.take(found, now)
            fingerprint = msgspec.json.encode(
                [
                    sorted(
                        (n, r.updated_at, r.ports, r.exited) for n, r in records.by_name.items()
                    ),
                    sorted(records.problems.items()),
                    records.strays,
                ]
            )
            if fingerprint != last:
                last = fingerprint
                on_change(records)
        quiet = now - changed_at >= WATCH_QUIET_S and not retry.pending
        await trio.sleep(max(idle_interval_s, interval_s) if quiet else interval_s)
