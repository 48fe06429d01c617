"""The job's end as a worker agent sees it: ``status.json`` says ``stopped`` or ``failed``, or the
head's last word is in its rendezvous record.

An agent started by the job (its ``srun`` step, the ``--local`` supervisor) is stopped with it by
a signal. One started by hand, by systemd or for a rejoin gets none: it watches the job directory
and drains and exits 0 once the job has ended (docs/agent.md, "When the job ends"). An end counts
only once this agent has seen the job alive (``status.json`` in another state, or the head's
record without a last word): a job directory used again (a systemd unit starting before its
head, after a reboot) still holds the last run's end, and no clock of two nodes is compared to
tell the two apart. An agent that starts into a job that looks ended says so and waits for its
head.

Every ``POLL_S`` it reads the head's record (a few hundred bytes) and the head of ``status.json``:
its ``state`` comes first (msgspec writes ``JobStatus``'s fields in order), so the file, which
lists every agent, is read whole only when it does not start so, or once it says the job ended.
The reads run in a worker thread: a hung shared file system must not wedge the agent's loop.
"""

from __future__ import annotations

import contextlib
import logging
import re

import msgspec
import trio

from agent.job.names import HEAD_NAME
from agent.job.paths import JobDir
from agent.job.vocab import FINAL_STATES
from agent.node.rendezvous import RecordProblem, read_record
from agent.problems import printable

POLL_S = 2.0
# Enough for ``{"state":"starting"`` in any spacing.
STATE_PREFIX_BYTES = 256
_STATE = re.compile(rb'^\s*\{\s*"state"\s*:\s*"([a-z]+)"')


def _status_state(job: JobDir) -> str | None:
    """``status.json``'s state, reading its first bytes only when they say it; None if unread."""
    try:
        with open(job.status, "rb") as f:
            head = f.read(STATE_PREFIX_BYTES)
    except OSError:
        return None
    found = _STATE.match(head)
    if found is not None:
        return found.group(1).decode()
    try:
        return job.read_status().state
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _status_end(job: JobDir, state: str) -> str:
    """Why the job ended, as ``status.json`` says it."""
    error = None
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        error = job.read_status().error
    return f"the job {state} (status.json" + (f": {printable(error)})" if error else ")")


def _head_word(job: JobDir) -> tuple[bool, str] | None:
    """Whether the head's record carries its last word, and that word; None when unread."""
    try:
        record = read_record(job.record(HEAD_NAME), HEAD_NAME)
    except (OSError, RecordProblem):
        return None
    if record.exited is None:
        return False, ""
    said = record.exited
    return True, f"the head {HEAD_NAME} exited ({said.state}: {printable(said.reason)})"


class JobEnd:
    """What this agent has seen of the job: alive yet, and ended since."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self.status_alive = False
        self.head_alive = False
        # An end found before the job was seen alive: the last run's (or this agent came late).
        self.stale: str | None = None

    def look(self) -> str | None:
        """One look at the files (blocking); why the job ended, or None while it has not."""
        state = _status_state(self.job)
        if state is not None:
            if state not in FINAL_STATES:
                self.status_alive = True
            elif self.status_alive:
                return _status_end(self.job, state)
            else:
                self.stale = f"status.json says {state}"
        word = _head_word(self.job)
        if word is not None:
            exited, why = word
            if not exited:
                self.head_alive = True
            elif self.head_alive:
                return why
            else:
                self.stale = why
        return None

    def looks_ended(self) -> bool:
        """Whether the job looked ended, and never alive, so far."""
        return self.stale is not None and not self.status_alive and not self.head_alive


async def wait_job_end(
    job: JobDir, log: logging.Logger, name: str, watch: JobEnd | None = None
) -> str:
    """Return once the job has ended (why, in a sentence); runs until then. ``watch``: what was
    seen of the job so far (a new one by default)."""
    watch = watch if watch is not None else JobEnd(job)
    first = True
    while True:
        why = await trio.to_thread.run_sync(watch.look, abandon_on_cancel=True)
        if why is not None:
            return why
        if first and watch.looks_ended():
            log.warning(
                "%s: the job in %s looks ended already (%s); this agent waits for its head to "
                "start it again, and ends when the job ends",
                name,
                job.root,
                watch.stale,
            )
        first = False
        await trio.sleep(POLL_S)
