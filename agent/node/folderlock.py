"""A lock on a shared file system: a file created with ``O_EXCL``, refreshed while alive, taken
over when stale.

``flock``/``fcntl`` locks are ignored or emulated per client by some NFS, Lustre and GPFS mounts,
and they die silently with a node. What every one of them does honour is an exclusive create
(``open(O_CREAT | O_EXCL)``), an atomic ``rename``, and ``link`` failing when the name exists.

**Holding.** The holder creates the file with ``O_EXCL`` and keeps its descriptor. Every
``heartbeat_s`` it rewrites the content through that descriptor (a beat counter and its progress,
``LockInfo``), after checking that the path still names the inode it created; if not, the lock was
taken over and the holder must stop (``LockLost``). Release unlinks the file; a holder that
failed first writes its verdict into it (``HeldLock.fail``) and keeps it a moment, so that its
waiters read why within a poll or two.

**Staleness** (the rule, docs/weights.md): a waiter reads the file's content on every poll; a lock
whose content has not changed for ``stale_s`` seconds *by the waiter's own clock* is stale. No
clock is compared across nodes, and an ``open`` revalidates an NFS client's cache, so a beat is
seen even through attribute caching. A holder's node that freezes for ``stale_s`` loses its lock.

**Takeover.** The waiter renames the stale file to a name of its own (of several waiters exactly
one rename succeeds), checks that what it renamed is the stale file (same inode, same content),
deletes it, and then competes for the lock with ``O_EXCL`` like anyone else. Had it renamed a
fresh lock instead (the holder beat, or a new holder came, in between), it links it back, which
fails rather than overwrite a newer lock; the holder of a lock lost that way notices at its next
beat.

File system calls here block: call them from a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from agent.errors import RuntimeFailure


class LockInfo(msgspec.Struct, kw_only=True):
    """The lock file's content: who holds it, where it writes, how far it got."""

    token: str
    agent: str
    node: str
    job: str
    pid: int
    # The sibling folder the holder converts into.
    temp: str
    started_at: float
    beat: int = 0
    bytes_written: int = 0
    rate_bytes_s: float = 0.0
    # The holder's verdict when its work failed: written into the lock just before it lets go,
    # so that its waiters know at their next poll instead of guessing from a vanished lock.
    failed: str | None = None


class LockLost(RuntimeFailure):
    """The lock file is no longer ours (it was taken over as stale, or removed)."""


def new_token() -> str:
    """A random identifier for one holder (names its lock and its folders)."""
    return secrets.token_hex(6)


class HeldLock:
    """A lock this process created; ``beat`` it while working, ``release`` it when done."""

    def __init__(self, path: Path, fd: int, info: LockInfo) -> None:
        self.path = path
        self.info = info
        self._fd: int | None = fd
        self._ino = os.fstat(fd).st_ino

    def _owned(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._ino
        except FileNotFoundError:
            return False

    def _write(self) -> None:
        if self._fd is None:
            raise LockLost(f"{self.path} was released")
        data = msgspec.json.encode(self.info)
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.fsync(self._fd)

    def beat(self, *, bytes_written: int, rate_bytes_s: float) -> None:
        """Refresh the lock with the holder's progress; LockLost when it is not ours any more."""
        if not self._owned():
            raise LockLost(f"{self.path} was taken over (it was not refreshed in time) or removed")
        self.info = msgspec.structs.replace(
            self.info,
            beat=self.info.beat + 1,
            bytes_written=bytes_written,
            rate_bytes_s=rate_bytes_s,
        )
        self._write()

    def fail(self, reason: str) -> None:
        """Leave the verdict ``reason`` in the lock (still ours), for the waiters to read."""
        if self._owned():
            self.info = msgspec.structs.replace(self.info, failed=reason)
            self._write()

    def release(self) -> None:
        """Remove the lock if it is still ours; idempotent."""
        if self._fd is None:
            return
        if self._owned():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def try_acquire(path: Path, info: LockInfo) -> HeldLock | None:
    """Create the lock file exclusively; None when it exists (someone holds it, or held it)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    lock = HeldLock(path, fd, info)
    try:
        lock._write()
    except BaseException:
        lock.release()
        raise
    return lock


@dataclass(frozen=True)
class Observed:
    """One reading of a lock file by a waiter."""

    ino: int
    content: bytes
    info: LockInfo | None  # None when the content is unreadable (half-written, or empty)


def observe(path: Path) -> Observed | None:
    """The lock file now, or None when there is none."""
    try:
        with open(path, "rb") as f:
            ino = os.fstat(f.fileno()).st_ino
            content = f.read()
    except FileNotFoundError:
        return None
    try:
        info: LockInfo | None = msgspec.json.decode(content, type=LockInfo)
    except (msgspec.DecodeError, msgspec.ValidationError):
        info = None
    return Observed(ino=ino, content=content, info=info)


class StaleWatch:
    """A waiter's staleness judge: content unchanged for ``stale_s`` on this node's clock."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._last: tuple[int, bytes] | None = None
        self._since = 0.0

    def stale(self, seen: Observed, now: float) -> bool:
        """Record a reading at ``now`` (the caller's clock: trio's, as its sleeps); whether the
        lock has been frozen for ``stale_s``."""
        key = (seen.ino, seen.content)
        if key != self._last:
            self._last, self._since = key, now
            return False
        return now - self._since >= self.stale_s

    def unchanged_for(self, now: float | None = None) -> float:
        """Seconds since the content last changed."""
        return (time.monotonic() if now is None else now) - self._since


def take_over(path: Path, stale: Observed) -> bool:
    """Remove the stale lock ``stale`` (and only it); whether this call removed it."""
    aside = path.with_name(f"{path.name}.stale-{new_token()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another waiter took it over first
    try:
        with open(aside, "rb") as f:
            same = os.fstat(f.fileno()).st_ino == stale.ino and f.read() == stale.content
        if not same:
            # A live lock: put it back unless a newer one is already there.
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def failed_verdict(seen: Observed | None, waited_on: Observed | None, job: str) -> str | None:
    """The failure left in the lock by the holder this agent waited for, or by one of its own
    job; None while it works. Another job's agent that only arrives waits for the lock to go,
    then converts from scratch."""
    info = seen.info if seen is not None else None
    if info is None or info.failed is None:
        return None
    if info.job == job:
        return info.failed
    if waited_on is None or waited_on.info is None or waited_on.info.token != info.token:
        return None
    return info.failed
