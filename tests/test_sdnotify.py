"""systemd's notifications (docs/systemd.md): a real ``AF_UNIX`` datagram socket listens as systemd
would, and real agents on a ``--mock --dry-run`` job folder tell it their standing.

Each datagram is stamped by the kernel as it arrives (``SO_TIMESTAMPNS``), so the watchdog's pace
is read as the agent sent it, not as this busy 2-core machine's test thread got round to reading
it. The pace is checked loosely ([0.2, 1.0] x ``WATCHDOG_USEC``), and every wait has a bound.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from agent.node.sdnotify import Notifier, socket_address, watchdog_seconds
from agent.node.servicenotes import EXTEND_BY_S, EXTEND_EVERY_S, ServiceNotes, Standing
from tests import kit

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's value; Python does not name it
WATCHDOG_S = 2.0
WEDGE_S = 4.0
LOAD_S = 2.0  # the stand-in decode "loads" this long before it binds its port


@dataclass(frozen=True)
class Note:
    """One datagram: when the kernel received it (wall clock) and its fields."""

    at: float
    fields: dict[str, str]


class Listener:
    """A datagram socket in systemd's place; a thread collects every note it receives."""

    def __init__(self, address: str) -> None:
        self.address = address  # the NOTIFY_SOCKET value: a path, or @name (abstract)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(address))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.settimeout(0.2)
        self.notes: list[Note] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._done.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, 64)
            except TimeoutError:
                continue
            except OSError:
                return
            stamp = next(
                (
                    sec + nsec / 1e9
                    for _, kind, raw in ancillary
                    if kind == SO_TIMESTAMPNS
                    for sec, nsec in [struct.unpack("qq", raw[:16])]
                ),
                0.0,
            )
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.notes.append(Note(stamp, fields))

    def seen(self) -> list[Note]:
        """Every note so far, in the order received."""
        with self._lock:
            return list(self.notes)

    def with_key(self, key: str) -> list[Note]:
        """The notes carrying ``key``."""
        return [n for n in self.seen() if key in n.fields]

    def wait(self, what: str, check: object, timeout: float) -> list[Note]:
        """Every note, once ``check(notes)`` holds (bounded)."""
        assert callable(check)
        return kit.wait_for(
            what,
            self.seen,
            timeout,
            until=check,
            detail=lambda: "\n".join(str(n.fields) for n in self.seen()[-20:]),
        )

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._done.set()
        self._thread.join(5)
        self.sock.close()


@contextlib.contextmanager
def listening(address: str) -> Iterator[Listener]:
    """A ``Listener`` on ``address``, closed on exit."""
    listener = Listener(address)
    try:
        yield listener
    finally:
        listener.close()


def abstract_address() -> str:
    """A fresh abstract socket name (no file to clean up)."""
    return f"@tilert-test-{uuid.uuid4().hex}"


def index_of(notes: list[Note], key: str, value: str | None = None) -> int:
    """The position of the first note with ``key`` (and ``value``), or -1."""
    for i, note in enumerate(notes):
        if key in note.fields and (value is None or value in note.fields[key]):
            return i
    return -1


# ---- the protocol ---------------------------------------------------------------------------


def test_notifier_reads_and_removes_systemds_variables() -> None:
    log = logging.getLogger("test")
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = Notifier.from_environ(log, env)
    assert notifier.enabled
    assert notifier.watchdog_s == 3.0
    assert env == {}  # engines started later do not inherit them
    notifier.close()
    # A watchdog meant for another process, or none: no pets.
    assert watchdog_seconds({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}, os.getpid()) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "0"}, os.getpid()) is None
    assert watchdog_seconds({"WATCHDOG_USEC": "abc"}, os.getpid()) is None
    # Without NOTIFY_SOCKET nothing is sent, and nothing fails.
    quiet = Notifier.from_environ(log, {"WATCHDOG_USEC": "1000000"})
    assert not quiet.enabled
    assert quiet.watchdog_s is None
    assert quiet.send(READY="1") is False


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notifier_sends_datagrams(tmp_path: Path, kind: str) -> None:
    address = str(tmp_path / "notify.sock") if kind == "path" else abstract_address()
    with listening(address) as listener:
        notifier = Notifier(address, watchdog_s=None, log=logging.getLogger("test"))
        assert notifier.send(READY="1", STATUS="line one\nline two")
        notes = listener.wait("one note", lambda n: len(n) == 1, 10)
        notifier.close()
    assert notes[0].fields == {"READY": "1", "STATUS": "line one line two"}


