"""A real Prometheus server (Debian's /usr/bin/prometheus) scraping file_sd targets, and promtool.

One scrape job reads a ``targets.json`` through ``file_sd_configs`` (the format the head agent
writes to ``J/prometheus/targets.json``), with 1 s scrape and refresh intervals so tests see
changes quickly. The server listens on a free 127.0.0.1 port and keeps its TSDB in a temp dir.
A new or changed target still takes about 5 s to be scraped: Prometheus's discovery manager
hands target updates to the scrape loop at most every 5 s (not configurable in 2.42), so give
``wait_for`` a timeout well above that.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from agent.job.atomicfile import write_atomic
from tests.infra.ports import free_port

JOB_NAME = "tilert"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class PrometheusError(RuntimeError):
    """The server did not start or a query failed; the message holds the log tail."""


def prometheus_binary() -> str | None:
    """Path of the prometheus server, or None when it is not installed."""
    return shutil.which("prometheus") or _existing("/usr/bin/prometheus")


def promtool_binary() -> str | None:
    """Path of promtool, or None when it is not installed."""
    return shutil.which("promtool") or _existing("/usr/bin/promtool")


def _existing(path: str) -> str | None:
    return path if os.access(path, os.X_OK) else None


def write_targets(path: Path, groups: Sequence[dict[str, Any]]) -> None:
    """Write a file_sd targets file atomically: ``[{"targets": [...], "labels": {...}}]``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(list(groups), indent=2).encode())


def promtool_check_metrics(text: str) -> tuple[int, str]:
    """``promtool check metrics`` on a page: (exit code, output); 0 clean, 3 lint, 1 parse error."""
    tool = promtool_binary()
    if tool is None:
        raise PrometheusError("promtool not found; install Debian's prometheus package")
    done = subprocess.run(
        [tool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode, done.stdout + done.stderr


class PrometheusServer:
    """A Prometheus server scraping the targets listed in ``targets_file``; a context manager."""

    def __init__(
        self,
        targets_file: Path,
        root: Path | None = None,
        *,
        scrape_interval: str = "1s",
        scrape_timeout: str = "900ms",
    ) -> None:
        self.targets_file = Path(targets_file)
        self.root = (
            Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="tilert-prom-"))
        )
        self.scrape_interval = scrape_interval
        self.scrape_timeout = scrape_timeout
        self.config = self.root / "prometheus.yml"
        self.log = self.root / "prometheus.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:40123``."""
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        """prometheus.yml: one job, file_sd on ``targets_file``, refreshed every second."""
        config = {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_timeout,
                "evaluation_interval": self.scrape_interval,
            },
            "scrape_configs": [
                {
                    "job_name": JOB_NAME,
                    "file_sd_configs": [
                        {"files": [str(self.targets_file)], "refresh_interval": "1s"}
                    ],
                }
            ],
        }
        return yaml.safe_dump(config, sort_keys=False)

    def start(self) -> PrometheusServer:
        """Start the server and wait until ``/-/ready`` answers 200."""
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError(
                "prometheus not found; install Debian's prometheus package (tests/run.sh does)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.targets_file.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.config_text())
        self.port = free_port()
        argv = [
            binary,
            f"--config.file={self.config}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.tsdb.path={self.root / 'data'}",
            "--storage.tsdb.retention.time=1h",
        ]
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )
        atexit.register(self.stop)
        try:
            self._wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode}\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready within {timeout:.0f} s\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL after a grace."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        try:
            resp = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"GET {path}: {exc}\n{self.log_tail()}") from exc
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: HTTP {resp.status_code}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the result vector as ``[{"metric": {...}, "value": [ts, "v"]}]``."""
        data = self._api("/api/v1/query", {"query": promql})
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Repeat ``query`` until ``predicate(result)`` holds; the error shows the targets."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise TimeoutError(
            f"{promql!r} did not satisfy the predicate within {timeout} s; last result {result}; "
            f"targets {self.targets()}"
        )

    def targets(self) -> list[dict[str, Any]]:
        """Active targets with ``scrapeUrl``, ``health``, ``lastError``, ``labels``."""
        data = self._api("/api/v1/targets", {"state": "active"})
        active: list[dict[str, Any]] = data["activeTargets"]
        return active

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log (for error messages)."""
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no prometheus log)"
        return f"--- {self.log} ---\n" + "\n".join(text)
