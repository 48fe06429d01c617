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

import shutil
import signal
from urllib.parse import urlsplit

from tests.infra.proxyprocess import ProxyProcess

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


class HAProxy(ProxyProcess):
    """HAProxy proxying ``http://127.0.0.1:PORT`` to ``upstream``; a context manager."""

    name = "haproxy"
    stop_signal = signal.SIGUSR1

    def command(self) -> list[str]:
        """The configuration under ``root``, and its command line."""
        binary = haproxy_binary()
        assert binary is not None, "haproxy is not installed"
        conf = self.root / "haproxy.cfg"
        address = urlsplit(self.upstream).netloc
        conf.write_text(CONFIG.format(root=self.root, port=self.port, upstream=address))
        return [binary, "-db", "-f", str(conf)]
