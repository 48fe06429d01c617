"""Writes into the job directory that must never stop an agent.

A full disk (an engine's log flood fills it too), a read-only or a removed job directory make a
write fail, not the agent: its engines keep serving. Each file keeps the writer of its latest
content; a failed one is retried with backoff (``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S``)
until it succeeds or a newer write replaces it. The failure is shown in the agent's ``/status``
(``problems``) and logged once per change of the error, the recovery once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 10.0


class JobWrites:
    """The agent's writes into ``J/``: attempted at once, retried in ``retry`` while they fail."""

    def __init__(self, log: logging.Logger, on_change: Callable[[], None]) -> None:
        self.log = log
        self.on_change = on_change
        self._failing: dict[str, str] = {}
        self._pending: dict[str, Callable[[], None]] = {}
        self._wake = trio.Event()

    def write(self, what: str, write: Callable[[], None]) -> bool:
        """Run ``write`` (which writes the file ``what``) now; True when it succeeded.

        On ``OSError`` the write is kept for ``retry`` (replacing an older one of ``what``).
        """
        try:
            write()
        except OSError as exc:
            self._pending[what] = write
            self._wake.set()
            problem = f"cannot write {what}: {exc.strerror or exc}"
            if self._failing.get(what) != problem:
                self._failing[what] = problem
                self.log.warning(
                    "%s; the engines keep serving; retrying every %g s at most",
                    problem,
                    RETRY_MAX_S,
                )
                self.on_change()
            return False
        self._pending.pop(what, None)
        if self._failing.pop(what, None) is not None:
            self.log.info("%s written again", what)
            self.on_change()
        return True

    def problems(self) -> list[str]:
        """The writes failing now, one line each (the agent's ``/status`` ``problems``)."""
        return list(self._failing.values())

    async def retry(self) -> None:
        """Retry the failed writes with backoff while there are some (runs forever)."""
        delay = RETRY_INITIAL_S
        while True:
            if not self._pending:
                await self._wake.wait()
                self._wake = trio.Event()
                delay = RETRY_INITIAL_S
                continue
            await trio.sleep(delay)
            for what, write in list(self._pending.items()):
                self.write(what, write)
            delay = min(RETRY_MAX_S, delay * 2)
