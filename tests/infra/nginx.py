"""Debian's nginx as a reverse proxy before one upstream, run as a test process.

Its defaults where they matter to a proxied stream: ``proxy_http_version`` is not set (nginx's
default, HTTP/1.0 to the upstream: no chunked encoding, so a streamed body ends only when the
upstream closes the connection) and ``proxy_read_timeout`` is nginx's 60 s. Buffering is off, as
for any streaming API behind nginx. Everything it writes (pid, logs, temp folders) is under
``root``; ``daemon off`` and ``master_process off`` keep it one process of ours, which ``stop``
ends. Nothing of the system's nginx (its service, /etc/nginx, /var/log/nginx) is touched.
"""

from __future__ import annotations

import shutil
import signal

from tests.infra.proxyprocess import ProxyProcess

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


class Nginx(ProxyProcess):
    """nginx proxying ``http://127.0.0.1:PORT`` to ``upstream``; a context manager."""

    name = "nginx"
    stop_signal = signal.SIGQUIT
    log_name = "error.log"

    def command(self) -> list[str]:
        """The configuration under ``root``, and its command line."""
        binary = nginx_binary()
        assert binary is not None, "nginx is not installed"
        conf = self.root / "nginx.conf"
        conf.write_text(CONFIG.format(root=self.root, port=self.port, upstream=self.upstream))
        return [binary, "-p", str(self.root), "-c", str(conf), "-e", str(self.root / "error.log")]
