"""The fronts' HTTP/1.1 server: h11 on trio's streams, an ASGI ``App`` served with little between.

hypercorn (``agent.web.server``) takes 40% of a front's CPU per streamed event: its ASGI, protocol
and h11 layers, a lock and a shielded scope per send (docs/performance.md, "The front beside the
floors"). This server writes a response's parts straight from the app's ``send`` and keeps what
a front needs from a server: each connection in a task of its own, its failure logged once per
kind and closing it alone (``agent.web.server.Accepting``, with the accept loop that goes on after
EMFILE); heads bounded (431) and malformed requests answered 400; bodies read only as the app asks
(it bounds them: 413), ``Expect: 100-continue`` answered then; keep-alive with its idle timeout,
HTTP/1.0 and ``Connection: close`` (the response ends with the server's close); a client that
leaves seen at once: before the response starts the app is cancelled (a request waiting in the
admission queue gives its place up), after it ``receive`` says ``http.disconnect``; a graceful
shutdown (idle connections closed, the others given ``GRACE_S``).
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import unquote

import h11
import trio

from agent.web.asgi import App, Scope
from agent.web.server import KEEP_ALIVE_S, Accepting, serving

READ_BYTES = 65536
# A request head still incomplete past this many bytes is answered 431 (h11's buffer bound,
# hypercorn's default too: a head that arrives whole in one read may be up to a read larger).
MAX_HEAD_BYTES = 16384
# Bytes a client may send ahead (a pipelined request) while its response is written: reading
# stops past this (the disconnect is then seen by a failed send).
MAX_AHEAD_BYTES = 65536
# A response the app ended before reading the whole body: the rest is read and dropped for this
# long (the connection then kept), so that a client still sending reads the answer, not a reset.
DRAIN_S = 2.0
DISCONNECT = {"type": "http.disconnect"}
_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)


class _Gone(Exception):
    """The client closed the connection (or it broke) while a request was read."""


class _Exchange:
    """One request on its connection: the app's ``receive`` and ``send``."""

    def __init__(self, conn: _Connection, nursery: trio.Nursery) -> None:
        self.conn = conn
        self.nursery = nursery
        self.body: list[bytes] = []  # parts read, not yet received by the app
        self.complete = conn.collect(self.body)  # the whole body is read
        self.delivered = False  # the app has received the body's end
        self.watching = False
        self.started = False
        self.chunked = False  # the response's parts framed here (h11 chose chunked)
        self.ended = False
        self.gone = trio.Event()
        self.app_scope = trio.CancelScope()
        if self.complete:
            self.watch()

    async def receive(self) -> dict[str, Any]:
        """The next part of the body, then ``http.disconnect`` once the client has left."""
        if self.delivered or self.gone.is_set():
            await self.gone.wait()
            return DISCONNECT
        if not self.body and not self.complete:
            try:
                await self._read_body()
            except (_Gone, h11.RemoteProtocolError):  # a body cut or malformed: as gone
                self.left()
                return DISCONNECT
        if self.complete:
            self.delivered = True
            self.watch()
        parts, self.body = self.body, []
        return {"type": "http.request", "body": b"".join(parts), "more_body": not self.complete}

    async def _read_body(self) -> None:
        """Read until some body arrives or it is complete."""
        h11conn = self.conn.h11
        if h11conn.they_are_waiting_for_100_continue:
            await self.conn.send_all(
                h11conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            )
        while not self.body:
            event = await self.conn.next_event()
            if isinstance(event, h11.EndOfMessage):
                self.complete = True
                return
            if not isinstance(event, h11.Data):
                raise _Gone
            self.body.append(bytes(event.data))
        self.complete = self.conn.collect(self.body)

    def watch(self) -> None:
        """Start reading the connection for the client's leaving (the body is all read)."""
        if not self.watching:
            self.watching = True
            self.nursery.start_soon(self._watch)

    async def send(self, message: dict[str, Any]) -> None:
        """Write a response part (dropped once the client has left, as hypercorn does: the app
        learns it from ``receive``)."""
        h11conn = self.conn.h11
        if message["type"] == "http.response.start":
            self.started = True
            headers = message["headers"]
            if h11conn.they_are_waiting_for_100_continue:
                # answered without the body, which the client may never send: no drain waits
                headers = [*headers, (b"connection", b"close")]
            response = h11.Response(status_code=message["status"], headers=headers)
            data = h11conn.send(response) or b""
            # A part costs h11 3 us (a streamed event 40-70 in all): where h11 chose chunked
            # framing (it says so in the head it wrote), the parts are framed here.
            self.chunked = b"\r\nTransfer-Encoding: chunked\r\n" in data
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if not body:
                data = b""
            elif self.chunked:  # h11's own framing, without its state machine's cost per part
                data = b"%x\r\n%b\r\n" % (len(body), body)
            else:
                data = h11conn.send(h11.Data(data=body)) or b""
            if not message.get("more_body", False):
                data += h11conn.send(h11.EndOfMessage()) or b""
                self.ended = True
        else:
            raise ValueError(f"an unknown ASGI message: {message['type']}")
        if self.gone.is_set():
            return
        if not await self.conn.send_all(data):
            self.left()
        elif self.ended and h11conn.our_state is h11.MUST_CLOSE and h11conn.their_state is h11.DONE:
            # HTTP/1.0 or ``Connection: close``: the close is the response's end, so it is sent
            # now, not once the app has returned (it may still be releasing what it held). With
            # the body unread, the close waits for the drain (``_serve``).
            await self.conn.close()

    async def _watch(self) -> None:
        """Read while the app runs, to see the client leave (bytes it sends ahead are kept)."""
        stream, h11conn = self.conn.stream, self.conn.h11
        while len(h11conn.trailing_data[0]) <= MAX_AHEAD_BYTES:
            try:
                data = await stream.receive_some(READ_BYTES)
            except _CLOSED:
                data = b""
            if not data:
                self.left()
                return
            h11conn.receive_data(data)

    def left(self) -> None:
        """The client has gone: a response not started is not worth making."""
        self.gone.set()
        if not self.started:
            self.app_scope.cancel()


