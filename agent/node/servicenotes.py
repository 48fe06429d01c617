"""What the agent tells systemd, and when (docs/systemd.md): readiness, status, watchdog, stop.

- ``STATUS=`` one sentence for ``systemctl status``, sent whenever it changes;
- ``READY=1`` once, when the agent serves: its engine healthy, or for the head (prefill-0) the job
  proven by canaries through the router; never while a model loads or weights convert;
- ``EXTEND_TIMEOUT_USEC=`` with every new status and every ``EXTEND_EVERY_S`` while it is still
  on its way to ready, so
  ``TimeoutStartSec`` need not cover the longest load: the agent's own budgets end a load that
  takes too long, and a loop that stops extending is timed out;
- ``WATCHDOG=1`` every half ``WATCHDOG_USEC``, from a task of the agent's one trio loop, the loop
  every supervisor, probe and the head run on: a loop wedged by a call that never returns stops
  petting, and systemd restarts the agent;
- ``STOPPING=1`` as a stop begins, before any engine is stopped.

``ServiceNotes.run`` sleeps until the next pet or extension is due or the agent's state changes
(``poke``): it never spins. ``TILERT_AGENT_TEST_WEDGE_S=S`` is a switch for tests: then SIGUSR2
blocks the agent's loop for S seconds, as a wedged loop would.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from agent.node.sdnotify import MAX_STATUS_CHARS, Notifier

# While loading: ask systemd for this much more time, again every EXTEND_EVERY_S.
EXTEND_BY_S = 90.0
EXTEND_EVERY_S = 30.0
WEDGE_SWITCH = "TILERT_AGENT_TEST_WEDGE_S"


@dataclass(frozen=True)
class Standing:
    """Where the agent stands, as systemd is told."""

    status: str  # one sentence for people
    ready: bool  # serving: the engine healthy (the head: the job proven by canaries)
    loading: bool  # still on its way to ready (preflight, conversion, load, gate, canaries)


class ServiceNotes:
    """Tells systemd the agent's standing through a ``Notifier`` (a no-op without systemd)."""

    def __init__(
        self, notifier: Notifier, standing: Callable[[], Standing], log: logging.Logger
    ) -> None:
        self.notifier = notifier
        self.standing = standing
        self.log = log
        self.ready_sent = False
        self.stopping_sent = False
        self._status = ""
        self._wake = trio.Event()

    def poke(self) -> None:
        """The agent's state changed: say so now."""
        self._wake.set()

    def stopping(self, why: str) -> None:
        """A stop begins: ``STOPPING=1`` (once), before the engines are stopped."""
        if self.stopping_sent:
            return
        self.stopping_sent = True
        self._status = _sentence(f"stopping: {why}")
        self.notifier.send(STOPPING="1", STATUS=self._status)

    def _due(
        self, standing: Standing, now: float, next_pet: float, next_extend: float
    ) -> dict[str, str]:
        """The fields to send now (empty: nothing changed and nothing is due)."""
        fields: dict[str, str] = {}
        status = _sentence(standing.status)
        if status != self._status:
            self._status = fields["STATUS"] = status
        if standing.ready and not self.ready_sent and not self.stopping_sent:
            self.ready_sent = True
            fields["READY"] = "1"
        if self._extending(standing) and (now >= next_extend or "STATUS" in fields):
            fields["EXTEND_TIMEOUT_USEC"] = str(int(EXTEND_BY_S * 1_000_000))
        if self.notifier.watchdog_s is not None and now >= next_pet:
            fields["WATCHDOG"] = "1"
        return fields

    def _extending(self, standing: Standing) -> bool:
        return standing.loading and not self.ready_sent and not self.stopping_sent

    async def run(self) -> None:
        """Send what is due, then sleep until the next pet or extension, or a change."""
        if not self.notifier.enabled:
            return
        watchdog_s = self.notifier.watchdog_s
        next_pet = next_extend = trio.current_time()
        while True:
            now = trio.current_time()
            standing = self.standing()
            fields = self._due(standing, now, next_pet, next_extend)
            if fields:
                self.notifier.send(**fields)
            if "WATCHDOG" in fields and watchdog_s is not None:
                next_pet = now + watchdog_s / 2
            if "EXTEND_TIMEOUT_USEC" in fields:
                next_extend = now + EXTEND_EVERY_S
            wakes = [next_pet] if watchdog_s is not None else []
            if self._extending(standing):
                wakes.append(next_extend)
            with trio.move_on_after(max(0.0, min(wakes) - now) if wakes else math.inf):
                await self._wake.wait()
            self._wake = trio.Event()


def _sentence(text: str) -> str:
    """One line of at most ``MAX_STATUS_CHARS`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_STATUS_CHARS else line[: MAX_STATUS_CHARS - 3] + "..."


def wedge_seconds() -> float | None:
    """The test switch ``TILERT_AGENT_TEST_WEDGE_S`` (seconds), or None when it is off."""
    value = os.environ.get(WEDGE_SWITCH, "").strip()
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


async def wedge_on_sigusr2(seconds: float, log: logging.Logger) -> None:
    """Test switch: on each SIGUSR2, block this thread's trio loop for ``seconds`` (everything
    the agent does stops, the watchdog pet too), then carry on."""
    with trio.open_signal_receiver(signal.SIGUSR2) as signals:
        async for _ in signals:
            log.warning("%s: wedging the agent's loop for %gs (SIGUSR2)", WEDGE_SWITCH, seconds)
            time.sleep(seconds)  # noqa: ASYNC251 (deliberately blocking: this is the wedge)
            log.warning("%s: the loop runs again", WEDGE_SWITCH)
