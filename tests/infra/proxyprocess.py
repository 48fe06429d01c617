"""A Debian reverse proxy (nginx, HAProxy) before one upstream, run as one test process of ours:
started, waited for until it answers, stopped (its own graceful signal, SIGKILL past the bound).

``tests/infra/nginx.py`` and ``tests/infra/haproxy.py`` say only what differs: the binary, the
configuration written under ``root``, the command line, the log that explains a failed start.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import httpx

from tests.infra.ports import free_port
from tests.kit.waiting import wait_for

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class ProxyProcess:
    """The proxy on ``http://127.0.0.1:PORT`` before ``upstream``; a context manager."""

    name: ClassVar[str]
    # The proxy's own graceful stop.
    stop_signal: ClassVar[signal.Signals]
    # Under ``root``: what explains a failed start (its stdout and stderr go to output.log).
    log_name: ClassVar[str] = "output.log"

    def __init__(self, upstream: str, root: Path) -> None:
        self.upstream = upstream
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """Its configuration written under ``root``, and the command line that runs it."""
        raise NotImplementedError

    def output(self) -> str:
        """What it wrote (``log_name``)."""
        path = self.root / self.log_name
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> Self:
        """Start it and wait until it answers (proxying the upstream's ``/health``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        argv = self.command()
        with (self.root / "output.log").open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

        def answers() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.output()}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/health", timeout=5).status_code < 500
            return False

        try:
            wait_for(f"{self.name} to answer", answers, START_TIMEOUT_S, detail=self.output)
        except BaseException:
            self.stop()  # a failed start leaves no proxy behind (__exit__ will not run)
            raise
        return self

    def stop(self) -> None:
        """Stop it (its graceful signal; SIGKILL past the bound)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
