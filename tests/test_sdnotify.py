"""systemd's notification protocol and what the agent says when (docs/systemd.md): the protocol on
real ``AF_UNIX`` datagram sockets, the pace and order of the notes on trio's clock. Real agents
under a notification socket: tests/test_sdnotify_agents.py.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest
import trio

from agent.node.sdnotify import Notifier, watchdog_seconds
from agent.node.servicenotes import EXTEND_BY_S, EXTEND_EVERY_S, ServiceNotes, Standing
from tests.kit.notifysocket import abstract_address, listening

WATCHDOG_S = 2.0


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