def test_notifier_without_listener_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier(abstract_address(), watchdog_s=None, log=logging.getLogger("test.notify"))
    with caplog.at_level(logging.WARNING, "test.notify"):
        assert notifier.send(WATCHDOG="1") is False
        assert notifier.send(WATCHDOG="1") is False
    notifier.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "cannot notify systemd" in lines[0]


# ---- what the agent says, on trio's clock ----------------------------------------------------


class Recorder(Notifier):
    """A notifier that keeps what it would send, with trio's clock."""

    def __init__(self, watchdog_s: float | None) -> None:
        super().__init__(None, watchdog_s=watchdog_s, log=logging.getLogger("test"))
        self.sent: list[tuple[float, dict[str, str]]] = []

    @property
    def enabled(self) -> bool:
        return True

    def send(self, **fields: str) -> bool:
        self.sent.append((trio.current_time(), fields))
        return True


async def test_notes_pace_and_order(
    autojump_clock: trio.abc.Clock,  # noqa: ARG001 (requesting it puts the test on trio's clock)
) -> None:
    """Pets every half period, extensions every EXTEND_EVERY_S while loading, READY once, and the
    loop sleeps between them (a bounded number of looks at the agent, not a spin)."""
    recorder = Recorder(watchdog_s=WATCHDOG_S)
    standing = Standing("decode-0 starting: loading", ready=False, loading=True)
    looks = 0

    def look() -> Standing:
        nonlocal looks
        looks += 1
        return standing

    notes = ServiceNotes(recorder, look, logging.getLogger("test"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(notes.run)
        start = trio.current_time()
        await trio.sleep(EXTEND_EVERY_S * 2 + 1)
        standing = Standing("decode-0 healthy: answered", ready=True, loading=False)
        notes.poke()
        await trio.sleep(10)
        notes.stopping("SIGTERM received")
        await trio.sleep(1.5)
        nursery.cancel_scope.cancel()
    pets = [t for t, f in recorder.sent if "WATCHDOG" in f]
    gaps = [b - a for a, b in itertools.pairwise(pets)]
    assert len(gaps) > 30
    assert all(abs(g - WATCHDOG_S / 2) < 1e-6 for g in gaps), gaps
    extends = [(t, f) for t, f in recorder.sent if "EXTEND_TIMEOUT_USEC" in f]
    assert [t - start for t, _ in extends] == [0.0, EXTEND_EVERY_S, EXTEND_EVERY_S * 2]
    assert extends[0][1]["EXTEND_TIMEOUT_USEC"] == str(int(EXTEND_BY_S * 1e6))
    keys = [k for _, f in recorder.sent for k in f if k in ("READY", "STOPPING")]
    assert keys == ["READY", "STOPPING"]
    ready = next(f for _, f in recorder.sent if "READY" in f)
    assert ready["STATUS"].startswith("decode-0 healthy")
    # One look per wakeup (a pet or an extension due, the poke, the stop), never a spin.
    assert looks <= len(pets) + len(extends) + 3, looks


# ---- a real agent --------------------------------------------------------------------------


def test_worker_notes_load_ready_watchdog_wedge_stop(tmp_path: Path) -> None:
    """decode-0 under a 'systemd' socket: STATUS while loading, READY=1 only once healthy,
    WATCHDOG=1 at its pace and none while the loop is wedged, STOPPING=1 on SIGTERM before the
    engine stops; in that order."""
    job = kit.make_job(tmp_path, f"roles.decode.env.TILERT_MOCK_STARTUP_DELAY_S={LOAD_S}")
    address = abstract_address()
    with listening(address) as listener, kit.running_agents() as agents:
        agent = agents.start(
            job,
            "decode",
            0,
            NOTIFY_SOCKET=address,
            WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)),
            TILERT_AGENT_TEST_WEDGE_S=str(WEDGE_S),
        )
        notes = listener.wait("READY=1", lambda n: index_of(n, "READY") >= 0, 60)
        assert agent.status()["state"] == "healthy"
        ready = index_of(notes, "READY")
        loading = index_of(notes, "STATUS", "decode-0 starting")
        assert 0 <= loading < ready, [n.fields for n in notes]
        assert index_of(notes, "EXTEND_TIMEOUT_USEC") < ready
        assert "decode-0 healthy" in notes[ready].fields["STATUS"]
        assert not [n for n in notes[:ready] if "healthy" in n.fields.get("STATUS", "")]
        # The watchdog's pace, once ready (kernel receive times).
        listener.wait("4 pets after READY", lambda n: len(pets_after(n, ready)) >= 4, 30)
        pets = pets_after(listener.seen(), ready)
        gaps = [b - a for a, b in itertools.pairwise(pets)]
        assert all(0.2 * WATCHDOG_S <= g <= 1.0 * WATCHDOG_S for g in gaps), gaps
        # Wedge the loop: no pet for WEDGE_S, then pets again.
        before = len(listener.with_key("WATCHDOG"))
        agent.signal(signal.SIGUSR2)
        kit.wait_for("the wedge to end", lambda: "runs again" in agent.agent_log.read_text(), 30)
        listener.wait("pets after the wedge", lambda n: len(pets_after(n, 0)) >= before + 2, 30)
        pets = pets_after(listener.seen(), 0)[before - 1 :]
        gaps = [b - a for a, b in itertools.pairwise(pets)]
        assert max(gaps) >= WEDGE_S - 0.05, gaps
        # SIGTERM: STOPPING=1 first, then the engine stops.
        agent.signal(signal.SIGTERM)
        assert agent.wait(30) == 0
        notes = listener.seen()
    stopping = index_of(notes, "STOPPING")
    assert ready < stopping, [n.fields for n in notes]
    engine_stops = index_of(notes, "STATUS", "decode-0 stopping")
    assert stopping < engine_stops, [n.fields for n in notes[stopping:]]
    assert index_of(notes, "STATUS", "decode-0 stopped") > engine_stops
    assert len([n for n in notes if "READY" in n.fields]) == 1


