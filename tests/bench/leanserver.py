"""A lean HTTP/1.1 server for an ASGI app, h11 on trio's streams, for measuring only: what the
front's streaming path costs without hypercorn's layers (``tests/bench/frontalone.py --lean``).
Not hardened for hostile clients (``agent/web/server.py`` is): one request at a time per
connection, keep-alive, a body sent as h11 chunks, one ``send_all`` per body message.
"""

from __future__ import annotations

from typing import Any

import h11
import trio

from agent.web.asgi import App

READ_BYTES = 65536


class _Exchange:
    """One request's ASGI ``receive`` and ``send`` on its connection."""

    def __init__(self, stream: trio.SocketStream, conn: h11.Connection, body: bytes) -> None:
        self.stream, self.conn, self.body = stream, conn, body
        self.gone = trio.Event()
        self.sent_body = False

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        try:
            if message["type"] == "http.response.start":
                response = h11.Response(status_code=message["status"], headers=message["headers"])
                await self.stream.send_all(self.conn.send(response) or b"")
            elif message["type"] == "http.response.body":
                data = self.conn.send(h11.Data(data=message.get("body", b""))) or b""
                if not message.get("more_body", False):
                    data += self.conn.send(h11.EndOfMessage()) or b""
                if data:
                    await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            self.gone.set()


async def _request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(READ_BYTES))
            continue
        return event if isinstance(event, h11.Request) else None


async def _body(stream: trio.SocketStream, conn: h11.Connection) -> bytes:
    parts = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(READ_BYTES))
        elif isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        else:
            return b"".join(parts)


async def _connection(app: App, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while (request := await _request(stream, conn)) is not None:
            body = await _body(stream, conn)
            path, _, query = request.target.partition(b"?")
            scope = {
                "type": "http",
                "method": request.method.decode(),
                "path": path.decode(),
                "query_string": query,
                "headers": list(request.headers),
            }
            exchange = _Exchange(stream, conn, body)
            await app(scope, exchange.receive, exchange.send)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, h11.RemoteProtocolError, OSError):
        pass
    finally:
        await stream.aclose()


async def serve_lean(app: App, port: int) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` until cancelled."""
    await trio.serve_tcp(lambda s: _connection(app, s), port, host="127.0.0.1")
