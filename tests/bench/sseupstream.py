"""An upstream that costs almost nothing: a chat stream in TileRT's router's shape (one event
per write, ``[DONE]`` last) from raw asyncio sockets, for the events per second one front
process sustains (``tests/bench/frontcost.py``; the router itself saturates long before the
front). ``python -m tests.bench.sseupstream PORT [--pace-ms MS]``: every POST gets
``max_tokens`` content events (one a ``--pace-ms``, 0: as fast as the socket takes them), a
finish chunk and ``[DONE]``, chunked, keep-alive; ``GET /health`` gets 200.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')


def chunked(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _stream(writer: asyncio.StreamWriter, events: int, pace_s: float) -> None:
    writer.write(HEAD)
    one = chunked(CHUNK)
    start = time.monotonic()
    for i in range(events):
        writer.write(one)
        await writer.drain()
        if pace_s:  # the i-th event at start + i * pace: late events are not owed a pause
            delay = start + (i + 1) * pace_s - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
    writer.write(chunked(FINISH) + chunked(DONE) + b"0\r\n\r\n")
    await writer.drain()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pace_s: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            if head.startswith(b"GET"):
                writer.write(HEALTH)
                await writer.drain()
                continue
            wanted = MAX_TOKENS.search(body)
            await _stream(writer, int(wanted.group(1)) if wanted else 16, pace_s)
            if re.search(rb"(?i)connection:\s*close", head):
                break
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def main(port: int, pace_s: float) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    server = await asyncio.start_server(lambda r, w: _serve(r, w, pace_s), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--pace-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.pace_ms / 1000))
