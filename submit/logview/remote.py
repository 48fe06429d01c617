"""Node-local engine logs, read through the agent that holds them: ``GET /logs?format=json``.

With ``agent.logs.location: node`` an engine's log exists only on its node's disk, so
``tilert-submit logs`` asks that node's agent (its address is in its rendezvous record) with the
job's bearer token (``J/token``), streamed: the same history, ``--tail``, ``--since`` and
``--timestamps`` as on the job directory, then, with ``-f``, new lines as the agent reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec

from agent.errors import RuntimeFailure
from agent.job.logtail import LogLine, WireLine
from agent.job.paths import JobDir
from agent.node.rendezvous import read_records
from submit.logview.catalogue import Source
from submit.logview.options import Options

CONNECT_TIMEOUT_S = 10.0
# Without -f the agent sends the history and ends; a silence this long means it is stuck.
HISTORY_READ_TIMEOUT_S = 60.0
_decoder = msgspec.json.Decoder(WireLine)


class NoLogYet(RuntimeFailure):
    """The agent that holds the log has not started, or the log does not exist yet."""


class Unreachable(RuntimeFailure):
    """The agent could not be asked, or the stream broke; ``streamed`` says whether any came."""

    def __init__(self, message: str, *, streamed: bool) -> None:
        super().__init__(message)
        self.streamed = streamed


def agent_url(job: JobDir, agent: str) -> str:
    """The base URL of ``agent``'s endpoint, from its rendezvous record (``NoLogYet``)."""
    record = read_records(job, {agent}).by_name.get(agent)
    if record is None:
        raise NoLogYet(f"its agent has not started: no {job.record(agent)} yet")
    return record.status_url.removesuffix("/status")


async def stream(
    client: httpx.AsyncClient,
    base: str,
    token: str,
    source: Source,
    options: Options,
    *,
    tail: int | None,
    on_lines: Callable[[list[LogLine]], None],
    on_live: Callable[[], None],
) -> None:
    """Stream ``source`` from the agent at ``base``: its history, then (``options.follow``) the
    new lines until the agent ends the stream. ``on_live`` runs once the history is printed."""
    params = {
        "name": source.key,
        "format": "json",
        "tail": "all" if tail is None else str(tail),
    }
    if options.since is not None:
        params["since"] = repr(options.since)
    if options.timestamps:
        params["timestamps"] = "1"
    if options.follow:
        params["follow"] = "1"
    timeout = httpx.Timeout(
        CONNECT_TIMEOUT_S, read=None if options.follow else HISTORY_READ_TIMEOUT_S
    )
    headers = {"Authorization": f"Bearer {token}"}
    streamed = False
    try:
        async with client.stream(
            "GET", f"{base}/logs", params=params, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace").strip()[:300]
                if response.status_code == 404:
                    raise NoLogYet(_error_text(body))
                raise Unreachable(
                    f"its agent at {base} answered {response.status_code}: {body}", streamed=False
                )
            streamed = True
            partial = b""
            async for chunk in response.aiter_bytes():
                *whole, partial = (partial + chunk).split(b"\n")
                batch: list[LogLine] = []
                for raw in whole:
                    message = _decoder.decode(raw)
                    if message.live:
                        on_lines(batch)
                        batch = []
                        on_live()
                    else:
                        batch.append(LogLine(message.time, message.line))
                on_lines(batch)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        what = "lost the stream from" if streamed else "could not reach"
        detail = str(exc) or type(exc).__name__
        raise Unreachable(f"{what} its agent at {base} ({detail})", streamed=streamed) from None
    if not options.follow:
        on_live()


def _error_text(body: str) -> str:
    """The message of an ``{"error": ...}`` answer (the body itself otherwise)."""
    try:
        message = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    error = message.get("error") if isinstance(message, dict) else None
    if isinstance(error, str):
        return error
    return body
