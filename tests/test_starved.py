"""A router alive but starved is not dead (agent/head/starved.py): in-process servers on loopback
stand for a router whose ``/health`` hangs while its event loop answers (excused, up to the
bound), one that is gone (refused: counted) and one whose process is frozen (the kernel accepts
the connection, nobody answers: counted); and ``diagnose``'s scan names the note it leaves."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from agent.head.starved import StarvedRouter
from agent.signatures import NOTES, SignatureSet
from agent.web.asgi import App, Request, Response, json_response
from agent.web.server import bound_socket, serve
from submit.diagnose import scan_file

BOUND_S = 0.5  # each probe's timeout here (a bound, not a speed assertion)


@asynccontextmanager
async def starved_router() -> AsyncIterator[str]:
    """A server whose ``/health`` never answers (its threads all busy) and whose other paths
    answer 404 at once (its event loop)."""
    app = App()

    @app.route("GET", "/health")
    async def health(_request: Request) -> Response:
        await trio.sleep_forever()
        return json_response({})

    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, app, sock)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def watcher(url: str, notes: list[str], max_s: float = 300.0) -> StarvedRouter:
    return StarvedRouter(
        lambda: url,
        timeout_s=BOUND_S,
        note=notes.append,
        in_flight=lambda: 7,
        log=logging.getLogger("test"),
        max_s=max_s,
    )


async def test_a_starved_router_is_excused_and_noted_once() -> None:
    """/health times out, the event loop answers: excused, one note, the row's ``starved_for``;
    /health answering again ends it with a note."""
    notes: list[str] = []
    async with starved_router() as url, httpx.AsyncClient() as client:
        starved = watcher(url, notes)
        try:
            await client.get(url + "/health", timeout=BOUND_S)
            raise AssertionError("/health answered")
        except httpx.TimeoutException:
            pass
        assert await starved.excuse(client)
        assert await starved.excuse(client)
        assert starved.starved_for() is not None
        assert len(notes) == 1
        assert notes[0].startswith("=== router starved: /health did not answer")
        assert "7 request(s) at the front door" in notes[0]
        starved.answered()
        assert starved.starved_for() is None
        assert notes[1].startswith("=== router answers /health again")


async def test_starved_past_the_bound_counts_again() -> None:
    """Past ``max_s`` from the first excused failure, failures count (a wedged router)."""
    notes: list[str] = []
    async with starved_router() as url, httpx.AsyncClient() as client:
        starved = watcher(url, notes, max_s=0.01)
        assert await starved.excuse(client)
        await trio.sleep(0.05)
        assert not await starved.excuse(client)
        assert "for longer than 0.01s" in notes[-1]


async def test_a_dead_router_is_not_excused() -> None:
    """Nothing listens (the connection is refused): the failure counts."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    notes: list[str] = []
    async with httpx.AsyncClient() as client:
        assert not await watcher(url, notes).excuse(client)
    assert notes == []


async def test_a_frozen_router_is_not_excused() -> None:
    """A listening socket nobody serves (a SIGSTOPped process: the kernel accepts the connection,
    no answer comes): the failure counts."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    notes: list[str] = []
    try:
        async with httpx.AsyncClient() as client:
            assert not await watcher(url, notes).excuse(client)
    finally:
        sock.close()
    assert notes == []


def test_diagnose_names_a_starved_router(tmp_path: Path) -> None:
    """The note in router.log is the ``router-starved`` finding; the engine's own lines are not
    matched as notes."""
    log = tmp_path / "router.log"
    log.write_text(
        "INFO: some line\n"
        "=== router starved: /health did not answer within 2s, but its event loop did ===\n"
        "router starved in the engine's own words is not our note\n"
    )
    found = list(scan_file(log, SignatureSet(NOTES), notes=True))
    assert [(n, f.signature.name) for n, f in found] == [(2, "router-starved")]
