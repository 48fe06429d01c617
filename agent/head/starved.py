"""A router alive but too busy to answer ``/health`` is starved, not dead: its failed probes are
excused for a while, so the head does not kill it for being loaded.

TileRT's router answers ``/health`` with a plain (``def``) handler, run on the same pool of 40
threads where requests wait for a free decode (``--queue-timeout``) and for the prefill: with
about 40 requests waiting, ``/health`` waits too. Its event loop still answers anything that needs
no thread, such as a path it does not serve (404, at once). So after a probe of ``/health`` fails,
the head asks the router's event loop (``ALIVE_PATH``): an HTTP answer within the probe's timeout
means the process is alive and serving connections, only its threads are all taken, and the
failure is excused; no answer (a refused connection: dead; a connection that is accepted by the
kernel but never answered: a frozen or wedged process) counts as before. Excused failures end at
``STARVED_MAX_S`` from the first one: a router starved longer than that is treated as wedged.

While starved the router's row says so (``reason``), and its log gets the agent's note
``=== router starved: ... ===`` (and one when it answers again), which ``tilert-submit diagnose``
names (``router-starved``, agent.signatures ``NOTES``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import trio

from agent.signatures import STARVED_NOTE

# A path the router does not serve: answered 404 by its event loop, without a thread.
ALIVE_PATH = "/tilert-agent/alive"
# How long failed /health probes of a router whose event loop answers are excused.
STARVED_MAX_S = 300.0


class StarvedRouter:
    """Whether a failed ``/health`` probe of the router is excused: it is starved, not dead."""

    def __init__(
        self,
        base_url: Callable[[], str],
        *,
        timeout_s: float,
        note: Callable[[str], None],
        in_flight: Callable[[], int],
        log: logging.Logger,
        max_s: float = STARVED_MAX_S,
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.note = note
        self.in_flight = in_flight
        self.log = log
        self.max_s = max_s
        self.since: float | None = None  # trio's clock at the first excused failure
        self.excused_count = 0
        self._over = False

    def starved_for(self) -> float | None:
        """Seconds since the router's ``/health`` stopped answering while its loop did."""
        return None if self.since is None else trio.current_time() - self.since

    def answered(self) -> None:
        """``/health`` answered: starved no more."""
        if self.since is not None:
            took = trio.current_time() - self.since
            self.note(f"=== router answers /health again after {took:.1f}s starved ===")
            self.log.info("head: the router answers /health again")
        self.since, self._over = None, False

    async def excuse(self, client: httpx.AsyncClient) -> bool:
        """After a failed ``/health`` probe: whether it is excused (the router's event loop
        answers, within ``max_s`` of the first excused failure)."""
        now = trio.current_time()
        if self.since is not None and now - self.since > self.max_s:
            if not self._over:
                self._over = True
                self.note(
                    f"{STARVED_NOTE} for longer than {self.max_s:g}s: its failed probes count "
                    "now (a router starved this long is treated as wedged) ==="
                )
            return False
        t0 = trio.current_time()
        try:
            response = await client.get(self.base_url() + ALIVE_PATH, timeout=self.timeout_s)
        except (httpx.HTTPError, OSError):
            return False
        took = trio.current_time() - t0
        self.excused_count += 1
        if self.since is None:
            self.since = now
            text = (
                f"{STARVED_NOTE}: /health did not answer within {self.timeout_s:g}s, but its event "
                f"loop did (HTTP {response.status_code} in {took:.3f}s): its threads are all "
                f"busy ({self.in_flight()} request(s) at the front door); not counted as a "
                f"failure for up to {self.max_s:g}s ==="
            )
            self.note(text)
            self.log.warning("head: %s", text.removeprefix("=== ").removesuffix(" ==="))
        return True