def pets_after(notes: list[Note], start: int) -> list[float]:
    """The kernel receive times of the pets from note ``start`` on."""
    return [n.at for n in notes[start:] if "WATCHDOG" in n.fields]


def head_engine_counted(notes: list[Note]) -> bool:
    """A job status that waits for decodes only: the head's own engine is healthy."""
    waits = [n.fields["STATUS"] for n in notes if "decode-0 (" in n.fields.get("STATUS", "")]
    return any("prefill-0" not in w for w in waits)


def test_head_ready_only_when_the_job_is(tmp_path: Path, router_python: Path) -> None:
    """prefill-0 says READY=1 only once the job is ready (canaries passed), not when its own
    engine turns healthy; then a chat is served."""
    sets, _ = kit.isolated_sets(router_python)
    job = kit.make_job(tmp_path, *sets[1::2])
    address = abstract_address()
    with listening(address) as listener, kit.running_agents() as agents:
        head = agents.start(job, "prefill", 0, NOTIFY_SOCKET=address)
        head.wait_state("healthy", 60)
        # The head has seen its engine healthy (no longer among those it waits for): not ready.
        notes = listener.wait("a status without prefill-0", head_engine_counted, 30)
        assert index_of(notes, "READY") < 0
        for index in (0, 1):
            agents.start(job, "decode", index)
        notes = listener.wait("READY=1", lambda n: index_of(n, "READY") >= 0, 90)
        status = kit.current_status(job)
        assert status["state"] == "ready", status
        ready = index_of(notes, "READY")
        assert notes[ready].fields["STATUS"].startswith("job ready: "), notes[ready]
        assert 0 <= index_of(notes, "STATUS", "job waiting") < ready
        assert "READY: " in head.agent_log.read_text()  # the canaries passed
        assert head.status()["state"] == "healthy"
        kit.check_chat(job)
        head.signal(signal.SIGTERM)
        assert head.wait(30) == 0
        notes = listener.seen()
    assert index_of(notes, "STOPPING") > ready
