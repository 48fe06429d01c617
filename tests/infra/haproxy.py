"""Debian's HAProxy as a reverse proxy before one upstream, run as a test process.

Set where it matters to a proxied stream: ``option http-no-delay`` (without it HAProxy holds
small writes back to merge them, and a server-sent event arrives late), client and server
timeouts of an hour (a stream may wait that long for its next event, as the front does), one
thread (one process's cost, beside nginx's one worker and the front's one process). ``-db``
keeps it in the foreground, one process of ours, which ``stop`` ends; it writes nothing but its
own output (``output.log`` under ``root``). Nothing of the system's HAProxy (its service,
/etc/haproxy) is touched.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from tests.infra.ports import free_port
from tests.kit.waiting import wait_for

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

CONFIG = """\
global
    nbthread 1
    pidfile {root}/haproxy.pid
defaults
    mode http
    option http-no-delay
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout http-keep-alive 75s
frontend front
    bind 127.0.0.1:{port}
    default_backend upstream
backend upstream
    server upstream {upstream}
"""


def haproxy_binary() -> str | None:
    """Path of haproxy, or None when it is not installed."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")


class HAProxy:
    """HAProxy proxying ``http://127.0.0.1:PORT`` to ``upstream``; a context manager."""

    def __init__(self, upstream: str, root: Path) -> None:
        self.upstream = upstream
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def output(self) -> str:
        """What HAProxy wrote."""
        path = self.root / "output.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> HAProxy:
        """Start it and wait until it answers (proxying the upstream's ``/health``)."""
        binary = haproxy_binary()
        assert binary is not None, "haproxy is not installed"
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "haproxy.cfg"
        address = urlsplit(self.upstream).netloc
        conf.write_text(CONFIG.format(root=self.root, port=self.port, upstream=address))
        with (self.root / "output.log").open("wb") as out:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def answers() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, f"haproxy exited:\n{self.output()}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/health", timeout=5).status_code < 500
            return False

        try:
            wait_for("haproxy to answer", answers, START_TIMEOUT_S, detail=self.output)
        except BaseException:
            self.stop()  # a failed start leaves no haproxy behind (__exit__ will not run)
            raise
        return self

    def stop(self) -> None:
        """Stop it (SIGUSR1: a soft stop; SIGKILL past the bound)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGUSR1)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
