"""A bare HTTP/1.1 server on 127.0.0.1 for the clients we wrote ourselves (the head's long polls,
the front's h11 upstream): it reads each request's head and sized body off the socket and lets
the test's ``answer`` write whatever bytes it likes back, a broken reply included."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import trio

# What the server does with one request (the socket, its head): send its reply; False closes the
# connection after it.
Answer = Callable[[trio.SocketStream, bytes], Awaitable[bool]]


class RawServer:
    """Serves ``path`` (any path, really) with ``answer``; every head and body kept in order."""

    def __init__(self, answer: Answer, path: str) -> None:
        self.answer = answer
        self.path = path
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> str:
        """Listen; the URL of ``path``."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)
        self.url = f"http://127.0.0.1:{port}{self.path}"
        return self.url

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                size = re.search(rb"(?i)content-length: (\d+)", head)
                length = int(size.group(1)) if size else 0
                while len(buffer) < length:
                    buffer += await stream.receive_some(4096)
                self.heads.append(head)
                self.bodies.append(buffer[:length])
                buffer = buffer[length:]
                if not await self.answer(stream, head):
                    return
