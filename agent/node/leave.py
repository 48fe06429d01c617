"""A decode agent leaving the pool (``tilert-submit scale`` shrinking it, docs/cli.md).

The head first restarts the router without this decode, then asks the agent to leave (``POST
/leave``). The old router may still be streaming a last answer through the decode (the head stops
it only once its streams are done, within the router's stop grace), so the agent waits until its
engine says ``idle`` on TileRT's ``/decode_status`` (the stand-in serves it too), bounded, and only
then stops its engine: no request in flight is cut.
"""

from __future__ import annotations

import logging

import httpx
import msgspec
import trio

IDLE_POLL_S = 0.2
# How long an old router may finish its streams after a hand-over (agent.head.router); a stop of
# the job cuts it to the router's stop grace.
HANDOVER_DRAIN_S = 120.0
# A leaving decode waits for idle at most this long: beyond the longest an old router may stream
# through it.
LEAVE_IDLE_S = HANDOVER_DRAIN_S + 10.0


class DecodeStatus(msgspec.Struct):
    """TileRT's ``GET /decode_status``: ``busy`` while its single decode slot is held."""

    status: str
    current_rid: str | None = None


async def wait_idle(
    client: httpx.AsyncClient, url: str, bound_s: float, log: logging.Logger
) -> str:
    """Wait until the decode engine at ``url`` (its ``/decode_status``) is idle, at most
    ``bound_s``; how the wait ended, in words (for the agent's last word)."""
    start = trio.current_time()
    said = ""
    last = "no answer yet"
    with trio.move_on_after(bound_s):
        while True:
            try:
                response = await client.get(url, timeout=2.0)
                response.raise_for_status()
                answer = msgspec.json.decode(response.content, type=DecodeStatus)
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                # An engine that cannot answer serves nobody: nothing to wait for.
                return f"its engine did not answer {url} ({exc or type(exc).__name__})"
            if answer.status == "idle":
                return f"its engine was idle after {trio.current_time() - start:.1f}s"
            last = f"busy with {answer.current_rid}"
            if last != said:
                log.info("leaving the pool: waiting for the engine to finish (%s)", last)
                said = last
            await trio.sleep(IDLE_POLL_S)
    return f"its engine was still {last} after {bound_s:g}s: stopped anyway"
