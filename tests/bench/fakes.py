"""What the benchmarks stand up, each runnable as ``python -m tests.bench.fakes KIND ...``.

- ``vllm_page``: a vLLM page of about 5,000 lines (the captured vLLM 0.32 page with its samples
  repeated for several engines), with fresh values per call, as vLLM's next scrape would have;
- ``page-server PATH``: a plain HTTP server (the standard library's) serving PATH, re-read per
  request (the reference the re-export is measured against);
- ``ENGINE_64K``: an engine (``python -c ENGINE_64K BYTES``) that writes BYTES of 100-byte lines to
  stdout, 64 KiB a write, as fast as it can;
- ``pump BYTES DIR``: the agent's side of that: the engine started by the agent's launcher,
  its output pumped by ``LogSink`` into DIR/engine.log; prints the seconds and the counters;
- ``peers COUNT [STATE]``: COUNT agents' ``/status`` in one process, each on a port of its own
  (``/decode-N/status``, long polls held until their timeout), for the head to follow; all
  ``healthy`` (the head then starts a router it cannot prove), or all ``starting`` (the head
  keeps following them, gate closed).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

REAL_PAGE = Path(__file__).resolve().parents[1] / "data" / "metrics" / "vllm-0.32-cpu.txt"
_SAMPLE_VALUE = re.compile(r"(?m)^(vllm:[^ \n]*) [^ \n]+$")


def vllm_page(lines: int = 5000, seed: int = 0) -> str:
    """About ``lines`` lines: each ``engine="0"`` sample repeated for engines 1..N; new values."""
    base = REAL_PAGE.read_text().splitlines()
    per_engine = sum(1 for line in base if 'engine="0"' in line)
    engines = max(1, -(-(lines - len(base)) // per_engine) + 1)
    out = []
    for line in base:
        out.append(line)
        if 'engine="0"' in line and not line.startswith("#"):
            out += [line.replace('engine="0"', f'engine="{e}"') for e in range(1, engines)]
    rnd = random.Random(seed)
    page = "\n".join(out) + "\n"
    return _SAMPLE_VALUE.sub(lambda m: f"{m[1]} {rnd.randrange(10**6)}.0", page)


def write_page(path: Path, seed: int) -> None:
    """A fresh vLLM page at ``path``, replaced atomically (readers see the old or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(vllm_page(seed=seed))
    os.replace(tmp, path)


def page_server(path: Path) -> None:
    """Serve ``path`` as classic text on 127.0.0.1 (prints the port), re-read per request."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


ENGINE_64K = """
import os, sys
line = b"x" * 99 + b"\\n"
chunk = (line * (65536 // len(line) + 1))[:65536]
for _ in range(int(sys.argv[1]) // len(chunk)):
    view = memoryview(chunk)
    while view:
        view = view[os.write(1, view):]
"""


def pump(total: int, folder: Path) -> None:
    """Start ``engine64k`` through the agent's launcher and pump it like the agent; print JSON."""
    import trio

    from agent.launch import LaunchSpec, ProcessLauncher
    from agent.node.decodestats import DecodeStats
    from agent.node.enginewatch import EngineWatch
    from agent.node.logpump import LogSink

    async def run() -> dict[str, float]:
        sink = LogSink(folder / "engine.log", max_bytes=1 << 40, backups=1)
        # What a decode agent watches in its engine's lines (REQSTAT, signatures, progress).
        watch = EngineWatch("decode")
        watch.starting = False  # a serving engine
        sink.watchers += [DecodeStats().feed, watch.feed]
        sink.partial_watchers.append(watch.feed_partial)
        argv = [sys.executable, "-c", ENGINE_64K, str(total)]
        start = time.perf_counter()
        engine = await ProcessLauncher().start(
            LaunchSpec(name="e", argv=argv, env=dict(os.environ))
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.wait)
            await sink.pump(engine.output)
        took = time.perf_counter() - start
        return {
            "seconds": took,
            "lines_written": sink.lines_written,
            "lines_dropped": sink.lines_dropped,
            "bytes_written": sink.bytes_written,
        }

    print(json.dumps(trio.run(run)), flush=True)


def peers(count: int, state: str = "healthy") -> None:
    """``count`` decode agents' ``/status``, a port each (printed), in ``state``, never changing."""
    since = time.time()

    def body(name: str) -> bytes:
        index = int(name.rsplit("-", 1)[1])
        status: dict[str, object] = {
            "state": state,
            "pid": None,
            "ports": {},
            "restarts": 0,
            "reason": "fake peer",
            "since": since,
            "uptime_s": None,
            "healthy_at": since if state == "healthy" else None,
            "name": name,
            "role": "decode",
            "index": index,
            "node": f"fake-{index}",
            "version": 1,
        }
        return json.dumps(status).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode()
                url = urlsplit(target)
                query = parse_qs(url.query)
                name = url.path.strip("/").split("/")[0]
                if int(query.get("after", ["-1"])[0]) >= 1:
                    await asyncio.sleep(float(query.get("timeout", ["30"])[0]))  # nothing changes
                data = body(name)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        # A port per peer: each real peer is an origin of its own (its node, its agent port).
        servers = [await asyncio.start_server(handle, "127.0.0.1", 0) for _ in range(count)]
        print(json.dumps([server.sockets[0].getsockname()[1] for server in servers]), flush=True)
        await asyncio.gather(*(server.serve_forever() for server in servers))

    asyncio.run(main())


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "page-server":
        page_server(Path(rest[0]))
    elif kind == "pump":
        pump(int(rest[0]), Path(rest[1]))
    elif kind == "peers":
        peers(int(rest[0]), *rest[1:])
    else:
        sys.exit(f"unknown kind {kind!r}")
