"""Debian's nginx as a reverse proxy before one upstream, run as a test process.

Its defaults where they matter to a proxied stream: ``proxy_http_version`` is not set (nginx's
default, HTTP/1.0 to the upstream: no chunked encoding, so a streamed body ends only when the
upstream closes the connection) and ``proxy_read_timeout`` is nginx's 60 s. Buffering is off, as
for any streaming API behind nginx. Everything it writes (pid, logs, temp folders) is under
``root``; ``daemon off`` and ``master_process off`` keep it one process of ours, which ``stop``
ends. Nothing of the system's nginx (its service, /etc/nginx, /var/log/nginx) is touched.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from pathlib import Path
from types import TracebackType

import httpx

from tests.infra.ports import free_port
from tests.kit.waiting import wait_for

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

CONFIG = """\
daemon off;
master_process off;
pid {root}/nginx.pid;
error_log {root}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {root}/access.log;
    client_body_temp_path {root}/client_body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass {upstream};
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """Path of nginx, or None when it is not installed."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


class Nginx:
    """nginx proxying ``http://127.0.0.1:PORT`` to ``upstream``; a context manager."""

    def __init__(self, upstream: str, root: Path) -> None:
        self.upstream = upstream
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def error_log(self) -> str:
        """What nginx logged."""
        path = self.root / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> Nginx:
        """Start it and wait until it answers (proxying the upstream's ``/health``)."""
        binary = nginx_binary()
        assert binary is not None, "nginx is not installed"
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nginx.conf"
        conf.write_text(CONFIG.format(root=self.root, port=self.port, upstream=self.upstream))
        self.proc = subprocess.Popen(
            [binary, "-p", str(self.root), "-c", str(conf), "-e", str(self.root / "error.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def answers() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, f"nginx exited:\n{self.error_log()}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/health", timeout=5).status_code < 500
            return False

        try:
            wait_for("nginx to answer", answers, START_TIMEOUT_S, detail=self.error_log)
        except BaseException:
            self.stop()  # a failed start leaves no nginx behind (__exit__ will not run)
            raise
        return self

    def stop(self) -> None:
        """Stop it (SIGQUIT: a graceful end; SIGKILL past the bound)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
