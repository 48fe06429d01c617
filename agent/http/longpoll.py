"""One peer's ``/status`` long polls over a bare HTTP/1.1 connection kept open to it.

The head long-polls every peer, and a live peer where nothing changes answers every long poll's
timeout (``agent.head.peers.LONG_POLL_S``): with 1,024 peers that is 200 answers a second. Through
httpx each costs about 0.8 ms of CPU (the URL and request models, the pool, h11), 17% of a core
for answers that say nothing new (docs/performance.md). A long poll is always the same small GET
of a small JSON answer, over plain http (agents serve no TLS), so this sends it as bytes on one
connection per peer and reads the answer (``Content-Length`` or chunked) with a few slices.

Every failure is a ``PollFailed`` naming what happened; the connection is then closed and the
next poll opens a new one. A kept-alive connection the peer closed while idle is opened again
once at once, as httpx does, so a peer that restarted is not taken for one that does not answer.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit

import httpx
import trio

# An answer's head (status line and headers) is a few hundred bytes; a /status body a few KiB.
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 1024 * 1024
READ_BYTES = 64 * 1024


class PollFailed(Exception):
    """A long poll got no usable answer; the message says why."""


class _Closed(PollFailed):
    """The peer closed the connection before answering."""


class StatusConnection:
    """GETs of one URL (a peer's ``/status``) with a query, on a connection kept open."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise PollFailed(f"{url}: not a plain http URL")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self._path = parts.path or "/"
        self._host_header = parts.netloc
        self._stream: trio.SocketStream | None = None
        self._buffer = bytearray()

    async def get(self, query: str, timeout_s: float) -> tuple[int, bytes]:
        """The status code and body of ``GET url?query``, within ``timeout_s``."""
        request = (
            f"GET {self._path}?{query} HTTP/1.1\r\nHost: {self._host_header}\r\n"
            "Accept: application/json\r\n\r\n"
        ).encode()
        try:
            with trio.fail_after(timeout_s):
                reused = self._stream is not None
                try:
                    return await self._exchange(request)
                except (_Closed, trio.BrokenResourceError, ConnectionResetError):
                    if not reused:
                        raise
                    self.close()  # the peer closed it while idle: once more, on a new one
                    return await self._exchange(request)
        except trio.TooSlowError:
            self.close()
            raise PollFailed(f"no answer from {self.url} within {timeout_s:g}s") from None
        except OSError as exc:
            self.close()
            raise PollFailed(f"{self.url}: {exc.strerror or exc}") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.close()
            raise PollFailed(f"{self.url}: the connection broke ({exc})") from None
        except PollFailed:
            self.close()
            raise

    def close(self) -> None:
        """Drop the connection (the next poll opens a new one)."""
        stream, self._stream = self._stream, None
        self._buffer.clear()
        if stream is not None:
            stream.socket.close()

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
        self._buffer.clear()
        await self._stream.send_all(request)
        head = await self._read_head()
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
            raise PollFailed(f"{self.url}: not an HTTP/1.1 answer: {lines[0][:80]!r}")
        try:
            code = int(status_line[1])
        except ValueError:
            raise PollFailed(f"{self.url}: bad status line {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked()
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise PollFailed(f"{self.url}: bad Content-Length") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                raise PollFailed(f"{self.url}: an answer of {length} bytes is not a /status")
            body = await self._read_exactly(length)
        else:
            raise PollFailed(f"{self.url}: an answer without a length")
        if headers.get("connection", "").lower() == "close" or status_line[0] == "HTTP/1.0":
            self.close()
        return code, body

    async def _fill(self) -> None:
        if self._stream is None:
            raise _Closed(f"{self.url}: the connection was closed")
        data = await self._stream.receive_some(READ_BYTES)
        if not data:
            raise _Closed(f"{self.url}: the connection was closed before the answer ended")
        self._buffer += data

    async def _read_head(self) -> bytes:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise PollFailed(f"{self.url}: an answer's head over {MAX_HEAD_BYTES} bytes")
            await self._fill()
        head = bytes(self._buffer[:end])
        del self._buffer[: end + 4]
        return head

    async def _read_exactly(self, length: int) -> bytes:
        while len(self._buffer) < length:
            await self._fill()
        data = bytes(self._buffer[:length])
        del self._buffer[:length]
        return data

    async def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise PollFailed(f"{self.url}: a chunk line over {MAX_HEAD_BYTES} bytes")
            await self._fill()
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_text = (await self._read_line()).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise PollFailed(f"{self.url}: bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while await self._read_line():  # trailers, up to the empty line
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise PollFailed(f"{self.url}: an answer over {MAX_BODY_BYTES} bytes")
            body += await self._read_exactly(size)
            await self._read_exactly(2)  # the chunk's CRLF


class Fetch(Protocol):
    """One peer's long polls: ``await fetch(url, after, hold_s, timeout_s)`` is the body of the
    peer's answer to ``GET url?after=..&timeout=hold_s`` within ``timeout_s`` (``PollFailed``
    otherwise); ``close()`` when done with the peer."""

    async def __call__(self, url: str, after: int, hold_s: float, timeout_s: float) -> bytes:
        """The body of a 200 answer."""
        ...

    def close(self) -> None:
        """Release what the polls hold (a connection)."""
        ...


class BarePoll:
    """The ``Fetch`` of one peer: one kept-open ``StatusConnection`` to its current URL."""

    def __init__(self) -> None:
        self._conn: StatusConnection | None = None

    async def __call__(self, url: str, after: int, hold_s: float, timeout_s: float) -> bytes:
        """GET ``url?after=..&timeout=..``; the body of a 200 answer."""
        if self._conn is None or self._conn.url != url:
            if self._conn is not None:
                self._conn.close()  # the peer moved (a new record)
            self._conn = StatusConnection(url)
        code, body = await self._conn.get(f"after={after}&timeout={hold_s:g}", timeout_s)
        if code != 200:
            raise PollFailed(f"{url} answered HTTP {code}: {body[:200].decode(errors='replace')}")
        return body

    def close(self) -> None:
        """Close the connection, if any."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ClientFetch:
    """A ``Fetch`` through an httpx client (tests hand a mock transport in)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def __call__(self, url: str, after: int, hold_s: float, timeout_s: float) -> bytes:
        """GET through the client; the body of a 2xx answer."""
        try:
            response = await self.client.get(
                url, params={"after": after, "timeout": hold_s}, timeout=timeout_s
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise PollFailed(str(exc) or type(exc).__name__) from None
        return response.content

    def close(self) -> None:
        """Nothing to close: the client is its owner's."""
