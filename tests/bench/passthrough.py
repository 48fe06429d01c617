"""A bare pass-through on trio, the floor of any proxy written on it: each client connection
gets its own connection to the upstream and the bytes are copied both ways as they arrive (no
HTTP parsing, no retries, nothing held). ``python -m tests.bench.passthrough PORT UPSTREAM_PORT``.
"""

from __future__ import annotations

import sys

import trio

READ_BYTES = 65536


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(READ_BYTES):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await sink.aclose()


async def _connection(client: trio.SocketStream, upstream_port: int) -> None:
    try:
        upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
    except OSError:
        await client.aclose()
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump, client, upstream)
        nursery.start_soon(_pump, upstream, client)


async def main(port: int, upstream_port: int) -> None:
    """Serve on 127.0.0.1:``port`` until killed."""
    await trio.serve_tcp(lambda s: _connection(s, upstream_port), port, host="127.0.0.1")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