class _Connection:
    """One client connection: its requests one after another."""

    def __init__(self, server: _H11Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.fd = stream.socket.fileno()
        self.closed = False

    async def run(self) -> None:
        """Serve requests until the client or the protocol ends the connection."""
        try:
            while not self.server.closing.is_set():
                request = await self._request()
                if request is None or not await self._serve(request):
                    break
                self.h11.start_next_cycle()
        except _CLOSED:
            pass
        finally:
            await self.close()

    async def _request(self) -> h11.Request | None:
        """The next request's head within the keep-alive timeout (shutdown ends the wait)."""
        event = None
        with trio.move_on_after(KEEP_ALIVE_S) as scope:
            self.server.idle.add(scope)
            try:
                event = await self.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc)
                return None
            except _Gone:
                return None
            finally:
                self.server.idle.discard(scope)
        return event if isinstance(event, h11.Request) else None

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        """Answer a request h11 cannot read (400, or 431 for a head too large) and close."""
        body = f"{exc}\n".encode()
        headers = [
            ("content-type", "text/plain"),
            ("content-length", str(len(body))),
            ("connection", "close"),
        ]
        response = h11.Response(status_code=exc.error_status_hint, headers=headers)
        try:
            head = self.h11.send(response) or b""
        except h11.LocalProtocolError:
            return  # mid-exchange (a second cycle's head is read only after the first's end)
        await self.send_all(head + body)

    async def _serve(self, request: h11.Request) -> bool:
        """Run the app for ``request``; whether the connection can carry another."""
        async with trio.open_nursery() as nursery:
            exchange = _Exchange(self, nursery)
            with exchange.app_scope:
                await self.server.app(_scope(request), exchange.receive, exchange.send)
            if not exchange.started and not exchange.gone.is_set():  # the app answered nothing
                await exchange.send({"type": "http.response.start", "status": 500, "headers": []})
                await exchange.send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()  # the watch
        if not exchange.ended or exchange.gone.is_set() or self.h11.our_state is not h11.DONE:
            return False  # a response the app left unfinished ends with the close
        return self.h11.their_state is h11.DONE or await self._drain()

    async def _drain(self) -> bool:
        """Read and drop the rest of a body the app answered without (a 413, a 404), for
        ``DRAIN_S`` at most; whether it ended in time (the connection is kept)."""
        with trio.move_on_after(DRAIN_S):
            try:
                while not isinstance(await self.next_event(), h11.EndOfMessage):
                    pass
                return True
            except (_Gone, h11.RemoteProtocolError):
                pass
        return False

    def collect(self, parts: list[bytes]) -> bool:
        """Take the body parts h11 holds already (no read); whether the body is complete."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                return False  # met again by the read that asks for more
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            else:
                return isinstance(event, h11.EndOfMessage)

    async def next_event(self) -> Any:
        """h11's next event, reading as it needs (``_Gone`` when the client closed first)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                    raise _Gone
                return event
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except _CLOSED:
                raise _Gone from None
            if not data and self.h11.their_state is h11.IDLE:
                raise _Gone  # a close between requests: nothing to answer
            self.h11.receive_data(data)

    async def send_all(self, data: bytes) -> bool:
        """Write ``data``; False when the client is gone."""
        if self.closed:
            return False  # never a write on a descriptor number that may be another's now
        try:
            # What the socket takes at once is written without trio's send, whose two trips
            # through the run loop cost a tenth of a streamed event; the rest waits for room
            # there. Only the app's task sends, one send at a time, so nothing interleaves.
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                await self.stream.send_all(memoryview(data)[sent:])
        except (*_CLOSED, OSError):
            return False
        return True

    async def close(self) -> None:
        """Half-close (what was sent is delivered), then close; once."""
        if self.closed:
            return
        self.closed = True
        with trio.CancelScope(shield=True):
            try:
                await self.stream.send_eof()
            except (*_CLOSED, trio.BusyResourceError, OSError):
                pass
            await self.stream.aclose()


def _scope(request: h11.Request) -> Scope:
    """The ASGI scope of ``request``."""
    path, _, query = request.target.partition(b"?")
    return {
        "type": "http",
        "http_version": request.http_version.decode(),
        "method": request.method.decode(),
        "path": unquote(path.decode("latin-1")),
        "raw_path": path,
        "query_string": query,
        "headers": list(request.headers),
    }


class _H11Server:
    """One app's connections."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.closing = trio.Event()
        self.idle: set[trio.CancelScope] = set()
        self.accepting = Accepting(self.connection)

    async def connection(self, stream: trio.SocketStream) -> None:
        """One connection served (trio's streams set TCP_NODELAY: each part leaves at once)."""
        await _Connection(self, stream).run()

    async def shut(self) -> None:
        """Close connections waiting for a request; the others close after their response."""
        self.closing.set()
        for scope in self.idle:
            scope.cancel()


async def serve(
    app: App,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    shutdown: trio.Event | None = None,
) -> None:
    """Serve ``app`` on an already bound socket until cancelled (or until ``shutdown`` is set,
    when open connections get ``GRACE_S``); the socket is closed when it returns."""
    server = _H11Server(app)
    await serving(server.accepting, server.shut, sock, task_status, shutdown)
